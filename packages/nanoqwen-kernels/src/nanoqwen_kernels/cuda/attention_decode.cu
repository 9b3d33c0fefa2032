// attention_decode.cu: paged decode attention over a batch of sequences of different lengths, one kernel:
// warp-specialised blocks each stream a run of pages, and the blocks of a thread-block cluster combine
// their partials through distributed shared memory.
//
// What: for every sequence b of the batch and every query head h,
//   out[b, h, :] = softmax_t(q[b, h] . K_b[t] / sqrt(128)) . V_b[t] over b's positions t < seq_len[b];
//   query head h reads KV head h / G (GQA, G = NQ_NHEADS / NQ_NKV: 7 for 7B).
// Shapes (docs/INTERFACES.md section 3, byte for byte):
//   q, out       fp16 [B, NQ_NHEADS * 128]
//   k/v_cache    fp16 [n_layers, n_pages, NQ_NKV, 16, 128]; one (page, KV head) slice = 4 KiB contiguous
//   page_table   int32 [B, max_pages]: row b maps b's logical block (tokens 16j..16j+15) -> page id
//   seq_len_dev  int32 [B], read on the device (a decode step is one CUDA graph replayed every token);
//                a row with seq_len 0 is an idle (padding) row: it reads nothing and its output is 0
//   workspace    fp32 words, three arrays back to back (one pointer, so the launcher passes no views):
//     tickets    [kTicketWords] ints, 0 between calls (the launcher's workspace starts zeroed; the
//                last cluster of each call resets what it counted)
//     ws_acc     [B, n_clusters, NQ_NHEADS, 128]          a cluster's unnormalised partial outputs
//     ws_ml      [B, n_clusters, C, NQ_NHEADS, 2]         its (max, sum) in the log2 domain, per rank
//   or, with `ll` (the flagged fold), after the tickets instead of ws_acc / ws_ml:
//     ll words   uint64 [B, n_clusters, NQ_NHEADS, 130]   acc[128], max, sum, each (fp32 bits | flag << 32);
//                no word holds the flag between calls (cluster 0 clears what it read)
// Launch: nq_attention_decode grid (NQ_NKV, C x n_clusters, B), cluster (1, C, 1), C <= NQ_DECODE_CLUSTER_MAX
//         (8, the portable size; the long-context build 16, a non-portable size the launcher allows),
//         32 * (1 + NQ_DECODE_CONSUMERS) threads, kSmemBytes dynamic smem, `ll` 0 or 1 (attention.py: C and n_clusters
//         from B, so that NQ_NKV x C x n_clusters x B blocks cover the SMs: 7B at batch 1 (8, 5), 33
//         sequences and more (1, 1)).
//
// Splits and clusters: a sequence's pages are dealt to clusters in contiguous runs of at least
//   NQ_DECODE_MIN_CLUSTER_PAGES (64 pages, 1,024 tokens), and a cluster's run to its C blocks in
//   contiguous sub-runs; the device-side seq_len decides the runs, so one graph serves every length.
//   - <= 1,024 tokens: cluster 0 alone. Head g of the block's KV head is folded by block rank g % C: every
//     block pushes its partial of head g (4 dims a thread, st.async) into that rank's shared memory and
//     each head's (m, l) into every rank's; the bytes count on the receiver's mbarrier, so each rank waits on
//     its own barrier, folds from its own shared memory and writes `out`. No workspace, no second kernel, no
//     cluster barrier after the pushes.
//   - longer: every cluster folds its blocks the same way, then the clusters fold into `out`, one of two ways:
//     * flagged words (`ll` = 1, NQ_ATTN_LL_FOLD; the launcher sets it where every cluster of the grid is
//       resident at once): clusters 1.. store each value of their partial as an 8-byte word with a flag in
//       its high half; rank r of cluster 0 polls the words of its heads until every flag is up, folds, writes
//       `out` and clears the words. No fence and no ticket on the critical path: a word's flag and value land
//       together (one 64-bit access), and since every cluster is resident, cluster 0 never waits on one
//       that cannot start.
//     * tickets (else): the last cluster to take a ticket (atomic, one counter per (sequence, KV head,
//       rank)) folds the clusters' partials into `out`. Rank r of the last cluster reads only what rank r of
//       each cluster wrote (acc and (m, l) of its heads), so one ticket chain per rank orders every read
//       after its write.
//   A block with no page contributes a neutral partial (m = -inf, acc = l = 0).
// Why one kernel (H200, docs/PERF.md "2026-12-01"): the split kernel + a combine kernel took 8.56 us per
//   call at 7B, batch 1, context 640, 3.8 us of it the combine's launch and its L2 round trips; this
//   kernel 7.24 us (1.5B dims 8.87 -> 7.21). An earlier one-kernel try (the last split block combining
//   everything through a ticket, before clusters) measured 29.4 us: one block then folded 7 heads x 128
//   dims over 20 splits alone, with dependent loads; here the fold is spread over the cluster's blocks and
//   every load is issued before any is used.
//
// The page ring, the producer's copies and the two consumer bodies: attention_decode_ring.cuh; the folds'
// primitives (cluster pushes, flagged words): attention_decode_fold.cuh.
//
// Tested: tests/test_attention_decode.py (numpy float64 reference; batches of mixed lengths 1..32768,
// pages scattered, every unread slot NaN; SASS holds UBLKCP and SYNCS); measured: bench/bench_attention.py.
#include "attention_decode_ring.cuh"
#include "attention_decode_fold.cuh"

#ifndef NQ_ATTN_EARLY_PAGES
// 1 (default): the settled pages' copies go out before the launch-overlap wait. In isolation it cuts a call
// at 7B / 640 tokens from 6.70 to 5.34 us (1.5B dims 6.20 -> 5.06); in the step, with two decode steps in
// flight, it won every interleaved pair (H200, 2026-12-02, docs/PERF.md nineteenth lease): 7B 1.834 ->
// 1.832 / 1.835 -> 1.833 ms/token (int8 activations 1.532 -> 1.519 / 1.531 -> 1.520), 1.5B dims 0.837 ->
// 0.835 / 0.838 -> 0.835 (int8 0.752 -> 0.735 / 0.753 -> 0.737). Two earlier leases found it neutral
// within the protocol's noise of the time (+-0.05 ms/token), which two steps in flight brought to ~0.01.
// 0: one wait before anything (the A/B's other side).
#define NQ_ATTN_EARLY_PAGES 1
#endif

#ifndef NQ_ATTN_PHASES
#define NQ_ATTN_PHASES 0
#endif
#if NQ_ATTN_PHASES
// A diagnostic build (scripts/attention_phase_probe.py; never a real build): where a block's time goes.
// Per block (linear index < 1,024) 16 words: [0] / [1] the global timer at phases 0 / 7, [2] the SM, [3 + k]
// the SM's clock64 when it passed phase k: 0 start, 1 the producer's wait, 2 the producer's last copy
// issued, 3 consumer 0's wait, 4 consumer 0's last page done, 5 both roles done, 6 the fold's inputs landed,
// 7 the end, 8 the fold's cluster wait passed, 9 the block's pushes issued.
extern "C" __device__ unsigned long long nq_attn_phases[1024 * 16];
#define NQ_PHASE(k, tid)                                                                                   \
  do {                                                                                                     \
    if (threadIdx.x == (tid)) {                                                                            \
      const unsigned blk = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);                \
      if (blk < 1024) {                                                                                    \
        unsigned long long* rec = nq_attn_phases + 16ull * blk;                                            \
        if ((k) == 0 || (k) == 7) {                                                                        \
          unsigned long long g;                                                                            \
          unsigned sm;                                                                                     \
          asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g));                                           \
          asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));                                                  \
          rec[(k) == 0 ? 0 : 1] = g;                                                                       \
          rec[2] = sm;                                                                                     \
        }                                                                                                  \
        rec[3 + (k)] = clock64();                                                                          \
      }                                                                                                    \
    }                                                                                                      \
  } while (0)
#else
#define NQ_PHASE(k, tid) static_cast<void>(0)
#endif

namespace nq_dec {

// The block's shared memory after the ring (attention.py's decode_smem_bytes mirrors kSmemBytes)
constexpr int kMergeAccBytes = kConsumers * kG * 128 * 4;
constexpr int kMergeMlBytes = 2 * kConsumers * kGPad * 4;
constexpr int kPBufBytes = kConsumers * 16 * kGPad * 4;
constexpr int kBarOffset = kRingBytes + kMergeAccBytes + kMergeMlBytes + kPBufBytes;

constexpr int kSmemBytes = kBarOffset + 2 * kStages * 8;
static_assert(kBarOffset % 8 == 0, "mbarriers need 8-byte alignment");
constexpr int kTicketWords = 1024;  // the workspace's first words: ticket counters (attention.py's TICKET_WORDS)

// This block's view of shared memory (attention_decode_ring.cuh's header draws the ring).
struct Smem {
  unsigned char* ring;  // [kStages][2][4096 B]
  float* merge_acc;     // [kConsumers][kG][128]
  float* merge_m;       // [kConsumers][kGPad]
  float* merge_l;       // [kConsumers][kGPad]
  float* pbuf_all;      // [kConsumers][16][kGPad]
  uint64_t* full;       // [kStages]
  uint64_t* empty;      // [kStages]
};

__device__ __forceinline__ Smem carve(unsigned char* smem) {
  Smem m;
  m.ring = smem;
  m.merge_acc = reinterpret_cast<float*>(smem + kRingBytes);
  m.merge_m = m.merge_acc + kConsumers * kG * 128;
  m.merge_l = m.merge_m + kConsumers * kGPad;
  m.pbuf_all = m.merge_l + kConsumers * kGPad;
  m.full = reinterpret_cast<uint64_t*>(smem + kBarOffset);
  m.empty = m.full + kStages;
  return m;
}

// The whole block streams pages p0 .. p0+count-1 of sequence b's KV head kvh through the ring: one
// producer warp, the consumer warps (their states left in merge_*). Called by every thread; ends with a
// block barrier.
__device__ __forceinline__ void stream_pages(const Smem& sm, const uint16_t* qb, const uint16_t* k_cache,
                                             const uint16_t* v_cache, const int* table, int layer, int n_pages,
                                             int kvh, int p0, int count, int seq_len) {
  const int warp = threadIdx.x >> 5;
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], 1);
    }
    // make the initialised barriers visible to the async proxy (the copy engine) before any copy
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();  // every role sees initialised barriers; outside any role branch

  // ---- role branches ----------------------------------------------------------------------------
  // NO __syncthreads() (or any block-wide barrier) may appear inside either branch: only the threads of
  // one role would reach it, which is undefined behaviour (in practice consumers then read ring slots
  // before their copies land). Every hand-off is an mbarrier (full/empty per slot); the only block
  // barriers are the one above and the one after both branches.
  if (warp == 0) {
    int issued = 0;
    // The run's first 32 page ids, one per lane (one coalesced load), read here, before the launch-overlap
    // wait: the page table is settled before the step (the host or the previous step's `advance` wrote it),
    // so the copy of the newest page after the wait starts without an L2 round trip for its id. A page id
    // outside the cache (a corrupt table) reads page 0 rather than faulting: garbage out, no GPU fault, as
    // the clamp of seq_len does for a corrupt length. Measured (H200, docs/PERF.md twenty-third lease,
    // decode protocol, three interleaved rounds against reading it after the wait): 1.5B dims 0.6545 ->
    // 0.653 ms/token in every round, the 7B level (1.4695 / 1.469); 7B at 640 tokens in isolation 4.18 ->
    // 4.15 us a call. Before the faster fold it measured neutral.
    const int n_first = min(count, 32);
    const int raw_first = lane < n_first ? table[p0 + lane] : 0;
    const int first_page = static_cast<unsigned>(raw_first) < static_cast<unsigned>(n_pages) ? raw_first : 0;
#if NQ_ATTN_EARLY_PAGES
    // Pages before the launch-overlap wait: every page of the run but the sequence's newest is settled
    // before this step began (the q/k/v kernel just before this one writes only the newest token's K/V,
    // into the page of position seq_len - 1), so their copies go out now, overlapping that kernel's
    // tail, up to one ring's worth (no slot is reused before the consumers start); the rest, the newest
    // page included, after the wait. The consumers read q only after their own wait.
    const int newest = (seq_len - 1) / nq::kPageTokens;
    const int n_early = max(0, min(min(count, kStages), newest - p0));
    if (n_early > 0) {
      const int my_page = first_page;
      for (int j = 0; j < n_early; ++j) {
        const int page = __shfl_sync(0xffffffffu, my_page, j);
        if (lane == 0) {
          const size_t off = ((static_cast<size_t>(layer) * n_pages + page) * nq::kKvHeads + kvh) *
                             static_cast<size_t>(kPageElems);
          unsigned char* dst = sm.ring + j * kSlotBytes;  // slot j, its first use
          mbar_arrive_expect_tx(&sm.full[j], kSlotBytes);
          bulk_copy_g2s(dst, k_cache + off, kPageBytes, &sm.full[j]);
          bulk_copy_g2s(dst + kPageBytes, v_cache + off, kPageBytes, &sm.full[j]);
        }
      }
    }
    issued = n_early;
    nq::pdl_wait();
    NQ_PHASE(1, 0);
#endif
    // producer: the warp reads the run's page ids 32 at a time (one coalesced load; read one by one, each
    // copy waited on its own L2 round trip for its page id first), lane 0 issues every copy not issued yet
    for (int base = 0; base < count; base += 32) {
      const int n = min(32, count - base);
      if (issued >= base + n) continue;  // every page of this batch went out before the wait
      int my_page = first_page;
      if (base > 0) {
        const int raw_page = lane < n ? table[p0 + base + lane] : 0;
        my_page = static_cast<unsigned>(raw_page) < static_cast<unsigned>(n_pages) ? raw_page : 0;
      }
      for (int j = max(0, issued - base); j < n; ++j) {
        const int page = __shfl_sync(0xffffffffu, my_page, j);
        if (lane == 0) {
          const int i = base + j;
          const int slot = i % kStages;
          const int use = i / kStages;
          if (use > 0) mbar_wait(&sm.empty[slot], (use - 1) & 1);  // the consumer of use-1 is done
          const size_t off = ((static_cast<size_t>(layer) * n_pages + page) * nq::kKvHeads + kvh) *
                             static_cast<size_t>(kPageElems);
          unsigned char* dst = sm.ring + slot * kSlotBytes;
          mbar_arrive_expect_tx(&sm.full[slot], kSlotBytes);
          bulk_copy_g2s(dst, k_cache + off, kPageBytes, &sm.full[slot]);
          bulk_copy_g2s(dst + kPageBytes, v_cache + off, kPageBytes, &sm.full[slot]);
        }
      }
    }
    NQ_PHASE(2, 0);
  } else {
#if NQ_ATTN_EARLY_PAGES
    nq::pdl_wait();  // q is the q/k/v kernel's output
#endif
    NQ_PHASE(3, 32);
#if NQ_DECODE_MMA
    consume_mma(warp - 1, lane, sm.ring, sm.full, sm.empty, qb, kvh, p0, count, seq_len, sm.merge_acc,
                sm.merge_m, sm.merge_l);
#else
    consume_fma(warp - 1, lane, sm.ring, sm.full, sm.empty, qb, kvh, p0, count, seq_len, sm.merge_acc,
                sm.merge_m, sm.merge_l, sm.pbuf_all);
#endif
    NQ_PHASE(4, 32);
  }
  __syncthreads();  // both roles done; the one block-wide barrier after the role branches
  NQ_PHASE(5, 0);
}

// The consumer warps' states merged for head g, dim d: (max, unnormalised acc, sum). A warp that saw no
// page (m = -inf) contributes nothing (and no inf - inf).
// The consumer warps' states merged for head g: (max, sum) and the unnormalised acc of dims d .. d+3. A warp
// that saw no page (m = -inf) contributes nothing (and no inf - inf).
struct HeadMl {
  float m, l;
};

// the largest of the consumer warps' maxima of head g
__device__ __forceinline__ float consumers_max(const Smem& sm, int g) {
  float mx = neg_inf();
#pragma unroll
  for (int w = 0; w < kConsumers; ++w) mx = fmaxf(mx, sm.merge_m[w * kGPad + g]);
  return mx;
}

__device__ __forceinline__ HeadMl merge_ml(const Smem& sm, int g) {
  const float mx = consumers_max(sm, g);
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kConsumers; ++w) {
    const float mw = sm.merge_m[w * kGPad + g];
    if (mw != neg_inf()) sum += exp2f(mw - mx) * sm.merge_l[w * kGPad + g];
  }
  return {mx, sum};
}

__device__ __forceinline__ float4 merge_acc4(const Smem& sm, int g, int d) {
  const float mx = consumers_max(sm, g);
  float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
  for (int w = 0; w < kConsumers; ++w) {
    const float mw = sm.merge_m[w * kGPad + g];
    if (mw != neg_inf()) {
      const float f = exp2f(mw - mx);
      const float4 v = *reinterpret_cast<const float4*>(sm.merge_acc + (w * kG + g) * 128 + d);
      a.x += f * v.x; a.y += f * v.y; a.z += f * v.z; a.w += f * v.w;
    }
  }
  return a;
}

// static + dynamic shared memory within the 227 KiB a block may opt into on sm_90 (+ 24: `last`, recv_bar)
static_assert(kSmemBytes + 16 * kRecvQuads + 4 * kRecvMlFloats + 24 <= 227 * 1024,
              "the fold's receive area does not fit beside the ring");

}  // namespace nq_dec

#ifndef NQ_ATTN_ONE_TRIGGER
#define NQ_ATTN_ONE_TRIGGER 1  // 1: let the next kernel launch once every block has its pages (A/B knob)
#endif
#ifndef NQ_ATTN_LL_FOLD
// 1 (default): where the launcher says every cluster of the grid is resident at once (`ll`), the several-cluster
// fold hands partials to cluster 0 as flagged words (no fence, no ticket); 0: always the ticket fold (A/B).
#define NQ_ATTN_LL_FOLD 1
#endif
#ifndef NQ_DECODE_MIN_CLUSTER_PAGES
#define NQ_DECODE_MIN_CLUSTER_PAGES 64  // a cluster's run is at least this long: <= 1,024 tokens in one cluster
#endif

extern "C" __global__ void __launch_bounds__(nq_dec::kThreads, 1)
    nq_attention_decode(const nq::uint16_t* __restrict__ q,          // [B, NQ_NHEADS*128]
                        const nq::uint16_t* __restrict__ k_cache,    // [L, n_pages, NQ_NKV, 16, 128]
                        const nq::uint16_t* __restrict__ v_cache,    // same
                        const int* __restrict__ page_table,          // [B, max_pages]
                        const int* __restrict__ seq_len_dev,         // [B]
                        int layer, int n_pages, int max_pages, int csize, int n_clusters,
                        int ll,                                      // 1: flagged-word fold (below)
                        float* __restrict__ workspace,               // tickets, ws_acc, ws_ml
                        nq::uint16_t* __restrict__ out) {            // [B, NQ_NHEADS*128]
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  NQ_PHASE(0, 0);
  using namespace nq_dec;
  // The fold's receive barrier: one arrival (this block's own, with the bytes it will receive) plus the
  // senders' st.async bytes; initialised and armed before this block's cluster arrival, so every sender (which
  // pushes only after that barrier's wait) finds it ready. Then the arrival, waited on before the first
  // remote store (every path below, the idle one included, waits on it exactly once).
  __shared__ __align__(8) nq::uint64_t recv_bar;
  if (csize > 1) {
    if (threadIdx.x == 0) {
      mbar_init(&recv_bar, 1);
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
      mbar_arrive_expect_tx(&recv_bar, recv_bytes(static_cast<int>(cluster_rank()), csize));
    }
    cluster_arrive_relaxed();
  }
#if !NQ_ATTN_EARLY_PAGES
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
#endif
  // With NQ_ATTN_EARLY_PAGES the wait comes later, per role (stream_pages): what is read before it is
  // settled before the step began: the lengths and page tables (written by the host or by the previous
  // step's `advance`, kernels that completed before the q/k/v kernel passed its own wait) and every page
  // but each sequence's newest. Nothing is written before it.
  extern __shared__ __align__(128) unsigned char smem[];
  const Smem sm = carve(smem);
  const int kvh = blockIdx.x;
  const int b = blockIdx.z;
  const int rank = csize > 1 ? static_cast<int>(cluster_rank()) : 0;  // == blockIdx.y % csize
  const int ci = blockIdx.y / csize;                                  // this block's cluster
  const int* table = page_table + static_cast<size_t>(b) * max_pages;
  const uint16_t* qb = q + static_cast<size_t>(b) * nq::kQDim;
  nq::uint16_t* outb = out + static_cast<size_t>(b) * nq::kQDim + kvh * kG * 128;

  // the pages: clusters take contiguous runs of >= NQ_DECODE_MIN_CLUSTER_PAGES, blocks sub-runs of those
  // clamped to what the page-table row can address, so a corrupt length cannot walk off the table
  const int seq_len = min(max(seq_len_dev[b], 0), max_pages * nq::kPageTokens);
  const int n_seq_pages = (seq_len + nq::kPageTokens - 1) / nq::kPageTokens;
  const int per_cluster = max((n_seq_pages + n_clusters - 1) / n_clusters, NQ_DECODE_MIN_CLUSTER_PAGES);
  const int used = (n_seq_pages + per_cluster - 1) / per_cluster;  // clusters holding pages
  if (ci >= used) {  // uniform over the cluster: no cluster barrier is skipped by only some of its blocks
    if (csize > 1) cluster_wait();  // the start's phase, waited here too (no arrive left unwaited)
#if NQ_ATTN_EARLY_PAGES
    nq::pdl_wait();  // before writing `out` (and a block's exit lets the next kernel launch)
#endif
    if (ci == 0) {   // an idle row (seq_len 0): defined output 0
      for (int o = threadIdx.x + kThreads * rank; o < kG * 128; o += kThreads * csize) outb[o] = nq::f2h(0.f);
    }
    return;
  }
  const int c0 = ci * per_cluster;
  const int c_cnt = min(per_cluster, n_seq_pages - c0);
  const int per_block = (c_cnt + csize - 1) / csize;
  const int p0 = c0 + rank * per_block;
  const int count = max(0, min(per_block, c_cnt - rank * per_block));

  stream_pages(sm, qb, k_cache, v_cache, table, layer, n_pages, kvh, p0, count, seq_len);
#if NQ_ATTN_ONE_TRIGGER
  // o_proj may launch once every block of this grid is here (all resident or gone, so its blocks cannot
  // crowd out one of ours) and place its blocks during this combine; it still waits for this kernel's
  // completion before reading `out`. Engine, 1.5B dims (docs/PERF.md): decode at depth 512 1.085 ->
  // 1.009 ms/token, batch 1 / 8 steps 1.00 / 1.56 -> 0.97 / 1.55 ms; the 7B within noise.
  nq::pdl_trigger();
#endif

  // The fold. Every block pushes its partial (the consumer warps merged) to the ranks that fold it: quad qd
  // of head g (dims 4 qd .. 4 qd + 3) to rank g % csize, each head's (m, l) to every rank; one st.async of 16
  // (8) bytes a thread and push (docs/PERF.md, twenty-third lease: element-wise pushes, 4 bytes a store and
  // a run of 8 (m, l) stores on one thread, took ~2 us of a 640-token call). Each rank then waits on its own
  // receive barrier and folds its heads from its own shared memory.
  __shared__ __align__(16) float4 recv_acc[kRecvQuads];  // [sender][recv_row(csize)]
  __shared__ __align__(16) float recv_ml[kRecvMlFloats];  // [sender][kGPad][m, l]
  const int row = recv_row(csize);
  if (csize > 1) cluster_wait();  // every block of the cluster has started: its receive barrier is armed
  NQ_PHASE(8, 0);
  if (threadIdx.x < csize * kG) {  // thread (r, g): head g's (m, l) to rank r
    const int g = threadIdx.x % kG, r = threadIdx.x / kG;
    const HeadMl ml = merge_ml(sm, g);
    float* dst = recv_ml + (rank * kGPad + g) * 2;
    if (csize > 1) {
      st_async2(dst, r, ml.m, ml.l, &recv_bar);
    } else {
      dst[0] = ml.m;
      dst[1] = ml.l;
    }
  }
  for (int qi = threadIdx.x; qi < kQuads; qi += kThreads) {
    const int g = qi >> 5, qd = qi & 31;
    const float4 a = merge_acc4(sm, g, 4 * qd);
    float4* dst = recv_acc + rank * row + (g / csize) * 32 + qd;
    if (csize > 1) st_async4(dst, g % csize, a, &recv_bar);
    else *dst = a;
  }
  NQ_PHASE(9, 0);
  // every byte pushed to this block landed (each sender's stores count on recv_bar); a block leaves only
  // after its own wait, so no store lands in a block that has gone
  if (csize > 1) recv_wait(&recv_bar);
  else __syncthreads();
  NQ_PHASE(6, 0);

  // fold the cluster's C partials of this rank's heads (g = rank + csize j), all from this block's receive
  // area; one cluster: the result; several: this cluster's partial to the workspace
  float* ws_acc = workspace + kTicketWords;
  float* ws_ml = ws_acc + static_cast<size_t>(gridDim.z) * n_clusters * nq::kHeads * 128;
  const size_t cpart = static_cast<size_t>(b) * n_clusters + ci;  // (sequence, cluster)
  // one element a thread (a rank folds at most heads_of_rank(csize) x 128 of them: every thread busy)
  const float* recv_f = reinterpret_cast<const float*>(recv_acc);
  for (int e = threadIdx.x; e < heads_of_rank(csize) * 128; e += kThreads) {
    const int g = rank + csize * (e >> 7), d = e & 127;
    if (g >= kG) break;
    // a rank past csize weighs 0; a rank with no page pushed m = -inf, acc = l = 0
    float ms[kClusterMax], ls[kClusterMax], as[kClusterMax];
#pragma unroll
    for (int s = 0; s < kClusterMax; ++s) {
      const bool in = s < csize;
      ms[s] = in ? recv_ml[(s * kGPad + g) * 2] : neg_inf();
      ls[s] = in ? recv_ml[(s * kGPad + g) * 2 + 1] : 0.f;
      as[s] = in ? recv_f[(s * row) * 4 + e] : 0.f;
    }
    float mx = neg_inf();
#pragma unroll
    for (int s = 0; s < kClusterMax; ++s) mx = fmaxf(mx, ms[s]);
    float a = 0.f, l = 0.f;
#pragma unroll
    for (int s = 0; s < kClusterMax; ++s) {
      const float f = ms[s] == neg_inf() ? 0.f : exp2f(ms[s] - mx);  // no inf - inf
      a += f * as[s];
      l += f * ls[s];
    }
    if (used == 1) {  // the short-context case: this cluster holds the whole sequence
      outb[g * 128 + d] = nq::f2h(l > 0.f ? a / l : 0.f);
      continue;
    }
    const int hd = kvh * kG + g;
#if NQ_ATTN_LL_FOLD
    if (ll) {
      uint64_t* const ll_ws = reinterpret_cast<uint64_t*>(workspace + kTicketWords);
      if (ci > 0) {  // a writer: this cluster's partial of (head hd, dim d) to cluster 0, flagged
        uint64_t* row = ll_ws + (cpart * nq::kHeads + hd) * kLlRow;
        st_ll(row + d, a);
        if (d == 0) {
          st_ll(row + 128, mx);
          st_ll(row + 129, l);
        }
        continue;
      }
      // cluster 0, rank r: fold the other clusters' partials of this element, 8 clusters' words in flight
      for (int cb = 1; cb < used; cb += 8) {
        const int nc = min(8, used - cb);
        uint64_t va[8], vm[8], vl[8];
        for (int spin = 0;; ++spin) {
          // all 24 loads issued back to back, then checked: a check (or a branch) between them would wait for
          // each group's round trip in turn (the first build did: 7B 16k 15.8 -> 17.0 us a call); a slot past
          // nc reloads cluster cb + nc - 1's words and counts as up
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const int c = cb + min(j, nc - 1);
            const uint64_t* row = ll_ws + ((static_cast<size_t>(b) * n_clusters + c) * nq::kHeads + hd) * kLlRow;
            va[j] = ld_ll(row + d);
            vm[j] = ld_ll(row + 128);
            vl[j] = ld_ll(row + 129);
          }
          bool up = true;
#pragma unroll
          for (int j = 0; j < 8; ++j) up &= (j >= nc) | (ll_up(va[j]) & ll_up(vm[j]) & ll_up(vl[j]));
          if (up || spin >= kLlSpinMax) break;
        }
        float m_new = mx;
#pragma unroll
        for (int j = 0; j < 8; ++j)
          if (j < nc) m_new = fmaxf(m_new, ll_val(vm[j]));
        const float alpha = mx == neg_inf() ? 0.f : exp2f(mx - m_new);
        a *= alpha;
        l *= alpha;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (j < nc) {
            const float mj = ll_val(vm[j]);
            const float f = mj == neg_inf() ? 0.f : exp2f(mj - m_new);
            a += f * ll_val(va[j]);
            l += f * ll_val(vl[j]);
            // this thread alone read this word: clear it now (m and l after the block barrier below)
            *(ll_ws + ((static_cast<size_t>(b) * n_clusters + cb + j) * nq::kHeads + hd) * kLlRow + d) = 0ull;
          }
        }
        mx = m_new;
      }
      outb[g * 128 + d] = nq::f2h(l > 0.f ? a / l : 0.f);
      continue;
    }
#endif
    ws_acc[(cpart * nq::kHeads + hd) * 128 + d] = a;
    if (d == 0) {  // head g's (m, l) of this cluster, read by this rank of the last cluster
      float* ml = ws_ml + ((cpart * csize + rank) * nq::kHeads + hd) * 2;
      ml[0] = mx;
      ml[1] = l;
    }
  }
  NQ_PHASE(7, 0);
  if (used == 1) return;
#if NQ_ATTN_LL_FOLD
  if (ll) {
    if (ci > 0) return;
    // cluster 0: every thread of a head has read that head's (m, l) words; clear them for the next call
    __syncthreads();
    uint64_t* const ll_ws = reinterpret_cast<uint64_t*>(workspace + kTicketWords);
    for (int e = threadIdx.x; e < heads_of_rank(csize) * (used - 1); e += kThreads) {
      const int g = rank + csize * (e / (used - 1)), c = 1 + e % (used - 1);
      if (g >= kG) break;
      uint64_t* row = ll_ws + ((static_cast<size_t>(b) * n_clusters + c) * nq::kHeads + kvh * kG + g) * kLlRow;
      row[128] = 0ull;
      row[129] = 0ull;
    }
    return;
  }
#endif

  // several clusters: take a ticket; rank r of the last cluster to count folds every cluster's partial of
  // its heads (what rank r of each cluster wrote: one ticket chain per rank orders every read after its write)
  __threadfence();  // this thread's partial is visible device-wide before the ticket below
  __syncthreads();
  __shared__ int last;
  int* ticket = reinterpret_cast<int*>(workspace) + (static_cast<size_t>(b) * nq::kKvHeads + kvh) * csize + rank;
  if (threadIdx.x == 0) last = atomicAdd(ticket, 1) == used - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();  // acquire side: the other clusters' partials, published before their tickets
  for (int e = threadIdx.x; e < heads_of_rank(csize) * 128; e += kThreads) {
    const int g = rank + csize * (e >> 7), d = e & 127;
    if (g >= kG) break;
    const int hd = kvh * kG + g;
    float mx = neg_inf(), a = 0.f, l = 0.f;  // online over the clusters, 4 clusters' loads at a time
    for (int c0 = 0; c0 < used; c0 += 4) {
      float mc[4], ac[4], lc[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const size_t cp = static_cast<size_t>(b) * n_clusters + min(c0 + j, used - 1);
        const float* ml = ws_ml + ((cp * csize + rank) * nq::kHeads + hd) * 2;
        mc[j] = c0 + j < used ? __ldcg(ml) : neg_inf();
        lc[j] = __ldcg(ml + 1);
        ac[j] = __ldcg(ws_acc + (cp * nq::kHeads + hd) * 128 + d);
      }
      float m_new = mx;
#pragma unroll
      for (int j = 0; j < 4; ++j) m_new = fmaxf(m_new, mc[j]);
      const float alpha = mx == neg_inf() ? 0.f : exp2f(mx - m_new);
      a *= alpha;
      l *= alpha;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float f = mc[j] == neg_inf() ? 0.f : exp2f(mc[j] - m_new);
        a += f * ac[j];
        l += f * lc[j];
      }
      mx = m_new;
    }
    outb[g * 128 + d] = nq::f2h(l > 0.f ? a / l : 0.f);
  }
  if (threadIdx.x == 0) *ticket = 0;  // every used cluster has counted: ready for the next call
}
