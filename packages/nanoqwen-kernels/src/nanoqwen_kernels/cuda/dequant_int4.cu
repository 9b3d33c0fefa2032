// dequant_int4.cu: INT4 ValueShuffle weights -> dense fp16, the first half of the prefill GEMM.
//
// What: out[n, k] = fp16(scales[n, k / 128] * q[n, k]),  q = u - 8 in -8..7 (docs/INTERFACES.md 1-2)
// Shapes: qweight uint32 [N, K/8] (ValueShuffle-v1 words), scales fp16 [N, K/128], out fp16 [N, K];
//   N, K are run-time (one build serves q/k/v/o, gate/up and down); K % 128 == 0 (checked in prefill.py).
// Launch: nq_dequantize_int4 grid ceil(N*K/8 / 1024) (capped at 16 blocks per SM, grid-stride), 256
//   threads; 4 words per thread, strided by 256, so loads and 16-byte stores stay coalesced and 4 loads
//   are in flight per thread (one word per thread measured slower: docs/PERF.md).
// Why: prefill at T >= ~64 tokens is matrix-bound, where cuBLAS on tensor cores at fp16 is the fastest
//   thing we have today; expanding W once per projection (N*K*2 B written, N*K/2 B read) costs about
//   the time of reading it, small next to the GEMM at T = 512 (measured in bench/bench_prefill.py).
//   A fused INT4 tensor-core GEMM would skip the fp16 copy; this two-step form is what runs today.
//   The product is exact before its one rounding: q has 4 bits, the scale 11, so mul.rn.f16x2 gives
//   the correctly rounded fp16 of the exact product, the same value as numpy's fp16(float64 product).
// Tested: tests/test_prefill_gemm.py (bit-exact against the numpy unpack of the same words).
#include "common.cuh"

constexpr int kDequantThreads = 256;
constexpr int kWordsPerThread = 4;  // independent loads in flight per thread before the first use

extern "C" __global__ void __launch_bounds__(kDequantThreads)
    nq_dequantize_int4(const nq::uint32_t* __restrict__ qweight,  // [N, K/8]
                    const nq::uint16_t* __restrict__ scales,   // [N, K/128] fp16
                    nq::uint16_t* __restrict__ out,            // [N, K] fp16
                    int n_rows, int k) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  const int words_per_row = k >> 3;
  const long long n_words = static_cast<long long>(n_rows) * words_per_row;
  constexpr long long kChunk = static_cast<long long>(kDequantThreads) * kWordsPerThread;
  for (long long base = blockIdx.x * kChunk + threadIdx.x; base < n_words; base += kChunk * gridDim.x) {
    // word j of this thread: base + j * 256, so each load and each 16-byte store is warp-coalesced
    nq::uint32_t w[kWordsPerThread], s[kWordsPerThread];
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      const long long i = base + j * kDequantThreads;
      w[j] = 0u;
      s[j] = 0u;
      if (i < n_words) {
        const long long row = i / words_per_row;
        const int wi = static_cast<int>(i - row * words_per_row);
        w[j] = __ldcs(qweight + i);                    // streamed once: evict-first
        s[j] = scales[row * (k >> 7) + (wi >> 4)];     // 16 words per group of 128
      }
    }
#pragma unroll
    for (int j = 0; j < kWordsPerThread; ++j) {
      const long long i = base + j * kDequantThreads;
      if (i < n_words) {
        const nq::uint32_t s2 = s[j] | (s[j] << 16);
        nq::uint32_t h[4];
        nq::unpack8(w[j], h);
        uint4 v;
        v.x = nq::hmul2(h[0], s2);
        v.y = nq::hmul2(h[1], s2);
        v.z = nq::hmul2(h[2], s2);
        v.w = nq::hmul2(h[3], s2);
        *reinterpret_cast<uint4*>(out + i * 8) = v;  // 8 values k = 8w .. 8w+7
      }
    }
  }
}
