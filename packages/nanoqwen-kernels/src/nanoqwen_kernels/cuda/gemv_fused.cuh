// gemv_fused.cuh: the post-attention half of a decoder layer for one sequence (B = 1) in one kernel:
//   phase A  o_proj:        y = W_o . attn + x                        (the residual add)
//   phase B  gate/up:       act = silu(W_g . n(y)) * (W_u . n(y))     n = the post-attention RMSNorm
//   phase C  down_proj:     x = W_d . act + y                         (the residual add)
// The same three GEMVs as the three kernels the engine launches otherwise (gemv_int4.cu's B = 1 loops, half2
// or int8 activations, with the same row maps and epilogues), so the results are the same bits; what goes
// is two kernel boundaries per layer. A phase needs every block's output of the phase before it, so the
// phases are separated by a grid barrier (GridBarrier below) instead of by a kernel's completion, and each
// block issues its first weights of the next phase before it arrives there (gemv_units_on's preload, which
// otherwise goes before the launch-overlap wait): the weights do not depend on the barrier, so their DRAM
// round trip overlaps the slowest block's tail instead of following it.
//
// Why a barrier here is cheaper than a kernel boundary (docs/KERNELS.md "The fused post-attention kernel"):
// a boundary is the last block's exit, the grid's completion and memory flush, the next grid's block
// placement and its prologue; the barrier is one atomic and one poll of an L2 line per block, with the
// blocks, their registers and the weights already in flight staying where they are.
//
// Residency: a grid barrier needs every block of the grid resident at once, or the blocks that have
// arrived wait forever for ones that cannot be placed. The launcher (gemv.py post_attention) sizes the grid
// from the occupancy API's blocks per SM for this kernel, so the grid fits the GPU on its own; nothing the
// blocks wait for depends on a later kernel (the next kernel launches only after every block of this one
// has released it in phase C, or exited).
#pragma once

namespace nq {

// A grid-wide barrier over uint32s in global memory: arrivals at bar[0], the generation at bar[32] (another
// 128-byte line, so the polls of the generation do not queue with the arrivals' atomics). Self-resetting
// (the last block to arrive zeroes the count before it bumps the generation), so one zeroed buffer serves
// every launch and every graph replay, as long as two grids using it never run at the same time (one per
// decode state: the kernels of a stream run one after another, overlapping only their neighbours).
// Split in two so a phase's weight loads go between them (gemv_units_on: arrive, preload, wait): the
// arrival's release must wait for this block's outstanding stores, and a fence placed after the preload
// would wait for those loads too (a DRAM round trip under load). Neither half uses a full fence
// (__threadfence is fence.sc: it drains every outstanding access): the arrival is an atomic with release
// semantics and the poll a load with acquire semantics.
struct GridBarrier {
  unsigned* bar;
  mutable unsigned gen = 0;  // thread 0's: the generation this block waits to see pass
  __device__ __forceinline__ void arrive() const {
    __syncthreads();  // every warp of the block has written its outputs of the phase
    if (threadIdx.x == 0) {
      // the generation before arriving: it cannot move before this block has arrived
      asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(gen) : "l"(bar + 32) : "memory");
      unsigned old;
      // release: the block's writes (ordered before thread 0 by the barrier above) before the arrival
      asm volatile("atom.release.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(bar) : "memory");
      if (old == gridDim.x - 1) {  // the last: reset the count, then let everyone go (release orders both)
        asm volatile("st.relaxed.gpu.global.u32 [%0], 0;" ::"l"(bar) : "memory");
        asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(bar + 32), "r"(gen + 1u) : "memory");
      }
    }
  }
  __device__ __forceinline__ void operator()() const {
    if (threadIdx.x == 0) {
      unsigned now;
      do {  // acquire: every block's writes of the phase are visible after it
        asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(now) : "l"(bar + 32) : "memory");
      } while (now == gen);
    }
    __syncthreads();  // the other threads after thread 0's acquire
  }
};

// A pointer the compiler knows nothing about, so its loads are generic ones (coherent, never hoisted). Phase
// A reads attention's output through it: as a const __restrict__ argument it was loaded non-coherently
// (ld.global.nc), and ptxas scheduled those loads above griddepcontrol.wait, before attention had
// finished (tests/test_compile.py: nothing but weights and scales is loaded before the wait).
__device__ __forceinline__ const uint16_t* opaque(const uint16_t* p) {
  asm("" : "+l"(p));
  return p;
}

template <bool kA8>
__device__ __forceinline__ void post_attention_b1(
    const uint32_t* __restrict__ o_qw, const uint16_t* __restrict__ o_sc, const uint16_t* attn,
    uint16_t* x, uint16_t* y, const uint32_t* __restrict__ gu_qw, const uint16_t* __restrict__ gu_sc,
    const uint16_t* __restrict__ norm_w, float eps, uint16_t* act, const uint32_t* __restrict__ dn_qw,
    const uint16_t* __restrict__ dn_sc, unsigned* bar) {
  constexpr int kXs = (kInter > kHidden ? kInter : kHidden) / 8;  // the phases take turns with one buffer
  __shared__ uint4 xs[kXs];
  __shared__ float red[32];
  constexpr int kUnits = (kHidden + 1) / 2;  // o_proj's and down_proj's
  constexpr int kX = kA8 ? kXA8 : kXHalf;
  const GridBarrier barrier{bar};
  // phase A waits for attention (the previous kernel) and releases nothing early: the next kernel must not
  // take SM resources while phases B and C still run
  gemv_units_on<kHidden, PlainRows, PlainEpi, kX, false>(o_qw, o_sc, opaque(attn), nullptr, 0.f, kUnits,
                                                         PlainRows{kHidden}, PlainEpi{x, y, kHidden}, xs, red,
                                                         PdlWait{});
  if constexpr (kA8) {
    __shared__ float hs[kA8ImageGroups][32];
    __shared__ int done[kA8ImageGroups];
    gate_up_a8_image_on<kHidden, false>(gu_qw, gu_sc, y, norm_w, eps, act, xs, red, hs, done, barrier);
    gemv_units_on<kInter, PlainRows, PlainEpi, kXImage, true>(dn_qw, dn_sc, act, nullptr, 0.f, kUnits,
                                                              PlainRows{kHidden}, PlainEpi{y, x, kHidden}, xs,
                                                              red, barrier);
  } else {
    gemv_units_on<kHidden, GateUpRows, GateUpEpi, kXHalf, false>(gu_qw, gu_sc, y, norm_w, eps, kInter,
                                                                 GateUpRows{}, GateUpEpi{act}, xs, red, barrier);
    gemv_units_on<kInter, PlainRows, PlainEpi, kXHalf, true>(dn_qw, dn_sc, act, nullptr, 0.f, kUnits,
                                                             PlainRows{kHidden}, PlainEpi{y, x, kHidden}, xs, red,
                                                             barrier);
  }
}

}  // namespace nq
