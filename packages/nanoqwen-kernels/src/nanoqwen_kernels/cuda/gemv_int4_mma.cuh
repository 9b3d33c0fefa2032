// gemv_int4_mma.cuh: the INT4 GEMV's dot products on tensor cores (mma.sync m16n8k16, fp32 accumulate).
// Built when NQ_GEMV_MMA=1; included by gemv_int4.cu. The default GEMV variant "mixed" (gemv.py) uses it
// for gate/up and down_proj, where it measured faster on the H200 (2026-11-30, bench_gemv.py --sweep:
// gate/up 24.60 vs 25.56 us, down 14.81 vs 16.53 us; slower on o_proj and q/k/v, which keep the half2
// loop). Tested: every GPU GEMV test (tests/test_gemv_gpu.py) passes on it, the numpy emulation of its
// lane mapping in tests/test_gemv_mma_mapping.py on the CPU, and the validation ladder on "mixed".
//
// What: the same results as gemv_int4.cu's default loop (same row maps and epilogues, same ValueShuffle
//   words, same prmt unpack), with the multiply-adds moved from half2 FMAs onto the tensor cores.
// Why: the default loop is issue-bound (docs/PERF.md): ~18 instructions per 8 weights, of which the
//   products, the fp16 partial sums and their conversions to fp32 are ~10. Here a word costs 2 LOP3 +
//   4 PRMT + 4 HSUB2 and a quarter of an HMMA (~10.5); with NQ_GEMV_MMA_OFFSET=1 the 4 HSUB2 go too
//   (the tensor core multiplies the raw 1032 + q values and the 1032 * sum(x) of the group is
//   subtracted once per group in fp32), ~6.5. The accumulation is fp32 throughout (more accurate than
//   the default's 4-term fp16 partial sums); the offset variant loses ~1e-7 x 1032 |sum x| per group
//   to the cancellation, well inside the test tolerance.
//
// Work split (a block = 8 warps, one tile of 16 rows at a time, grid-stride over tiles):
//
//   tile t = units 8t .. 8t+7 (a unit = the 2 rows its map gives, as in the default loop)
//   lane l: unit 8t + l/4 (mma "groupID"), c = l % 4 ("thread in group")
//     mma A row l/4      <- row r0 of its unit,  A row l/4 + 8 <- row r1
//   warp w: the groups g = w, w + 8, w + 16, ... of K (split K across the block's warps, so a 16-row tile
//     still keeps 8 warps of loads in flight); a group g is 128 k = 4 lanes x 16 B per row:
//     lane c loads piece 4g + c of each of its two rows (32 k, 4 words -> 16 half2)
//   per group, 8 mmas: mma j takes the lane's half2 2j (A k-slots 2c, 2c+1) and 2j+1 (slots 2c+8, 2c+9)
//     of both rows, and B = the x half2s of the same k (so every B column is x: C's 8 columns are equal
//     and column 2c of lane c is the group's dot product for its unit). The k order inside the mma is
//     a permutation shared by A and B, so the dot product is exact in any order.
//   fp32: acc_r += C_g(r) * scale[r][g];  then the 8 warps' partials meet in shared memory and 8
//     threads of warp 0 run the epilogue.
//
// x in shared memory in natural order (the 4 lanes of a unit read 4 consecutive 64-byte segments of one
// group; lanes of other units read the same addresses: broadcast).
#pragma once

#ifndef NQ_GEMV_MMA_OFFSET
#define NQ_GEMV_MMA_OFFSET 0
#endif

namespace nq {

// x (optionally RMS-normed, HF order as stage_x) into natural order; with the offset variant also the
// fp32 sum of each 128-group of the staged values. Every thread calls it (barriers inside).
template <int K>
__device__ __forceinline__ void stage_x_natural(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                                float eps, uint4* xs, float* gsum, float* red) {
  constexpr int kChunks = K / 8;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float r = 1.f;
  if (norm_w != nullptr) {  // block-uniform
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
    ss = block_sum<kThreads>(ss, red);
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
        const uint16_t lo = f2h(wf.x * h2f(f2h(xf.x * r)));
        const uint16_t hi = f2h(wf.y * h2f(f2h(xf.y * r)));
        pv[t] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
      }
    }
    xs[i] = v;
  }
  __syncthreads();  // xs complete
#if NQ_GEMV_MMA_OFFSET
  for (int g = threadIdx.x; g < K / kGroup; g += kThreads) {
    float s = 0.f;
#pragma unroll 4
    for (int i = 0; i < kGroup / 8; ++i) {
      const uint4 v = xs[g * (kGroup / 8) + i];
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 f = h22f2(h[t]);
        s += f.x + f.y;
      }
    }
    gsum[g] = s;
  }
  __syncthreads();  // gsum complete
#endif
}

// The 8 fp16 values of a word as 4 half2 for the A operand: exact q (default) or 1032 + q (offset).
__device__ __forceinline__ void unpack8_a(uint32_t w, uint32_t out[4]) {
#if NQ_GEMV_MMA_OFFSET
  const uint32_t lo = w & 0x0F0F0F0Fu;
  const uint32_t hi = (w >> 4) & 0x0F0F0F0Fu;
  out[0] = prmt(lo, 0x64646464u, 0x4140u);  // {1024 + u} = {1032 + q}, exact
  out[1] = prmt(lo, 0x64646464u, 0x4342u);
  out[2] = prmt(hi, 0x64646464u, 0x4140u);
  out[3] = prmt(hi, 0x64646464u, 0x4342u);
#else
  unpack8(w, out);
#endif
}

// d += A B for one m16n8k16 step (row-major A: 16 rows x 16 k fp16; col-major B: 16 k x 8 fp16; fp32 C).
__device__ __forceinline__ void mma16816(float d[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One group (128 k) of the lane's two rows: piece v0 (row r0), v1 (row r1), x pieces xw[0..3].
// Returns C's column-2c values for row r0 (d[0]) and r1 (d[2]).
__device__ __forceinline__ void group_mma(const uint4& v0, const uint4& v1, const uint4 xw[4], float d[4]) {
  const uint32_t w0[4] = {v0.x, v0.y, v0.z, v0.w};
  const uint32_t w1[4] = {v1.x, v1.y, v1.z, v1.w};
  d[0] = d[1] = d[2] = d[3] = 0.f;
#pragma unroll
  for (int wd = 0; wd < 4; ++wd) {  // word wd = half2 4wd .. 4wd+3 of the piece
    uint32_t q0[4], q1[4];
    unpack8_a(w0[wd], q0);
    unpack8_a(w1[wd], q1);
    const uint32_t xh[4] = {xw[wd].x, xw[wd].y, xw[wd].z, xw[wd].w};  // x half2 4wd .. 4wd+3
    // mma j = 2wd: half2 4wd (slots 2c, 2c+1) and 4wd+1 (slots 2c+8, 2c+9); A regs: {r0, r1, r0, r1}
    mma16816(d, q0[0], q1[0], q0[1], q1[1], xh[0], xh[1]);
    mma16816(d, q0[2], q1[2], q0[3], q1[3], xh[2], xh[3]);
  }
}

template <int K, class Map, class Epi>
__device__ __forceinline__ void gemv_units_mma(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                               const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                               float eps, int units, const Map& map, const Epi& epi) {
  constexpr int kG = K / kGroup;                       // groups per row
  constexpr int kGpw = (kG + kWarps - 1) / kWarps;     // groups per warp (g = warp + 8 i)
  __shared__ uint4 xs[K / 8];                          // xin in natural order: K * 2 bytes
  __shared__ float gsum[NQ_GEMV_MMA_OFFSET ? kG : 1];  // fp32 sum of each group of xin (offset variant)
  __shared__ float red32[32];
  __shared__ float part[kWarps][8][2];                 // per warp, per unit of the tile: (row r0, row r1)
  stage_x_natural<K>(x, norm_w, eps, xs, gsum, red32);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int ul = lane >> 2, c = lane & 3;
  const int tiles = (units + 7) / 8;
  // block-uniform loop (t depends on the block only): the barriers inside are reached by every thread
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int r0, r1;
    map(min(t * 8 + ul, units - 1), r0, r1);  // a tail tile recomputes the last unit; only real units written
    const uint4* w0 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r0) * (K / 8));
    const uint4* w1 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r1) * (K / 8));
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int i0 = 0; i0 < kGpw; i0 += kInFlight) {
      uint4 v0[kInFlight], v1[kInFlight];
      uint16_t s0[kInFlight], s1[kInFlight];
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {  // every load of the chunk first
        const int g = warp + kWarps * (i0 + f);
        if (i0 + f < kGpw && g < kG) {  // warp-uniform
          v0[f] = ld_stream_v4(w0 + 4 * g + c);
          v1[f] = ld_stream_v4(w1 + 4 * g + c);
          s0[f] = sc[static_cast<size_t>(r0) * kG + g];
          s1[f] = sc[static_cast<size_t>(r1) * kG + g];
        }
      }
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) {
        const int g = warp + kWarps * (i0 + f);
        if (i0 + f < kGpw && g < kG) {  // warp-uniform: mma.sync needs the whole warp
          const uint4* xp = xs + (g * kGroup + 32 * c) / 8;  // this lane's 32 k of group g
          const uint4 xw[4] = {xp[0], xp[1], xp[2], xp[3]};
          float d[4];
          group_mma(v0[f], v1[f], xw, d);
#if NQ_GEMV_MMA_OFFSET
          const float off = 1032.f * gsum[g];  // every A value carried +1032
          d[0] -= off;
          d[2] -= off;
#endif
          a0 = fmaf(d[0], h2f(s0[f]), a0);
          a1 = fmaf(d[2], h2f(s1[f]), a1);
        }
      }
    }
    if (c == 0) {  // the 4 lanes of a unit hold the same sums
      part[warp][ul][0] = a0;
      part[warp][ul][1] = a1;
    }
    __syncthreads();  // all warps' partials of this tile visible
    if (threadIdx.x < 8) {
      const int p = t * 8 + threadIdx.x;
      if (p < units) {
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          o0 += part[w][threadIdx.x][0];
          o1 += part[w][threadIdx.x][1];
        }
        int q0, q1;
        map(p, q0, q1);
        epi(p, q0, q1, o0, o1);
      }
    }
    __syncthreads();  // part[] read before the next tile overwrites it
  }
}

}  // namespace nq
