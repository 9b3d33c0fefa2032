// mma.cuh: the warp-level tensor-core primitives the kernels share (PTX; no CUDA headers under NVRTC).
//
// mma.sync m16n8k16 (row-major A 16x16 fp16, column-major B 16x8 fp16, fp32 C/D). Fragments, lane =
// 4 g + t (g = "groupID" 0..7, t = "thread in group" 0..3), PTX ISA "Matrix Fragments for mma.m16n8k16
// with floating point type":
//   A: a0 = (row g,   k 2t, 2t+1)   a1 = (row g+8, k 2t, 2t+1)
//      a2 = (row g,   k 2t+8, +9)   a3 = (row g+8, k 2t+8, +9)        (each a half2, low half = lower k)
//   B: b0 = (k 2t, 2t+1; col g)     b1 = (k 2t+8, 2t+9; col g)
//   C: c0, c1 = (row g, cols 2t, 2t+1)   c2, c3 = (row g+8, cols 2t, 2t+1)
// tests/test_gemv_mma_mapping.py emulates exactly this layout in numpy.
#pragma once
#include "common.cuh"

namespace nq {

// d += A B for one m16n8k16 step
__device__ __forceinline__ void mma16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace nq
