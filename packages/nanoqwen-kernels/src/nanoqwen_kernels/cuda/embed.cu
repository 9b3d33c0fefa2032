// embed.cu: the token embedding lookup, token id read from device memory (so a CUDA graph can replay
// the decode step with whatever id the sampler wrote).
//
// What: out[:] = table[token, :]. An id outside [0, V) writes NaN everywhere instead of reading out of
//   bounds: the garbage then shows in the logits rather than as a silent wrong row or a fault.
// Shapes/dtypes: table fp16 [V, H], token_dev int32 [1], out fp16 [H].
// Launch: ceil(H / 8 / 256) blocks of 256 threads, one 16-byte piece per thread.
// Why: a single 7 KB row; nothing to design beyond keeping the id on the device.
// Tested: tests/test_norm_embed_gpu.py (random ids, the last id, an out-of-range id -> NaN).
#include "common.cuh"
using namespace nq;

extern "C" __global__ void __launch_bounds__(256) nq_embed(
    const uint16_t* __restrict__ table,     // [V, H] fp16
    const int32_t* __restrict__ token_dev,  // [1]
    uint16_t* __restrict__ out) {           // [H] fp16
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= kHidden / 8) return;
  const int tok = *token_dev;
  uint4 v;
  if (tok >= 0 && tok < kVocab) {
    v = reinterpret_cast<const uint4*>(table + static_cast<size_t>(tok) * kHidden)[i];
  } else {
    const uint32_t nan2 = kHalfNaN | (static_cast<uint32_t>(kHalfNaN) << 16);
    v = make_uint4(nan2, nan2, nan2, nan2);
  }
  reinterpret_cast<uint4*>(out)[i] = v;
}
