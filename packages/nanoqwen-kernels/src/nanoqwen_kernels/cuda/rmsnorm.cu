// rmsnorm.cu: RMSNorm of rows of width H (the final norm at decode, one row per sequence; rows of a
// prompt at prefill). The per-piece math is common.cuh's sum_squares8 / rms_apply8.
//
// What: out[t] = fp16(w * fp16(x[t] * rsqrt(mean(x[t]^2) + eps))), the HF Qwen2RMSNorm order (mean of
//   squares in fp32, normalised value rounded to fp16 before the weight multiply).
// Shapes/dtypes: x fp16 [T, H], w fp16 [H], out fp16 [T, H]; out may alias x (each thread writes only
//   the pieces it read, after the block barrier inside block_sum).
// Launch: one 256-thread block per row (grid T): T prompt tokens at prefill, B sequences at decode.
// Why: H <= 8192 fp16 is at most 16 KB: one block holds a row in registers (a few 16-byte pieces per
//   thread), so a row costs one read and one write; the work is tiny next to the GEMVs around it.
// Tested: tests/test_norm_embed_gpu.py (numpy reference, poisoned output, in-place, T = 1, 3, 17).
#include "common.cuh"

namespace nq {
constexpr int kNormThreads = 256;
}
using namespace nq;

extern "C" __global__ void __launch_bounds__(kNormThreads) nq_rmsnorm_rows(
    const uint16_t* x,                    // [T, H] fp16
    const uint16_t* __restrict__ w,       // [H] fp16
    uint16_t* out,                        // [T, H] fp16, may alias x
    float eps) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  constexpr int kPieces = kHidden / 8;                                  // 16 B = 8 halves each
  constexpr int kPer = (kPieces + kNormThreads - 1) / kNormThreads;     // pieces per thread
  __shared__ float red[32];
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<size_t>(blockIdx.x) * kHidden);
  uint4* orow = reinterpret_cast<uint4*>(out + static_cast<size_t>(blockIdx.x) * kHidden);
  uint4 v[kPer];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = j * kNormThreads + threadIdx.x;
    if (i < kPieces) {
      v[j] = xr[i];
      ss += sum_squares8(v[j]);
    }
  }
  const float r = rsqrtf(block_sum<kNormThreads>(ss, red) / kHidden + eps);  // all threads call it
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int i = j * kNormThreads + threadIdx.x;
    if (i < kPieces) {
      orow[i] = rms_apply8(v[j], reinterpret_cast<const uint4*>(w)[i], r);
    }
  }
}
