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
//     lane l loads pieces u = l, l+32, l+64, ... of both rows; a "stage" is 4 pieces x 2 rows = 8 x 16 B
//     per lane (4 KB per warp). Stages are software-pipelined: stage s+1 is issued before stage s is
//     computed, and a warp's first stage before the block stages x, so the prologue (x from L2, the
//     norm's reduction, a barrier) hides under DRAM latency. Little's law (DESIGN.md) wants ~32 KB in
//     flight per SM: 2 resident blocks (~90-120 registers) x 8 warps x 4 KB = 64 KB.
//   Measured (H200, bench_gemv.py, 2026-11-30): without the pipeline, a stage per warp at a time and
//   the prologue exposed, 3584x3584 reached 32% of copy bandwidth, 3584x18944 50%, 37888x3584 65%.
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
#ifndef NQ_GEMV_STAGE_PIECES
#define NQ_GEMV_STAGE_PIECES 4  // tuning knob for bench_gemv.py --sweep
#endif
constexpr int kInFlight = NQ_GEMV_STAGE_PIECES;  // 16-byte pieces per row per lane in one stage

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

// ---- the software-pipelined warp loop -----------------------------------------------------------------
// A warp walks its units (grid-stride) in "stages": one stage = kInFlight 16-byte pieces of each of the
// unit's 2 rows (a K = 3584 row is one stage, a K = 18944 row five). The loads of stage s+1 are issued
// before stage s is computed, so a warp always has a stage in flight while it does arithmetic, and the
// first stage is issued before the activation is staged, so the block's prologue (x from L2, the norm's
// reduction and barrier) hides under the first weights' DRAM latency.
template <int K>
struct Stage {
  uint4 v0[kInFlight], v1[kInFlight];  // weight pieces of the two rows
  uint16_t g0[kInFlight], g1[kInFlight];  // their group scales (fp16 bits)
};

template <int K>
__device__ __forceinline__ void load_stage(Stage<K>& st, const uint32_t* __restrict__ qw,
                                           const uint16_t* __restrict__ sc, int r0, int r1, int c, int lane) {
  constexpr int kNU = K / 32;           // 16-byte pieces per row
  constexpr int kNJ = (kNU + 31) / 32;  // pieces per lane
  constexpr int kGroups = K / kGroup;
  const uint4* w0 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r0) * (K / 8));
  const uint4* w1 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r1) * (K / 8));
#pragma unroll
  for (int jj = 0; jj < kInFlight; ++jj) {
    const int j = c * kInFlight + jj, u = j * 32 + lane;
    if (j < kNJ && u < kNU) {
      st.v0[jj] = ld_stream_v4(w0 + u);
      st.v1[jj] = ld_stream_v4(w1 + u);
      st.g0[jj] = sc[static_cast<size_t>(r0) * kGroups + (u >> 2)];  // 4 pieces per group
      st.g1[jj] = sc[static_cast<size_t>(r1) * kGroups + (u >> 2)];
    }
  }
}

template <int K>
__device__ __forceinline__ void compute_stage(const Stage<K>& st, const uint4* xs, int c, int lane, float& a0,
                                              float& a1) {
  constexpr int kNU = K / 32;
  constexpr int kNJ = (kNU + 31) / 32;
#pragma unroll
  for (int jj = 0; jj < kInFlight; ++jj) {
    const int j = c * kInFlight + jj, u = j * 32 + lane;
    if (j < kNJ && u < kNU) {
      const uint4 x0 = xs[u], x1 = xs[kNU + u], x2 = xs[2 * kNU + u], x3 = xs[3 * kNU + u];
      a0 += h2f(st.g0[jj]) *
            (dot8(st.v0[jj].x, x0) + dot8(st.v0[jj].y, x1) + dot8(st.v0[jj].z, x2) + dot8(st.v0[jj].w, x3));
      a1 += h2f(st.g1[jj]) *
            (dot8(st.v1[jj].x, x0) + dot8(st.v1[jj].y, x1) + dot8(st.v1[jj].z, x2) + dot8(st.v1[jj].w, x3));
    }
  }
}

// The whole kernel body: stage x (optionally normed), then every unit of this warp.
// map(p, r0, r1): unit -> its two rows. epi(p, r0, r1, a0, a1): lane 0, full sums (fp32).
template <int K, class Map, class Epi>
__device__ __forceinline__ void gemv_units(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                           float eps, int units, Map map, Epi epi) {
  constexpr int kNJ = (K / 32 + 31) / 32;
  constexpr int kStages = (kNJ + kInFlight - 1) / kInFlight;  // stages per unit
  __shared__ uint4 xs[K / 8];  // [4][K/32] x 16 B: K * 2 bytes (37.9 KB at K = 18944)
  __shared__ float red[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int stride = gridDim.x * kWarps;
  int p = blockIdx.x * kWarps + warp, c = 0, r0 = 0, r1 = 0;
  Stage<K> cur;
  if (p < units) {
    map(p, r0, r1);
    load_stage<K>(cur, qw, sc, r0, r1, 0, lane);  // in flight across the prologue
  }
  stage_x<K>(x, norm_w, eps, xs, red);  // every thread: barriers inside
  // no barrier below: warps leave the loop independently
  float a0 = 0.f, a1 = 0.f;
  while (p < units) {
    int pn = p, cn = c + 1, n0 = r0, n1 = r1;
    if (cn == kStages) {
      cn = 0;
      pn = p + stride;
      if (pn < units) map(pn, n0, n1);
    }
    Stage<K> nxt;
    if (pn < units) load_stage<K>(nxt, qw, sc, n0, n1, cn, lane);
    compute_stage<K>(cur, xs, c, lane, a0, a1);
    if (c == kStages - 1) {
      a0 = warp_sum(a0);
      a1 = warp_sum(a1);
      if (lane == 0) epi(p, r0, r1, a0, a1);
      a0 = a1 = 0.f;
    }
    cur = nxt;
    p = pn;
    c = cn;
    r0 = n0;
    r1 = n1;
  }
}

template <int K>
__device__ __forceinline__ void gemv_plain(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                           float eps, const uint16_t* residual, uint16_t* out, int n_rows) {
  gemv_units<K>(
      qw, sc, x, norm_w, eps, (n_rows + 1) / 2,
      [n_rows](int p, int& r0, int& r1) {
        r0 = 2 * p;
        r1 = min(2 * p + 1, n_rows - 1);  // odd N: the last unit recomputes row N-1, writes it once
      },
      [residual, out](int, int r0, int r1, float o0, float o1) {
        // residual may alias out: each element is read, then written, by this one lane
        if (residual != nullptr) {
          o0 += h2f(residual[r0]);
          o1 += h2f(residual[r1]);
        }
        out[r0] = f2h(o0);
        if (r1 != r0) out[r1] = f2h(o1);
      });
}

}  // namespace nq

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
  gemv_plain<kHidden>(qweight, scales, x, norm_w, eps, residual, out, n_rows);
}

extern "C" __global__ void __launch_bounds__(kThreads) nq_gemv_int4_i(
    const uint32_t* __restrict__ qweight,  // [N, I/8]
    const uint16_t* __restrict__ scales,   // [N, I/128] fp16
    const uint16_t* __restrict__ x,        // [I] fp16
    const uint16_t* __restrict__ norm_w,   // [I] fp16 or null
    float eps, const uint16_t* residual, uint16_t* out, int n_rows) {
  gemv_plain<kInter>(qweight, scales, x, norm_w, eps, residual, out, n_rows);
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
  const int pos = *pos_dev;
  gemv_units<kHidden>(
      qweight, scales, x, norm_w, eps, kQkvRows / 2,
      [](int p, int& r0, int& r1) {
        const int head = p / 64, d = p % 64;  // heads: q heads, then k heads, then v heads
        r0 = head * kHeadDim + d;
        r1 = r0 + 64;  // the pair HF's rotate-half RoPE mixes
      },
      [=](int p, int r0, int r1, float a, float b) {
        const int head = p / 64, d = p % 64;
        a += h2f(bias[r0]);
        b += h2f(bias[r1]);
        if (head < kHeads + kKvHeads) {  // q or k: rotate the pair (d, d + 64)
          // HF: inv_freq[d] = 1 / theta^(2d/128), angle = pos * inv_freq in fp32. inv_freq is computed
          // in fp64 and rounded once, so it is the correctly rounded fp32 value (as the engine's numpy
          // reference computes it): an ulp of inv_freq is ~2e-3 rad of angle at pos 32k. Precise
          // sincosf (no fast math) because the angle reaches ~3e4 rad at 32k context.
          const float inv =
              static_cast<float>(1.0 / pow(static_cast<double>(NQ_ROPE_THETA), (2.0 * d) / kHeadDim));
          float sn, cs;
          sincosf(static_cast<float>(pos) * inv, &sn, &cs);
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
              ((((static_cast<size_t>(layer) * n_pages + page) * kKvHeads + kvh) * kPageTokens) +
               pos % kPageTokens) * kHeadDim;
          uint16_t* dst = is_k ? k_cache : v_cache;
          dst[base + d] = f2h(a);
          dst[base + d + 64] = f2h(b);
        }
      });
}

// Fused post-attention RMSNorm + gate/up projection + SiLU(gate) * up. Units = kInter.
extern "C" __global__ void __launch_bounds__(kThreads) nq_gate_up_silu(
    const uint32_t* __restrict__ qweight,  // [2I, H/8]  rows gate | up
    const uint16_t* __restrict__ scales,   // [2I, H/128]
    const uint16_t* __restrict__ x,        // [H] fp16
    const uint16_t* __restrict__ norm_w,   // [H] fp16 or null
    float eps,
    uint16_t* __restrict__ out) {          // [I] fp16
  gemv_units<kHidden>(
      qweight, scales, x, norm_w, eps, kInter,
      [](int p, int& r0, int& r1) {
        r0 = p;           // gate row
        r1 = kInter + p;  // up row of the same output element
      },
      [out](int p, int, int, float g, float u) {
        // HF rounds gate and up to fp16 before the activation; fp32 here (within the test tolerance)
        out[p] = f2h(g / (1.f + __expf(-g)) * u);
      });
}
