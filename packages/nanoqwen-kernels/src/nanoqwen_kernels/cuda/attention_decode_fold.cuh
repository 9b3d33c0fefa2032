// attention_decode_fold.cuh: how the blocks of a decode-attention call meet (attention_decode.cu has the
// kernel, what it computes and when each fold runs: its header, "Splits and clusters"):
//   - the cluster fold's primitives: the cluster barrier halves, mapa, st.async pushes counted on the
//     receiver's mbarrier, the receive area's shape and byte counts;
//   - the several-cluster fold's flagged words (NQ_ATTN_LL_FOLD): an 8-byte word per value, fp32 bits low and
//     a flag high, stored and polled as single 64-bit accesses.
// Tested through the kernel: tests/test_attention_decode.py; tests/test_compile.py reads the fold's SASS.
#pragma once
#include "attention_decode_ring.cuh"

namespace nq_dec {

// ---- the cluster fold (header: "Splits and clusters") -------------------------------------------------
#ifndef NQ_DECODE_CLUSTER_MAX
#define NQ_DECODE_CLUSTER_MAX 8  // the portable cluster size (attention.py CLUSTER_MAX); 16: the long build
#endif
constexpr int kClusterMax = NQ_DECODE_CLUSTER_MAX;  // the largest cluster a launch may have (the fold's arrays)
static_assert(kClusterMax == 8 || kClusterMax == 16, "clusters of up to 8 (portable) or 16 (non-portable)");
constexpr int kQuads = kG * 32;  // the block's outputs (G heads x 128 dims) as quads of 4 dims: 32 a head
static_assert(kClusterMax * kG <= kThreads, "the (m, l) pushes take one thread per (rank, head)");

// the cluster's rank, its barrier's halves and the receive wait: common.cuh
using nq::cluster_arrive_relaxed;
using nq::cluster_rank;
using nq::cluster_wait;
using nq::recv_wait;

// the shared::cluster address of `local`'s offset in block `rank`'s shared memory
__device__ __forceinline__ uint32_t mapa(const void* local, uint32_t rank) {
  return nq::mapa_u32(nq::smem_u32(local), rank);
}

// st.async: `bytes` of this thread's registers into block `rank`'s shared memory at the offset `local` has in
// this block's, counted on that block's mbarrier at `bar`'s offset (mbarrier::complete_tx::bytes: the
// receiver's wait on the phase sees the values). No fence, no barrier: the receiver's wait is the hand-over.
__device__ __forceinline__ void st_async4(float4* local, uint32_t rank, float4 v, uint64_t* bar) {
  const uint32_t remote = mapa(local, rank), rbar = mapa(bar, rank);
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(
                   remote),
               "r"(__float_as_uint(v.x)), "r"(__float_as_uint(v.y)), "r"(__float_as_uint(v.z)),
               "r"(__float_as_uint(v.w)), "r"(rbar)
               : "memory");
}
__device__ __forceinline__ void st_async2(float* local, uint32_t rank, float a, float b, uint64_t* bar) {
  const uint32_t remote = mapa(local, rank), rbar = mapa(bar, rank);
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(
                   remote),
               "r"(__float_as_uint(a)), "r"(__float_as_uint(b)), "r"(rbar)
               : "memory");
}

// The receive area (static __shared__ in nq_attention_decode, outside the launcher's dynamic size). Head g
// of the block's KV head is folded by rank g % C; a sender's quads of head g go to that rank's row for the
// sender, at slot (g / C) * 32 + quad: recv_acc[sender][slot], rows of recv_row(C) quads; recv_ml[sender][g]
// the sender's (m, l) of head g, pushed to every rank.
__device__ constexpr int heads_of_rank(int c) { return (kG + c - 1) / c; }  // the most heads a rank folds
__device__ constexpr int recv_row(int c) { return heads_of_rank(c) * 32; }
__device__ constexpr int recv_quads() {
  int n = 0;
  for (int c = 1; c <= kClusterMax; ++c) n = c * recv_row(c) > n ? c * recv_row(c) : n;
  return n;
}
constexpr int kRecvQuads = recv_quads();
constexpr int kRecvMlFloats = kClusterMax * kGPad * 2;
// bytes rank `rank` of a cluster of c receives: from each of the c senders, 32 quads of every head it folds
// and every head's (m, l)
__device__ __forceinline__ uint32_t recv_bytes(int rank, int c) {
  const int heads = rank < kG ? (kG - 1 - rank) / c + 1 : 0;
  return static_cast<uint32_t>(c * (heads * 32 * 16 + kG * 8));
}

// ---- the several-cluster fold through flagged words (NQ_ATTN_LL_FOLD; header: "Splits and clusters") ------
// Each value a cluster hands to cluster 0 travels as one 8-byte word: the fp32 bits low, kLlFlag high, stored
// and loaded as single 64-bit accesses (single-copy atomic: a reader that sees the flag sees the value stored
// with it). So the reader needs no fence on the writer's side and no ticket: it polls the words until every
// flag is up. Cluster 0 clears the words it read (plain stores, visible to the next call through the kernel
// boundary), so between calls no word holds the flag. kLlFlag is no fp32 NaN's high word, so a workspace
// poisoned with NaNs never passes for a written one.
constexpr unsigned kLlFlag = 0x4E514C4Cu;  // "NQLL"
constexpr int kLlRow = 128 + 2;          // a (sequence, cluster, head) row: acc[128], m, l
constexpr int kLlSpinMax = 1 << 20;      // a bound on one poll (a bug must not hang the GPU): ~1 s

__device__ __forceinline__ void st_ll(uint64_t* p, float x) {
  const uint64_t v = (static_cast<uint64_t>(kLlFlag) << 32) | __float_as_uint(x);
  asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t ld_ll(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ bool ll_up(uint64_t v) { return static_cast<unsigned>(v >> 32) == kLlFlag; }
__device__ __forceinline__ float ll_val(uint64_t v) { return __uint_as_float(static_cast<unsigned>(v)); }

}  // namespace nq_dec
