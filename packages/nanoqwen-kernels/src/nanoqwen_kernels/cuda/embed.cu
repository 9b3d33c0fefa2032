// embed.cu: the token embedding lookup for B sequences, token ids read from device memory (so a CUDA
// graph can replay the decode step with whatever ids the sampler wrote).
//
// What: out[b, :] = table[token_dev[b], :]. An id outside [0, V) writes NaN everywhere in its row instead
//   of reading out of bounds: the garbage then shows in that row's logits rather than as a silent wrong
//   row or a fault.
// Shapes/dtypes: table fp16 [V, H], token_dev int32 [B], out fp16 [B, H].
// Launch: grid (ceil(H / 8 / 256), B) of 256 threads, one 16-byte piece per thread.
// Why: B rows of 7 KB; nothing to design beyond keeping the ids on the device.
// Tested: tests/test_norm_embed_gpu.py (random ids, the last id, out-of-range ids -> NaN, B = 1 .. 64).
#include "common.cuh"
using namespace nq;

extern "C" __global__ void __launch_bounds__(256) nq_embed(
    const uint16_t* __restrict__ table,     // [V, H] fp16
    const int32_t* __restrict__ token_dev,  // [B]
    uint16_t* __restrict__ out) {           // [B, H] fp16
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= kHidden / 8) return;
  const int b = blockIdx.y;
  const int tok = token_dev[b];
  uint4 v;
  if (tok >= 0 && tok < kVocab) {
    v = reinterpret_cast<const uint4*>(table + static_cast<size_t>(tok) * kHidden)[i];
  } else {
    const uint32_t nan2 = kHalfNaN | (static_cast<uint32_t>(kHalfNaN) << 16);
    v = make_uint4(nan2, nan2, nan2, nan2);
  }
  reinterpret_cast<uint4*>(out + static_cast<size_t>(b) * kHidden)[i] = v;
}
