// gemv_units.cuh: the B = 1 loops' walk over units (the half2 loop and the int8-activation loop), included by
// gemv_int4.cu after the pieces it drives (dot_rows2, stage_x, stage_x_a8): gemv_units stages x, issues a
// warp's first weights before the launch-overlap wait (NQ_GEMV_PRELOAD), lets the next kernel launch early
// (the int8 loop's NQ_TRIG_*), splits down_proj's units over warps where the launcher's build asks for it
// (NQ_SPLIT_DOWN) and hands each unit's two sums to the entry's epilogue. The entries are in gemv_int4.cu.
#pragma once

namespace nq {

#ifndef NQ_GEMV_PRELOAD
#define NQ_GEMV_PRELOAD 1  // 1: a warp's first chunk of weights is loaded before the launch-overlap wait
#endif

// The half2 loop over units: a warp takes unit p, `map` names its 2 rows, `epi` (lane 0) writes the
// results of column 0. The same maps and epilogues serve the tensor-core core (gemv_mma.cuh), so each
// fused epilogue is written once.
// Weights before the wait (NQ_GEMV_PRELOAD): the weights and scales are constant for the whole decode, so
// a warp may load its first unit's first chunk before griddepcontrol.wait, while the previous kernel (the
// producer of x) drains; the DRAM round trip then overlaps that kernel's tail and this one's x prologue
// instead of following them. Only weight loads go before the wait; x is read after it (the one exception
// to common.cuh's rule that nothing is read before the wait, checked in tests/test_compile.py).
// What gemv_units stages as its x (template argument kX)
constexpr int kXHalf = 0;   // fp16 x (normed or not) for the half2 loop
constexpr int kXA8 = 1;     // fp16 x rounded to int8 in the prologue, for the int8-activation loop
constexpr int kXImage = 2;  // x already rounded: an a8 image (gate_up_a8_image's output), copied as it is

// Launch overlap, the int8-activation loop only: when each block lets the next kernel launch
// (griddepcontrol.launch_dependents, which takes effect for a block at its first warp's call, and for the
// grid once every block has called it or exited). The next kernel's launch is then processed while this
// one streams: its blocks are placed as this one's blocks exit (or beside them where registers allow) and
// issue their first weights before their own wait, instead of after this kernel's last exit plus a launch
// latency. Per matrix kind (NQ_TRIG_QKV / _O / _GU / _DOWN): 3 right after pdl_wait, 2 at the entry (before
// the weights preload), 1 once a warp of every block has its last unit's sums, 0 never (the blocks' exits).
// After the wait, not at the entry: a trigger at the entry lets the successor trigger at its own entry in
// turn, so two kernels' blocks wait beside a running one and their preloads slow it. The half2 loop never
// triggers. H200, decode protocol, ms/token, two rounds each (docs/PERF.md, twenty-first lease):
//   int8 loop            last unit (1) | after the wait (3) | entry (2) | 3, gate/up 2 (kept) | 3, o_proj 2
//   7B                   1.570 / 1.571 | 1.511 / 1.508      | 1.529 / 1.529 | 1.509 / 1.512    | 1.521 / 1.524
//   the 1.5B's dims      0.763 / 0.764 | 0.754 / 0.757      | 0.740 / 0.740 | 0.750 / 0.750    | 0.743 / 0.741
//   half2 loop           none          | after the wait: 7B 1.828 -> 1.805, 1.5B's dims 0.811 -> 0.828
// The step timeline (7B int8, us per launch, none -> after the wait): the hand-off after down_proj 1.65 ->
// 0.66, after q/k/v 1.06 -> 0.80, after gate/up 1.57 -> 1.09; each running kernel's own tail grows 0.5-0.9
// (its successor's preloads share the DRAM), the step 1,641 -> 1,575 (stamped build). Per dims: where
// o_proj's grid leaves SMs without a block (the 1.5B's 96 blocks on 132 SMs), the launcher's build sets
// NQ_TRIG_O=2 (gemv.py b1_build_defines): gate/up's blocks fill the empty SMs early, 1.5B's dims 0.697 ->
// 0.678 ms/token (docs/PERF.md "twenty-second lease").
#ifndef NQ_TRIG_QKV
#define NQ_TRIG_QKV 3
#endif
#ifndef NQ_TRIG_O
#define NQ_TRIG_O 3
#endif
#ifndef NQ_TRIG_GU
#define NQ_TRIG_GU 2
#endif
#ifndef NQ_TRIG_DOWN
#define NQ_TRIG_DOWN 3
#endif
struct QkvRows;     // gemv_epilogues.cuh
struct GateUpRows;  // gemv_epilogues.cuh
template <class A, class B> struct SameType { static constexpr bool value = false; };
template <class A> struct SameType<A, A> { static constexpr bool value = true; };
// the trigger mode of a B = 1 loop: its kind from its row map and K (o_proj K = hidden, down_proj K = inter)
template <int K, class Map, int kX>
__device__ constexpr int gemv_trigger_mode() {
  return kX == kXHalf ? 0
         : SameType<Map, QkvRows>::value ? NQ_TRIG_QKV
         : SameType<Map, GateUpRows>::value ? NQ_TRIG_GU
         : K == kHidden ? NQ_TRIG_O : NQ_TRIG_DOWN;
}
template <int kMode>
__device__ __forceinline__ void trigger_after_last_unit(bool last) {
  if (kMode == 1 && last) pdl_trigger();
}
template <int kAt, int kMode>  // kAt 2: at the entry, 3: after the wait
__device__ __forceinline__ void gemv_trigger_at() {
  if (kMode == kAt) pdl_trigger();
}

// Stage an a8 image (K bytes of int8 x then K / 32 int4, two {scale / 16, accumulator start} per piece: the shared
// layout itself). Every load of a thread's share goes out before any store: a grid-stride copy loop (load,
// store, next) let the compiler issue only part of the loads before the first store waited on its data, so
// the copy took two or more L2 round trips after the launch-overlap wait instead of one. H200, the 1.5B's dims
// (its down_proj: 840 uint4s, 4 a thread), decode protocol, three interleaved rounds: 0.6273 / 0.6267 / 0.6263
// -> 0.6096 / 0.6083 / 0.6072 ms/token; down_proj's family 3.46 -> 2.84 us a launch (docs/PERF.md,
// twenty-sixth lease).
template <int K>
__device__ __forceinline__ void stage_image(const uint16_t* __restrict__ img, uint4* xs) {
  constexpr int kN = K / 16 + K / 32;  // uint4s: xq, then xm
  constexpr int kIt = (kN + kThreads - 1) / kThreads;
  const uint4* src = reinterpret_cast<const uint4*>(img);
  uint4 v[kIt];
#pragma unroll
  for (int j = 0; j < kIt; ++j) {
    const int i = j * kThreads + threadIdx.x;
    if (i < kN) v[j] = src[i];
  }
#pragma unroll
  for (int j = 0; j < kIt; ++j) {
    const int i = j * kThreads + threadIdx.x;
    if (i < kN) xs[i] = v[j];
  }
  __syncthreads();  // the image complete before any warp reads it
}

// Units prefetched (NQ_GEMV_UNIT_PREFETCH_NJ): where a row is at most that many pieces per lane, a unit is
// a single chunk, and a warp that owns several units (the 1.5B's gate/up: 8,960 units, 2 for each of 4,480 warps)
// issues the next unit's loads before it multiplies the current one. Otherwise each unit is a dependent
// DRAM round trip after the previous one's products and warp sums. Limited to short rows because the
// prefetched chunk costs registers (8 per piece and row): at the 7B's K = 3584 (4 pieces a lane) it would
// cost 32 and a block per SM.
#ifndef NQ_GEMV_UNIT_PREFETCH_NJ
#define NQ_GEMV_UNIT_PREFETCH_NJ 2
#endif
template <int K, int kSplit = 1>
constexpr bool kUnitPrefetch = pieces_per_lane<K, kSplit>() <= NQ_GEMV_UNIT_PREFETCH_NJ &&
                               pieces_per_lane<K, kSplit>() <= kInFlight;

// Split-K, the int8 loop's down_proj only (NQ_SPLIT_DOWN: warps per unit, 1, 2, 4 or 8): a unit's row
// pair is shared by kSplit neighbouring
// warps of a block, each taking every kSplit-th 512-byte step of the rows (for_chunk_pieces), and the
// first of them adds the others' sums (through shared memory, in part order: the same sum at every run)
// and runs the epilogue. What it buys: blocks. A grid of one warp a unit is units / 8 blocks, and where
// that is fewer than the SMs (the 1.5B's down_proj: 768 units, 96 blocks on 132 SMs) a third of the SMs
// stream nothing, and each warp's row is a chain of dependent chunks (the 1.5B's 9 pieces a lane: 3 chunks
// of <= 4). Split in 4 it is 384 blocks and one chunk a warp: 1.5B's dims 0.756 -> 0.682 ms/token. Where
// every SM has a block already the split only adds the join (the 7B's down_proj in 2: 1.515 -> 1.532).
// q/k/v and o_proj split in 2 lost on both models (7B 1.549 / 1.562, 1.5B's dims 0.758 / 0.804 against
// 1.515 / 0.756) and gate/up's 2-row units are short and many: those are never split (their knobs were
// removed, docs/PERF.md "twenty-third lease"). The build's split comes from the launcher (gemv.py
// b1_build_defines: per dims and SM count, figures there and in docs/PERF.md "twenty-second lease"); the
// default here, 1, is no split.
#ifndef NQ_SPLIT_DOWN
#define NQ_SPLIT_DOWN 1
#endif
template <int K, class Map, int kX>
__device__ constexpr int gemv_split() {
  return kX == kXHalf || SameType<Map, QkvRows>::value || SameType<Map, GateUpRows>::value || K == kHidden
             ? 1
             : NQ_SPLIT_DOWN;
}

// The cluster sharing the prologue of the int8 loop's K = hidden kinds (gemv_a8_cluster.cuh NQ_QKV_CLUSTER,
// NQ_O_CLUSTER, NQ_GU_CLUSTER; 1: none): its block count. down_proj's is NQ_DOWN_CLUSTER (gemv_units' kCluster).
template <int K, class Map, int kX>
__device__ constexpr int gemv_norm_cluster() {
  return kX != kXA8 || K != kHidden ? 1
         : SameType<Map, QkvRows>::value ? NQ_QKV_CLUSTER
         : SameType<Map, GateUpRows>::value ? NQ_GU_CLUSTER
         : SameType<Map, PlainRows>::value ? NQ_O_CLUSTER
                                           : 1;
}

// The parts of a split unit meet here: part 0 gets the sum over every part (in part order) in o0, o1.
// Named barrier 1 + slot over the unit's kSplit warps only (the other units of the block run on); the
// sums are double-buffered by the unit's iteration parity, so a part that runs ahead into its next unit
// cannot overwrite sums part 0 has not read (it would first have to pass the next barrier, which part 0
// reaches only after reading).
template <int kSplit>
__device__ __forceinline__ void join_split(float& o0, float& o1, int slot, int part, int it, float2 (*sums)[kWarps]) {
  if constexpr (kSplit > 1) {
    const int lane = threadIdx.x & 31;
    if (lane == 0) sums[it & 1][threadIdx.x >> 5] = make_float2(o0, o1);
    asm volatile("bar.sync %0, %1;" ::"r"(1 + slot), "r"(32 * kSplit) : "memory");
    if (part == 0) {
      const float2* mine = &sums[it & 1][slot * kSplit];
      o0 = mine[0].x;
      o1 = mine[0].y;
#pragma unroll
      for (int s = 1; s < kSplit; ++s) {
        o0 += mine[s].x;
        o1 += mine[s].y;
      }
    }
  }
}

// An epilogue's reads that no kernel of the step writes during the step (Epi::Pre, Epi::pre: q/k/v's
// position, page id and bias), issued for a warp's first unit before the launch-overlap wait, with its weights,
// where the caller says they are settled (Epi::pre_settled); otherwise, and for a warp's later units, the
// epilogue reads them after the sums. At batch 1 a warp has one or two units, so the first unit's epilogue is
// most of the kernel's last step: without this it waited on three L2 round trips (pos, then the page id it
// indexes, then the bias) between its sums and its stores. An Epi without Pre is called as it is.
// Why "settled" holds in the engine's decode step: a kernel's blocks run their pre-wait code only once the
// previous kernel released them, which every B = 1 loop does after its own wait (or at its entry / exit),
// and each wait returns only after the previous kernel completed; the host's control copy and the previous
// step's `advance` (which wrote pos) precede the step's first kernel, and q/k/v of layer 0 follows the
// embedding, which releases nothing early. tests/test_compile.py lets these loads precede the wait.
// Measured (H200, docs/PERF.md twenty-fifth lease): the 7B 1.456-1.458 -> 1.447 ms/token, the 1.5B's dims
// ~0.638 -> 0.628; the same for o_proj's and down_proj's residual made the 7B slower (1.468) and bought the
// 1.5B nothing more: removed.
#ifndef NQ_EPI_SETTLED
#define NQ_EPI_SETTLED 0  // 1: the above (the int8 builds set it: gemv.py b1_build_defines); 0: after the sums
#endif
template <class...>
using void_t = void;
template <class Epi, class = void>
struct EpiPre {
  struct type {};
  __device__ static type read(const Epi&, int, int, int) { return {}; }
  __device__ static void call(const Epi& e, const type&, bool, int p, int r0, int r1, float o0, float o1) {
    e(0, p, r0, r1, o0, o1);
  }
};
template <class Epi>
struct EpiPre<Epi, void_t<typename Epi::Pre>> {
  using type = typename Epi::Pre;
  __device__ static type read(const Epi& e, int p, int r0, int r1) {
    return NQ_EPI_SETTLED && e.pre_settled() ? e.pre(0, p, r0, r1) : type{};
  }
  // first: this is the unit `read` was given
  __device__ static void call(const Epi& e, const type& pr, bool first, int p, int r0, int r1, float o0, float o1) {
    if (NQ_EPI_SETTLED && first && e.pre_settled()) {
      e.at(pr, 0, p, r0, r1, o0, o1);
    } else {
      e(0, p, r0, r1, o0, o1);
    }
  }
};

template <int K, class Map, class Epi, int kX = kXHalf>
__device__ __forceinline__ void gemv_units(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                           float eps, int units, const Map& map, const Epi& epi) {
  constexpr int kSplit = gemv_split<K, Map, kX>();
  static_assert(kSplit == 1 || kSplit == 2 || kSplit == 4 || kSplit == 8, "warps per unit: 1, 2, 4 or 8");
  constexpr int kSlots = kWarps / kSplit;  // units a block runs at once
  constexpr bool kA8 = kX != kXHalf;
  __shared__ uint4 xs[K / 8];  // [4][K/32] x 16 B: K * 2 bytes (37.9 KB at K = 18944)
  __shared__ float red[32];
  __shared__ float2 sums[kSplit > 1 ? 2 : 1][kWarps];  // split units' partial sums (join_split)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int slot = warp / kSplit, part = warp % kSplit;
  const int p_first = blockIdx.x * kSlots + slot;
  const int stride = gridDim.x * kSlots;
  constexpr int kTrig = gemv_trigger_mode<K, Map, kX>();
  // the prologue shared by a cluster (gemv_a8_cluster.cuh): the entry's arrival, first of all. down_proj's
  // (kCluster) pushes only without a norm; q/k/v's, o_proj's and gate/up's (kNormCluster) with or without one
  constexpr bool kCluster = kDownCluster > 1 && kX == kXA8 && K == kInter && K != kHidden && kSplit == 1 &&
                            SameType<Map, PlainRows>::value;
  constexpr int kNormCluster = gemv_norm_cluster<K, Map, kX>();
  __shared__ __align__(8) uint64_t cluster_bar;  // the cluster prologue's receive barrier
  if constexpr (kCluster) a8c_arm(&cluster_bar, K * 3 / 2, norm_w == nullptr);
  if constexpr (kNormCluster > 1) a8c_arm(&cluster_bar, K * 3 / 2, true);
  gemv_trigger_at<2, kTrig>();
#if NQ_GEMV_PRELOAD
  RowChunk first;
  int f0 = 0, f1 = 0;
  if (p_first < units) {
    map(p_first, f0, f1);
    load_chunk<K, kSplit>(qw, sc, f0, f1, 0, first, part);
  }
#endif
#if NQ_GEMV_PRELOAD
  const auto pre = EpiPre<Epi>::read(epi, p_first, f0, f1);  // the first unit's settled epilogue inputs
#else
  const typename EpiPre<Epi>::type pre{};
#endif
  NormEarly<K> ne;  // the norm's weights, with the first weights (gemv_a8.cuh NQ_NORM_EARLY)
  if constexpr (kX == kXA8) load_norm_early<K>(norm_w, ne);
  pdl_wait();  // launch overlap (common.cuh): x is the previous kernel's output
  gemv_trigger_at<3, kTrig>();
  if constexpr (kX == kXImage) {
    stage_image<K>(x, xs);
  } else if constexpr (kCluster) {
    stage_x_a8_cluster<K, kDownCluster>(x, norm_w, eps, a8_views<K>(xs), red, ne, &cluster_bar);
  } else if constexpr (kNormCluster > 1) {
    stage_x_a8_cluster_norm<K, kNormCluster>(x, norm_w, eps, a8_views<K>(xs), red, ne, &cluster_bar);
  } else if constexpr (kX == kXA8) {
    stage_x_a8<K>(x, norm_w, eps, a8_views<K>(xs), red, ne);
  } else {
    stage_x<K>(x, norm_w, eps, xs, red);
  }
  // no block barrier below: units (a warp, or a split unit's warps) leave the loop independently
  int p = p_first, it = 0;
#if NQ_GEMV_PRELOAD
  if constexpr (kUnitPrefetch<K, kSplit>) {
    // A unit is one chunk here (short K): the next unit's weights are issued before this unit's products,
    // so a warp with several units pays one DRAM round trip, not one per unit (see kUnitPrefetch)
    RowChunk cur = first;
    int c0 = f0, c1 = f1;
    while (p < units) {
      const int pn = p + stride;
      RowChunk nxt;
      int n0 = 0, n1 = 0;
      if (pn < units) {
        map(pn, n0, n1);
        load_chunk<K, kSplit>(qw, sc, n0, n1, 0, nxt, part);
      }
      float o0, o1;
      dot_rows2<K, kA8, kSplit>(qw, sc, c0, c1, xs, o0, o1, &cur, part);
      trigger_after_last_unit<kTrig>(pn >= units);
      join_split<kSplit>(o0, o1, slot, part, it++, sums);
      if (lane == 0 && part == 0) EpiPre<Epi>::call(epi, pre, p == p_first, p, c0, c1, o0, o1);
      cur = nxt;
      c0 = n0;
      c1 = n1;
      p = pn;
    }
    return;
  }
  if (p < units) {
    float o0, o1;
    dot_rows2<K, kA8, kSplit>(qw, sc, f0, f1, xs, o0, o1, &first, part);
    trigger_after_last_unit<kTrig>(p + stride >= units);
    join_split<kSplit>(o0, o1, slot, part, it++, sums);
    if (lane == 0 && part == 0) EpiPre<Epi>::call(epi, pre, true, p, f0, f1, o0, o1);
  }
  p += stride;
#endif
  for (; p < units; p += stride) {
    int r0, r1;
    map(p, r0, r1);
    float o0, o1;
    dot_rows2<K, kA8, kSplit>(qw, sc, r0, r1, xs, o0, o1, nullptr, part);
    trigger_after_last_unit<kTrig>(p + stride >= units);
    join_split<kSplit>(o0, o1, slot, part, it++, sums);
    if (lane == 0 && part == 0) EpiPre<Epi>::call(epi, pre, false, p, r0, r1, o0, o1);
  }
}

}  // namespace nq
