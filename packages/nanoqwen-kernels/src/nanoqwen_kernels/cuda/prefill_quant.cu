// prefill_quant.cu: the operands of the FP8 prefill GEMM (gemm_fp8_prefill.cu).
//
// nq_quantize_e4m3_rows: an activation X fp16 [T, K] -> xq e4m3 [T, K] and sx f32 [T]: each token row gets
//   the scale s = amax / 448 (1 for an all-zero row) and xq = e4m3(x / s), round to nearest even, saturating
//   (|x / s| <= 448 but for the division's rounding). One block of 256 threads per row: the row read once
//   into shared memory while the amax is taken (4 values a thread per step, a block reduction), then
//   converted from there: X is read from memory once (a second read of the 7B's 8,192 x 18,944 MLP
//   activation cost ~75 us a layer).
// nq_rmsnorm_e4m3_rows: rmsnorm.cu's nq_rmsnorm_rows and nq_quantize_e4m3_rows in one pass: the normed fp16
//   row (the same bits) converted as above, never written in fp16 (the q/k/v and gate|up GEMMs' X).
// nq_int4_to_e4m3: the resident FP8 copy of an INT4 matrix (made once at load): w8[r][k] = e4m3(u - 8) for
//   the nibble u of row rowmap[r], k in natural order (ValueShuffle-v1 keeps k 0..3 of a word in the low
//   nibbles of bytes 0..3 and k 4..7 in the high ones). The integers -8..7 are exact in e4m3. rowmap lets
//   the gate|up copy interleave its rows as the SiLU build's tiles want them (prefill_gemm.fp8_silu_rowmap).
//   One thread per 32-bit word, 8 bytes out.
// Tested: tests/test_prefill_gemm_fp8.py (both against numpy's e4m3 rounding, bit for bit).
#include "common.cuh"

namespace nq {
// {e4m3(lo), e4m3(hi)} as 2 bytes (lo in the low byte): PTX cvt with .satfinite (saturates to +-448, NaN
// stays NaN)
__device__ __forceinline__ uint32_t e4m3x2(float lo, float hi) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}
}  // namespace nq

extern "C" __global__ void __launch_bounds__(256)
    nq_quantize_e4m3_rows(const nq::uint16_t* __restrict__ x, nq::uint8_t* __restrict__ xq, float* __restrict__ sx,
                          int K) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  using namespace nq;
  extern __shared__ uint2 row_s[];  // the row, K / 4 pieces of 4 halves (K x 2 bytes: 37 KB at the 7B's 18,944)
  __shared__ float red[8];
  pdl_wait();
  const size_t row = static_cast<size_t>(blockIdx.x) * K;
  const uint2* src = reinterpret_cast<const uint2*>(x + row);
  float m = 0.f;
  for (int i = threadIdx.x; i < K / 4; i += 256) {
    const uint2 v = src[i];
    row_s[i] = v;  // read once from memory: the conversion below reads it from here
    const float2 a = h22f2(v.x), b = h22f2(v.y);
    m = fmaxf(m, fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y))));
  }
  m = warp_max(m);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();  // red and row_s complete
  m = warp_max((threadIdx.x & 31) < 8 ? red[threadIdx.x & 31] : 0.f);  // every warp folds the 8 maxima itself
  const float s = m > 0.f ? m / 448.f : 1.f;
  uint32_t* dst = reinterpret_cast<uint32_t*>(xq + row);
  for (int i = threadIdx.x; i < K / 4; i += 256) {
    const uint2 v = row_s[i];
    const float2 a = h22f2(v.x), b = h22f2(v.y);
    dst[i] = e4m3x2(a.x / s, a.y / s) | (e4m3x2(b.x / s, b.y / s) << 16);
  }
  if (threadIdx.x == 0) sx[blockIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256)
    nq_rmsnorm_e4m3_rows(const nq::uint16_t* __restrict__ x,  // [T, kHidden] fp16
                         const nq::uint16_t* __restrict__ w,  // [kHidden] fp16
                         nq::uint8_t* __restrict__ xq,        // [T, kHidden] e4m3
                         float* __restrict__ sx,              // [T]
                         float eps) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  using namespace nq;
  constexpr int kPieces = kHidden / 8;               // 16 B = 8 halves each
  constexpr int kPer = (kPieces + 255) / 256;        // pieces per thread
  __shared__ float red[32];
  pdl_wait();
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<size_t>(blockIdx.x) * kHidden);
  uint4 v[kPer];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = j * 256 + threadIdx.x;
    if (i < kPieces) {
      v[j] = xr[i];
      ss += sum_squares8(v[j]);
    }
  }
  const float r = rsqrtf(block_sum<256>(ss, red) / kHidden + eps);  // all threads call it
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = j * 256 + threadIdx.x;
    if (i < kPieces) {
      v[j] = rms_apply8(v[j], reinterpret_cast<const uint4*>(w)[i], r);  // the fp16 values rmsnorm_rows writes
      const uint32_t h[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const float2 f = h22f2(h[t]);
        m = fmaxf(m, fmaxf(fabsf(f.x), fabsf(f.y)));
      }
    }
  }
  m = warp_max(m);  // (block_sum ended with a barrier: red is free again)
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  m = warp_max((threadIdx.x & 31) < 8 ? red[threadIdx.x & 31] : 0.f);
  const float s = m > 0.f ? m / 448.f : 1.f;
  uint2* orow = reinterpret_cast<uint2*>(xq + static_cast<size_t>(blockIdx.x) * kHidden);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = j * 256 + threadIdx.x;
    if (i < kPieces) {
      const uint32_t h[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
      uint32_t q[2];
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const float2 a = h22f2(h[2 * t]), b = h22f2(h[2 * t + 1]);
        q[t] = e4m3x2(a.x / s, a.y / s) | (e4m3x2(b.x / s, b.y / s) << 16);
      }
      orow[i] = make_uint2(q[0], q[1]);
    }
  }
  if (threadIdx.x == 0) sx[blockIdx.x] = s;
}

extern "C" __global__ void __launch_bounds__(256)
    nq_int4_to_e4m3(const nq::uint32_t* __restrict__ qw, const int* __restrict__ rowmap, nq::uint8_t* __restrict__ w8,
                    int n_out, int K) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  using namespace nq;
  // e4m3 of q = u - 8, u = 0 .. 15 (sign bit 7, biased exponent bits 6-3, mantissa 2-0), 8 bytes each
  // packed in two 64-bit constants (no table in memory): byte u & 7 of kLo (u < 8) or kHi
  // kLut[16] = {0xD0, 0xCE, 0xCC, 0xCA, 0xC8, 0xC4, 0xC0, 0xB8, 0x00, 0x38, 0x40, 0x44, 0x48, 0x4A, 0x4C, 0x4E}
  constexpr unsigned long long kLo = 0xB8C0C4C8CACCCED0ull, kHi = 0x4E4C4A4844403800ull;
  pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  const int kw = K / 8;
  const long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= static_cast<long long>(n_out) * kw) return;
  const int r = static_cast<int>(i / kw), w = static_cast<int>(i % kw);
  const uint32_t word = qw[static_cast<size_t>(rowmap[r]) * kw + w];
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t ul = (word >> (8 * j)) & 15u, uh = (word >> (8 * j + 4)) & 15u;
    lo |= static_cast<uint32_t>(((ul < 8 ? kLo : kHi) >> (8 * (ul & 7))) & 0xFFu) << (8 * j);
    hi |= static_cast<uint32_t>(((uh < 8 ? kLo : kHi) >> (8 * (uh & 7))) & 0xFFu) << (8 * j);
  }
  reinterpret_cast<uint2*>(w8)[i] = make_uint2(lo, hi);
}
