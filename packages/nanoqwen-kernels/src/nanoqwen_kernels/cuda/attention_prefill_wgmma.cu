// attention_prefill_wgmma.cu: causal prefill attention with both of its matrix products on Hopper's
// warpgroup MMA ("wg", nq_attention_prefill_wg). The contract is attention_prefill.cu's (same arguments,
// same output, P rounded to fp16 before P V as FlashAttention does); what differs is how the block works.
//
// Launch: grid (ceil(T/64), NQ_NHEADS), 128 threads = one warpgroup, smem_bytes() of dynamic shared
//   memory (97 KB), two blocks per SM (__launch_bounds__(128, 2): up to 255 registers a thread).
//   Block = 64 query rows of one head, warp w of the warpgroup rows 16w .. 16w+15 (wgmma's M = 64).
//   Per key tile of 64 keys (4 pages):
//     S = Q K^T    8 x wgmma m64n64k16: A = Q from registers (loaded once, the same fragments mma.sync
//                  takes), B = the K tile read by the tensor cores from shared memory (K-major)
//     softmax      on S's D fragments, which are mma.sync's C fragments per warp (attention_prefill_
//                  common.cuh tile_softmax, shared with mma_db), giving P as A fragments in registers
//     O += P V     4 x wgmma m64n128k16: A = P from registers, B = the V tile from shared memory read
//                  MN-major (imm-trans-b: V is stored [key][dim], dims contiguous)
//   so K and V never pass through registers (mma_db reads both with ldmatrix: 32 KB of shared-memory
//   traffic per tile and warp, which bounds it near 190 TFLOP/s), and one instruction does a warpgroup's
//   16 x 8 mma.sync worth of S or 4 warps x 32 mma.sync of P V.
//
// Why two one-warpgroup blocks per SM rather than one block of two warpgroups (FlashAttention-3's
//   ping-pong): each block runs its own copy pipeline and barrier, so while one block's warps do their
//   softmax (exp2, max, the O rescale: CUDA cores) the other block's wgmmas keep the tensor cores busy,
//   with no named barriers to order them. The price is that the two blocks each stream their keys (L2
//   traffic, not DRAM: a KV head's blocks run together).
//
// Copy pipeline: 3 stages of [K tile | V tile], each tile 16 KB in wgmma's 128-byte-swizzled layout:
//   byte (key n, dim k) = 8192 (k / 64) + 1024 (n / 8) + 128 (n % 8) + 16 (((k % 64) / 8) ^ (n % 8)) + 2 (k % 8)
//   For K (B of S, N = keys, K = dims; K-major) dim step kk starts 8192 (kk / 4) + 32 (kk % 4) bytes in,
//   the next 8 keys 1024 bytes on (SBO). For V (B of P V, K = keys, N = dims; MN-major) the same bytes
//   are 8 key rows of 128 B per atom: key step kk (16 keys) starts 2048 kk bytes in, the next 8 keys
//   1024 bytes on (SBO) and dims 64..127 8192 bytes on (LBO). tests/test_wgmma_tile_mapping.py emulates
//   both reads in numpy.
//   The 128 threads copy tile j + 2 with cp.async (16 bytes each, 16 per thread) while tile j is
//   multiplied; one barrier per tile both publishes tile j (after each thread's cp.async.wait_group and
//   a proxy fence: wgmma reads through the async proxy) and certifies that every warp has finished tile
//   j - 1 (its wgmmas waited for), whose stage the next copy overwrites.
#include "attention_prefill_common.cuh"
#include "wgmma.cuh"

namespace nq_pre_wg {
using nq::uint16_t;
using nq::uint32_t;
using nq::uint64_t;
constexpr int kBQ = 64;                       // query rows of a block (one warpgroup)
constexpr int kBK = 64;                       // keys per tile (4 pages)
constexpr int kStages = 3;                    // tiles in flight: copy j + 2 while j is multiplied
constexpr int kTileBytes = 2 * 8 * 1024;      // K or V tile: 2 dim halves x 8 atoms x 1024 B
constexpr int kStageBytes = 2 * kTileBytes;   // [K tile | V tile]
// dynamic shared memory: the stages and room to align them to 1024 bytes (the swizzle atoms)
__host__ __device__ constexpr int smem_bytes() { return kStages * kStageBytes + 1024; }
// byte of key n's dims 8c .. 8c+7 (c = 0..15) inside a tile
__device__ __forceinline__ int tile_offset(int n, int c) {
  return 8192 * (c >> 3) + 1024 * (n >> 3) + 128 * (n & 7) + 16 * ((c & 7) ^ (n & 7));
}
}  // namespace nq_pre_wg

extern "C" __global__ void __launch_bounds__(128, 2) nq_attention_prefill_wg(NQ_ATTENTION_PREFILL_ARGS) {
  using namespace nq_pre_wg;
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  extern __shared__ __align__(16) unsigned char smem_wg[];
  unsigned char* stages = smem_wg + ((1024u - (nq::smem_u32(smem_wg) & 1023u)) & 1023u);

  if (ctl != nullptr) {  // a captured prefill graph (prefill_rope_kv.cu): the grid covers its bucket's rows
    start_pos = ctl[0];
    T = ctl[1];
  }
  const nq_pre_common::Block blk(kBQ, start_pos, T, true);  // the blocks with the most keys first
  const int h = blk.h;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = blk.q0 + 16 * warp + g;  // this lane's rows r0 and r0 + 8 (query index)
  const int r1 = r0 + 8;
  const int qpos0 = start_pos + r0, qpos1 = start_pos + r1;
  // keys below this all sit at or before the block's first row's position: those tiles need no mask
  const int full_end = start_pos + blk.q0 + 1;

  uint32_t qa[8][4];
  nq_pre_common::load_q_frags(q, h, r0, r1, T, t, qa);
  float m[2] = {nq::neg_inf(), nq::neg_inf()}, l[2] = {0.f, 0.f};  // rows r0, r1 (l: this lane's part)
  float o[16][4];  // wgmma D / mma.sync C fragments: (row g, dims 8n+2t, +1), (row g+8, same dims)
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  // thread tid copies 16-byte chunk c = tid % 16 (dims 8c ..) of keys kk0 + 8 j, j = 0..7 (page j / 2 of
  // the tile's 4), of both K and V
  const int kk0 = tid >> 4, c = tid & 15;
  int pg[4];  // page ids of the next tile to copy (read one tile ahead of their use)
  auto read_pages = [&](int kb) {
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const int kp = kb + 16 * p;
      pg[p] = kp < blk.kv_len ? page_table[kp / nq::kPageTokens] : 0;
    }
  };
  auto issue = [&](int kb, int stage) {
    unsigned char* st = stages + stage * kStageBytes;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int kk = kk0 + 8 * j, kp = kb + kk;
      unsigned char* dk = st + tile_offset(kk, c);
      unsigned char* dv = dk + kTileBytes;
      if (kp < blk.kv_len) {
        const size_t off = ((static_cast<size_t>(layer) * n_pages + pg[j >> 1]) * nq::kKvHeads + blk.kvh) *
                               (nq::kPageTokens * 128) + (kp % nq::kPageTokens) * 128 + 8 * c;
        nq::cp_async16(dk, k_cache + off);
        nq::cp_async16(dv, v_cache + off);
      } else {  // past the sequence: zeros, never a page's stale (maybe NaN) bytes (0 x NaN is NaN in P V)
        *reinterpret_cast<uint4*>(dk) = make_uint4(0u, 0u, 0u, 0u);
        *reinterpret_cast<uint4*>(dv) = make_uint4(0u, 0u, 0u, 0u);
      }
    }
    nq::cp_async_commit();
  };
  // prologue: tiles 0 and 1 in flight (an empty group stands for a tile past the block's keys, so "all
  // but the newest group" below always means the current tile)
  read_pages(0);
  issue(0, 0);
  read_pages(kBK);
  if (kBK < blk.kv_end) issue(kBK, 1); else nq::cp_async_commit();
  read_pages(2 * kBK);

  int stage = 0;
  for (int kb = 0; kb < blk.kv_end; kb += kBK) {
    nq::cp_async_wait<1>();         // this thread's copies of tile kb have landed
    nq::fence_proxy_async_smem();   // ... visible to the async proxy (the wgmmas)
    __syncthreads();                // every thread's; and every warp is done with tile kb - 64's stage
    const int next = kb + 2 * kBK;
    if (next < blk.kv_end) {
      issue(next, stage == 0 ? kStages - 1 : stage - 1);  // the stage tile kb - 64 used
      read_pages(next + kBK);
    } else {
      nq::cp_async_commit();
    }
    const unsigned char* st = stages + stage * kStageBytes;

    // S = Q K^T: dim step kk's B starts 8192 (kk / 4) + 32 (kk % 4) bytes into the K tile
    float s[8][4];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
    const uint64_t desc_k = nq::wgmma_desc_sw128(nq::smem_u32(st));
    nq::wgmma_fence();  // the zeroed accumulators (and qa) written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      nq::wgmma_rs<8>(s, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                      desc_k + static_cast<uint64_t>((8192 * (kk >> 2) + 32 * (kk & 3)) >> 4));
    }
    nq::wgmma_commit();
    nq::wgmma_wait<0>();

    uint32_t pa[4][4];
    if (kb + kBK <= full_end) {  // block-uniform
      nq_pre_common::tile_softmax<false>(s, m, l, o, pa, kb, lane, r0, r1, qpos0, qpos1, T);
    } else {
      nq_pre_common::tile_softmax<true>(s, m, l, o, pa, kb, lane, r0, r1, qpos0, qpos1, T);
    }

    // O += P V: key step kk's B starts 2048 kk bytes into the V tile; dims 64.. are 8192 bytes on (LBO)
    const uint64_t desc_v = nq::wgmma_desc_sw128_mn(nq::smem_u32(st + kTileBytes), 8192);
    nq::wgmma_fence();  // P and the rescaled O written before the wgmmas read them
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
      nq::wgmma_rs_n128_tb(o, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                           desc_v + static_cast<uint64_t>((2048 * kk) >> 4));
    }
    nq::wgmma_commit();
    nq::wgmma_wait<0>();  // O readable; this stage no longer read (the barrier above publishes that)
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  nq_pre_common::write_rows(o, l, out, h, r0, r1, T, t);
}
