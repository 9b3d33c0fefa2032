// gemm_epilogue.cuh: the prefill GEMMs' epilogue (gemm_int4_prefill.cu, gemm_fp8_prefill.cu). A block's sums
// are wgmma accumulators over [weight row][token]: a consumer lane holds tile rows r0 and r0 + 8 (r0 =
// 64 (warp / 4) + 16 (warp % 4) + lane / 4) for tokens 8 j + 2 c and + 1 (c = lane % 4, j < NT). They go
// through shared memory (`ep`, the free ring) into out's [token][row] fp16 rows, so each warp writes whole
// 256-byte runs of a token's row. Called (store, below) by the two consumer warpgroups (256 threads, named
// barrier 1) once every consumer's wgmmas are done.
#pragma once
#include "common.cuh"

namespace nq {
namespace epi {

constexpr int kPitch = 132;     // floats per token of the staging: 128 rows + 4 (bank spread)
constexpr int kSiluPitch = 68;  // the SiLU build's: 64 outputs + 4 (16-byte rows)
// the staging a build needs (the SiLU build's rows are half as wide)
template <int NT, bool kSilu = false>
__host__ __device__ constexpr int staging_bytes() { return NT * 8 * (kSilu ? kSiluPitch : kPitch) * 4; }

__device__ __forceinline__ void consumers_sync() { asm volatile("bar.sync 1, 256;" ::: "memory"); }

// silu with the fast reciprocal division (2 instructions; IEEE division is a ~20-instruction subroutine, and
// the SiLU build does 2 NT of them a lane): ~2 ulp of fp32, far below the fp16 output's rounding. For x
// very negative, __expf(-x) is inf and __fdividef gives -0, silu's limit.
__device__ __forceinline__ float silu(float x) { return __fdividef(x, 1.f + __expf(-x)); }

// The SiLU build (gate|up, N = 2I rows mapped so a lane's rows r0 and r0 + 8 are output a's gate and up,
// a = 64 ty + 8 (r0 / 16) + lane / 4, ty the tile's row block): out[t][a] = silu(gate) * up from the fp32 sums,
// out [T][N / 2].
template <int NT>
__device__ __forceinline__ void store_silu(const float (&acc)[NT][4], float* ep, int r0, int warp, int lane,
                                           uint16_t* __restrict__ out, int T, int N, int t0, int ty) {
  const int c = lane & 3, al = 8 * (r0 >> 4) + (lane >> 2);
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tl = 8 * j + 2 * c;
    ep[tl * kSiluPitch + al] = silu(acc[j][0]) * acc[j][2];
    ep[(tl + 1) * kSiluPitch + al] = silu(acc[j][1]) * acc[j][3];
  }
  consumers_sync();
  const int I = N / 2, a = 64 * ty + 4 * (lane & 15);
  if (a >= I) return;
  for (int tl = 2 * warp + (lane >> 4); tl < 8 * NT; tl += 16) {  // half-warp h: token 2 (warp + 8 i) + h
    const int tok = t0 + tl;
    if (tok >= T) break;
    const float4 v = *reinterpret_cast<const float4*>(ep + tl * kSiluPitch + 4 * (lane & 15));
    *reinterpret_cast<uint2*>(out + static_cast<size_t>(tok) * I + a) = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
  }
}

// The plain build: out[tok][row0 + r] = sum (+ out when accumulate: the residual added in fp32, one
// rounding), or, split-K, split z's fp32 partial sums into ws [splits][T][N] (nq_gemm_splitk_reduce in
// gemm_int4_prefill.cu adds them). Warp w writes tokens w, w + 8, ..: lane q the rows 4q .. 4q + 3 (8
// bytes). The residual's old values are all loaded before any is used: loaded one after another, each
// waited for, they made the FP8 GEMM's o_proj epilogue (K = 3,584: ~14 us of multiplies a tile) take about
// as long again (docs/PERF.md, "thirteenth lease").
template <int NT>
__device__ __forceinline__ void store_rows(const float (&acc)[NT][4], float* ep, int r0, int warp, int lane,
                                           uint16_t* __restrict__ out, int T, int N, int t0, int row0, int accumulate,
                                           float* __restrict__ ws, int z, int splits) {
  const int c = lane & 3;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tl = 8 * j + 2 * c;
    ep[tl * kPitch + r0] = acc[j][0];
    ep[(tl + 1) * kPitch + r0] = acc[j][1];
    ep[tl * kPitch + r0 + 8] = acc[j][2];
    ep[(tl + 1) * kPitch + r0 + 8] = acc[j][3];
  }
  consumers_sync();
  const int row = row0 + 4 * lane;
  if (row >= N) return;
  constexpr int kPer = NT;  // tokens per warp: 8 NT / 8 warps
  uint2 old[kPer];
  if (accumulate && splits == 1) {
#pragma unroll
    for (int q = 0; q < kPer; ++q) {
      const int tok = t0 + warp + 8 * q;
      old[q] = tok < T ? *reinterpret_cast<const uint2*>(out + static_cast<size_t>(tok) * N + row) : make_uint2(0, 0);
    }
  }
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int tl = warp + 8 * q, tok = t0 + tl;
    if (tok >= T) break;
    const float4 v = *reinterpret_cast<const float4*>(ep + tl * kPitch + 4 * lane);
    if (splits > 1) {
      *reinterpret_cast<float4*>(ws + (static_cast<size_t>(z) * T + tok) * N + row) = v;
      continue;
    }
    float r[4] = {v.x, v.y, v.z, v.w};
    if (accumulate) {
      const float2 o0 = h22f2(old[q].x), o1 = h22f2(old[q].y);
      r[0] += o0.x, r[1] += o0.y, r[2] += o1.x, r[3] += o1.y;
    }
    *reinterpret_cast<uint2*>(out + static_cast<size_t>(tok) * N + row) = make_uint2(pack_h2(r[0], r[1]), pack_h2(r[2], r[3]));
  }
}

// The epilogue of either build for the tile (t0, row block ty, split z), once every consumer's wgmmas are
// done. The first barrier frees `ep`: the ring (no copy in flight), or a persistent block's own staging,
// which the consumers' reads of the previous tile's epilogue used last.
template <int NT, bool kSilu>
__device__ __forceinline__ void store(const float (&acc)[NT][4], float* ep, int r0, int warp, int lane,
                                      uint16_t* __restrict__ out, int T, int N, int t0, int ty, int accumulate,
                                      float* __restrict__ ws, int z, int splits) {
  consumers_sync();
  if constexpr (kSilu) {
    store_silu<NT>(acc, ep, r0, warp, lane, out, T, N, t0, ty);
  } else {
    store_rows<NT>(acc, ep, r0, warp, lane, out, T, N, t0, 128 * ty, accumulate, ws, z, splits);
  }
}

}  // namespace epi
}  // namespace nq
