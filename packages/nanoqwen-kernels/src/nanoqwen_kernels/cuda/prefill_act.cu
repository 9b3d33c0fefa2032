// prefill_act.cu: the MLP activation of prefill, out = silu(gate) * up, row by row.
//
// What: gu fp16 [T, 2I] (the gate|up GEMM's output: gate in columns [0, I), up in [I, 2I)),
//   out[t, i] = silu(g) * u with g = gu[t, i], u = gu[t, I + i], in fp32 (silu(g) = g / (1 + e^-g)),
//   rounded once to fp16: as the decode path's nq_gate_up_silu epilogue computes it from its fp32 sums.
// Launch: nq_silu_mul_rows grid (ceil(I / 2048), T), 256 threads, 8 outputs (16 bytes) per thread.
// Why a kernel here rather than CuPy's elementwise one: one launch through the same launcher rules
//   (checked arguments, programmatic dependent launch, capturable in the prefill graphs) and ~7 us of
//   Python a call instead of ~25.
// Tested: tests/test_prefill_gemm.py (numpy reference, T 1 .. 70).
#include "common.cuh"

static_assert(nq::kInter % 8 == 0, "silu_mul_rows moves 8 halves per thread");

extern "C" __global__ void __launch_bounds__(256)
    nq_silu_mul_rows(const nq::uint16_t* __restrict__ gu,  // [T, 2 kInter] fp16
                     nq::uint16_t* __restrict__ out) {     // [T, kInter] fp16
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  const int c = blockIdx.x * blockDim.x + threadIdx.x;  // 16-byte chunk of the row
  if (c >= nq::kInter / 8) return;
  const size_t t = blockIdx.y;
  const uint4 g = reinterpret_cast<const uint4*>(gu + t * 2 * nq::kInter)[c];
  const uint4 u = reinterpret_cast<const uint4*>(gu + t * 2 * nq::kInter + nq::kInter)[c];
  const nq::uint32_t gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
  nq::uint32_t ow[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 gf = nq::h22f2(gw[j]), uf = nq::h22f2(uw[j]);
    ow[j] = nq::pack_h2(gf.x / (1.f + __expf(-gf.x)) * uf.x, gf.y / (1.f + __expf(-gf.y)) * uf.y);
  }
  reinterpret_cast<uint4*>(out + t * nq::kInter)[c] = make_uint4(ow[0], ow[1], ow[2], ow[3]);
}
