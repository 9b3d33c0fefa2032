// common.cuh: what every nanoqwen kernel shares: the model dims (compile-time), fp16 arithmetic in PTX,
// the INT4 ValueShuffle unpack, streaming loads, warp/block reductions, the RMSNorm of a 16-byte piece
// and the softmax constants of the attention kernels.
//
// Model dims come in as -D constants from nanoqwen_kernels.dims.ModelDims.defines(); a missing one is a
// compile error here rather than a silently wrong build.
#pragma once
// No <cuda_fp16.h>: the NVRTC wheels ship no CUDA headers (NVRTC 12.9 here cannot open it), so the few
// fp16 operations the kernels need are spelled in PTX below. fp16 values travel as their bit patterns:
// uint16_t (one half) and uint32_t (a half2, low half = lower address / lower index). The integer
// typedefs live in namespace nq so they cannot clash with whatever a given NVRTC predefines.

#ifndef NQ_HIDDEN
#error "NQ_HIDDEN not defined: compile through nanoqwen_kernels.loader with ModelDims.defines()"
#endif
#if !defined(NQ_INTER) || !defined(NQ_NHEADS) || !defined(NQ_NKV) || !defined(NQ_HEAD_DIM) || \
    !defined(NQ_VOCAB) || !defined(NQ_ROPE_THETA) || !defined(NQ_ROPE_INV_FREQ)
#error "model dims incomplete: NQ_INTER, NQ_NHEADS, NQ_NKV, NQ_HEAD_DIM, NQ_VOCAB, NQ_ROPE_THETA, NQ_ROPE_INV_FREQ needed"
#endif
#if NQ_HEAD_DIM != 128
#error "nanoqwen kernels are built for head_dim 128"
#endif

namespace nq {

typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;

constexpr int kHidden = NQ_HIDDEN;         // H
constexpr int kInter = NQ_INTER;           // I
constexpr int kHeads = NQ_NHEADS;          // query heads
constexpr int kKvHeads = NQ_NKV;           // KV heads
constexpr int kHeadDim = NQ_HEAD_DIM;      // 128
// RoPE's inverse frequencies 1 / theta^(2d / 128), d < 64, rounded once to fp32 on the host (dims.py
// rope_inv_freq, as the reference backend computes them). A table rather than pow() in fp64 where it is
// used: the fused q/k/v epilogue called it per output (the 7B tile64 entry: ~550 fp64 instructions).
__device__ const float kRopeInvFreq[kHeadDim / 2] = {NQ_ROPE_INV_FREQ};
constexpr int kQDim = kHeads * kHeadDim;   // q rows of the fused qkv
constexpr int kKvDim = kKvHeads * kHeadDim;
constexpr int kQkvRows = kQDim + 2 * kKvDim;
constexpr int kVocab = NQ_VOCAB;
constexpr int kGroup = 128;                // INT4 group along K: one fp16 scale per 128 weights
constexpr int kPageTokens = 16;            // KV page = 16 tokens x 128 x fp16 = 4 KiB per KV head

// ---- fp16 <-> fp32 and half2 arithmetic (PTX; round-to-nearest-even like the CUDA intrinsics) -------
__device__ __forceinline__ float h2f(uint16_t h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ uint16_t f2h(float f) {
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
// half2 -> (low, high) as floats
__device__ __forceinline__ float2 h22f2(uint32_t v) {
  return make_float2(h2f(static_cast<uint16_t>(v & 0xffffu)), h2f(static_cast<uint16_t>(v >> 16)));
}
__device__ __forceinline__ uint32_t hsub2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
constexpr uint16_t kHalfNaN = 0x7e00u;
#define NQ_INF __int_as_float(0x7f800000)  // no <math.h> under NVRTC: +inf spelled by its bits
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000u); }

// (lo, hi) floats -> half2 with lo in the low half (the lower index), round to nearest even
__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// ---- attention softmax ----------------------------------------------------------------------------
// Scores live in the log2 domain: s * log2(e) / sqrt(128), so exp2f (one MUFU.EX2) replaces expf.
constexpr float kScaleLog2 = 1.4426950408889634f * 0.08838834764831845f;

// ---- loads -------------------------------------------------------------------------------------------
// Weights are read exactly once per token: the non-coherent path with L1::no_allocate keeps them from
// evicting what *is* reused (the activation vector and the scales), and L2::256B prefetches the next
// sector group of a streamed row.
__device__ __forceinline__ uint4 ld_stream_v4(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16 bytes global -> shared without passing through registers (cp.async, L2 only: .cg); a thread's
// copies complete at cp_async_wait_all (then a barrier publishes them to the block)
__device__ __forceinline__ void cp_async16(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// the same for streamed weights, asking L2 to fetch the whole 256-byte block around the copy: a stage
// of the tile GEMM reads 128 B per row, so the next stage's 128 B of that row are already in L2 and HBM
// sees 256-byte bursts instead of 128-byte ones
__device__ __forceinline__ void cp_async16_l2_256(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(smem_u32(smem_dst)), "l"(gmem_src)
               : "memory");
}
// ---- the step timeline (NQ_STAMPS=1, a diagnostic build; scripts/decode_breakdown.py --timeline) --------
// Thread 0 of every block of an entry (NQ_STAMP() is every entry's first statement) takes a slot by an
// atomic on a buffer the host points every module's nq_stamp_buf at (nanoqwen_kernels.stamps), and writes
// the global nanosecond timer at the block's start and exit, with the grid's block count and the SM; when it
// passes pdl_wait it appends the time to a second stream of records. Start slots order the blocks of the
// whole step across modules, and a launch's blocks all start before the next launch's (that one launches
// only once every block of this one has triggered or exited), so the host cuts the slots into launches by
// grid size; the waits likewise (a launch's blocks pass pdl_wait only after the previous launch completed).
// No shared memory (a kernel's shared-memory budget is the same as in a real build); 0 in every real
// build: no code at all. Buffer (uint64): [0] start slots taken, [1] capacity, [2] wait slots taken, [3]
// unused (counts in the low 32 bits); then `capacity` start records {start, exit, grid blocks | smid << 32,
// 0}; then `capacity` wait records {time, grid blocks}. nullptr (the default): nothing recorded.
#ifndef NQ_STAMPS
#define NQ_STAMPS 0
#endif
#if NQ_STAMPS
}  // namespace nq
extern "C" {
__device__ unsigned long long* nq_stamp_buf;  // C linkage: the host finds it by this name in every module
}
namespace nq {
__device__ __forceinline__ unsigned long long global_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned long long grid_blocks() {
  return static_cast<unsigned long long>(gridDim.x) * gridDim.y * gridDim.z;
}
struct BlockStamp {
  unsigned long long* rec = nullptr;  // thread 0's start record
  __device__ BlockStamp() {
    unsigned long long* b = nq_stamp_buf;
    if (threadIdx.x != 0 || b == nullptr) return;
    const unsigned long long t = global_ns();
    const unsigned i = atomicAdd(reinterpret_cast<unsigned*>(b), 1u);
    if (i >= b[1]) return;
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    rec = b + 4 + 4ull * i;
    rec[0] = t;
    rec[2] = grid_blocks() | (static_cast<unsigned long long>(sm) << 32);
  }
  __device__ ~BlockStamp() {
    if (rec != nullptr) rec[1] = global_ns();
  }
};
#define NQ_STAMP() const nq::BlockStamp nq_block_stamp_
#else
#define NQ_STAMP() static_cast<void>(0)
#endif

// ---- programmatic dependent launch (docs/KERNELS.md "Launch overlap") ----------------------------------
// Every kernel is launched with the programmatic-stream-serialization attribute (nanoqwen_kernels.pdl), so
// the launch of a kernel is processed while the kernel before it in the stream drains, and its blocks are
// placed as that kernel's blocks exit, instead of after the whole grid has completed and been flushed.
// The contract, kept by every entry in this directory (tests/test_compile.py checks the SASS: ACQBULK
// before any global load or store): pdl_wait() comes first; it returns once the previous kernel has
// completed and its writes are visible. Without the attribute (NANOQWEN_PDL=0, a launch by CuPy) it is a
// no-op.
// What was measured and not kept (H200, 7B decode at depth 0, docs/PERF.md "Launch overlap"): an explicit
// griddepcontrol.launch_dependents at each entry (the next kernel launched at once, its blocks waiting
// beside the running ones) took 2.20 -> 2.55 ms/token, 2.43 without the weight prefetch; an L2 prefetch
// of the first weights before the wait cost 0.06 ms on its own; the wait alone gave 2.12 ms.
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
#if NQ_STAMPS
  unsigned long long* b = nq_stamp_buf;
  if (threadIdx.x == 0 && b != nullptr) {
    const unsigned long long t = global_ns();
    const unsigned i = atomicAdd(reinterpret_cast<unsigned*>(b + 2), 1u);
    if (i < b[1]) {
      unsigned long long* w = b + 4 + 4ull * b[1] + 2ull * i;
      w[0] = t;
      w[1] = grid_blocks();
    }
  }
#endif
}
// Let the next kernel in the stream launch now rather than when this one's blocks exit: its blocks are then
// placed early and issue work that does not depend on this one (weight loads, the tile GEMM's copies); the
// successor still waits in pdl_wait for this kernel's completion and flush. Used by one-wave kernels only
// (the tile GEMM, decode attention, the int8-activation GEMVs: gemv_units.cuh gemv_trigger_mode, with the
// measurements). Every kernel doing it at its entry was the 2.20 -> 2.55 ms/token above (then the
// successors' blocks waited beside kernels that still had blocks to place).
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }

// ---- thread-block clusters (decode attention's fold, down_proj's shared prologue) --------------------------
// this block's rank in its cluster
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The cluster barrier's halves as the users here take them: every thread of every block arrives once at its
// start (relaxed: it orders no memory but an mbarrier's initialisation, fenced before it; it only says the
// block runs) and waits once before its first store into another block's shared memory. Both .aligned:
// every thread of a warp executes them together.
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.aligned;" ::: "memory"); }
// the shared::cluster address of shared-memory address `local` (smem_u32) in block `rank` of the cluster
__device__ __forceinline__ uint32_t mapa_u32(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
// until the phase of parity 0 of this block's receive mbarrier completes: every byte other blocks of the
// cluster pushed to it (st.async, counted on it) landed (acquire at cluster scope)
__device__ __forceinline__ void recv_wait(uint64_t* bar) {
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar))
        : "memory");
  } while (!done);
}

// 4 bytes global -> shared (cp.async.ca: .cg takes only 16-byte copies)
__device__ __forceinline__ void cp_async4(void* smem_dst, const void* gmem_src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(smem_u32(smem_dst)), "l"(gmem_src) : "memory");
}
// close the thread's cp.async copies issued since the last commit into one group (possibly empty)
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
// wait until at most N of the thread's committed groups are still in flight
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// ---- ValueShuffle-v1 unpack (docs/INTERFACES.md section 2) ------------------------------------------
//
//   word w (8 values, k = 8w .. 8w+7), u = q + 8 in 0..15:
//    bit: 31..28 27..24 23..20 19..16 15..12 11..8  7..4   3..0
//         u[k+7] u[k+3] u[k+6] u[k+2] u[k+5] u[k+1] u[k+4] u[k+0]
//   lo = w & 0x0F0F0F0F -> bytes u[k+0], u[k+1], u[k+2], u[k+3]
//   hi = (w>>4) & 0x0F0F0F0F -> bytes u[k+4] .. u[k+7]
//   prmt(lo, 0x64646464, sel): each output half = {0x64, byte}, i.e. fp16 1024 + u exactly
//   (fp16 1024 has ulp 1, so the byte lands in the low mantissa bits). Subtract 1032 = 1024 + 8 -> q.
//
// prmt.b32 d, a, b, c: bytes of {b,a} numbered 0..7 (a = 0..3, b = 4..7); selector nibble i picks byte i
// of d. 0x4140 -> d = {a.byte0, 0x64, a.byte1, 0x64} = half2(1024+u0, 1024+u1).
__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

// out[0..3] = half2 (q[k], q[k+1]), (q[k+2], q[k+3]), (q[k+4], q[k+5]), (q[k+6], q[k+7]); exact.
__device__ __forceinline__ void unpack8(uint32_t w, uint32_t out[4]) {
  const uint32_t lo = w & 0x0F0F0F0Fu;
  const uint32_t hi = (w >> 4) & 0x0F0F0F0Fu;
  constexpr uint32_t kBias = 0x64086408u;  // half2(1032, 1032) = 1024 (magic) + 8 (the u = q + 8 offset)
  out[0] = hsub2(prmt(lo, 0x64646464u, 0x4140u), kBias);
  out[1] = hsub2(prmt(lo, 0x64646464u, 0x4342u), kBias);
  out[2] = hsub2(prmt(hi, 0x64646464u, 0x4140u), kBias);
  out[3] = hsub2(prmt(hi, 0x64646464u, 0x4342u), kBias);
}

// ---- reductions ---------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Block-wide sum, result in every thread. `red` is >= 32 floats of shared memory. Every thread of the
// block must call it (two __syncthreads inside, none in a divergent branch).
template <int kThreads>
__device__ __forceinline__ float block_sum(float v, float* red) {
  constexpr int kWarps = kThreads / 32;
  v = warp_sum(v);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) red[warp] = v;
  __syncthreads();  // partials visible
  float r = lane < kWarps ? red[lane] : 0.f;
  r = warp_sum(r);
  __syncthreads();  // red may be reused by the caller right after
  return r;
}

// ---- RMSNorm (HF Qwen2RMSNorm order) --------------------------------------------------------------
// out = fp16(w * fp16(x * r)), r = rsqrt(mean(x^2) + eps) with the mean of squares in fp32. Written once
// here for every kernel that normalises: rmsnorm.cu, and the GEMVs that stage a normed activation.

// sum of squares of the 8 fp16 values of a 16-byte piece, in fp32
__device__ __forceinline__ float sum_squares8(const uint4& v) {
  const uint32_t h[4] = {v.x, v.y, v.z, v.w};
  float ss = 0.f;
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float2 f = h22f2(h[t]);
    ss += f.x * f.x + f.y * f.y;
  }
  return ss;
}

// the 8 values of piece v normed with r and weighted with the matching piece w of the norm weight
__device__ __forceinline__ uint4 rms_apply8(const uint4& v, const uint4& w, float r) {
  const uint32_t h[4] = {v.x, v.y, v.z, v.w};
  const uint32_t g[4] = {w.x, w.y, w.z, w.w};
  uint32_t o[4];
#pragma unroll
  for (int t = 0; t < 4; ++t) {
    const float2 xf = h22f2(h[t]), wf = h22f2(g[t]);
    o[t] = static_cast<uint32_t>(f2h(wf.x * h2f(f2h(xf.x * r)))) |
           (static_cast<uint32_t>(f2h(wf.y * h2f(f2h(xf.y * r)))) << 16);
  }
  return make_uint4(o[0], o[1], o[2], o[3]);
}

}  // namespace nq
