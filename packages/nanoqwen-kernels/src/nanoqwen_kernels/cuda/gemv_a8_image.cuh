// gemv_a8_image.cuh: gate/up + SiLU writing down_proj's input already rounded to int8 (the "a8 image"), the
// int8-activation loop's down_proj pair (entries nq_gate_up_silu_a8x -> nq_gemv_int4_i_a8x in gemv_int4.cu,
// which includes this after the loop's pieces, dot_rows2 and the row maps).
#pragma once

namespace nq {

// ---- gate/up writing down_proj's x already rounded (the "a8 image") -------------------------------------
// Under the int8-activation loop every down_proj block rounds the whole intermediate (18,944 values on the
// 7B) in its prologue: ~3.6 of its 13.9 us (docs/PERF.md "fourteenth lease"). Here the kernel that produces
// the intermediate rounds it once: a block takes whole groups of 32 outputs (warp w units 32g + 4w .. +3,
// the same rows and epilogue arithmetic as GateUpEpi) and puts their fp16-rounded values in shared memory;
// the last of the block's warps to finish a group (a shared-memory counter per group, no block barrier:
// a barrier per group held the warps in step and lost, docs/PERF.md) rounds it as stage_x_a8 would (the
// group is one of down_proj's 32-k pieces, two scales of 16) and writes it in the layout down_proj stages:
// image = xq [2][kInter/32] uint4, then xm [kInter/32] int4. A block takes at most kA8ImageGroups groups (the
// launcher's grid), each its own slot, so no slot is reused.
constexpr int kA8ImageGroups = 8;
// Next-unit prefetch (NQ_GU_UNIT_PREFETCH_NJ): where a row is at most that many 16-byte pieces a lane (one
// chunk: the 1.5B's K = 1,536 is 2, the 7B's 3,584 is 4), a warp issues its next unit's weights before this
// unit's products, so its units cost one DRAM round trip each in the shadow of the previous one's. 0: never.
// H200, decode protocol, ms/token, three interleaved rounds (docs/PERF.md, twenty-fourth lease):
//   the 1.5B's dims (48 -> 62 registers, 5 -> 4 blocks of 256 threads an SM): 0.652 / 0.654 / 0.656 ->
//   0.637 / 0.636 / 0.636 (every round); the 7B (80 -> 113 registers, 3 -> 2 blocks an SM): 1.476 / 1.476 /
//   1.478 -> 1.511 / 1.508 / 1.511 (lost every round). So 2: the 1.5B's K takes it, the 7B's does not.
#ifndef NQ_GU_UNIT_PREFETCH_NJ
#define NQ_GU_UNIT_PREFETCH_NJ 2
#endif
template <int K>
constexpr bool kGuUnitPrefetch = pieces_per_lane<K>() <= NQ_GU_UNIT_PREFETCH_NJ && pieces_per_lane<K>() <= kInFlight;
__device__ __forceinline__ void a8_round_group(float v, int g, uint16_t* img) {
  constexpr int kNU = kInter / 32;
  const int lane = threadIdx.x & 31;
  // lanes 0-15 hold the group's first half-piece (k = 32g ..), 16-31 its second: each its own scale
  float amax = fabsf(v);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  const uint32_t b = __float_as_uint(__fadd_rn(__fmul_rn(v, inv), 12582912.f));  // as stage_x_a8
  int sum = static_cast<int>(b - 0x4B400000u);
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  // lane 4m gathers the bytes of lanes 4m .. 4m+3: word m of the group (k = 32g + 4m ..)
  const uint32_t b1 = __shfl_down_sync(0xffffffffu, b, 1), b2 = __shfl_down_sync(0xffffffffu, b, 2),
                 b3 = __shfl_down_sync(0xffffffffu, b, 3);
  if ((lane & 3) == 0) {
    const int m = lane >> 2;  // bytes 4m .. 4m+3 of the group: half m / 4 of the piece, word m % 4 of it
    reinterpret_cast<uint32_t*>(img)[((m >> 2) * kNU + g) * 4 + (m & 3)] =
        __byte_perm(__byte_perm(b, b1, 0x0040u), __byte_perm(b2, b3, 0x0040u), 0x5410u);
  }
  // half-piece 2g + lane / 16's {scale / 16, kA8AccStart - 8 sum}: xm[g]'s .x, .y (lane 0) or .z, .w (lane 16)
  if ((lane & 15) == 0)
    reinterpret_cast<int2*>(img + kInter / 2)[2 * g + (lane >> 4)] =
        make_int2(__float_as_int(amax / 127.f * 0.0625f), kA8AccStart - 8 * sum);
}

template <int K>
__device__ __forceinline__ void gate_up_a8_image(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                                 const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                                 float eps, uint16_t* __restrict__ img) {
  static_assert(kInter % 32 == 0, "groups of 32 outputs");
  constexpr int kGroups = kInter / 32;
  __shared__ uint4 xs[K / 8];
  __shared__ float red[32];
  __shared__ float hs[kA8ImageGroups][32];
  __shared__ int done[kA8ImageGroups];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const GateUpRows map{};
  gemv_trigger_at<2, NQ_TRIG_GU>();
#if NQ_GEMV_PRELOAD
  RowChunk first;  // the first unit's first chunk, before the wait (as gemv_units)
  if (blockIdx.x < kGroups) {
    int f0, f1;
    map(32 * blockIdx.x + 4 * warp, f0, f1);
    load_chunk<K>(qw, sc, f0, f1, 0, first);
  }
#endif
  if (threadIdx.x < kA8ImageGroups) done[threadIdx.x] = 0;  // published by stage_x_a8's barrier
  NormEarly<K> ne;  // the norm's weights, with the first weights (gemv_a8.cuh NQ_NORM_EARLY)
  load_norm_early<K>(norm_w, ne);
  pdl_wait();
  gemv_trigger_at<3, NQ_TRIG_GU>();
  stage_x_a8<K>(x, norm_w, eps, a8_views<K>(xs), red, ne);
  // unit j of group g (slot s): warp w's output 4w + j of the group; after its 4th, the warp counts itself
  // done with the group, and the last of the kWarps rounds and writes it
  const auto finish_unit = [&](int g, int j, int s, float o0, float o1) {
    if (lane == 0) hs[s][4 * warp + j] = h2f(f2h(o0 / (1.f + __expf(-o0)) * o1));  // GateUpEpi's value
    if (j == 3) {
      int last = 0;
      if (lane == 0) {
        __threadfence_block();  // this warp's 4 values before its count (release)
        last = atomicAdd(&done[s], 1) == kWarps - 1;
      }
      if (__shfl_sync(0xffffffffu, last, 0)) {
        __threadfence_block();  // every warp's values after the last count (acquire)
        a8_round_group(hs[s][lane], g, img);
      }
    }
  };
#if NQ_GEMV_PRELOAD
  if constexpr (kGuUnitPrefetch<K>) {
    // a unit is one chunk (kGuUnitPrefetch): the warp's next unit is issued before this one's products, as
    // gemv_units does at short K
    RowChunk cur = first;
    int g = blockIdx.x, j = 0, s = 0;
    int c0 = 0, c1 = 0;
    if (g < kGroups) map(32 * g + 4 * warp, c0, c1);
    while (g < kGroups) {  // block-uniform
      int gn = g, jn = j + 1;
      if (jn == 4) {
        jn = 0;
        gn += gridDim.x;
      }
      RowChunk nxt;
      int n0 = 0, n1 = 0;
      if (gn < kGroups) {
        map(32 * gn + 4 * warp + jn, n0, n1);
        load_chunk<K>(qw, sc, n0, n1, 0, nxt);
      }
      float o0, o1;
      dot_rows2<K, true>(qw, sc, c0, c1, xs, o0, o1, &cur);
      trigger_after_last_unit<NQ_TRIG_GU>(gn >= kGroups);
      finish_unit(g, j, s, o0, o1);
      if (jn == 0) ++s;
      cur = nxt;
      c0 = n0;
      c1 = n1;
      g = gn;
      j = jn;
    }
    return;
  }
#endif
  int s = 0, j = 0;
#if NQ_GEMV_PRELOAD
  if (static_cast<int>(blockIdx.x) < kGroups) {  // the first unit, peeled: its chunk was loaded before the wait
    int r0, r1;
    map(32 * blockIdx.x + 4 * warp, r0, r1);
    float o0, o1;
    dot_rows2<K, true>(qw, sc, r0, r1, xs, o0, o1, &first);
    finish_unit(blockIdx.x, 0, 0, o0, o1);
    j = 1;
  }
#endif
  for (int g = blockIdx.x; g < kGroups;) {  // block-uniform; s < kA8ImageGroups
    int r0, r1;
    map(32 * g + 4 * warp + j, r0, r1);
    float o0, o1;
    dot_rows2<K, true>(qw, sc, r0, r1, xs, o0, o1);
    trigger_after_last_unit<NQ_TRIG_GU>(j == 3 && g + static_cast<int>(gridDim.x) >= kGroups);
    finish_unit(g, j, s, o0, o1);
    if (++j == 4) {
      j = 0;
      ++s;
      g += gridDim.x;
    }
  }
}

}  // namespace nq
