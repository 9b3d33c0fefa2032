// gemv_a8_cluster.cuh: the int8 loop's prologue shared by a thread-block cluster (down_proj's NQ_DOWN_CLUSTER
// = C blocks; q/k/v's, o_proj's and gate/up's NQ_QKV_CLUSTER, NQ_O_CLUSTER, NQ_GU_CLUSTER), included by
// gemv_int4.cu after gemv_a8.cuh.
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
// The same for the K = hidden matrices (q/k/v and gate/up with their RMSNorm, o_proj without): 1: none.
// With a norm every block still reads all of x and sums its squares itself (the same sum, in the same order,
// as stage_x_a8: every block gets the same scale, so the outputs are the unshared build's bit for bit); what
// the cluster shares is the costly part, the norm's multiply and the rounding (stage_x_a8_cluster_norm).
#ifndef NQ_QKV_CLUSTER
#define NQ_QKV_CLUSTER 1
#endif
#ifndef NQ_O_CLUSTER
#define NQ_O_CLUSTER 1
#endif
#ifndef NQ_GU_CLUSTER
#define NQ_GU_CLUSTER 1
#endif

// 8 bytes into a block of the cluster, counted on that block's mbarrier (no fence: its wait is the hand-over)
__device__ __forceinline__ void a8c_st_async2(uint32_t addr, uint32_t a, uint32_t b, uint32_t bar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.b32 [%0], {%1, %2}, [%3];" ::"r"(addr),
               "r"(a), "r"(b), "r"(bar)
               : "memory");
}

// One rounded chunk (round_chunk_a8's put: its 8 bytes as xq's uint2 qi and, on a half-piece's first chunk, its
// {scale / 16, accumulator start} as xm's int2 mi) into every block of a cluster of C; q0, m0, b0: this block's
// shared addresses of xq, xm and the receive barrier, mapped to each rank's
template <int C>
__device__ __forceinline__ void a8c_push(uint32_t q0, uint32_t m0, uint32_t b0, int qi, uint2 q, int mi, bool has_m,
                                         int2 m) {
#pragma unroll
  for (int r = 0; r < C; ++r) {
    const uint32_t rb = mapa_u32(b0, r);
    a8c_st_async2(mapa_u32(q0 + 8 * qi, r), q.x, q.y, rb);
    if (has_m) a8c_st_async2(mapa_u32(m0 + 8 * mi, r), static_cast<uint32_t>(m.x), static_cast<uint32_t>(m.y), rb);
  }
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
template <int K, int C>
__device__ __forceinline__ void stage_x_a8_cluster(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                                   float eps, A8Stage st, float* red, const NormEarly<K>& ne,
                                                   uint64_t* bar) {
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
        a8c_push<C>(q0, m0, b0, qi, q, mi, has_m, m);
      });
    }
  }
  // every byte of x landed in this block (the C blocks' stores count on its barrier); no store lands in it
  // after this, so it may leave whenever its units are done
  recv_wait(bar);
}

// The q/k/v, o_proj and gate/up prologue in a cluster of C blocks (armed always: both paths push). Without a
// norm, stage_x_a8_cluster's. With one, every block loads all of x (kIters chunks a thread, K = hidden: 2 on
// the 7B) and sums its squares as stage_x_a8 does; then rank r norms and rounds the chunks of its range
// [r kPer, (r + 1) kPer) (whole warps, so a half-piece's two lanes and round_chunk_a8's shuffles stay
// together) and pushes them into every block of the cluster. The 7B's q/k/v in 2: each block rounds 224 of
// the 448 chunks, one a thread at most instead of two.
template <int K, int C>
__device__ __forceinline__ void stage_x_a8_cluster_norm(const uint16_t* __restrict__ x,
                                                        const uint16_t* __restrict__ norm_w, float eps, A8Stage st,
                                                        float* red, const NormEarly<K>& ne, uint64_t* bar) {
  if (norm_w == nullptr) {
    stage_x_a8_cluster<K, C>(x, norm_w, eps, st, red, ne, bar);
    return;
  }
  constexpr int kChunks = K / 8;
  constexpr int kIters = a8_iters<K>();
  constexpr int kPer = ((kChunks + C - 1) / C + 31) / 32 * 32;  // chunks a rank rounds: whole warps
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
  uint4 xe[kIters];
  float ss = 0.f;
#pragma unroll
  for (int it = 0; it < kIters; ++it) {  // stage_x_a8's loads and order of sums
    const int i = it * kThreads + threadIdx.x;
    xe[it] = i < kChunks ? x4[i] : make_uint4(0u, 0u, 0u, 0u);
    if (i < kChunks) ss += sum_squares8(xe[it]);
  }
  ss = block_sum<kThreads>(ss, red);
  const float r = rsqrtf(ss / K + eps);
  const int lo = static_cast<int>(cluster_rank()) * kPer;
  const uint32_t q0 = smem_u32(st.xq), m0 = smem_u32(st.xm), b0 = smem_u32(bar);
  cluster_wait();  // the entry's phase: every block of the cluster has started and armed its barrier
#pragma unroll
  for (int it = 0; it < kIters; ++it) {
    const int i = it * kThreads + threadIdx.x;
    const int w0 = it * kThreads + (threadIdx.x & ~31);  // the warp's first chunk: the test is warp-uniform
    if (w0 >= lo && w0 < lo + kPer && w0 < kChunks) {
      uint4 v = xe[it];
      if (i < kChunks) v = rms_apply8(v, kNormEarly<K> ? ne.w[it] : w4[i], r);
      round_chunk_a8<K>(v, i, [&](int qi, uint2 q, int mi, bool has_m, int2 m) {
        a8c_push<C>(q0, m0, b0, qi, q, mi, has_m, m);
      });
    }
  }
  recv_wait(bar);  // all of x landed here; no store lands after it
}

}  // namespace nq
