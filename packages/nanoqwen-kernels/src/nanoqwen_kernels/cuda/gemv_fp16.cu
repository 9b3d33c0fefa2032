// gemv_fp16.cu: the FP16 GEMV with fp32 output, for the lm_head (V x H = 152064 x 3584 on the 7B), for B
// sequences at once.
//
// What: out_f32[b][n] = sum_k W[n,k] * x[b][k], fp32 products and sums (logits feed argmax/sampling, so
//   they stay fp32: a fp16 logit would turn near-ties into exact ties).
// Shapes/dtypes: w fp16 [N, H] row-major, x fp16 [B, H], out fp32 [B, N]. K is the compile-time H.
// Entries: nq_gemv_fp16 (B = 1, the streaming loop below) and nq_gemv_fp16_mma8 / _mma32 (any B, the
//   tensor-core core of gemv_mma.cuh with dense fp16 rows: up to 8 / 32 columns per pass).
//
// nq_gemv_fp16 (B = 1). Launch: 256 threads (8 warps), 1-D grid-stride over units of 2 rows per warp;
//   the launcher sizes the grid so every block runs the same number of units.
// Why: the lm_head is the single largest read of a decode step (1.09 GB of the 7B's 4.46 GB) and is
//   read once per token, so this is a pure streaming kernel: 16-byte non-allocating loads
//   (common.cuh ld_stream_v4), 2 rows x 4 pieces = 8 x 16 B in flight per lane before first use, the
//   activation converted to fp32 once per block into shared memory ([H] fp32, 14 KB), and each lane
//   reading x pieces at consecutive 32-byte strides across the warp (2 phases, no bank conflict).
//   It streams at 99% of copy bandwidth (docs/PERF.md). For B > 1 the fp32 FMAs would grow B-fold
//   (70 GFLOP at B = 64): the products go to the tensor cores instead (fp16 in, fp32 accumulate).
//
//   lane l of a warp: pieces u = l, l+32, ... (8 halves each) of rows 2p and 2p+1
//   xs (float) [H]:  xs[8u .. 8u+7] pairs with piece u
//
// Tested: tests/test_gemv_gpu.py (numpy fp32 reference, poisoned output, 7B and 1.5B, awkward N, B = 1 .. 64).
#include "gemv_mma.cuh"

namespace nq {
constexpr int kF16InFlight = 4;

struct F32Epi {  // fp32 logits [B, n_rows]
  float* out;
  int n_rows;
  __device__ void operator()(int b, int, int r0, int r1, float o0, float o1) const {
    float* o = out + static_cast<size_t>(b) * n_rows;
    o[r0] = o0;
    if (r1 != r0) o[r1] = o1;
  }
};
}  // namespace nq

using namespace nq;

extern "C" __global__ void __launch_bounds__(kThreads) nq_gemv_fp16(
    const uint16_t* __restrict__ w,  // [N, H] fp16
    const uint16_t* __restrict__ x,  // [H] fp16
    float* __restrict__ out,         // [N] fp32
    int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  constexpr int kNU = kHidden / 8;           // 16-byte pieces per row
  constexpr int kNJ = (kNU + 31) / 32;       // pieces per lane
  __shared__ float4 xs[kHidden / 4];         // [H] fp32 = H * 4 bytes
  pdl_wait();  // launch overlap (common.cuh): x is the previous kernel's output
  for (int i = threadIdx.x; i < kHidden / 2; i += kThreads) {
    const float2 f = h22f2(reinterpret_cast<const uint32_t*>(x)[i]);
    reinterpret_cast<float2*>(xs)[i] = f;
  }
  __syncthreads();  // xs complete; no barrier after this point

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int units = (n_rows + 1) / 2;
  for (int p = blockIdx.x * (kThreads / 32) + warp; p < units; p += gridDim.x * (kThreads / 32)) {
    const int r0 = 2 * p, r1 = min(2 * p + 1, n_rows - 1);
    const uint4* w0 = reinterpret_cast<const uint4*>(w + static_cast<size_t>(r0) * kHidden);
    const uint4* w1 = reinterpret_cast<const uint4*>(w + static_cast<size_t>(r1) * kHidden);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int j0 = 0; j0 < kNJ; j0 += kF16InFlight) {
      uint4 v0[kF16InFlight], v1[kF16InFlight];
#pragma unroll
      for (int jj = 0; jj < kF16InFlight; ++jj) {
        const int u = (j0 + jj) * 32 + lane;
        if (j0 + jj < kNJ && u < kNU) {
          v0[jj] = ld_stream_v4(w0 + u);
          v1[jj] = ld_stream_v4(w1 + u);
        }
      }
#pragma unroll
      for (int jj = 0; jj < kF16InFlight; ++jj) {
        const int u = (j0 + jj) * 32 + lane;
        if (j0 + jj < kNJ && u < kNU) {
          const float4 xa = xs[2 * u], xb = xs[2 * u + 1];
          const float xv[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
          const uint32_t p0[4] = {v0[jj].x, v0[jj].y, v0[jj].z, v0[jj].w};
          const uint32_t p1[4] = {v1[jj].x, v1[jj].y, v1[jj].z, v1[jj].w};
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float2 f0 = h22f2(p0[t]), f1 = h22f2(p1[t]);
            a0 = fmaf(f0.x, xv[2 * t], a0);
            a0 = fmaf(f0.y, xv[2 * t + 1], a0);
            a1 = fmaf(f1.x, xv[2 * t], a1);
            a1 = fmaf(f1.y, xv[2 * t + 1], a1);
          }
        }
      }
    }
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane == 0) {
      out[r0] = a0;
      if (r1 != r0) out[r1] = a1;
    }
  }
}

// B columns: x [B, H], out [B, N]; n_cols = B, pass_cols, slice_groups and grid.y as gemv_int4.cu's
// tensor-core entries (gemv.py plans them).
#define NQ_FP16_MMA_ENTRY(COLS, MIN_BLOCKS)                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gemv_fp16_mma##COLS(                         \
      const uint16_t* __restrict__ w, const uint16_t* __restrict__ x, float* __restrict__ out, int n_rows,  \
      int n_cols, int pass_cols, int slice_groups) {                                                   \
    NQ_STAMP();                                                                                         \
    gemv_mma<kHidden, COLS / 8>(Fp16Weights{w}, x, nullptr, 0.f, (n_rows + 1) / 2, n_cols, pass_cols,   \
                                slice_groups, PlainRows{n_rows}, F32Epi{out, n_rows});                 \
  }

NQ_FP16_MMA_ENTRY(8, 2)
NQ_FP16_MMA_ENTRY(32, 1)
