// gemv_int4.cu: the INT4 x FP16 GEMVs of decode over ValueShuffle-v1 words, for B sequences at once,
// with their fused variants. Four bodies share the row maps and epilogues (gemv_epilogues.cuh):
//   the half2 loop (this file)      B = 1; products in half2 FMAs
//   the int8-activation loop        B = 1, the engine's default (suffix _a8, _a8x); gemv_a8.cuh: x to int8, dp4a
//   the tensor-core core            any B; gemv_mma.cuh (mma.sync, one column per sequence)
//   the tile GEMM                   B <= 64; gemm_tiles.cuh (entries at the end of this file)
//
// What: out[b][n] = sum_k W[n,k] * xin[b][k], W[n,k] = scale[n, k/128] * q[n,k] (q = u - 8, u in 0..15),
//   xin[b] = x[b], or RMSNorm(x[b]) * norm_w when norm_w is given (HF Qwen2RMSNorm: fp32 mean of
//   squares, x*r rounded to fp16, times the fp16 weight, rounded to fp16). Kernel entries (extern "C"):
//   nq_gemv_int4_h / _i       K = H / K = I: out = W.xin (+ residual); residual may alias out.
//   nq_qkv_rope_kv            K = H, rows q|k|v (kQkvRows): + bias, RoPE on q and k at pos[b] (device
//                             memory), k and v written into the KV page of pos[b] from page_table row b,
//                             q (roped) to q_out row b.
//   nq_gate_up_silu           K = H, rows [0,I) gate, [I,2I) up: out[b][i] = silu(gate[i]) * up[i].
//   each as the half2 loop (B = 1, the name above), the int8-activation loop (B = 1, suffix _a8; and the
//   down_proj pair nq_gate_up_silu_a8x -> nq_gemv_int4_i_a8x, which hands the intermediate over already
//   rounded) and as the tensor-core core for up to 8 or 32 columns per pass (suffix _mma8, _mma32;
//   blockIdx.y = pass; gemv.py plans passes and slices).
// Shapes/dtypes: qweight uint32 [N, K/8], scales fp16 [N, K/128], x fp16 [B, K], out fp16 [B, N or I].
//   The KV page layout is docs/INTERFACES.md section 3: k_cache fp16 [L, n_pages, n_kv, 16, 128];
//   page_table int32 [B, max_pages], row b = sequence b's table.
//
// The half2 loop. Launch: 256 threads (8 warps), 1-D grid, grid-stride over "units". A unit is 2 weight
//   rows, owned by one warp; the lanes split K in 16-byte pieces (32 weights, 1/4 of a group). Which 2
//   rows make a unit is what lets each epilogue stay inside one warp (or one thread, on the tensor-core
//   core):
//     plain      rows (2p, 2p+1)                    more loads in flight per lane
//     qkv_rope   rows (128h + d, 128h + d + 64)     exactly the pair HF's rotate-half RoPE mixes
//     gate_up    rows (i, I + i)                    gate and up of the same output element
//   So no epilogue needs a second kernel, a grid-wide counter or a head per block (which would give the
//   7B only 36 blocks for q/k/v). The python launcher sizes the grid so each block runs the same number
//   of units (no ragged last wave).
//
//   per warp, one K pass (K = 3584: 112 pieces per row, NJ = 4 per lane):
//     lane l loads pieces u = l, l+32, l+64, ... of both rows; 4 pieces x 2 rows = 8 x 16 B in flight
//     per lane before the first use. Little's law: an SM's share of the bandwidth (4.19 TB/s / 132 =
//     32 B/ns) times the HBM latency (~0.7 us) asks for ~22 KB in flight per SM; 8 warps x 32 lanes x
//     128 B = 32 KB per block, with 3-4 blocks resident at ~55-64 registers.
//
// Why it is issue-bound (docs/PERF.md has the figures): each 8 weights cost ~18 instructions (2 LOP3,
//   4 PRMT, 4 HSUB2, 4 HMUL2/HFMA2, 2 cvt, adds); the fp16 lm_head with the same load structure streams
//   at 99% of copy bandwidth with 4x fewer weights per byte. The tensor-core core drops the products,
//   the fp16 partial sums and their conversions (~10.5 instructions per word), but as built for batches
//   it keeps fewer bytes in flight at B = 1, and this loop is the faster body for every matrix at B = 1
//   (the default GEMV variant, gemv.py; figures in docs/PERF.md). A software-pipelined version of this
//   loop (next stage issued before the current one is used; 90-120 registers, 2 blocks/SM) measured
//   slower and is not kept: with fewer warps the dependent half2 chains are hidden worse.
//
// Activation in shared memory, transposed so that the 16-byte reads of a warp hit 32 distinct banks:
//
//     xs (uint4 = 8 halves) [4][K/32]:  xs[c][u] = xin[32u + 8c .. 32u + 8c + 7]
//     piece u of a row = 4 words w0..w3;  word c pairs with xs[c][u]   (lanes read consecutive u)
//
// Arithmetic: each word is unpacked with 4 prmt.b32 into 4 exact half2 q's (common.cuh unpack8); the 8
//   products q*x of a word are summed in one half2 chain (hmul2 + 3 hfma2, 4 products per half), then
//   converted to fp32; the group scale and every sum beyond those 4 products are fp32. Why not all fp32:
//   converting each weight to fp32 costs ~2 extra instructions per weight and the GEMV would turn
//   compute-bound near 4 TB/s; the half chain is 1 instruction per 2 weights. Limit this buys: a chain
//   sums 4 products |q*x| <= 8|x|, so |x| must stay below ~2000 for it not to overflow fp16; the
//   normed activations and silu*up of Qwen2.5 stay far below (checked in the layer tests).
//
// Tested: tests/test_gemv_gpu.py against numpy (quantize + ValueShuffle pack in the test) for B = 1 .. 64,
//   poisoned outputs, mixed positions and page tables per row, 7B and 1.5B shapes; tests/test_compile.py
//   compiles it for the 7B, 1.5B and tiny dims and checks the SASS (PRMT, HMMA, no spills).
#include "gemv_mma.cuh"
#include "gemm_tiles.cuh"

namespace nq {

#ifndef NQ_GEMV_STAGE_PIECES
#define NQ_GEMV_STAGE_PIECES 4  // tuning knob (bench_gemv.py --sweep); 4 covers a K = 3584 row in one go
#endif
constexpr int kInFlight = NQ_GEMV_STAGE_PIECES;  // 16-byte pieces per row per lane issued before first use

// ---- the half2 loop (B = 1) ---------------------------------------------------------------------------
// Stage the activation (optionally RMS-normed) into the transposed shared layout. Every thread of the
// block must call this (it holds barriers); norm_w is block-uniform.
template <int K>
__device__ __forceinline__ void stage_x(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                        float eps, uint4* xs, float* red) {
  constexpr int kChunks = K / 8;  // 8 halves (16 B) each
  constexpr int kNU = K / 32;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float r = 1.f;
  if (norm_w != nullptr) {
    float ss = 0.f;
    for (int i = threadIdx.x; i < kChunks; i += kThreads) ss += sum_squares8(x4[i]);
    ss = block_sum<kThreads>(ss, red);  // barrier inside; the branch is block-uniform
    r = rsqrtf(ss / K + eps);
  }
  for (int i = threadIdx.x; i < kChunks; i += kThreads) {
    uint4 v = x4[i];
    if (norm_w != nullptr) v = rms_apply8(v, reinterpret_cast<const uint4*>(norm_w)[i], r);
    xs[(i & 3) * kNU + (i >> 2)] = v;  // chunk i = piece u = i/4, word c = i%4
  }
  __syncthreads();  // xs complete before any warp reads it
}

// 8 products of one word with its 8 activations: half2 chain, then fp32.
__device__ __forceinline__ float dot8(uint32_t w, uint4 x) {
  uint32_t q[4];
  unpack8(w, q);
  uint32_t h = hmul2(q[0], x.x);
  h = hfma2(q[1], x.y, h);
  h = hfma2(q[2], x.z, h);
  h = hfma2(q[3], x.w, h);
  const float2 f = h22f2(h);
  return f.x + f.y;
}

// One chunk of a unit's loads: kInFlight 16-byte pieces of each of the 2 rows per lane, and their scales.
struct RowChunk {
  uint4 v0[kInFlight], v1[kInFlight];
  uint16_t g0[kInFlight], g1[kInFlight];
};

// f(jj, u) for each piece jj of chunk j0 this lane holds that exists: u = the piece's index in its row
// (K / 32 pieces of 16 bytes). Without a split (kSplit = 1) lane l holds pieces l, l + 32, ...; split over
// kSplit warps, the warps of a unit act as 32 kSplit lanes of one wide warp: the lane l of part s holds
// pieces 32 s + l, 32 s + l + 32 kSplit, ... (each chunk step still a contiguous 512 bytes per warp). The
// loads and both loops' multiplies walk a chunk this way.
template <int K, int kSplit = 1>
__host__ __device__ constexpr int pieces_per_lane() {
  return (K / 32 + 32 * kSplit - 1) / (32 * kSplit);
}
template <int K, int kSplit = 1, class F>
__device__ __forceinline__ void for_chunk_pieces(int j0, int part, F&& f) {
  constexpr int kNU = K / 32;                         // 16-byte pieces per row
  constexpr int kNJ = pieces_per_lane<K, kSplit>();   // pieces per lane
  const int vl = 32 * part + (threadIdx.x & 31);
#pragma unroll
  for (int jj = 0; jj < kInFlight; ++jj) {
    const int u = (j0 + jj) * 32 * kSplit + vl;
    if (j0 + jj < kNJ && u < kNU) f(jj, u);
  }
}

// Issue the loads of chunk j0 (pieces j0 .. j0+kInFlight-1 of each lane) of rows r0 and r1.
template <int K, int kSplit = 1>
__device__ __forceinline__ void load_chunk(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           int r0, int r1, int j0, RowChunk& c, int part = 0) {
  constexpr int kGroups = K / kGroup;         // scales per row
  const uint4* w0 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r0) * (K / 8));
  const uint4* w1 = reinterpret_cast<const uint4*>(qw + static_cast<size_t>(r1) * (K / 8));
  const uint16_t* s0 = sc + static_cast<size_t>(r0) * kGroups;
  const uint16_t* s1 = sc + static_cast<size_t>(r1) * kGroups;
  for_chunk_pieces<K, kSplit>(j0, part, [&](int jj, int u) {  // issue every load of the chunk first
    c.v0[jj] = ld_stream_v4(w0 + u);
    c.v1[jj] = ld_stream_v4(w1 + u);
    c.g0[jj] = s0[u >> 2];  // 4 pieces per group: lanes 4m..4m+3 share a scale
    c.g1[jj] = s1[u >> 2];
  });
}

// Multiply chunk j0 with xs into the lane's partial sums.
template <int K>
__device__ __forceinline__ void use_chunk(const RowChunk& c, int j0, const uint4* xs, float& a0, float& a1) {
  constexpr int kNU = K / 32;
  for_chunk_pieces<K>(j0, 0, [&](int jj, int u) {
    const uint4 x0 = xs[u], x1 = xs[kNU + u], x2 = xs[2 * kNU + u], x3 = xs[3 * kNU + u];
    a0 += h2f(c.g0[jj]) * (dot8(c.v0[jj].x, x0) + dot8(c.v0[jj].y, x1) + dot8(c.v0[jj].z, x2) + dot8(c.v0[jj].w, x3));
    a1 += h2f(c.g1[jj]) * (dot8(c.v1[jj].x, x0) + dot8(c.v1[jj].y, x1) + dot8(c.v1[jj].z, x2) + dot8(c.v1[jj].w, x3));
  });
}

}  // namespace nq

#include "gemv_a8.cuh"  // the int8-activation loop: x rounded to int8 in the prologue, dp4a products

namespace nq {

// One warp: dot products of rows r0 and r1 with xs; the full sums end in every lane. `first`, when
// given, is chunk 0 already loaded (gemv_units issues it before the launch-overlap wait). Split over
// kSplit warps (the int8 loop only), this warp's share, part `part` of the row (for_chunk_pieces).
template <int K, bool kA8 = false, int kSplit = 1>
__device__ __forceinline__ void dot_rows2(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                          int r0, int r1, uint4* xs, float& o0, float& o1,
                                          const RowChunk* first = nullptr, int part = 0) {
  static_assert(kSplit == 1 || kA8, "the half2 loop is not split");
  constexpr int kNJ = pieces_per_lane<K, kSplit>();
  float a0 = 0.f, a1 = 0.f;
#pragma unroll
  for (int j0 = 0; j0 < kNJ; j0 += kInFlight) {
    RowChunk c;
    if (j0 == 0 && first != nullptr) {
      c = *first;
    } else {
      load_chunk<K, kSplit>(qw, sc, r0, r1, j0, c, part);
    }
    if constexpr (kA8) {
      use_chunk_a8<K, kSplit>(c, j0, a8_views<K>(xs), a0, a1, part);
    } else {
      use_chunk<K>(c, j0, xs, a0, a1);
    }
  }
  o0 = warp_sum(a0);
  o1 = warp_sum(a1);
}

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
// layout itself)
template <int K>
__device__ __forceinline__ void stage_image(const uint16_t* __restrict__ img, uint4* xs) {
  constexpr int kN = K / 16 + K / 32;  // uint4s: xq, then xm
  const uint4* src = reinterpret_cast<const uint4*>(img);
  for (int i = threadIdx.x; i < kN; i += kThreads) xs[i] = src[i];
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
  gemv_trigger_at<2, kTrig>();
#if NQ_GEMV_PRELOAD
  RowChunk first;
  int f0 = 0, f1 = 0;
  if (p_first < units) {
    map(p_first, f0, f1);
    load_chunk<K, kSplit>(qw, sc, f0, f1, 0, first, part);
  }
#endif
  pdl_wait();  // launch overlap (common.cuh): x is the previous kernel's output
  gemv_trigger_at<3, kTrig>();
  if constexpr (kX == kXImage) {
    stage_image<K>(x, xs);
  } else if constexpr (kX == kXA8) {
    stage_x_a8<K>(x, norm_w, eps, a8_views<K>(xs), red);
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
      if (lane == 0 && part == 0) epi(0, p, c0, c1, o0, o1);
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
    if (lane == 0 && part == 0) epi(0, p, f0, f1, o0, o1);
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
    if (lane == 0 && part == 0) epi(0, p, r0, r1, o0, o1);
  }
}

}  // namespace nq

#include "gemv_epilogues.cuh"  // the row maps and fused epilogues every body shares
#include "gemv_a8_image.cuh"   // gate/up handing down_proj its input already rounded (int8 loop)

using namespace nq;

// ---- entries ---------------------------------------------------------------------------------------------
// The B = 1 loops (x [K], out [N]; pos_dev [1], page_table [1, max_pages]): the half2 loop (no suffix) and
// the int8-activation loop (suffix _a8), the same arguments. Per entry:
//   nq_gemv_int4_h / _i: qweight [N, K/8], scales [N, K/128] fp16, x [K] fp16, norm_w [K] fp16 or null (no
//     norm), eps, residual [N] fp16 or null (may alias out), out [N] fp16, n_rows = N.
//   nq_qkv_rope_kv: fused input RMSNorm + q/k/v projection + bias + RoPE + KV page write (units kQkvRows / 2):
//     qweight [kQkvRows, H/8] rows q | k | v, scales, bias [kQkvRows], x [H] (the residual stream), norm_w
//     (not null), eps, pos [1] (device: graph-replayable), page_table [1, max_pages], max_pages, k_cache,
//     v_cache [L, n_pages, kKvHeads, 16, 128] fp16, layer, n_pages, q_out [kQDim] fp16 (roped).
//   nq_gate_up_silu: fused post-attention RMSNorm + gate/up + SiLU(gate) * up (units kInter): qweight
//     [2I, H/8] rows gate | up, scales, x [H], norm_w or null, eps, out [I] fp16.
#define NQ_B1_ENTRIES(SUFFIX, KX, LB_I)                                                                                              \
  extern "C" __global__ void NQ_LB0 nq_gemv_int4_h##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, const uint16_t* residual, uint16_t* out, int n_rows) { \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, PlainRows, PlainEpi, KX>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2,         \
                                                 PlainRows{n_rows}, PlainEpi{residual, out, n_rows});       \
  }                                                                                                         \
  extern "C" __global__ void LB_I nq_gemv_int4_i##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, const uint16_t* residual, uint16_t* out, int n_rows) { \
    NQ_STAMP();                                                                                             \
    gemv_units<kInter, PlainRows, PlainEpi, KX>(qweight, scales, x, norm_w, eps, (n_rows + 1) / 2,          \
                                                PlainRows{n_rows}, PlainEpi{residual, out, n_rows});        \
  }                                                                                                         \
  extern "C" __global__ void NQ_LB0 nq_qkv_rope_kv##SUFFIX(                                              \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ bias, const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, \
      float eps, const int32_t* __restrict__ pos, const int32_t* __restrict__ page_table, int max_pages,     \
      uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache, int layer, int n_pages,                \
      uint16_t* __restrict__ q_out) {                                                                       \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, QkvRows, QkvEpi, KX>(                                                               \
        qweight, scales, x, norm_w, eps, kQkvRows / 2, QkvRows{},                                           \
        QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer, n_pages, q_out});                 \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(kThreads) nq_gate_up_silu##SUFFIX(                           \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x, \
      const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ out) {                         \
    NQ_STAMP();                                                                                             \
    gemv_units<kHidden, GateUpRows, GateUpEpi, KX>(qweight, scales, x, norm_w, eps, kInter, GateUpRows{},   \
                                                   GateUpEpi{out});                                         \
  }

// down_proj's blocks an SM must hold at once (NQ_MINB_DOWN, __launch_bounds__'s second argument, so a
// register cap; 0: none given): split in 4 (gemv.py b1_build_defines) it has 4x the blocks, and at ~76-80
// registers only 3 blocks of 256 threads fit an SM, so even_grid would fold the grid back into two rounds a
// block; at 4 (64 registers) 528 blocks fit the H200. (0 is not 1: with a minimum of 1 given, ptxas takes
// up to 255 registers, ~200 here, and 1 block an SM.)
#ifndef NQ_MINB_DOWN
#define NQ_MINB_DOWN 0
#endif
#define NQ_LB0 __launch_bounds__(kThreads)
#if NQ_MINB_DOWN
#define NQ_LB_DOWN __launch_bounds__(kThreads, NQ_MINB_DOWN)
#else
#define NQ_LB_DOWN NQ_LB0
#endif
NQ_B1_ENTRIES(, kXHalf, NQ_LB0)
NQ_B1_ENTRIES(_a8, kXA8, NQ_LB_DOWN)

// The int8-activation loop's down_proj pair (the engine's batch-1 decode under decode_activations="int8"):
//   nq_gate_up_silu_a8x: as nq_gate_up_silu_a8, but its output is the intermediate already rounded for
//     down_proj, an a8 image (gate_up_a8_image, gemv_a8_image.cuh) of kInter * 3 / 2 bytes, in `out` ([I] fp16 storage);
//   nq_gemv_int4_i_a8x: down_proj (K = I) reading such an image as its x (no norm): its prologue is a copy.
extern "C" __global__ void __launch_bounds__(kThreads) nq_gate_up_silu_a8x(
    const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x,
    const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ out) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  gate_up_a8_image<kHidden>(qweight, scales, x, norm_w, eps, out);
}

extern "C" __global__ void NQ_LB_DOWN nq_gemv_int4_i_a8x(
    const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales, const uint16_t* __restrict__ x,
    const uint16_t* residual, uint16_t* out, int n_rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  gemv_units<kInter, PlainRows, PlainEpi, kXImage>(qweight, scales, x, nullptr, 0.f, (n_rows + 1) / 2,
                                                   PlainRows{n_rows}, PlainEpi{residual, out, n_rows});
}

// The tensor-core core, B columns (x [B, K], outputs [B, ...]; pos [B], page_table [B, max_pages]);
// n_cols = B, pass_cols = columns per pass, slice_groups = 128-k groups of x staged at a time (gemv.py's
// plan); grid.y = passes; dynamic shared memory = pass_cols x (slice_groups * 128 + 16) x 2 bytes.
#define NQ_INT4_MMA_ENTRIES(COLS, MIN_BLOCKS)                                                                \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gemv_int4_h_mma##COLS(                         \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      const uint16_t* residual, uint16_t* out, int n_rows, int n_cols, int pass_cols, int slice_groups) {  \
    NQ_STAMP();                                                                                             \
    gemv_mma<kHidden, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, (n_rows + 1) / 2, n_cols,     \
                                pass_cols, slice_groups, PlainRows{n_rows},                                \
                                PlainEpi{residual, out, n_rows});                                          \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gemv_int4_i_mma##COLS(                           \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      const uint16_t* residual, uint16_t* out, int n_rows, int n_cols, int pass_cols, int slice_groups) {  \
    NQ_STAMP();                                                                                             \
    gemv_mma<kInter, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, (n_rows + 1) / 2, n_cols,      \
                               pass_cols, slice_groups, PlainRows{n_rows}, PlainEpi{residual, out, n_rows}); \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_qkv_rope_kv_mma##COLS(                           \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ bias, const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, \
      float eps, const int32_t* __restrict__ pos, const int32_t* __restrict__ page_table, int max_pages,     \
      uint16_t* __restrict__ k_cache, uint16_t* __restrict__ v_cache, int layer, int n_pages,                \
      uint16_t* __restrict__ q_out, int n_cols, int pass_cols, int slice_groups) {                         \
    NQ_STAMP();                                                                                            \
    gemv_mma<kHidden, COLS / 8>(                                                                           \
        Int4Weights{qweight, scales}, x, norm_w, eps, kQkvRows / 2, n_cols, pass_cols, slice_groups,        \
        QkvRows{}, QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer, n_pages, q_out});      \
  }                                                                                                        \
  extern "C" __global__ void __launch_bounds__(kThreads, MIN_BLOCKS) nq_gate_up_silu_mma##COLS(                          \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps,                       \
      uint16_t* __restrict__ out, int n_cols, int pass_cols, int slice_groups) {                           \
    NQ_STAMP();                                                                                             \
    gemv_mma<kHidden, COLS / 8>(Int4Weights{qweight, scales}, x, norm_w, eps, kInter, n_cols, pass_cols,    \
                                slice_groups, GateUpRows{}, GateUpEpi{out});                               \
  }

NQ_INT4_MMA_ENTRIES(8, 2)
NQ_INT4_MMA_ENTRIES(32, 2)

// The tile GEMM's input RMSNorm, one block per column (grid = B): xn [B, K] = RMSNorm(x) * norm_w, run
// before the tile entries when the GEMV has a norm (they read x already normalised).
extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_h(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kHidden>(x, norm_w, eps, xn);
}

#if NQ_TILE_X_PREPERM
// ... written in the tile GEMM's stage layout for x (the q/k/v and gate/up tile entries of this build read it)
extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_wg_h(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn,
    int tile_cols) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kHidden, true>(x, norm_w, eps, xn, tile_cols);
}
#endif

extern "C" __global__ void __launch_bounds__(kThreads) nq_norm_cols_i(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w, float eps, uint16_t* __restrict__ xn) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  norm_cols<kInter>(x, norm_w, eps, xn);
}

// The batched tile GEMM (gemm_tiles.cuh; the "tiles" variant of gemv.py, B > 1), up to 8, 16, 32 or 64
// columns (suffix _tile8 .. _tile64). Arguments: the weights, x [B, K] (already normalised: nq_norm_cols_*),
// the epilogue's arguments, n_cols = B, the fp32 workspace ws [2 P, COLS, 128, 2] and the tickets [tiles]
// (int32, zero). Grid: P blocks (gemv.py plan_tiles), kTileBlockThreads threads, dynamic shared memory =
// kTileStages x tile_stage_bytes<COLS>().
// o_proj (K = H) and down_proj (K = I): the same entry but for K
#define NQ_PLAIN_TILE_ENTRY(NAME, K, COLS)                                                                  \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_##NAME##_tile##COLS(                     \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* residual, uint16_t* out, int n_rows, int n_cols,      \
      float* __restrict__ ws, int* __restrict__ tickets) {                                                  \
    NQ_STAMP();                                                                                            \
    gemm_tiles<K, COLS / 8>(qweight, scales, x, (n_rows + 1) / 2, n_cols, ws, tickets, PlainRows{n_rows},  \
                            PlainEpi{residual, out, n_rows});                                               \
  }
#define NQ_INT4_TILE_ENTRIES(COLS)                                                                          \
  NQ_PLAIN_TILE_ENTRY(gemv_int4_h, kHidden, COLS)                                                           \
  NQ_PLAIN_TILE_ENTRY(gemv_int4_i, kInter, COLS)                                                            \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_qkv_rope_kv_tile##COLS(                  \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, const uint16_t* __restrict__ bias, const int32_t* __restrict__ pos,   \
      const int32_t* __restrict__ page_table, int max_pages, uint16_t* __restrict__ k_cache,                \
      uint16_t* __restrict__ v_cache, int layer, int n_pages, uint16_t* __restrict__ q_out, int n_cols,     \
      float* __restrict__ ws, int* __restrict__ tickets) {                                                  \
    NQ_STAMP();                                                                                             \
    gemm_tiles<kHidden, COLS / 8, NQ_TILE_X_PREPERM>(qweight, scales, x, kQkvRows / 2, n_cols, ws, tickets, \
                                                     QkvRows{},                                               \
                                  QkvEpi{bias, pos, page_table, max_pages, k_cache, v_cache, layer,         \
                                         n_pages, q_out});                                                  \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(kTileBlockThreads, 1) nq_gate_up_silu_tile##COLS(                 \
      const uint32_t* __restrict__ qweight, const uint16_t* __restrict__ scales,                            \
      const uint16_t* __restrict__ x, uint16_t* __restrict__ out, int n_cols, float* __restrict__ ws,       \
      int* __restrict__ tickets) {                                                                          \
    NQ_STAMP();                                                                                             \
    gemm_tiles<kHidden, COLS / 8, NQ_TILE_X_PREPERM>(qweight, scales, x, kInter, n_cols, ws, tickets,       \
                                                     GateUpRows{},                                            \
                                  GateUpEpi{out});                                                          \
  }

NQ_INT4_TILE_ENTRIES(8)
NQ_INT4_TILE_ENTRIES(16)
NQ_INT4_TILE_ENTRIES(32)
NQ_INT4_TILE_ENTRIES(64)
