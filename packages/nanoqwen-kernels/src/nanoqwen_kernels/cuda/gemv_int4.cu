// gemv_int4.cu: the INT4 x FP16 GEMVs of decode over ValueShuffle-v1 words, for B sequences at once,
// with their fused variants. Four bodies share the row maps and epilogues (gemv_epilogues.cuh):
//   the half2 loop (this file)      B = 1; products in half2 FMAs
//   the int8-activation loop        B = 1, the engine's default (suffix _a8, _a8x); gemv_a8.cuh: x to int8, dp4a
//   the tensor-core core            any B; gemv_mma.cuh (mma.sync, one column per sequence)
//   the tile GEMM                   B <= 64; gemm_tiles.cuh (entries at the end of this file)
//
// What: out[b][n] = sum_k W[n,k] * xin[b][k], W[n,k] = scale[n, k/128] * q[n,k] (q = u - 8, u in 0..15),
//   xin[b] = x[b], or RMSNorm(x[b]) * norm_w when norm_w is given (HF Qwen2RMSNorm: fp32 mean of
//   squares, x*r rounded to fp16, times the fp16 weight, rounded to fp16). Kernel entries (extern "C"):
//   nq_gemv_int4_h / _i       K = H / K = I: out = W.xin (+ residual); residual may alias out.
//   nq_qkv_rope_kv            K = H, rows q|k|v (kQkvRows): + bias, RoPE on q and k at pos[b] (device
//                             memory), k and v written into the KV page of pos[b] from page_table row b,
//                             q (roped) to q_out row b.
//   nq_gate_up_silu           K = H, rows [0,I) gate, [I,2I) up: out[b][i] = silu(gate[i]) * up[i].
//   each as the half2 loop (B = 1, the name above), the int8-activation loop (B = 1, suffix _a8; and the
//   down_proj pair nq_gate_up_silu_a8x -> nq_gemv_int4_i_a8x, which hands the intermediate over already
//   rounded) and as the tensor-core core for up to 8 or 32 columns per pass (suffix _mma8, _mma32;
//   blockIdx.y = pass; gemv.py plans passes and slices).
// Shapes/dtypes: qweight uint32 [N, K/8], scales fp16 [N, K/128], x fp16 [B, K], out fp16 [B, N or I].
//   The KV page layout is docs/INTERFACES.md section 3: k_cache fp16 [L, n_pages, n_kv, 16, 128];
//   page_table int32 [B, max_pages], row b = sequence b's table.
//
// The half2 loop. Launch: 256 threads (8 warps), 1-D grid, grid-stride over "units". A unit is 2 weight
//   rows, owned by one warp; the lanes split K in 16-byte pieces (32 weights, 1/4 of a group). Which 2
//   rows make a unit is what lets each epilogue stay inside one warp (or one thread, on the tensor-core
//   core):
//     plain      rows (2p, 2p+1)                    more loads in flight per lane
//     qkv_rope   rows (128h + d, 128h + d + 64)     exactly the pair HF's rotate-half RoPE mixes
//     gate_up    rows (i, I + i)                    gate and up of the same output element
//   So no epilogue needs a second kernel, a grid-wide counter or a head per block (which would give the
//   7B only 36 blocks for q/k/v). The python launcher sizes the grid so each block runs the same number
//   of units (no ragged last wave).
//
//   per warp, one K pass (K = 3584: 112 pieces per row, NJ = 4 per lane):
//     lane l loads pieces u = l, l+32, l+64, ... of both rows; 4 pieces x 2 rows = 8 x 16 B in flight
//     per lane before the first use. Little's law: an SM's share of the bandwidth (4.19 TB/s / 132 =
//     32 B/ns) times the HBM latency (~0.7 us) asks for ~22 KB in flight per SM; 8 warps x 32 lanes x
//     128 B = 32 KB per block, with 3-4 blocks resident at ~55-64 registers.
//
// Why it is issue-bound (docs/PERF.md has the figures): each 8 weights cost ~18 instructions (2 LOP3,
//   4 PRMT, 4 HSUB2, 4 HMUL2/HFMA2, 2 cvt, adds); the fp16 lm_head with the same load structure streams
//   at 99% of copy bandwidth with 4x fewer weights per byte. The tensor-core core drops the products,
//   the fp16 partial sums and their conversions (~10.5 instructions per word), but as built for batches
//   it keeps fewer bytes in flight at B = 1, and this loop is the faster body for every matrix at B = 1
//   (the default GEMV variant, gemv.py; figures in docs/PERF.md). A software-pipelined version of this
//   loop (next stage issued before the current one is used; 90-120 registers, 2 blocks/SM) measured
//   slower and is not kept: with fewer warps the dependent half2 chains are hidden worse.
//
// Activation in shared memory, transposed so that the 16-byte reads of a warp hit 32 distinct banks:
//
//     xs (uint4 = 8 halves) [4][K/32]:  xs[c][u] = xin[32u + 8c .. 32u + 8c + 7]
//     piece u of a row = 4 words w0..w3;  word c pairs with xs[c][u]   (lanes read consecutive u)
//
// Arithmetic: each word is unpacked with 4 prmt.b32 into 4 exact half2 q's (common.cuh unpack8); the 8
//   products q*x of a word are summed in one half2 chain (hmul2 + 3 hfma2, 4 products per half), then
//   converted to fp32; the group scale and every sum beyond those 4 products are fp32. Why not all fp32:
//   converting each weight to fp32 costs ~2 extra instructions per weight and the GEMV would turn
//   compute-bound near 4 TB/s; the half chain is 1 instruction per 2 weights. Limit this buys: a chain
//   sums 4 products |q*x| <= 8|x|, so |x| must stay below ~2000 for it not to overflow fp16; the
//   normed activations and silu*up of Qwen2.5 stay far below (checked in the layer tests).
//
// Tested: tests/test_gemv_gpu.py against numpy (quantize + ValueShuffle pack in the test) for B = 1 .. 64,
//   poisoned outputs, mixed positions and page tables per row, 7B and 1.5B shapes; tests/test_compile.py
//   compiles it for the 7B, 1.5B and tiny dims and checks the SASS (PRMT, HMMA, no spills).
#include "gemv_mma.cuh"
#include "gemm_tiles.cuh"

namespace nq {

#ifndef NQ_GEMV_STAGE_PIECES
#define NQ_GEMV_STAGE_PIECES 4  // tuning knob (bench_gemv.py --sweep); 4 covers a K = 3584 row in one go
#endif
constexpr int kInFlight = NQ_GEMV_STAGE_PIECES;  // 16-byte pieces per row per lane issued before first use

// ---- the half2 loop (B = 1) ---------------------------------------------------------------------------
// Stage the activation (optionally RMS-normed) into the transposed shared layout. Every thread of the
// block must call this (it holds barriers); norm_w is block-uniform.
template <int K>
__device__ __forceinline__ void stage_x(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                        float eps, uint4* xs, float* red) {
  constexpr int kChunks = K / 8;  // 8 halves (16 B) each
  constexpr int kNU = K / 32;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float r = 1.f;
  if (norm_w != nullptr) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < kChunks; i += kThreads) ss += sum_squares8(x4[i]);
    ss = block_sum<kThreads>(ss, red);  // barrier inside; the branch is block-uniform
    r = rsqrtf(ss / K + eps);
  }
  for (int i = threadIdx.x; i < kChunks; i += kThreads) {
    uint4 v = x4[i];
    if (norm_w != nullptr) v = rms_apply8(v, reinterpret_cast<const uint4*>(norm_w)[i], r);
    xs[(i & 3) * kNU + (i >> 2)] = v;  // chunk i = piece u = i/4, word c = i%4
  }
  __syncthreads();  // xs complete before any warp reads it
}

// 8 products of one word with its 8 activations: half2 chain, then fp32.
__device__ __forceinline__ float dot8(uint32_t w, uint4 x) {
  uint32_t q[4];
  unpack8(w, q);
  uint32_t h = hmul2(q[0], x.x);
  h = hfma2(q[1], x.y, h);
  h = hfma2(q[2], x.z, h);
  h = hfma2(q[3], x.w, h);
  const float2 f = h22f2(h);
  return f.x + f.y;
}

// One chunk of a unit's loads: kInFlight 16-byte pieces of each of the 2 rows per lane, and their scales.
struct RowChunk {
  uint4 v0[kInFlight], v1[kInFlight];
  uint16_t g0[kInFlight], g1[kInFlight];
};

// f(jj, u) for each piece jj of chunk j0 this lane holds that exists: u = the piece's index in its row
// (K / 32 pieces of 16 bytes). Without a split (kSplit = 1) lane l holds pieces l, l + 32, ...; split over
// kSplit warps, the warps of a unit act as 32 kSplit lanes of one wide warp: the lane l of part s holds
// pieces 32 s + l, 32 s + l + 32 kSplit, ... (each chunk step still a contiguous 512 bytes per warp). The
// loads and both loops' multiplies walk a chunk this way.
template <int K, int kSplit = 1>
__host__ __device__ constexpr int pieces_per_lane() {
  return (K / 32 + 32 * kSplit - 1) / (32 * kSplit);
}
template <int K, int kSplit = 1, class F>
__device__ __forceinline__ void for_chunk_pieces(int j0, int part, F&& f) {
  constexpr int kNU = K / 32;                         // 16-byte pieces per row
  constexpr int kNJ = pieces_per_lane<K, kSplit>();   // pieces per lane
  const int vl = 32 * part + (threadIdx.x & 31);
#pragma unroll
  for (int jj = 0; jj < kInFlight; ++jj) {
    const int u = (j0 + jj) * 32 * kSplit + vl;
    if (j0 + jj < kNJ && u < kNU) f(jj, u);
  }
}

// Issue the loads of chunk j0 (pieces j0 .. j0+kInFlight-1 of each lane) of rows r0 and r1.
template <int K, int kSplit = 1>
__device__ __forceinline__ void load_chunk(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           int r0, int r1, int j0, RowChunk& c, int part = 0) {
  constexpr int kGroups = K / kGroup;         // scales per row
  const uint4* w0 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r0) * (K / 8));
  const uint4* w1 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r1) * (K / 8));
  const uint16_t* s0 = sc + static_cast<size_t>(r0) * kGroups;
  const uint16_t* s1 = sc + static_cast<size_t>(r1) * kGroups;
  for_chunk_pieces<K, kSplit>(j0, part, [&](int jj, int u) {  // issue every load of the chunk first
    c.v0[jj] = ld_stream_v4(w0 + u);
    c.v1[jj] = ld_stream_v4(w1 + u);
    c.g0[jj] = s0[u >> 2];  // 4 pieces per group: lanes 4m..4m+3 share a scale
    c.g1[jj] = s1[u >> 2];
  });
}

// Multiply chunk j0 with xs into the lane's partial sums.
template <int K>
__device__ __forceinline__ void use_chunk(const RowChunk& c, int j0, const uint4* xs, float& a0, float& a1) {
  constexpr int kNU = K / 32;
  for_chunk_pieces<K>(j0, 0, [&](int jj, int u) {
    const uint4 x0 = xs[u], x1 = xs[kNU + u], x2 = xs[2 * kNU + u], x3 = xs[3 * kNU + u];
    a0 += h2f(c.g0[jj]) * (dot8(c.v0[jj].x, x0) + dot8(c.v0[jj].y, x1) + dot8(c.v0[jj].z, x2) + dot8(c.v0[jj].w, x3));
    a1 += h2f(c.g1[jj]) * (dot8(c.v1[jj].x, x0) + dot8(c.v1[jj].y, x1) + dot8(c.v1[jj].z, x2) + dot8(c.v1[jj].w, x3));
  });
}

}  // namespace nq

#include "gemv_a8.cuh"  // the int8-activation loop: x rounded to int8 in the prologue, dp4a products
#include "gemv_a8_cluster.cuh"  // down_proj's prologue shared by a thread-block cluster (NQ_DOWN_CLUSTER)

namespace nq {

// One warp: dot products of rows r0 and r1 with xs; the full sums end in every lane. `first`, when
// given, is chunk 0 already loaded (gemv_units issues it before the launch-overlap wait). Split over
// kSplit warps (the int8 loop only), this warp's share, part `part` of the row (for_chunk_pieces).
template <int K, bool kA8 = false, int kSplit = 1>
__device__ __forceinline__ void dot_rows2(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                          int r0, int r1, uint4* xs, float& o0, float& o1,
                                          const RowChunk* first = nullptr, int part = 0) {
  static_assert(kSplit == 1 || kA8, "the half2 loop is not split");
  constexpr int kNJ = pieces_per_lane<K, kSplit>();
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j0 = 0; j0 < kNJ; j0 += kInFlight) {
    RowChunk c;
    if (j0 == 0 && first != nullptr) {
      c = *first;
    } else {
      load_chunk<K, kSplit>(qw, sc, r0, r1, j0, c, part);
    }
    if constexpr (kA8) {
      use_chunk_a8<K, kSplit>(c, j0, a8_views<K>(xs), a0, a1, part);
    } else {
      use_chunk<K>(c, j0, xs, a0, a1);
    }
  }
  o0 = warp_sum(a0);
  o1 = warp_sum(a1);
}

}  // namespace nq

#include "gemv_units.cuh"  // the B = 1 loops over units: weights before the wait, launch trigger, split-K

#include "gemv_epilogues.cuh"  // the row maps and fused epilogues every body shares
#include "gemv_a8_image.cuh"   // gate/up handing down_proj its input already rounded (int8 loop)

using namespace nq;

// ---- entries ---------------------------------------------------------------------------------------------
// The B = 1 loops (x [K], out [N]; pos_dev [1], page_table [1, max_pages]): the half2 loop (no suffix) and
// the int8-activation loop (suffix _a8), the same arguments. Per entry:
//   nq_gemv_int4_h / _i: qweight [N, K/8], scales [N, K/128] fp16, x [K] fp16, norm_w [K] fp16 or null (no
//     norm), eps, residual [N] fp16 or null (may alias out), out [N] fp16, n_rows = N.
//   nq_qkv_rope_kv: fused input RMSNorm + q/k/v projection + bias + RoPE + KV page write (units kQkvRows / 2):
//     qweight [kQkvRows, H/8] rows q | k | v, scales, bias [kQkvRows], x [H] (the residual stream), norm_w
//     (not null), eps, pos [1] (device: graph-replayable), page_table [1, max_pages], max_pages, k_cache,
//     v_cache [L, n_pages, kKvHeads, 16, 128] fp16, layer, n_pages, q_out [kQDim] fp16 (roped), settled (1:
//     pos and page_table were written before the previous kernel started: read before the wait; QkvEpi).
//   nq_gate_up_silu: fused post-attention RMSNorm + gate/up + SiLU(gate) * up (units kInter): qweight
//     [2I, H/8] rows gate | up, scales, x [H], norm_w or null, eps, out [I] fp16.
#define NQ_B1_ENTRIES(SUFFIX, KX, LB_I, LB_GU)                                                                                              \
  extern "C" __global__ void NQ_LB0 nq_gemv_int4_h##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, const uint16_t* residual, uint16_t* out, int n_rows) { \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, PlainRows, PlainEpi, KX>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2,         \
                                                 PlainRows{n_rows}, PlainEpi{residual, out, n_rows});       \
  }                                                                                                         \
  extern "C" __global__ void LB_I nq_gemv_int4_i##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, const uint16_t* residual, uint16_t* out, int n_rows) { \
    NQ_STAMP();                                                                                             \
    gemv_units<kInter, PlainRows, PlainEpi, KX>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2,          \
                                                PlainRows{n_rows}, PlainEpi{residual, out, n_rows});        \
  }                                                                                                         \
  extern "C" __global__ void NQ_LB0 nq_qkv_rope_kv##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ bias, const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, \
      float eps, const int32_t* __restrict__ pos, const int32_t* __restrict__ page_table, int max_pages,     \
      uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache, int layer, int n_pages,                \
      uint16_t* __restrict__ q_out, int settled) {                                                          \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, QkvRows, QkvEpi, KX>(                                                               \
        qweight, scales, x, norm_w, eps, kQkvRows / 2, QkvRows{},                                           \
        QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer, n_pages, q_out, settled});        \
  }                                                                                                         \
  extern "C" __global__ void LB_GU nq_gate_up_silu##SUFFIX(                                               \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ out) {                         \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, GateUpRows, GateUpEpi, KX>(qweight, scales, x, norm_w, eps, kInter, GateUpRows{},   \
                                                   GateUpEpi{out});                                         \
  }

// down_proj's blocks an SM must hold at once (NQ_MINB_DOWN, __launch_bounds__'s second argument, so a
// register cap; 0: none given): split in 4 (gemv.py b1_build_defines) it has 4x the blocks, and at ~76-80
// registers only 3 blocks of 256 threads fit an SM, so even_grid would fold the grid back into two rounds a
// block; at 4 (64 registers) 528 blocks fit the H200. (0 is not 1: with a minimum of 1 given, ptxas takes
// up to 255 registers, ~200 here, and 1 block an SM.)
#ifndef NQ_MINB_DOWN
#define NQ_MINB_DOWN 0
#endif
#define NQ_LB0 __launch_bounds__(kThreads)
#if NQ_MINB_DOWN
#define NQ_LB_DOWN __launch_bounds__(kThreads, NQ_MINB_DOWN)
#else
#define NQ_LB_DOWN NQ_LB0
#endif
// gate/up's int8 loop with its prologue shared by a cluster (NQ_GU_CLUSTER) is held to 80 registers, 3 blocks an
// SM, as without it (ptxas takes 93 for the cluster build: 2 blocks an SM)
#if NQ_GU_CLUSTER > 1
#define NQ_LB_GU_A8 __launch_bounds__(kThreads, 3)
#else
#define NQ_LB_GU_A8 NQ_LB0
#endif
NQ_B1_ENTRIES(, kXHalf, NQ_LB0, NQ_LB0)
NQ_B1_ENTRIES(_a8, kXA8, NQ_LB_DOWN, NQ_LB_GU_A8)

// The int8-activation loop's down_proj pair (the engine's batch-1 decode under decode_activations="int8"):
//   nq_gate_up_silu_a8x: as nq_gate_up_silu_a8, but its output is the intermediate already rounded for
//     down_proj, an a8 image (gate_up_a8_image, gemv_a8_image.cuh) of kInter * 3 / 2 bytes, in `out` ([I] fp16 storage);
//   nq_gemv_int4_i_a8x: down_proj (K = I) reading such an image as its x (no norm): its prologue is a copy.
extern "C" __global__ void __launch_bounds__(kThreads) nq_gate_up_silu_a8x(
    const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x,
    const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ out) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  gate_up_a8_image<kHidden>(qweight, scales, x, norm_w, eps, out);
}

extern "C" __global__ void NQ_LB_DOWN nq_gemv_int4_i_a8x(
    const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x,
    const uint16_t* residual, uint16_t* out, int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  gemv_units<kInter, PlainRows, PlainEpi, kXImage>(qweight, scales, x, nullptr, 0.f, (n_rows + 1) / 2,
                                                   PlainRows{n_rows}, PlainEpi{residual, out, n_rows});
}

// The tensor-core core, B columns (x [B, K], outputs [B, ...]; pos [B], page_table [B, max_pages]);
// n_cols = B, pass_cols = columns per pass, slice_groups = 128-k groups of x staged at a time (gemv.py's
// plan); grid.y = passes; dynamic shared memory = pass_cols x (slice_groups * 128 + 16) x 2 bytes.
#define NQ_INT4_MMA_ENTRIES(COLS, MIN_BLOCKS)                                                                \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gemv_int4_h_mma##COLS(                         \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      const uint16_t* residual, uint16_t* out, int n_rows, int n_cols, int pass_cols, int slice_groups) {  \
    NQ_STAMP();                                                                                             \
    gemv_mma<kHidden, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, (n_rows + 1) / 2, n_cols,     \
                                pass_cols, slice_groups, PlainRows{n_rows},                                \
                                PlainEpi{residual, out, n_rows});                                          \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gemv_int4_i_mma##COLS(                           \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      const uint16_t* residual, uint16_t* out, int n_rows, int n_cols, int pass_cols, int slice_groups) {  \
    NQ_STAMP();                                                                                             \
    gemv_mma<kInter, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, (n_rows + 1) / 2, n_cols,      \
                               pass_cols, slice_groups, PlainRows{n_rows}, PlainEpi{residual, out, n_rows}); \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_qkv_rope_kv_mma##COLS(                           \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ bias, const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, \
      float eps, const int32_t* __restrict__ pos, const int32_t* __restrict__ page_table, int max_pages,     \
      uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache, int layer, int n_pages,                \
      uint16_t* __restrict__ q_out, int n_cols, int pass_cols, int slice_groups) {                         \
    NQ_STAMP();                                                                                            \
    gemv_mma<kHidden, COLS / 8>(                                                                           \
        Int4Weights{qweight, scales}, x, norm_w, eps, kQkvRows / 2, n_cols, pass_cols, slice_groups,        \
        QkvRows{}, QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer, n_pages, q_out});      \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gate_up_silu_mma##COLS(                          \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      uint16_t* __restrict__ out, int n_cols, int pass_cols, int slice_groups) {                           \
    NQ_STAMP();                                                                                             \
    gemv_mma<kHidden, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, kInter, n_cols, pass_cols,    \
                                slice_groups, GateUpRows{}, GateUpEpi{out});                               \
  }

NQ_INT4_MMA_ENTRIES(8, 2)
NQ_INT4_MMA_ENTRIES(32, 2)

// The tile GEMM's input RMSNorm, one block per column (grid = B): xn [B, K] = RMSNorm(x) * norm_w, run
// before the tile entries when the GEMV has a norm (they read x already normalised).
extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_h(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kHidden>(x, norm_w, eps, xn);
}

#if NQ_TILE_X_PREPERM
// ... written in the tile GEMM's stage layout for x (the q/k/v and gate/up tile entries of this build read it)
extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_wg_h(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn,
    int tile_cols) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kHidden, true>(x, norm_w, eps, xn, tile_cols);
}
#endif

extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_i(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kInter>(x, norm_w, eps, xn);
}

// The batched tile GEMM (gemm_tiles.cuh; the "tiles" variant of gemv.py, B > 1), up to 8, 16, 32 or 64
// columns (suffix _tile8 .. _tile64). Arguments: the weights, x [B, K] (already normalised: nq_norm_cols_*),
// the epilogue's arguments, n_cols = B, the fp32 workspace ws [2 P, COLS, 128, 2] and the tickets [tiles]
// (int32, zero). Grid: P blocks (tile_plan.py plan_tiles), kTileBlockThreads threads, dynamic shared memory =
// kTileStages x tile_stage_bytes<COLS>().
// o_proj (K = H) and down_proj (K = I): the same entry but for K
#define NQ_PLAIN_TILE_ENTRY(NAME, K, COLS)                                                                  \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_##NAME##_tile##COLS(                     \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* residual, uint16_t* out, int n_rows, int n_cols,      \
      float* __restrict__ ws, int* __restrict__ tickets) {                                                  \
    NQ_STAMP();                                                                                            \
    gemm_tiles<K, COLS / 8>(qweight, scales, x, (n_rows + 1) / 2, n_cols, ws, tickets, PlainRows{n_rows},  \
                            PlainEpi{residual, out, n_rows});                                               \
  }
#define NQ_INT4_TILE_ENTRIES(COLS)                                                                          \
  NQ_PLAIN_TILE_ENTRY(gemv_int4_h, kHidden, COLS)                                                           \
  NQ_PLAIN_TILE_ENTRY(gemv_int4_i, kInter, COLS)                                                            \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_qkv_rope_kv_tile##COLS(                  \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ bias, const int32_t* __restrict__ pos,   \
      const int32_t* __restrict__ page_table, int max_pages, uint16_t* __restrict__ k_cache,                \
      uint16_t* __restrict__ v_cache, int layer, int n_pages, uint16_t* __restrict__ q_out, int n_cols,     \
      float* __restrict__ ws, int* __restrict__ tickets) {                                                  \
    NQ_STAMP();                                                                                             \
    gemm_tiles<kHidden, COLS / 8, NQ_TILE_X_PREPERM>(qweight, scales, x, kQkvRows / 2, n_cols, ws, tickets, \
                                                     QkvRows{},                                               \
                                  QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer,         \
                                         n_pages, q_out});                                                  \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_gate_up_silu_tile##COLS(                 \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, uint16_t* __restrict__ out, int n_cols, float* __restrict__ ws,       \
      int* __restrict__ tickets) {                                                                          \
    NQ_STAMP();                                                                                             \
    gemm_tiles<kHidden, COLS / 8, NQ_TILE_X_PREPERM>(qweight, scales, x, kInter, n_cols, ws, tickets,       \
                                                     GateUpRows{},                                            \
                                  GateUpEpi{out});                                                          \
  }

NQ_INT4_TILE_ENTRIES(8)
NQ_INT4_TILE_ENTRIES(16)
NQ_INT4_TILE_ENTRIES(32)
NQ_INT4_TILE_ENTRIES(64)
