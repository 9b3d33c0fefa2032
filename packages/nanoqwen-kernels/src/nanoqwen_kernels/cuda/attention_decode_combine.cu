// attention_decode_combine.cu: the second kernel of paged decode attention (attention_decode.cu's header
// has the whole design): each (query head, sequence) folds the split kernel's partials into its output.
//   out[b, h, :] = sum_s 2^(m_s - M) acc_s[h, :] / sum_s 2^(m_s - M) l_s over the used splits of b
// Launch: nq_attention_decode_combine grid (NQ_NHEADS, B), 128 threads (one output dim each).
// Workspace: kTicketWords (unused here), ws_acc [B, n_splits, NQ_NHEADS, 128] then ws_ml [B, n_splits, NQ_NHEADS, 2] (fp32).
#include "common.cuh"
#include "attention_decode_splits.cuh"

namespace nq_dec {
using nq::neg_inf;

// out[b, h, d] = sum_s 2^(m_s - M) acc_s[h, d] / sum_s 2^(m_s - M) l_s   (M = max_s m_s) over the
// `used` splits of sequence b (the others hold no page: neutral, not read).
__device__ __forceinline__ float combine_one(const float* ws_acc, const float* ws_ml, size_t base, int used,
                                             int h, int d) {
  float mx = neg_inf();
  for (int s = 0; s < used; ++s) mx = fmaxf(mx, ws_ml[((base + s) * nq::kHeads + h) * 2]);
  float a = 0.f, sum = 0.f;
  for (int s = 0; s < used; ++s) {
    const float ms = ws_ml[((base + s) * nq::kHeads + h) * 2];
    if (ms != neg_inf()) {
      const float f = exp2f(ms - mx);
      a += f * ws_acc[((base + s) * nq::kHeads + h) * 128 + d];
      sum += f * ws_ml[((base + s) * nq::kHeads + h) * 2 + 1];
    }
  }
  return sum > 0.f ? a / sum : 0.f;  // seq_len 0 (an idle row) has no split: defined output 0, not 0/0
}

// The same sum with the splits spread over the block's 128 threads (NQ_ATTN_COMBINE_PAR, the default):
// thread t reads split t's (m, l), the block reduces max and weighted sum, and the weights go through
// shared memory to the acc loop, whose loads no longer wait on each other. Why: combine_one's two loops
// over the splits are chains of dependent L2 reads (max, then sum; `used` is a run-time count, so the
// compiler keeps them serial): at batch 1 a 7B call combines 20 splits at context 640 (40 on the 1.5B's
// 2 KV heads), 40-80 L2 round trips one after another inside a ~9 us attention.
__device__ __forceinline__ float combine_par(const float* ws_acc, const float* ws_ml, size_t base, int used,
                                             int h, int d) {
  constexpr int kT = 128;  // the combine's threads, one output dim each
  __shared__ float f_sm[kT];
  __shared__ float red[kT / 32];
  float mx = neg_inf();
  for (int s0 = 0; s0 < used; s0 += kT) {
    const int s = s0 + d;
    if (s < used) mx = fmaxf(mx, ws_ml[((base + s) * nq::kHeads + h) * 2]);
  }
  mx = nq::warp_max(mx);
  if ((d & 31) == 0) red[d >> 5] = mx;
  __syncthreads();
  mx = fmaxf(fmaxf(red[0], red[1]), fmaxf(red[2], red[3]));
  __syncthreads();  // red is reused below
  float a = 0.f, lsum = 0.f;
  for (int s0 = 0; s0 < used; s0 += kT) {
    const int s = s0 + d;
    float f = 0.f;
    if (s < used) {
      const float ms = ws_ml[((base + s) * nq::kHeads + h) * 2];
      f = ms == neg_inf() ? 0.f : exp2f(ms - mx);  // an empty split: weight 0 (and no inf - inf)
      lsum += f * ws_ml[((base + s) * nq::kHeads + h) * 2 + 1];
    }
    f_sm[d] = f;
    __syncthreads();
    const int n = min(kT, used - s0);
    const float* acc = ws_acc + ((base + s0) * nq::kHeads + h) * 128 + d;
#pragma unroll 8
    for (int j = 0; j < n; ++j) a += f_sm[j] * acc[static_cast<size_t>(j) * nq::kHeads * 128];
    __syncthreads();  // f_sm is rewritten by the next chunk
  }
  lsum = nq::warp_sum(lsum);
  if ((d & 31) == 0) red[d >> 5] = lsum;
  __syncthreads();
  lsum = red[0] + red[1] + red[2] + red[3];
  return lsum > 0.f ? a / lsum : 0.f;  // seq_len 0 (an idle row) has no split: defined output 0
}

}  // namespace nq_dec

// The combine: one block per (head, sequence).
#ifndef NQ_ATTN_COMBINE_PAR
#define NQ_ATTN_COMBINE_PAR 1  // 1: combine_par (splits across the threads) at many splits, 0: never (A/B knob)
#endif
#ifndef NQ_ATTN_COMBINE_PAR_MIN_SPLITS
#define NQ_ATTN_COMBINE_PAR_MIN_SPLITS 8
#endif
#ifndef NQ_ATTN_PDL_TRIGGER
#define NQ_ATTN_PDL_TRIGGER 1
#endif
extern "C" __global__ void __launch_bounds__(128)
    nq_attention_decode_combine(const float* __restrict__ workspace,   // the split kernel's partials
                                const int* __restrict__ seq_len_dev,   // [B]
                                int max_pages, int n_splits,
                                nq::uint16_t* __restrict__ out) {      // [B, NQ_NHEADS*128]
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
#if NQ_ATTN_PDL_TRIGGER
  // o_proj's GEMM after this one-wave kernel may place its blocks and issue its first weight copies now
  // (it still waits for this kernel's completion before reading x); with the tile GEMM's own trigger,
  // B = 8 / 32 / 64 steps 2.72 / 3.71 / 5.23 -> 2.68 / 3.70 / 5.21 ms (gemm_tiles.cuh). A/B knob.
  nq::pdl_trigger();
#endif
  using namespace nq_dec;
  const float* ws_acc = workspace + kTicketWords;
  const float* ws_ml = ws_acc + static_cast<size_t>(gridDim.y) * n_splits * nq::kHeads * 128;
  const int h = blockIdx.x, b = blockIdx.y, d = threadIdx.x;
  const int used = split_range(seq_len_dev[b], max_pages, n_splits).used;
  // combine_par where there are many splits to combine (batch 1..4 at 7B: 33..9 splits), the plain loop
  // where there are few (B = 8: 5, B >= 33: 1), where combine_par's barriers cost more than they save:
  // 7B, H200, same call (docs/PERF.md, eighth lease), decode at depth 512: 2.144 -> 2.083 ms/token with
  // combine_par at every B; bench_batch steps at B = 8 / 64: 2.68 / 5.30 -> 2.73 / 5.35 ms.
  // n_splits is a launch argument: the branch is grid-uniform.
  const size_t base = static_cast<size_t>(b) * n_splits;
  const float o = (NQ_ATTN_COMBINE_PAR && n_splits >= NQ_ATTN_COMBINE_PAR_MIN_SPLITS)
                      ? combine_par(ws_acc, ws_ml, base, used, h, d)
                      : combine_one(ws_acc, ws_ml, base, used, h, d);
  out[static_cast<size_t>(b) * nq::kQDim + h * 128 + d] = nq::f2h(o);
}
