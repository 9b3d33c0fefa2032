// gemv_int4.cu: batch-1 INT4 x FP16 GEMV (decode) over ValueShuffle-v1 words, with its fused variants.
//
// What: out[n] = sum_k W[n,k] * xin[k], W[n,k] = scale[n, k/128] * q[n,k] (q = u - 8, u in 0..15), where
//   xin = x, or RMSNorm(x) * norm_w when norm_w is given (HF Qwen2RMSNorm: fp32 mean of squares, x*r
//   rounded to fp16, times the fp16 weight, rounded to fp16). Four entry points (extern "C"):
//   nq_gemv_int4_h / nq_gemv_int4_i  K = H / K = I: out = W.xin (+ residual); residual may alias out.
//   nq_qkv_rope_kv   K = H, rows q|k|v (kQkvRows): + bias, RoPE on q and k at pos (device memory),
//                    k and v written into the KV page of pos, q (roped) to q_out.
//   nq_gate_up_silu  K = H, rows [0,I) gate, [I,2I) up: out[i] = silu(gate[i]) * up[i].
// Shapes/dtypes: qweight uint32 [N, K/8], scales fp16 [N, K/128], x fp16 [K], out fp16 [N or I].
//   The KV page layout is docs/INTERFACES.md section 3: k_cache fp16 [L, n_pages, n_kv, 16, 128].
//
// Launch: 256 threads (8 warps: 4 schedulers per SM, 2 warps each), 1-D grid, grid-stride over "units".
//   A unit is 2 weight rows, owned by one warp; the lanes split K in 16-byte pieces (32 weights, 1/4 of
//   a group). Which 2 rows make a unit is what lets each epilogue stay inside one warp:
//     plain      rows (2p, 2p+1)                    more loads in flight per lane
//     qkv_rope   rows (128h + d, 128h + d + 64)     exactly the pair HF's rotate-half RoPE mixes
//     gate_up    rows (i, I + i)                    gate and up of the same output element
//   So no epilogue needs a second kernel, a grid-wide counter or a head per block (which would give the
//   7B only 36 blocks for q/k/v). The python launcher sizes the grid so each block runs the same number
//   of units (no ragged last wave).
//
//   per warp, one K pass (K = 3584: 112 pieces per row, NJ = 4 per lane):
//     lane l loads pieces u = l, l+32, l+64, ... of both rows; 4 pieces x 2 rows = 8 x 16 B in flight
//     per lane before the first use (Little's law, DESIGN.md: ~32 KB per SM in flight is enough; 8 warps
//     x 32 lanes x 128 B = 32 KB per block, 4 blocks resident at ~55-64 registers).
//
// Measured (H200, bench_gemv.py in graphs, 2026-11-30; docs/PERF.md): 3584x3584 4.97 us (32% of copy
//   bandwidth), 512x3584 3.31 us, fused qkv 4608x3584 7.43 us, fused gate/up 37888x3584 25.7 us (65%),
//   down 3584x18944 16.6 us (50%). The kernel is issue-bound, not starved of loads: the fp16 lm_head
//   with the same load structure streams at 99% (it has 4x fewer weights per byte), while here each
//   8 weights cost ~18 instructions (2 LOP3, 4 PRMT, 4 HSUB2, 4 HMUL2/HFMA2, 2 cvt, adds). A
//   software-pipelined variant (next stage issued before computing the current one; 90-120 registers,
//   2 blocks/SM) measured slower overall (gate/up 28.2 us, qkv 8.8 us, down 15.6 us) and was dropped:
//   with fewer warps the dependent half2 chains are hidden worse. The stage size (2/4/8 pieces) made no
//   difference. What would reach 85%: fewer instructions per weight, i.e. the dot product on tensor
//   cores: gemv_int4_mma.cuh, built with NQ_GEMV_MMA=1 (+ NQ_GEMV_MMA_OFFSET=1 to fold the 1032 offset
//   into a per-group sum of x), is that variant. Measured (2026-11-30): it wins on the long matrices
//   only (gate/up, down), so the default build mix (gemv.py, "mixed") uses it there and this loop for
//   o_proj and q/k/v; the folded-offset build lost everywhere.
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
// Tested: tests/test_gemv_gpu.py against numpy (quantize + ValueShuffle pack in the test), poisoned
//   outputs, 7B and awkward shapes; tests/test_compile.py compiles it for the 7B and tiny dims and
//   checks the SASS holds PRMT.
#include "common.cuh"

namespace nq {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
#ifndef NQ_GEMV_MMA
#define NQ_GEMV_MMA 0  // 1: the tensor-core variant (gemv_int4_mma.cuh); 0: the half2 loop below
#endif
#ifndef NQ_GEMV_STAGE_PIECES
#define NQ_GEMV_STAGE_PIECES 4  // tuning knob (bench_gemv.py --sweep); 4 covers a K = 3584 row in one go
#endif
constexpr int kInFlight = NQ_GEMV_STAGE_PIECES;  // 16-byte pieces per row per lane issued before first use

// ---- stage the activation (optionally RMS-normed) into the transposed shared layout ----------------
// Every thread of the block must call this (it holds barriers); norm_w is block-uniform.
template <int K>
__device__ __forceinline__ void stage_x(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                        float eps, uint4* xs, float* red) {
  constexpr int kChunks = K / 8;  // 8 halves (16 B) each
  constexpr int kNU = K / 32;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float r = 1.f;
  if (norm_w != nullptr) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < kChunks; i += kThreads) {
      const uint4 v = x4[i];
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 f = h22f2(h[t]);
        ss += f.x * f.x + f.y * f.y;
      }
    }
    ss = block_sum<kThreads>(ss, red);  // barrier inside; the branch is block-uniform
    r = rsqrtf(ss / K + eps);
  }
  for (int i = threadIdx.x; i < kChunks; i += kThreads) {
    uint4 v = x4[i];
    if (norm_w != nullptr) {
      const uint4 w = reinterpret_cast<const uint4*>(norm_w)[i];
      uint32_t* pv = reinterpret_cast<uint32_t*>(&v);
      const uint32_t* pw = reinterpret_cast<const uint32_t*>(&w);
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 xf = h22f2(pv[t]);
        const float2 wf = h22f2(pw[t]);
        // HF order: fp16(x * r), then fp16(w * that)
        const uint16_t lo = f2h(wf.x * h2f(f2h(xf.x * r)));
        const uint16_t hi = f2h(wf.y * h2f(f2h(xf.y * r)));
        pv[t] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
      }
    }
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

// One warp: dot products of rows r0 and r1 with xs; the full sums end in every lane.
template <int K>
__device__ __forceinline__ void dot_rows2(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                          int r0, int r1, const uint4* xs, float& o0, float& o1) {
  constexpr int kNU = K / 32;                 // 16-byte pieces per row
  constexpr int kNJ = (kNU + 31) / 32;        // pieces per lane
  constexpr int kGroups = K / kGroup;         // scales per row
  const int lane = threadIdx.x & 31;
  const uint4* w0 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r0) * (K / 8));
  const uint4* w1 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r1) * (K / 8));
  const uint16_t* s0 = sc + static_cast<size_t>(r0) * kGroups;
  const uint16_t* s1 = sc + static_cast<size_t>(r1) * kGroups;
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j0 = 0; j0 < kNJ; j0 += kInFlight) {
    uint4 v0[kInFlight], v1[kInFlight];
    uint16_t g0[kInFlight], g1[kInFlight];
#pragma unroll
    for (int jj = 0; jj < kInFlight; ++jj) {  // issue every load of the chunk first
      const int u = (j0 + jj) * 32 + lane;
      if (j0 + jj < kNJ && u < kNU) {
        v0[jj] = ld_stream_v4(w0 + u);
        v1[jj] = ld_stream_v4(w1 + u);
        g0[jj] = s0[u >> 2];  // 4 pieces per group: lanes 4m..4m+3 share a scale
        g1[jj] = s1[u >> 2];
      }
    }
#pragma unroll
    for (int jj = 0; jj < kInFlight; ++jj) {
      const int u = (j0 + jj) * 32 + lane;
      if (j0 + jj < kNJ && u < kNU) {
        const uint4 x0 = xs[u], x1 = xs[kNU + u], x2 = xs[2 * kNU + u], x3 = xs[3 * kNU + u];
        a0 += h2f(g0[jj]) * (dot8(v0[jj].x, x0) + dot8(v0[jj].y, x1) + dot8(v0[jj].z, x2) + dot8(v0[jj].w, x3));
        a1 += h2f(g1[jj]) * (dot8(v1[jj].x, x0) + dot8(v1[jj].y, x1) + dot8(v1[jj].z, x2) + dot8(v1[jj].w, x3));
      }
    }
  }
  o0 = warp_sum(a0);
  o1 = warp_sum(a1);
}

// The half2 loop over units: a warp takes unit p, `map` names its 2 rows, `epi` (lane 0) writes the
// results. The same maps and epilogues serve the tensor-core variant (gemv_units_mma), so each fused
// epilogue is written once.
template <int K, class Map, class Epi>
__device__ __forceinline__ void gemv_units(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                           float eps, int units, const Map& map, const Epi& epi) {
  __shared__ uint4 xs[K / 8];  // [4][K/32] x 16 B: K * 2 bytes (37.9 KB at K = 18944)
  __shared__ float red[32];
  stage_x<K>(x, norm_w, eps, xs, red);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // no barrier below: warps leave the loop independently
  for (int p = blockIdx.x * kWarps + warp; p < units; p += gridDim.x * kWarps) {
    int r0, r1;
    map(p, r0, r1);
    float o0, o1;
    dot_rows2<K>(qw, sc, r0, r1, xs, o0, o1);
    if (lane == 0) epi(p, r0, r1, o0, o1);
  }
}

// ---- row maps and epilogues: which 2 rows a unit is, and what lane 0 does with their dot products -----
// Shared by the half2 loop (gemv_units) and the tensor-core variant (gemv_units_mma, gemv_int4_mma.cuh).
struct PlainRows {  // rows (2p, 2p+1); odd N: the last unit recomputes row N-1 and writes it once
  int n_rows;
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = 2 * p;
    r1 = min(2 * p + 1, n_rows - 1);
  }
};
struct PlainEpi {
  const uint16_t* residual;  // may alias out: each element is read, then written, by one thread
  uint16_t* out;
  __device__ void operator()(int, int r0, int r1, float o0, float o1) const {
    if (residual != nullptr) {
      o0 += h2f(residual[r0]);
      o1 += h2f(residual[r1]);
    }
    out[r0] = f2h(o0);
    if (r1 != r0) out[r1] = f2h(o1);
  }
};

struct QkvRows {  // unit p: head p/64 (q heads, then k, then v), rows d and d+64 of it (d = p % 64)
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = (p / 64) * kHeadDim + p % 64;
    r1 = r0 + 64;  // the pair HF's rotate-half RoPE mixes
  }
};
struct QkvEpi {
  const uint16_t* bias;
  int pos;
  const int32_t* page_table;
  uint16_t* k_cache;
  uint16_t* v_cache;
  int layer, n_pages;
  uint16_t* q_out;
  __device__ void operator()(int p, int r0, int r1, float a, float b) const {
    const int head = p / 64, d = p % 64;
    a += h2f(bias[r0]);
    b += h2f(bias[r1]);
    if (head < kHeads + kKvHeads) {  // q or k: rotate the pair (d, d + 64)
      // HF: inv_freq[d] = 1 / theta^(2d/128), angle = pos * inv_freq in fp32. inv_freq is computed in
      // fp64 and rounded once, so it is the correctly rounded fp32 value (as the engine's numpy
      // reference computes it): an ulp of inv_freq is ~2e-3 rad of angle at pos 32k. Precise sincosf
      // (no fast math) because the angle reaches ~3e4 rad at 32k context.
      const float inv = static_cast<float>(1.0 / pow(static_cast<double>(NQ_ROPE_THETA), (2.0 * d) / kHeadDim));
      const float ang = static_cast<float>(pos) * inv;
      float sn, cs;
      sincosf(ang, &sn, &cs);
      const float ra = a * cs - b * sn;
      const float rb = b * cs + a * sn;
      a = ra;
      b = rb;
    }
    if (head < kHeads) {
      q_out[r0] = f2h(a);
      q_out[r1] = f2h(b);
    } else {
      const bool is_k = head < kHeads + kKvHeads;
      const int kvh = head - kHeads - (is_k ? 0 : kKvHeads);
      const int page = page_table[pos / kPageTokens];
      // k_cache[layer][page][kvh][pos % 16][:]
      const size_t base =
          ((((static_cast<size_t>(layer) * n_pages + page) * kKvHeads + kvh) * kPageTokens) + pos % kPageTokens) *
          kHeadDim;
      uint16_t* dst = is_k ? k_cache : v_cache;
      dst[base + d] = f2h(a);
      dst[base + d + 64] = f2h(b);
    }
  }
};

struct GateUpRows {  // gate row p and the up row of the same output element
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = p;
    r1 = kInter + p;
  }
};
struct GateUpEpi {
  uint16_t* out;
  __device__ void operator()(int p, int, int, float g, float u) const {
    // HF rounds gate and up to fp16 before the activation; we keep fp32 (within the test tolerance)
    out[p] = f2h(g / (1.f + __expf(-g)) * u);
  }
};

}  // namespace nq

#if NQ_GEMV_MMA
#include "gemv_int4_mma.cuh"  // gemv_units_mma: the tensor-core variant (see its header)
#define NQ_GEMV_UNITS gemv_units_mma
#else
#define NQ_GEMV_UNITS gemv_units
#endif

using namespace nq;

extern "C" __global__ void __launch_bounds__(kThreads) nq_gemv_int4_h(
    const uint32_t* __restrict__ qweight,  // [N, H/8]
    const uint16_t* __restrict__ scales,   // [N, H/128] fp16
    const uint16_t* __restrict__ x,        // [H] fp16
    const uint16_t* __restrict__ norm_w,   // [H] fp16 or null (no norm)
    float eps,
    const uint16_t* residual,              // [N] fp16 or null; may alias out
    uint16_t* out,                         // [N] fp16
    int n_rows) {
  NQ_GEMV_UNITS<kHidden>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2, PlainRows{n_rows},
                         PlainEpi{residual, out});
}

extern "C" __global__ void __launch_bounds__(kThreads) nq_gemv_int4_i(
    const uint32_t* __restrict__ qweight,  // [N, I/8]
    const uint16_t* __restrict__ scales,   // [N, I/128] fp16
    const uint16_t* __restrict__ x,        // [I] fp16
    const uint16_t* __restrict__ norm_w,   // [I] fp16 or null
    float eps, const uint16_t* residual, uint16_t* out, int n_rows) {
  NQ_GEMV_UNITS<kInter>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2, PlainRows{n_rows},
                        PlainEpi{residual, out});
}

// Fused input RMSNorm + q/k/v projection + bias + RoPE + KV page write. Units = kQkvRows / 2.
extern "C" __global__ void __launch_bounds__(kThreads) nq_qkv_rope_kv(
    const uint32_t* __restrict__ qweight,   // [kQkvRows, H/8]   rows q | k | v
    const uint16_t* __restrict__ scales,    // [kQkvRows, H/128]
    const uint16_t* __restrict__ bias,      // [kQkvRows] fp16
    const uint16_t* __restrict__ x,         // [H] fp16 residual stream
    const uint16_t* __restrict__ norm_w,    // [H] fp16 input_layernorm weight (not null)
    float eps,
    const int32_t* __restrict__ pos_dev,    // [1] position of this token (device: graph-replayable)
    const int32_t* __restrict__ page_table, // [max_pages] logical block -> page id
    uint16_t* __restrict__ k_cache,         // [L, n_pages, kKvHeads, 16, 128] fp16
    uint16_t* __restrict__ v_cache,         // same
    int layer, int n_pages,
    uint16_t* __restrict__ q_out) {         // [kQDim] fp16, roped
  NQ_GEMV_UNITS<kHidden>(qweight, scales, x, norm_w, eps, kQkvRows / 2, QkvRows{},
                         QkvEpi{bias, *pos_dev, page_table, k_cache, v_cache, layer, n_pages, q_out});
}

// Fused post-attention RMSNorm + gate/up projection + SiLU(gate) * up. Units = kInter.
extern "C" __global__ void __launch_bounds__(kThreads) nq_gate_up_silu(
    const uint32_t* __restrict__ qweight,  // [2I, H/8]  rows gate | up
    const uint16_t* __restrict__ scales,   // [2I, H/128]
    const uint16_t* __restrict__ x,        // [H] fp16
    const uint16_t* __restrict__ norm_w,   // [H] fp16 or null
    float eps,
    uint16_t* __restrict__ out) {          // [I] fp16
  NQ_GEMV_UNITS<kHidden>(qweight, scales, x, norm_w, eps, kInter, GateUpRows{}, GateUpEpi{out});
}
