// gemv_a8_cluster.cuh: the int8 loop's down_proj prologue shared by a thread-block cluster
// (NQ_DOWN_CLUSTER = C blocks), included by gemv_int4.cu after gemv_a8.cuh.
#pragma once

namespace nq {

// Why. Every block of the unsplit down_proj (the 7B's: 224 blocks) reads the whole 18,944-value intermediate
// from L2 and rounds it to int8 in its prologue (stage_x_a8): 10 chunks of 8 values a thread, ~60 instructions
// each, on every block, two blocks an SM, before any warp uses its weights. In a cluster of C blocks each
// block reads and rounds a C-th of the chunks and stores the result into every block's shared memory of the
// cluster (distributed shared memory: st.async, each store counted on the receiving block's mbarrier), and
// each block waits on its own barrier for all of x. What it costs: a cluster barrier at the start (a block
// stores into a peer only once the peer has started and armed its barrier), the stores to C blocks.
#ifndef NQ_DOWN_CLUSTER
#define NQ_DOWN_CLUSTER 1  // blocks of a cluster sharing down_proj's prologue; 1: none (gemv.py sets it)
#endif
constexpr int kDownCluster = NQ_DOWN_CLUSTER;

// 8 bytes into a block of the cluster, counted on that block's mbarrier (no fence: its wait is the hand-over)
__device__ __forceinline__ void a8c_st_async2(uint32_t addr, uint32_t a, uint32_t b, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(addr),
               "r"(a), "r"(b), "r"(bar)
               : "memory");
}

// The receive barrier of the cluster's prologue (a __shared__ word of the caller): armed at the kernel's start
// by thread 0 with the bytes the block will receive (all of x's int8 image, K * 3 / 2, its own share
// included), before the entry's cluster arrival, so no block stores into it unarmed. Not armed with a norm.
__device__ __forceinline__ void a8c_arm(uint64_t* bar, int bytes, bool armed) {
  if (threadIdx.x == 0 && armed) {
    mbar_init(bar, 1);
    fence_mbarrier_init();
    mbar_arrive_expect_tx(bar, bytes);
  }
  cluster_arrive_relaxed();
}

// The cluster's prologue: every thread of every block of the cluster calls it, after a8c_arm. Without a norm
// only: with one (a norm needs the sum over the whole x in every block) each block stages all of x itself, as
// stage_x_a8 does.
template <int K>
__device__ __forceinline__ void stage_x_a8_cluster(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                                   float eps, A8Stage st, float* red, const NormEarly<K>& ne,
                                                   uint64_t* bar) {
  constexpr int C = kDownCluster;
  constexpr int kChunks = K / 8;
  constexpr int kIters = a8_iters<K>();
  constexpr int kMine = (kIters + C - 1) / C;  // chunks a thread rounds (its iterations it = rank + C j)
  if (norm_w != nullptr) {
    cluster_wait();  // the entry's phase (no block stores into another on this path)
    stage_x_a8<K>(x, norm_w, eps, st, red, ne);
    return;
  }
  const int rank = static_cast<int>(cluster_rank());
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  uint4 v[kMine];
#pragma unroll
  for (int j = 0; j < kMine; ++j) {  // every load first (one L2 round trip)
    const int it = rank + C * j;
    const int i = it * kThreads + threadIdx.x;
    v[j] = it < kIters && i < kChunks ? x4[i] : make_uint4(0u, 0u, 0u, 0u);
  }
  const uint32_t q0 = smem_u32(st.xq), m0 = smem_u32(st.xm), b0 = smem_u32(bar);
  cluster_wait();  // the entry's phase: every block of the cluster has started and armed its barrier
#pragma unroll
  for (int j = 0; j < kMine; ++j) {
    const int it = rank + C * j;
    if (it < kIters) {  // uniform over the block
      round_chunk_a8<K>(v[j], it * kThreads + threadIdx.x, [&](int qi, uint2 q, int mi, bool has_m, int2 m) {
#pragma unroll
        for (int r = 0; r < C; ++r) {
          const uint32_t rb = mapa_u32(b0, r);
          a8c_st_async2(mapa_u32(q0 + 8 * qi, r), q.x, q.y, rb);
          if (has_m) a8c_st_async2(mapa_u32(m0 + 8 * mi, r), static_cast<uint32_t>(m.x), static_cast<uint32_t>(m.y), rb);
        }
      });
    }
  }
  // every byte of x landed in this block (the C blocks' stores count on its barrier); no store lands in it
  // after this, so it may leave whenever its units are done
  recv_wait(bar);
}

}  // namespace nq
