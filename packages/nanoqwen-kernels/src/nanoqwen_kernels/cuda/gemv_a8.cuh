// gemv_a8.cuh: the int8-activation loop's own parts (B = 1, the "a8" GEMV variant: the engine's default), included by
// gemv_int4.cu after the half2 loop's pieces it shares (RowChunk, load_chunk, for_chunk_pieces): the
// prologue that rounds x to int8 into shared memory (stage_x_a8) and the dp4a multiply of a chunk
// (use_chunk_a8). gemv_int4.cu's dot_rows2 / gemv_units run it with kA8 / kXA8, and its a8 image pair
// (gate_up_a8_image, nq_gemv_int4_i_a8x) hands down_proj its x already rounded.
#pragma once

namespace nq {

// ---- the int8-activation loop (B = 1, the "a8" GEMV variant; it rounds the activations) ----------------
// The half2 loop spends ~19 instructions per word (8 weights) and is issue-bound (docs/PERF.md). Here the
// activation is rounded to int8 in its prologue, one fp32 scale per 16 k (half of a 16-byte piece of a
// row), and a word costs 4 instructions: 2 LOP3 and 2 dp4a (4 byte products summed into an int32 each):
//     lo = w & 0x0F0F0F0F   bytes u[k+0..3]         dp4a(lo, x[k+0..3], acc_lo)
//     hi = w & 0xF0F0F0F0   bytes 16 u[k+4..7]      dp4a(hi, x[k+4..7], acc_hi)
//   a half-piece's integer sum is 16 (acc_lo) + acc_hi = 16 sum_k u x, exact in int32 (|.| < 2^19), and
//   the zero point is folded in by starting acc_lo at -8 sum_k x (so the sum is 16 sum_k q x, q = u - 8);
//   then per piece and row (sum_a s_a + sum_b s_b) times the group's scale, s_a, s_b the two halves'
//   scales / 16.
// The int -> float conversion of a sum costs no I2F: the accumulator starts at kA8AccStart more, so the
//   int32 16 acc_lo + acc_hi is the bit pattern of the float 1.5 * 2^23 + sum (|sum| < 2^22: the binade
//   [2^23, 2^24) whose ulp is 1), and one FADD of -1.5 * 2^23 gives the sum exactly. I2F issues at a
//   quarter of the FMA rate, and with two per piece and row it held the loop: per-16 scales with I2F took
//   the 7B from 1.519 to 1.581 ms/token (H200, docs/PERF.md twentieth lease).
// Why 16 and not 32 (llama.cpp's q8_1 block): against transformers fp32 on the real 1.5B at batch 1, one
//   scale per 32 values put the worst logit gap where the argmaxes differ at 0.104, over the tier's
//   near-tie bound of 0.1; per 16 the CPU study of the same criterion gave 0.097 and half the KL
//   (docs/PERF.md, nineteenth and twentieth leases). The price is the second sum's IMAD, I2F and FFMA.
// Staged per block (every block rounds the whole x: K/8 chunks over 256 threads, the 2 chunks of a
//   half-piece in 2 neighbouring lanes that share their max and sum by a shuffle):
//     xq (uint4) [2][K/32]:  xq[h][u] = the int8 x of words 2h, 2h+1 of piece u (k = 32u + 16h ..)
//     xm (int4)  [K/32]:     per piece {bits of scale_a / 16, kA8AccStart - 8 sum_a, the same for b},
//                            a / b its halves k = 32u .. 32u+15 / 32u+16 .. 32u+31
//   scale = amax / 127, x_int = rint(x * (127 / amax)) (ties to even; 0 when amax = 0) per half-piece, from
//   the fp16 activation (normed and rounded as the half2 loop stages it). gemv.py's numpy twin (round_a8)
//   rounds the same way; the tests compare against it.
#ifndef NQ_A8_PROBE
#define NQ_A8_PROBE 0  // 1: skip rounding x in the prologue (a timing probe; results wrong)
#endif
// Weights in flight: the half2 loop's kInFlight pieces per row and lane (RowChunk). Measured for this loop
// (H200, 7B down_proj): 2 / 6 / 8 / 10 pieces 16.8 / 15.5 / 14.6 / 14.9 us against 14.8 at 4; gate/up,
// o_proj and q/k/v within 0.3 us at 2 / 6 / 8 (docs/PERF.md "fourteenth lease").

// Chunks a thread loads before rounding them (stage_x_a8; why batches there). All of them where registers
// allow: the 7B's down_proj (K = 18,944, 10 chunks a thread) stays at 126 registers (2 blocks an SM, as its
// 224-block grid needs) with its 10 loads in one L2 round trip instead of three batches of 4, 4, 2. H200,
// decode protocol, three interleaved rounds: 1.4557 / 1.4548 / 1.4544 -> 1.4321 / 1.4298 / 1.4277 ms/token,
// down_proj's family 12.63 -> 12.12 us a launch (docs/PERF.md, twenty-sixth lease). The register-capped
// split build (NQ_MINB_DOWN: 64 registers) would spill with more than 4.
#ifndef NQ_A8_BATCH
#if defined(NQ_MINB_DOWN) && NQ_MINB_DOWN
#define NQ_A8_BATCH 4
#else
#define NQ_A8_BATCH 16
#endif
#endif

constexpr int kA8AccStart = 0x04B40000;  // 16 x this = 0x4B400000, the bits of the float 1.5 * 2^23
constexpr float kA8FloatBase = 12582912.f;  // 1.5 * 2^23

struct A8Stage {  // the shared-memory views of the staged x (carved from the half2 loop's xs buffer)
  uint4* xq;
  int4* xm;
};

template <int K>
__device__ __forceinline__ A8Stage a8_views(uint4* xs) {
  // half2's xs is K * 2 bytes; the int8 x takes K bytes and its metadata K / 2
  return A8Stage{xs, reinterpret_cast<int4*>(xs + K / 16)};
}

// The norm's weights before the launch-overlap wait (NQ_NORM_EARLY, where a thread has at most 2 chunks: the
// q/k/v and gate/up prologues, K = hidden). They are constants of the step, as the GEMV's weights, so the
// caller loads them with its first weights (load_norm_early); the prologue then keeps its x chunks in
// registers from the sum of squares to the rounding. Before, the weights' loads and x's second read came
// after the block barrier of the sum, an L2 (or DRAM) round trip after the one of x. H200, decode
// protocol, three interleaved rounds (docs/PERF.md, twenty-sixth lease): 7B 1.4409 / 1.4422 / 1.4421 ->
// 1.4183 / 1.4161 / 1.4154 ms/token, the 1.5B's dims 0.6112 / 0.6194 / 0.6094 -> 0.5964 / 0.5972 / 0.5966;
// the 7B's gate/up 19.95 -> 19.19 us a launch (83.8% -> 87.1% of the copy rate), q/k/v 5.17 -> 4.84.
// (ptxas may still sink the norm's loads below the wait, as it does in the 1.5B's q/k/v: they then go out
// right after it, beside x's.) NQ_NORM_EARLY=0: the A/B's other side.
#ifndef NQ_NORM_EARLY
#define NQ_NORM_EARLY 1
#endif
template <int K>
__host__ __device__ constexpr int a8_iters() { return (K / 8 + kThreads - 1) / kThreads; }
template <int K>
constexpr bool kNormEarly = NQ_NORM_EARLY && a8_iters<K>() <= 2;
template <int K>
struct NormEarly {
  uint4 w[kNormEarly<K> ? a8_iters<K>() : 1];
};
template <int K>
__device__ __forceinline__ void load_norm_early(const uint16_t* __restrict__ norm_w, NormEarly<K>& ne) {
  if constexpr (kNormEarly<K>) {
    if (norm_w != nullptr) {
#pragma unroll
      for (int it = 0; it < a8_iters<K>(); ++it) {
        const int i = it * kThreads + threadIdx.x;
        if (i < K / 8) ne.w[it] = ld_stream_v4(reinterpret_cast<const uint4*>(norm_w) + i);
      }
    }
  }
}

// Round chunk i (8 fp16 values, v) of the staged x to int8; called by both lanes of each half-piece (lanes
// 2m, 2m+1 hold its 2 chunks, which share their max and sum by a shuffle). put(qi, q, mi, has_m, m) stores
// the chunk's 8 bytes as the uint2 qi of xq and, on the half-piece's first chunk (has_m), its {scale / 16,
// accumulator start} as the int2 mi of xm; chunks past K / 8 (i >= K / 8) store nothing.
template <int K, class Put>
__device__ __forceinline__ void round_chunk_a8(const uint4& v, int i, Put&& put) {
  constexpr int kChunks = K / 8;
  constexpr int kNU = K / 32;
  const uint32_t h[4] = {v.x, v.y, v.z, v.w};
  float f[8];
  float amax = 0.f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float2 p = h22f2(h[t]);
    f[2 * t] = p.x;
    f[2 * t + 1] = p.y;
    amax = fmaxf(amax, fmaxf(fabsf(p.x), fabsf(p.y)));
  }
  amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));  // a half-piece's 2 chunks: lanes 2m, 2m+1
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  // rint(f * inv) without a conversion instruction (F2I issues at a quarter of the FMA rate): t = f * inv
  // is rounded to fp32 first (as numpy's twin rounds it), then t + 1.5 * 2^23 lands in the binade whose
  // ulp is 1, so the add rounds t to the nearest integer (ties to even) and the bits are 0x4B400000 + q:
  // the low byte is q's int8, and the bits of 8 values summed in uint32 are 8 x 0x4B400000 + sum q.
  uint32_t b[8], bsum = 0u;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    b[j] = __float_as_uint(__fadd_rn(__fmul_rn(f[j], inv), 12582912.f));  // _rn: never fused into one FMA
    bsum += b[j];
  }
  int sum = static_cast<int>(bsum - 8u * 0x4B400000u);
  sum += __shfl_xor_sync(0xffffffffu, sum, 1);
  if (i < kChunks) {
    const int u = i >> 2, c = i & 3;  // chunk i = word c of piece u
    const uint32_t lo = __byte_perm(__byte_perm(b[0], b[1], 0x0040u), __byte_perm(b[2], b[3], 0x0040u), 0x5410u);
    const uint32_t hi = __byte_perm(__byte_perm(b[4], b[5], 0x0040u), __byte_perm(b[6], b[7], 0x0040u), 0x5410u);
    // half-piece i / 2 = 2u + c / 2: its pair is the .x, .y (c = 0) or .z, .w (c = 2) of xm[u]
    put(((c >> 1) * kNU + u) * 2 + (c & 1), make_uint2(lo, hi), i >> 1, (c & 1) == 0,
        make_int2(__float_as_int(amax / 127.f * 0.0625f), kA8AccStart - 8 * sum));
  }
}

template <int K>
__device__ __forceinline__ void stage_x_a8(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                           float eps, A8Stage st, float* red, const NormEarly<K>& ne) {
  constexpr int kChunks = K / 8;
  constexpr int kNU = K / 32;
  constexpr int kIters = a8_iters<K>();  // chunks per thread (K = 18944: 10)
  static_assert(kChunks % 4 == 0 && kThreads % 4 == 0, "a piece is 4 chunks of 4 neighbouring threads");
  static_assert(kNU * 32 == K, "whole pieces");
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
  // Loads first, then the arithmetic, kBatch chunks a thread at a time: the rounding below holds warp
  // shuffles, across which the compiler does not move the next chunk's load, so a loop of load -> round ->
  // store pays one L2 round trip per chunk. Measured (H200, 7B down_proj, K = 18944, 10 chunks a thread):
  // that loop cost 4.5 of the kernel's 14.8 us (the same build with the rounding skipped: 10.2 us). Batches
  // of NQ_A8_BATCH (above): a first build of all 10 at once took 255 registers; today's takes 126.
  constexpr int kBatch = kIters < NQ_A8_BATCH ? kIters : NQ_A8_BATCH;
  float r = 1.f;
  uint4 xe[kNormEarly<K> ? kIters : 1];  // kNormEarly: x's chunks, read once
  if (norm_w != nullptr) {
    float ss = 0.f;
    if constexpr (kNormEarly<K>) {
#pragma unroll
      for (int it = 0; it < kIters; ++it) {  // the same order of sums as the loop below
        const int i = it * kThreads + threadIdx.x;
        xe[it] = i < kChunks ? x4[i] : make_uint4(0u, 0u, 0u, 0u);
        if (i < kChunks) ss += sum_squares8(xe[it]);
      }
    } else {
      for (int i = threadIdx.x; i < kChunks; i += kThreads) ss += sum_squares8(x4[i]);
    }
    ss = block_sum<kThreads>(ss, red);
    r = rsqrtf(ss / K + eps);
  }
#pragma unroll
  for (int it0 = 0; it0 < (NQ_A8_PROBE ? 0 : kIters); it0 += kBatch) {
    uint4 v[kBatch];
#pragma unroll
    for (int jb = 0; jb < kBatch; ++jb) {
      const int i = (it0 + jb) * kThreads + threadIdx.x;
      if (kNormEarly<K> && norm_w != nullptr) {
        v[jb] = xe[it0 + jb];
      } else {
        v[jb] = i < kChunks ? x4[i] : make_uint4(0u, 0u, 0u, 0u);
      }
    }
    if (norm_w != nullptr) {
#pragma unroll
      for (int jb = 0; jb < kBatch; ++jb) {
        const int i = (it0 + jb) * kThreads + threadIdx.x;
        if (i < kChunks) v[jb] = rms_apply8(v[jb], kNormEarly<K> ? ne.w[it0 + jb] : w4[i], r);
      }
    }
#pragma unroll
    for (int jb = 0; jb < kBatch; ++jb) {
      const int i = (it0 + jb) * kThreads + threadIdx.x;
      round_chunk_a8<K>(v[jb], i, [&](int qi, uint2 q, int mi, bool has_m, int2 m) {
        reinterpret_cast<uint2*>(st.xq)[qi] = q;
        if (has_m) reinterpret_cast<int2*>(st.xm)[mi] = m;
      });
    }
  }
  __syncthreads();  // xq, xm complete before any warp reads them
}

// dp4a with unsigned bytes in a (the weights' nibbles) and signed bytes in b (x)
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
  int d;
  asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// The bits of the floats 1.5 * 2^23 + 16 sum_k q[k] x_int[k] over each half of one piece (4 words) of a row
// (exact; the biases hold kA8AccStart). Four independent chains of two dp4a.
__device__ __forceinline__ int2 dot16x2_a8(const uint4& w, const uint4& xa, const uint4& xb, int bias_a, int bias_b) {
  int la = bias_a, ha = 0, lb = bias_b, hb = 0;
  la = dp4a_us(w.x & 0x0F0F0F0Fu, xa.x, la);
  ha = dp4a_us(w.x & 0xF0F0F0F0u, xa.y, ha);
  la = dp4a_us(w.y & 0x0F0F0F0Fu, xa.z, la);
  ha = dp4a_us(w.y & 0xF0F0F0F0u, xa.w, ha);
  lb = dp4a_us(w.z & 0x0F0F0F0Fu, xb.x, lb);
  hb = dp4a_us(w.z & 0xF0F0F0F0u, xb.y, hb);
  lb = dp4a_us(w.w & 0x0F0F0F0Fu, xb.z, lb);
  hb = dp4a_us(w.w & 0xF0F0F0F0u, xb.w, hb);
  return make_int2(la * 16 + ha, lb * 16 + hb);
}

template <int K, int kSplit = 1>
__device__ __forceinline__ void use_chunk_a8(const RowChunk& c, int j0, A8Stage st, float& a0, float& a1,
                                             int part = 0) {
  constexpr int kNU = K / 32;
  for_chunk_pieces<K, kSplit>(j0, part, [&](int jj, int u) {
    const uint4 xa = st.xq[u], xb = st.xq[kNU + u];
    const int4 m = st.xm[u];
    const float sa = __int_as_float(m.x), sb = __int_as_float(m.z);
    const int2 d0 = dot16x2_a8(c.v0[jj], xa, xb, m.y, m.w);
    const int2 d1 = dot16x2_a8(c.v1[jj], xa, xb, m.y, m.w);
    // __int_as_float(d) - 1.5 * 2^23 is the sum itself, exactly (no I2F)
    const float fa0 = __int_as_float(d0.x) - kA8FloatBase, fb0 = __int_as_float(d0.y) - kA8FloatBase;
    const float fa1 = __int_as_float(d1.x) - kA8FloatBase, fb1 = __int_as_float(d1.y) - kA8FloatBase;
    a0 = fmaf(fmaf(fa0, sa, fb0 * sb), h2f(c.g0[jj]), a0);
    a1 = fmaf(fmaf(fa1, sa, fb1 * sb), h2f(c.g1[jj]), a1);
  });
}

}  // namespace nq
