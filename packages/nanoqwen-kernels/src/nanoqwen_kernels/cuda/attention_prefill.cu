// attention_prefill.cu: causal attention of T new queries over the paged KV cache (flash-style), with both
// of its matrix products on Hopper's warpgroup MMA (nq_attention_prefill_wg, prefill.py's "wg", the default).
//
// What: for query token i (position p = start_pos + i) and head h (KV head h / G):
//   out[i, h] = softmax_{t <= p}(q[i, h] . K[t] / sqrt(128)) . V[t],   K/V read from the pages
//   (positions < start_pos were cached earlier; start_pos .. start_pos+T-1 by nq_rope_kv_prefill).
// Shapes: q, out fp16 [T, NQ_NHEADS*128] (q already roped), k/v_cache fp16 [L, n_pages, NQ_NKV, 16, 128],
//   page_table int32 [max_pages]. P is rounded to fp16 before P V, as FlashAttention does; the fp32
//   CUDA-core body (attention_prefill_fma.cu, "fma") keeps fp32 probabilities and is the tighter oracle.
// What the bodies share (blocks, the argument list, Q fragments, the tile softmax, the output rows):
//   attention_prefill_common.cuh. Memory is O(T) (no T x T score matrix).
// ctl (device int32 [2], or NULL): start_pos and T read on the device (a prefill captured in a CUDA graph
//   for a bucket of rows; the grid covers the bucket, rows past T are neither read nor written).
//
// Launch: grid (ceil(T/64), NQ_NHEADS), 128 threads = one warpgroup, smem_bytes() of dynamic shared
//   memory (97 KB), two blocks per SM (__launch_bounds__(128, 2): up to 255 registers a thread).
//   Block = 64 query rows of one head, warp w of the warpgroup rows 16w .. 16w+15 (wgmma's M = 64).
//   Per key tile of 64 keys (4 pages):
//     S = Q K^T    8 x wgmma m64n64k16: A = Q from registers (loaded once, the same fragments mma.sync
//                  takes), B = the K tile read by the tensor cores from shared memory (K-major)
//     softmax      on S's D fragments, which are mma.sync's C fragments per warp (attention_prefill_
//                  common.cuh tile_softmax), giving P as A fragments in registers
//     O += P V     4 x wgmma m64n128k16: A = P from registers, B = the V tile from shared memory read
//                  MN-major (imm-trans-b: V is stored [key][dim], dims contiguous)
//   so K and V never pass through registers (the mma.sync body this replaced read both with ldmatrix:
//   32 KB of shared-memory traffic per tile and warp; it peaked near 190 TFLOP/s, this one at 420-480:
//   docs/PERF.md), and one instruction does a warpgroup's 16 x 8 mma.sync worth of S or 4 warps x 32
//   mma.sync of P V.
//
// Why two one-warpgroup blocks per SM rather than one block of two warpgroups (FlashAttention-3's
//   ping-pong): each block runs its own copy pipeline and barrier, so while one block's warps do their
//   softmax (exp2, max, the O rescale: CUDA cores) the other block's wgmmas keep the tensor cores busy,
//   with no named barriers to order them. The price is that the two blocks each stream their keys (L2
//   traffic, not DRAM: a KV head's blocks run together). Measured against it (2026-12-01, removed): one
//   block of two warpgroups sharing each K/V tile, each warpgroup issuing the next tile's S before this
//   tile's softmax (FlashAttention-3's intra-warpgroup overlap): 394 against 420 TFLOP/s at 7B / 32k,
//   slower at every length.
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

// The K/V tile copies of the block's 128 threads: thread tid copies 16-byte chunk c = tid % 16 (dims 8c ..)
// of keys kk0 + 8 j (kk0 = tid / 16, j = 0..7) of both K and V. Everything but the page bases is fixed per
// thread (key kk0 + 8 j sits at tile_offset(kk0, c) + 1024 j in the tile and at row kk0 + 8 (j % 2) of page
// j / 2), so a copy is one add and one cp.async; the page ids are read one tile ahead (read_pages), so no
// copy waits on a page-table load.
struct KvCopier {
  int kk0, dst0, src0;
  __device__ __forceinline__ explicit KvCopier(int tid) {
    kk0 = tid >> 4;
    const int c = tid & 15;
    dst0 = nq_pre_wg::tile_offset(kk0, c);
    src0 = kk0 * 128 + 8 * c;
  }
  // page ids of the tile at key kb (0 for pages past the sequence: never copied from)
  __device__ __forceinline__ static void read_pages(const int* __restrict__ page_table, int kb, int kv_len,
                                                    int (&pg)[4]) {
#pragma unroll
    for (int p = 0; p < 4; ++p) pg[p] = kb + 16 * p < kv_len ? page_table[kb / nq::kPageTokens + p] : 0;
  }
  // copy the tile at key kb (pages pg) into stage st; keys past kv_len become zeros (never a page's
  // stale, maybe NaN, bytes: 0 x NaN is NaN in P V). head0 = layer * n_pages. Commits one group.
  __device__ __forceinline__ void issue(const nq::uint16_t* __restrict__ k_cache,
                                        const nq::uint16_t* __restrict__ v_cache, size_t head0, int kvh,
                                        const int (&pg)[4], int kb, int kv_len, unsigned char* st) const {
    const nq::uint16_t* ksrc[4];  // this thread's first chunk in each of the tile's 4 pages
    const nq::uint16_t* vsrc[4];
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const size_t base = ((head0 + pg[p]) * nq::kKvHeads + kvh) * (nq::kPageTokens * 128) + src0;
      ksrc[p] = k_cache + base;
      vsrc[p] = v_cache + base;
    }
    unsigned char* dst = st + dst0;
    if (kb + nq_pre_wg::kBK <= kv_len) {  // every tile but a sequence's last: no checks, and every
#pragma unroll                             // offset below a constant (folded into the copy instruction)
      for (int j = 0; j < 8; ++j) {
        const int p = j >> 1, in_page = (j & 1) * 8 * 128;  // page j / 2, row kk0 + 8 (j % 2)
        nq::cp_async16(dst + 1024 * j, ksrc[p] + in_page);
        nq::cp_async16(dst + 1024 * j + nq_pre_wg::kTileBytes, vsrc[p] + in_page);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int p = j >> 1, in_page = (j & 1) * 8 * 128;
        unsigned char* dk = dst + 1024 * j;
        if (kb + kk0 + 8 * j < kv_len) {
          nq::cp_async16(dk, ksrc[p] + in_page);
          nq::cp_async16(dk + nq_pre_wg::kTileBytes, vsrc[p] + in_page);
        } else {
          *reinterpret_cast<uint4*>(dk) = make_uint4(0u, 0u, 0u, 0u);
          *reinterpret_cast<uint4*>(dk + nq_pre_wg::kTileBytes) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
    }
    nq::cp_async_commit();
  }
};

// S = Q K^T of the tile in stage st for this warpgroup's 64 rows (issued and committed, not waited for)
__device__ __forceinline__ void wg_scores_issue(const nq::uint32_t (&qa)[8][4], const unsigned char* st,
                                                float (&s)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
  const nq::uint64_t desc_k = nq::wgmma_desc_sw128(nq::smem_u32(st));
  nq::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    nq::wgmma_rs<8>(s, qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3],
                    desc_k + static_cast<nq::uint64_t>((8192 * (kk >> 2) + 32 * (kk & 3)) >> 4));
  }
  nq::wgmma_commit();
}

// O += P V with the V tile of stage st (issued and committed, not waited for)
__device__ __forceinline__ void wg_pv_issue(const nq::uint32_t (&pa)[4][4], const unsigned char* st,
                                            float (&o)[16][4]) {
  const nq::uint64_t desc_v = nq::wgmma_desc_sw128_mn(nq::smem_u32(st + nq_pre_wg::kTileBytes), 8192);
  nq::wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    nq::wgmma_rs_n128_tb(o, pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3],
                         desc_v + static_cast<nq::uint64_t>((2048 * kk) >> 4));
  }
  nq::wgmma_commit();
}

extern "C" __global__ void __launch_bounds__(128, 2) nq_attention_prefill_wg(NQ_ATTENTION_PREFILL_ARGS) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
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

  const KvCopier cp(tid);
  const size_t head0 = static_cast<size_t>(layer) * n_pages;
  int pg[4];  // page ids of the next tile to copy
  // prologue: tiles 0 and 1 in flight (an empty group stands for a tile past the block's keys, so "all
  // but the newest group" below always means the current tile)
  cp.read_pages(page_table, 0, blk.kv_len, pg);
  cp.issue(k_cache, v_cache, head0, blk.kvh, pg, 0, blk.kv_len, stages);
  cp.read_pages(page_table, kBK, blk.kv_len, pg);
  if (kBK < blk.kv_end) cp.issue(k_cache, v_cache, head0, blk.kvh, pg, kBK, blk.kv_len, stages + kStageBytes);
  else nq::cp_async_commit();
  cp.read_pages(page_table, 2 * kBK, blk.kv_len, pg);

  int stage = 0;
  for (int kb = 0; kb < blk.kv_end; kb += kBK) {
    nq::cp_async_wait<1>();         // this thread's copies of tile kb have landed
    nq::fence_proxy_async_smem();   // ... visible to the async proxy (the wgmmas)
    __syncthreads();                // every thread's; and every warp is done with tile kb - 64's stage
    const int next = kb + 2 * kBK;
    if (next < blk.kv_end) {  // into the stage tile kb - 64 used
      cp.issue(k_cache, v_cache, head0, blk.kvh, pg, next, blk.kv_len,
               stages + (stage == 0 ? kStages - 1 : stage - 1) * kStageBytes);
      cp.read_pages(page_table, next + kBK, blk.kv_len, pg);
    } else {
      nq::cp_async_commit();
    }
    const unsigned char* st = stages + stage * kStageBytes;

    float s[8][4];
    wg_scores_issue(qa, st, s);  // S = Q K^T
    nq::wgmma_wait<0>();
    uint32_t pa[4][4];
    if (kb + kBK <= full_end) {  // block-uniform
      nq_pre_common::tile_softmax<false>(s, m, l, o, pa, kb, lane, r0, r1, qpos0, qpos1, T);
    } else {
      nq_pre_common::tile_softmax<true>(s, m, l, o, pa, kb, lane, r0, r1, qpos0, qpos1, T);
    }

    wg_pv_issue(pa, st, o);  // O += P V
    nq::wgmma_wait<0>();  // O readable; this stage no longer read (the barrier above publishes that)
    stage = stage == kStages - 1 ? 0 : stage + 1;
  }
  nq_pre_common::write_rows(o, l, out, h, r0, r1, T, t);
}
