// head_i8.cu: the lm_head in INT8 (one fp16 scale per 128 values along K): its quantizer, its dequantizer
// to fp16 and its batch-1 GEMV with fp32 logits. The layout and the rounding rule are head_i8.py's (module
// doc); its numpy twins give the same bits as the quantizer and the dequantizer here.
//
// Shapes: w fp16 [N, H] (the file's lm_head), q uint8 [N, H] (offset binary: byte = q + 128, q in
//   -127..127), s fp16 [N, H/128]; x fp16 [H]; out fp32 [N]. K is the compile-time H.
//
// Why INT8 for the head (head_i8.py has the figures): at batch 1 the lm_head is the single largest read
//   of a step, and a GEMV is a stream: halving its bytes halves its time once the loop keeps up with the
//   copy rate. The loop does more arithmetic per byte than the fp16 one (16 weights per 16-byte load
//   instead of 8): a byte b becomes the float 8388608 + b with one byte permute (the float's exponent
//   bits come from a constant word), one FADD of -8388736 gives q exactly, one FFMA adds q * x: 3 simple
//   instructions per weight, no int-to-float conversion (I2F runs at 1/8 of the FFMA rate: 16 per piece
//   would take as long as the piece's bytes take to arrive).
//
// nq_gemv_head_i8 (B = 1). Launch: 256 threads (8 warps), grid-stride over units of 2 rows per warp, the
//   grid sized so every block runs the same number of units (gemv.py even_grid, as nq_gemv_fp16).
//   lane l of a warp: 16-byte pieces u = l, l + 32, ... of rows 2p and 2p+1 (piece u = k 16u .. 16u+15,
//   inside the 128-k group u / 8: its 16 products are summed, then scaled once)
//   xs (fp32) [H] in shared memory, 16 B chunks swizzled: chunk c (k 16u + 4c ..) of piece u sits in slot
//   4u + (c ^ ((u >> 1) & 3)), so the 8 lanes of a quarter-warp (pieces u = 8m .. 8m+7) read 8 distinct
//   bank groups; unswizzled, lanes 64 bytes apart would meet 4 to a bank group.
//   Weights before the wait: a warp issues its first unit's weight loads (at most 2 x 7 pieces at 7B)
//   before griddepcontrol.wait (they never change during a step; the scales and x come after it).
//
// nq_quantize_head_i8 / nq_dequantize_head_i8: a warp per (row, 128-k group), 4 values per lane.
//
// Tested: tests/test_head_i8_gpu.py (the quantizer and the dequantizer bit for bit against head_i8.py's
// twins, the GEMV against float64, poisoned outputs, the 7B / 1.5B / tiny dims).
#include "common.cuh"

namespace nq {
constexpr int kHeadThreads = 256;
constexpr int kHeadPieces = kHidden / 16;            // 16-byte pieces per row (16 int8 each)
constexpr int kHeadPerLane = (kHeadPieces + 31) / 32;  // pieces per lane per row
static_assert(kHidden % kGroup == 0, "the head's K must be whole 128-value groups");

__device__ __forceinline__ int head_xs_slot(int u, int c) { return 4 * u + (c ^ ((u >> 1) & 3)); }

// sum over the 16 bytes of p (offset binary) of q * x, x the piece's 16 fp32 values in xs
__device__ __forceinline__ float head_piece_dot(const uint4& p, const float4* __restrict__ xs, int u) {
  const uint32_t w[4] = {p.x, p.y, p.z, p.w};
  float d = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float4 xv = xs[head_xs_slot(u, c)];
    const float xa[4] = {xv.x, xv.y, xv.z, xv.w};
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      // bytes: [w's byte b, 0x00, 0x00, 0x4B] = the float 8388608 + byte
      const float f = __uint_as_float(prmt(w[c], 0x4B000000u, 0x7540u | b)) - 8388736.f;
      d = fmaf(f, xa[b], d);
    }
  }
  return d;
}
}  // namespace nq

using namespace nq;

extern "C" __global__ void __launch_bounds__(kHeadThreads) nq_gemv_head_i8(
    const uint8_t* __restrict__ q,    // [N, H] offset binary
    const uint16_t* __restrict__ s,   // [N, H/128] fp16
    const uint16_t* __restrict__ x,   // [H] fp16
    float* __restrict__ out,          // [N] fp32
    int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  __shared__ float4 xs[kHidden / 4];  // [H] fp32, swizzled (head_xs_slot)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int units = (n_rows + 1) / 2;
  const int stride = gridDim.x * (kHeadThreads / 32);
  int p = blockIdx.x * (kHeadThreads / 32) + warp;

  uint4 v0[kHeadPerLane], v1[kHeadPerLane];
  auto load_unit = [&](int pp) {
    const int r0 = 2 * pp, r1 = min(2 * pp + 1, n_rows - 1);
    const uint4* w0 = reinterpret_cast<const uint4*>(q + static_cast<size_t>(r0) * kHidden);
    const uint4* w1 = reinterpret_cast<const uint4*>(q + static_cast<size_t>(r1) * kHidden);
#pragma unroll
    for (int j = 0; j < kHeadPerLane; ++j) {
      const int u = j * 32 + lane;
      if (u < kHeadPieces) {
        v0[j] = ld_stream_v4(w0 + u);
        v1[j] = ld_stream_v4(w1 + u);
      }
    }
  };
  if (p < units) load_unit(p);  // weights before the wait: constant for the whole step

  pdl_wait();  // launch overlap (common.cuh): x is the previous kernel's output
  for (int i = threadIdx.x; i < kHidden / 4; i += kHeadThreads) {
    const uint2 h = reinterpret_cast<const uint2*>(x)[i];  // k 4i .. 4i+3
    const float2 a = h22f2(h.x), b = h22f2(h.y);
    xs[head_xs_slot(i >> 2, i & 3)] = make_float4(a.x, a.y, b.x, b.y);
  }
  __syncthreads();  // xs complete; no barrier after this point

  for (; p < units; p += stride) {
    const int r0 = 2 * p, r1 = min(2 * p + 1, n_rows - 1);
    const uint16_t* s0 = s + static_cast<size_t>(r0) * (kHidden / kGroup);
    const uint16_t* s1 = s + static_cast<size_t>(r1) * (kHidden / kGroup);
    float a0 = 0.f, a1 = 0.f;
#pragma unroll
    for (int j = 0; j < kHeadPerLane; ++j) {
      const int u = j * 32 + lane;
      if (u < kHeadPieces) {
        a0 = fmaf(h2f(__ldg(s0 + u / 8)), head_piece_dot(v0[j], xs, u), a0);
        a1 = fmaf(h2f(__ldg(s1 + u / 8)), head_piece_dot(v1[j], xs, u), a1);
      }
    }
    if (p + stride < units) load_unit(p + stride);  // the next unit's bytes in flight during the sums
    a0 = warp_sum(a0);
    a1 = warp_sum(a1);
    if (lane == 0) {
      out[r0] = a0;
      if (r1 != r0) out[r1] = a1;
    }
  }
}

// q = clamp(rint(w / s), -127, 127) + 128 with s = fp16(amax / 127) of the group (0 where s is 0): the rule
// of head_i8.py's quantize_head_i8, bit for bit (IEEE division: NVRTC builds without fast math)
extern "C" __global__ void __launch_bounds__(256) nq_quantize_head_i8(
    const uint16_t* __restrict__ w,  // [N, H] fp16
    uint8_t* __restrict__ q,         // [N, H]
    uint16_t* __restrict__ s,        // [N, H/128]
    int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  pdl_wait();
  constexpr int kGroups = kHidden / kGroup;
  const long long item = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);  // (row, group)
  const int lane = threadIdx.x & 31;
  if (item >= static_cast<long long>(n_rows) * kGroups) return;
  const size_t off = static_cast<size_t>(item) * kGroup + 4 * lane;  // rows are whole groups
  const uint2 h = *reinterpret_cast<const uint2*>(w + off);
  const float2 a = h22f2(h.x), b = h22f2(h.y);
  const float v[4] = {a.x, a.y, b.x, b.y};
  const float amax = warp_max(fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3]))));
  const uint16_t s16 = f2h(amax / 127.f);
  const float sf = h2f(s16);
  uint32_t packed = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float r = sf > 0.f ? fminf(fmaxf(rintf(v[i] / sf), -127.f), 127.f) : 0.f;
    packed |= static_cast<uint32_t>(static_cast<int>(r) + 128) << (8 * i);
  }
  *reinterpret_cast<uint32_t*>(q + off) = packed;
  if (lane == 0) s[item] = s16;
}

// out = fp16(s * (q - 128)): s * (q - 128) is exact in fp32 (8 x 11 significant bits), rounded once
extern "C" __global__ void __launch_bounds__(256) nq_dequantize_head_i8(
    const uint8_t* __restrict__ q,   // [N, H]
    const uint16_t* __restrict__ s,  // [N, H/128]
    uint16_t* __restrict__ out,      // [N, H] fp16
    int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  pdl_wait();
  constexpr int kGroups = kHidden / kGroup;
  const long long item = static_cast<long long>(blockIdx.x) * 8 + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (item >= static_cast<long long>(n_rows) * kGroups) return;
  const size_t off = static_cast<size_t>(item) * kGroup + 4 * lane;
  const uint32_t packed = *reinterpret_cast<const uint32_t*>(q + off);
  const float sf = h2f(s[item]);
  float v[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) v[i] = sf * static_cast<float>(static_cast<int>((packed >> (8 * i)) & 0xffu) - 128);
  *reinterpret_cast<uint2*>(out + off) = make_uint2(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]));
}
