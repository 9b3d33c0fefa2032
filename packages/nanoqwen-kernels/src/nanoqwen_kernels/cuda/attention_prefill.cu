// attention_prefill.cu: causal attention of T new queries over the paged KV cache (flash-style).
//
// What: for query token i (position p = start_pos + i) and head h (KV head h / G):
//   out[i, h] = softmax_{t <= p}(q[i, h] . K[t] / sqrt(128)) . V[t],   K/V read from the pages
//   (positions < start_pos were cached earlier; start_pos .. start_pos+T-1 by nq_rope_kv_prefill).
// Shapes: q, out fp16 [T, NQ_NHEADS*128] (q already roped), k/v_cache fp16 [L, n_pages, NQ_NKV, 16, 128],
//   page_table int32 [max_pages].
// Two bodies, the same contract (prefill.py ATTENTION_VARIANTS picks one):
//   nq_attention_prefill_mma_db  tensor cores (mma.sync), FlashAttention-2 structure, P rounded to
//                             fp16 before P.V (as FlashAttention does), the next K/V tile copied while
//                             the current one is multiplied: the default. Its section below; _mma is
//                             the same math with one buffer (load, barrier, multiply).
//   nq_attention_prefill      fp32 throughout on CUDA cores (fp32 probabilities): the slower fallback,
//                             kept as the numerically tighter body ("fma"): attention_prefill_fma.cu.
// What the bodies share (blocks, the K/V read, the argument list): attention_prefill_common.cuh.
// Memory is O(T) in both (no T x T score matrix): T = 32768 runs as ceil(T / rows) x heads blocks.
// ctl (device int32 [2], or NULL): start_pos and T read on the device (a prefill captured in a CUDA graph
//   for a bucket of rows; the grid covers the bucket, rows past T are neither read nor written).
//
// Tested: tests/test_attention_prefill.py (numpy float64 reference, T 1..513 and 32768, start_pos 0 and
//   > 0, both bodies); measured: bench/bench_prefill.py.
#include "attention_prefill_common.cuh"

// ======================================================================================================
// nq_attention_prefill_mma_db / _mma: the same computation on tensor cores (FlashAttention-2 structure).
//
// Launch: grid (ceil(T/64), NQ_NHEADS), 128 threads (4 warps), 34 KB of dynamic smem per tile buffer
//   (2 for _mma_db, 1 for _mma).
//   Block = 64 query rows of one head; warp w owns rows 16w .. 16w+15 (the M of m16n8k16).
//   Key tiles of 64 positions (4 pages) are copied into padded smem rows (136 halves = 272 B, so the
//   8 row addresses of an ldmatrix land on 8 distinct 16-byte bank groups). Per tile and warp:
//     S = Q [16 x 128] . K^T [128 x 64]: 8 key tiles x 8 dim steps = 64 mma (K via ldmatrix)
//     O += P [16 x 64] . V [64 x 128]:   4 key steps x 16 dim tiles = 64 mma (V via ldmatrix.trans)
//   S's C fragment is P's A fragment (rounded to fp16, as FlashAttention does); the softmax state is
//   fp32, the row sum stays per lane until the end. Q fragments live in registers for the whole block.
// ======================================================================================================
namespace nq_pre_mma {
using nq::uint16_t;
using nq::uint32_t;
constexpr int kBQ = 64;
constexpr int kBK = 64;
constexpr int kWarps = 4;  // the block's 4 warps own its 64 query rows, 16 each
constexpr int kRowH = 136;  // padded smem row (halves) of the K/V tiles
constexpr int kTileHalves = kBK * kRowH;  // one K (or V) tile
// dynamic smem of a block with S tile buffers: S x (K tile + V tile) = S x 34,816 B
__host__ __device__ constexpr int smem_bytes(int stages) { return stages * 2 * kTileHalves * 2; }
using nq::ldmatrix_x4;
using nq::ldmatrix_x4_trans;
using nq::mma16816;
using nq::neg_inf;
using nq_pre_common::Block;
using nq_pre_common::kv_offset;
}  // namespace nq_pre_mma

// S = Q K^T of one key tile of 64 keys (K rows in ks, padded) for this warp's 16 query rows, by mma.sync:
// key tile nt (keys 8nt..8nt+7), C (row g / g+8, keys 8nt+2t, +1).
__device__ __forceinline__ void tile_scores_mma(const nq::uint32_t (&qa)[8][4], const nq::uint16_t* ks, int lane,
                                                float (&s)[8][4]) {
  using namespace nq_pre_mma;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 8; kk += 2) {
      // matrices: (keys 8nt.., dims 16kk..), (dims +8), (dims +16), (dims +24) -> b0,b1 of steps kk, kk+1
      uint32_t b[4];
      ldmatrix_x4(b, ks + (8 * nt + (lane & 7)) * kRowH + 16 * kk + 8 * (lane >> 3));
      mma16816(s[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b[0], b[1]);
      mma16816(s[nt], qa[kk + 1][0], qa[kk + 1][1], qa[kk + 1][2], qa[kk + 1][3], b[2], b[3]);
    }
  }
}

// O += P V for one key tile by mma.sync (V rows in vs, padded; ldmatrix.trans): the "mma" builds' P V.
__device__ __forceinline__ void tile_pv_mma(const nq::uint32_t (&pa)[4][4], float (&o)[16][4], const nq::uint16_t* vs,
                                            int lane) {
  using namespace nq_pre_mma;
  // key step kk (keys 16kk..16kk+15), dim tiles n, n+1 per ldmatrix.x4.trans
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int n = 0; n < 16; n += 2) {
      // matrices: (keys 16kk.., dims 8n..), (keys 16kk+8.., dims 8n..), (keys 16kk.., dims 8n+8..),
      // (keys 16kk+8.., dims 8n+8..) -> b0,b1 of dim tile n, then of n+1
      uint32_t b[4];
      const int key = 16 * kk + (lane & 7) + 8 * ((lane >> 3) & 1);
      const int dim = 8 * n + 8 * (lane >> 4);
      ldmatrix_x4_trans(b, vs + key * kRowH + dim);
      mma16816(o[n], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
      mma16816(o[n + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
    }
  }
}

// One key tile for this warp's 16 query rows, all on mma.sync (the "mma" and "mma_db" builds).
__device__ __forceinline__ void tile_step(const nq::uint32_t (&qa)[8][4], float (&m)[2], float (&l)[2],
                                          float (&o)[16][4], const nq::uint16_t* ks, const nq::uint16_t* vs,
                                          int kb, int lane, int r0, int r1, int qpos0, int qpos1, int T) {
  float s[8][4];
  tile_scores_mma(qa, ks, lane, s);
  nq::uint32_t pa[4][4];
  nq_pre_common::tile_softmax<true>(s, m, l, o, pa, kb, lane, r0, r1, qpos0, qpos1, T);
  tile_pv_mma(pa, o, vs, lane);
}

// kStages = 1 ("mma"): load a tile (through registers), barrier, multiply, barrier: the plain loop.
template <int kStages>
__device__ __forceinline__ void attention_prefill_mma_body(NQ_ATTENTION_PREFILL_ARGS) {
  using namespace nq_pre_mma;
  static_assert(kStages == 1 || kStages == 2, "one buffer or two");
  constexpr int kThreads = 32 * kWarps;
  extern __shared__ __align__(16) uint16_t smem_pre[];  // [kStages][K tile | V tile]

  if (ctl != nullptr) {  // a captured prefill graph (prefill_rope_kv.cu): the grid covers its bucket's rows
    start_pos = ctl[0];
    T = ctl[1];
  }
  const Block blk(kBQ, start_pos, T, kStages == 2);
  const int h = blk.h;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int r0 = blk.q0 + 16 * warp + g;  // this lane's rows r0 and r0 + 8 (query index)
  const int r1 = r0 + 8;
  const int qpos0 = start_pos + r0, qpos1 = start_pos + r1;
  const uint16_t* ks = smem_pre;        // K tile [64 keys][136] (one buffer; the pipeline's are below)
  const uint16_t* vs = ks + kTileHalves;  // and V tile

  uint32_t qa[8][4];
  nq_pre_common::load_q_frags(q, h, r0, r1, T, t, qa);

  float m[2] = {neg_inf(), neg_inf()}, l[2] = {0.f, 0.f};  // rows r0, r1 (l: this lane's part)
  float o[16][4];  // [dim tile] C fragment: (row g, dims 8n+2t, +1), (row g+8, same dims)
#pragma unroll
  for (int n = 0; n < 16; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;

  if constexpr (kStages == 2) {
    // thread tid copies chunks ch = tid + 128 j (j = 0..7) of a tile: key kk = tid / 16 + 8 j (page j / 2
    // of the tile's 4), dims dd = (tid % 16) * 8
    const int kk0 = tid >> 4, dd = (tid & 15) * 8;
    int pg[4];  // page ids of the tile to copy next (read a tile ahead of their use)
    auto read_pages = [&](int kb) {
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        const int kp = kb + 16 * p;
        pg[p] = kp < blk.kv_len ? page_table[kp / nq::kPageTokens] : 0;
      }
    };
    // a stage: [K tile | V tile], padded rows ([64][136] halves each)
    auto issue = [&](int kb, int stage) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int kk = kk0 + 8 * j, kp = kb + kk;
        uint16_t* dk = smem_pre + stage * 2 * kTileHalves + kk * kRowH + dd;
        uint16_t* dv = dk + kTileHalves;
        if (kp < blk.kv_len) {
          const size_t off = ((static_cast<size_t>(layer) * n_pages + pg[j >> 1]) * nq::kKvHeads + blk.kvh) *
                                 (nq::kPageTokens * 128) + (kp % nq::kPageTokens) * 128 + dd;
          nq::cp_async16(dk, k_cache + off);
          nq::cp_async16(dv, v_cache + off);
        } else {  // past the sequence: zeros, never a page's stale (maybe NaN) bytes
          *reinterpret_cast<uint4*>(dk) = make_uint4(0u, 0u, 0u, 0u);
          *reinterpret_cast<uint4*>(dv) = make_uint4(0u, 0u, 0u, 0u);
        }
      }
      nq::cp_async_commit();
    };
    read_pages(0);
    issue(0, 0);
    read_pages(kBK);
    int stage = 0;
    for (int kb = 0; kb < blk.kv_end; kb += kBK) {
      if (kb + kBK < blk.kv_end) {
        issue(kb + kBK, stage ^ 1);  // the buffer the previous tile used: every warp left it (barrier below)
        read_pages(kb + 2 * kBK);
      } else {
        nq::cp_async_commit();  // an empty group: "all but the newest" below still means this tile
      }
      nq::cp_async_wait<1>();  // this thread's copies of the current tile have landed
      __syncthreads();         // ... and every thread's (and the zero stores)
      const uint16_t* kst = smem_pre + stage * 2 * kTileHalves;
      tile_step(qa, m, l, o, kst, kst + kTileHalves, kb, lane, r0, r1, qpos0, qpos1, T);
      __syncthreads();  // every warp is done with this buffer before the next round copies into it
      stage ^= 1;
    }
  } else {
    for (int kb = 0; kb < blk.kv_end; kb += kBK) {
      __syncthreads();  // the previous tile's ldmatrix reads are done
      for (int ch = tid; ch < kBK * 16; ch += kThreads) {
        NQ_KV_CHUNK(ch, kb)
        *reinterpret_cast<uint4*>(smem_pre + kk * kRowH + dd) = kr;
        *reinterpret_cast<uint4*>(smem_pre + kTileHalves + kk * kRowH + dd) = vr;
      }
      __syncthreads();
      tile_step(qa, m, l, o, ks, vs, kb, lane, r0, r1, qpos0, qpos1, T);
    }
  }

  nq_pre_common::write_rows(o, l, out, h, r0, r1, T, t);
}

// Launch: grid (ceil(T/64), NQ_NHEADS), 128 threads, nq_pre_mma::smem_bytes(kStages) dynamic smem.
extern "C" __global__ void __launch_bounds__(128) nq_attention_prefill_mma(NQ_ATTENTION_PREFILL_ARGS) {
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  attention_prefill_mma_body<1>(q, k_cache, v_cache, page_table, start_pos, T, ctl, layer, n_pages, out);
}
extern "C" __global__ void __launch_bounds__(128) nq_attention_prefill_mma_db(NQ_ATTENTION_PREFILL_ARGS) {
  nq::pdl_wait();
  attention_prefill_mma_body<2>(q, k_cache, v_cache, page_table, start_pos, T, ctl, layer, n_pages, out);
}
