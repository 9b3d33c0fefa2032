// gemm_tiles.cuh: the batched INT4 GEMM of decode (B = 2 .. 64 sequences): out[b] = W . x[b], each weight
// byte read from HBM once per step, each activation slice read from L2 once per 256-row tile.
//
// Why this shape (docs/PERF.md "batched GEMVs" has the measurements that led here): gemv_mma.cuh gives a
// block 16 rows at a time and stages x of all B sequences per tile, so at B = 32 it moves ~8x more bytes
// of x (L2 -> shared memory) than of weights (HBM) and ran at 5-10% of the copy rate. Here a block owns
// 256 rows (a "tile": 128 units of 2 rows) and walks K; every 256-k step it stages 256 x 128 B of weights
// and B x 512 B of x, so x costs B / 64 of the weight bytes (half of them at B = 32) and both stream.
//
// The default build (NQ_TILE_WS, gemm_tiles_ws below): 16 warps multiply on warpgroup MMAs (wgmma.cuh,
// multiply_pair_wg) and 4 producer warps issue every copy, the stages handed over by mbarriers; the rest of
// this comment describes what both builds share (tiles, stages, stripes, fragments) and the barrier ring of
// the mma.sync build (NQ_TILE_WS=0), which the warp-specialized one replaced (docs/PERF.md "sixth lease").
// Pipeline (one block per SM): a ring of kStages shared-memory stages filled by cp.async, each
// stage = one "pair" of 128-k groups of the tile:
//     W   [256 row slots][128 B]   INT4 words of groups 2pg, 2pg+1; row slot rs = rr * 128 + u holds row
//                                 r0 (rr = 0) or r1 (rr = 1) of unit u (the Map names them)
//     S   [256 row slots][2] fp16  their scales (one 4-byte copy per row: groups 2pg, 2pg+1 are adjacent)
//     X   [B][256 + 16] fp16       x[b][256 pg ..], 16-byte chunks swizzled as gemv_mma.cuh's xs_slot
//   stage i + kStages - 1 is issued while stage i is multiplied; the barrier at the top of each step is
//   both "stage i landed" (after cp.async.wait_group) and "stage i - 1 is no longer read" (its slot is
//   the one refilled). Two rings (kTileContinuous picks per build, by measurement): the continuous one
//   runs across the block's segments and issues stage 0's weights before pdl_wait; the drained one
//   refills from empty at each segment.
//   Bank layout of W: lane (g, c) reads 16 B of unit u = ... + g at chunk 4 gl + c; units g and g + 1 of a
//   quarter-warp are 128 B apart (the same banks), so an odd row slot stores its two 64-byte halves
//   swapped (chunk j at j ^ 4): the quarter-warp then covers all 32 banks once.
//
// Fragments: warp w owns units 16 w .. 16 w + 15 of the tile as two m16 tiles (m = 0, 1: units
//   16 w + 8 m + g); per group, per 8-k word: A = 4 half2 of rows r0 / r1 (unpack8, exact), B = x of
//   columns 8 nt + g (the lane's 16 B); the k order inside an mma is a permutation A and B share, as in
//   gemv_mma.cuh. A holds q * scale (fp16, one rounding); the mmas accumulate in fp32 (multiply_pair).
//
// Stripes (Marlin's load balance): the work items are (tile, pair), tile-major, W_items = tiles x pairs.
//   Block b of P (gridDim.x) takes items [b W / P, (b + 1) W / P): the tail of one tile, whole tiles, the
//   head of another. A whole tile's sums go straight through the epilogue functor; a partial segment's
//   fp32 sums go to ws slot 2 b (the block's first segment) or 2 b + 1 (its last), and the block that
//   finishes a tile's last segment (an atomic ticket per tile) adds the slots in block order and runs the
//   epilogue, then resets the ticket for the next launch. P depends on the matrix only (gemv.py
//   plan_tiles), not on B, so a column's sums are added in the same order at every batch size.
//
// Tested: tests/test_gemv_gpu.py (every entry against numpy, B = 2 .. 64, 7B / 1.5B / tiny shapes);
//   tests/test_gemm_tiles_plan.py emulates the stripes and the reduction's bookkeeping on the CPU.
#pragma once
#include "mma.cuh"
#include "wgmma.cuh"

namespace nq {

#ifndef NQ_TILE_WARPS
#define NQ_TILE_WARPS 16  // 16 warps x 1 m16 tile, or 8 x 2 (measured: docs/PERF.md)
#endif
constexpr int kTileWarps = NQ_TILE_WARPS;          // warps per block
constexpr int kTileThreads = 32 * kTileWarps;
constexpr int kTileMT = 128 / (8 * kTileWarps);     // m16 tiles per warp
constexpr int kTileUnits = kTileWarps * 8 * kTileMT;  // 128 units = 256 rows per tile
static_assert(kTileUnits == 128, "the tile is 128 units (gemv.py TILE_UNITS)");
constexpr int kCopyRows = kTileThreads / 8;         // row slots one pass of the block's 16-byte copies covers
constexpr int kTileSlots = 2 * kTileUnits;         // row slots per stage
constexpr int kXRowChunks = (2 * kGroup + kXPad) / 8;  // 16-byte chunks per staged x row (34)

// NQ_TILE_WGMMA (A/B knob; gemv.py tile_wgmma mirrors it): the multiply on warpgroup MMAs (wgmma.cuh)
// instead of mma.sync. A warpgroup's 4 warps hold their 64 rows' dequantized weights as wgmma's register A
// (the same fragments mma.sync took), and the tensor cores read x from shared memory themselves: no x
// fragment loads, and one instruction per k16 step for all the columns instead of 4 x NT per warpgroup
// (the SASS count of the mma.sync step at 64 columns, 1194 instructions per warp per 256-k step, was
// 64 x-fragment loads and 128 mmas for 16 rows' 4096 weights). x is staged in wgmma's layout (issue_x_wg).
#ifndef NQ_TILE_WGMMA
#define NQ_TILE_WGMMA 0
#endif
// NQ_TILE_WS (A/B knob; gemv.py tile_ws mirrors it; implies the wgmma multiply): the warp-specialized ring.
// NQ_TILE_PRODUCERS extra warps (warps 16 ..) issue every copy (weights, scales, x) and the 16 warps of the
// wgmma build only multiply. Stages are handed over by mbarriers instead of a block-wide barrier per step:
// full[s] completes when the producers' copies of stage s have landed (cp.async.mbarrier.arrive), empty[s]
// when the 16 consumer warps have read it (their wgmmas waited for). The producers run up to the ring's depth
// ahead, through the consumers' epilogues and partial-sum reductions; the consumers never wait for each
// other between steps. Why: the barrier ring measured ~2.3 us per 256-k step at 8 columns where its
// 32 KB of weights need ~1.1 us at an SM's share of the copy rate, and neither the multiply's flavour
// (mma.sync or wgmma) nor a deeper ring moved it: every warp issued its share of the copies, then waited
// at the barrier for the slowest, then multiplied (docs/PERF.md).
#ifndef NQ_TILE_WS
#define NQ_TILE_WS 1
#endif
// NQ_TILE_WG_GROUP_WAIT: the wgmma multiply waits for each group's 8 wgmmas before dequantizing the next
// group, so one group's A fragments (32 registers) are live, not two. Default: on in the warp-specialized
// build, whose 16 + NQ_TILE_PRODUCERS warps leave ptxas ~96 registers a thread; with both groups' fragments
// live it serialized every wgmma (ptxas C7511/C7512: a wait after each one) from 16 columns up.
#ifndef NQ_TILE_WG_GROUP_WAIT
#define NQ_TILE_WG_GROUP_WAIT NQ_TILE_WS
#endif
#ifndef NQ_TILE_PRODUCERS
#define NQ_TILE_PRODUCERS 4
#endif
#ifndef NQ_TILE_WS_STAGES
#define NQ_TILE_WS_STAGES 8  // at most; fewer where they do not fit kTileSmemCap (gemv.py tile_stages)
#endif
constexpr bool kTileWs = NQ_TILE_WS != 0;
constexpr bool kTileWg = NQ_TILE_WGMMA != 0 || kTileWs;
constexpr int kTileProducers = kTileWs ? NQ_TILE_PRODUCERS : 0;
constexpr int kTileBlockThreads = kTileThreads + 32 * kTileProducers;  // the launch's block size
static_assert(!kTileWg || kTileMT == 1, "the wgmma build takes one m16 tile per warp (NQ_TILE_WARPS = 16)");
// the wgmma build aligns the ring to 1024 bytes (the swizzle atoms of x) inside its dynamic shared memory:
// the launcher allocates this much more
constexpr int kTileSmemAlignPad = kTileWg ? 1024 : 0;

// bytes of one stage for kCols columns (the launcher sizes dynamic shared memory with the same formula):
// weights, scales, then x (padded rows for mma.sync; 1024-byte atoms for wgmma, so every stage is
// 1024-aligned: 256 x 132 bytes is 33 x 1024)
template <int kCols>
__host__ __device__ constexpr int tile_stage_bytes() {
  return kTileSlots * 128 + kTileSlots * 4 + (kTileWg ? kCols * 2 * 2 * kGroup : kCols * kXRowChunks * 16);
}
// Ring depth: NQ_TILE_STAGES (default 3: 2 stages, 64 KB of weights, in flight), fewer where the stages of
// a wide build would not fit kTileSmemCap (gemv.py tile_stages mirrors this)
#ifndef NQ_TILE_STAGES
#define NQ_TILE_STAGES 3
#endif
constexpr int kTileSmemCap = 220 * 1024;
// NQ_TILE_X_ALL_COLS (A/B knob, default 0; not yet run on a GPU): the x rows of the columns past the batch
// (ncols .. kCols - 1) are zeroed once per launch in every stage (zero_idle_cols) and multiply_pair loads
// x unconditionally, instead of selecting zeros per load. An mma's output column depends on its own B
// column only, so the used columns get the same bits either way. What changes is the step loop's length
// (SASS of the 7B gate/up build, instructions per warp per 256-k step): 32 columns 805 -> 743, 64 columns
// 1194 -> 881; at 8 and 16 columns it grew, so the knob applies from 32 columns (kTileXAllCols).
#ifndef NQ_TILE_X_ALL_COLS
#define NQ_TILE_X_ALL_COLS 0
#endif
// NQ_TILE_STATIC_ISSUE (A/B knob, default 0; not yet run on a GPU): the copy issue's bounds known at compile
// time: the x copies in a loop of kCols * 32 / 512 rounds (not a loop over the runtime ncols), and no group
// or chunk bounds check where K is a multiple of 256 (every real shape). The same copies either way.
#ifndef NQ_TILE_STATIC_ISSUE
#define NQ_TILE_STATIC_ISSUE 0
#endif
// Stage 0's weights issued before pdl_wait (1, default) or after it (0), in the continuous builds (below)
#ifndef NQ_TILE_EARLY_W
#define NQ_TILE_EARLY_W 1
#endif
template <int kCols>
__host__ __device__ constexpr int tile_stages() {
  return (kTileWs ? NQ_TILE_WS_STAGES : NQ_TILE_STAGES) < kTileSmemCap / tile_stage_bytes<kCols>()
             ? (kTileWs ? NQ_TILE_WS_STAGES : NQ_TILE_STAGES)
             : kTileSmemCap / tile_stage_bytes<kCols>();
}
constexpr int kTileMaxStages = 8;  // the mbarrier arrays of the warp-specialized ring
static_assert(!kTileWs || NQ_TILE_WS_STAGES <= kTileMaxStages, "NQ_TILE_WS_STAGES: at most 8");

// A barrier among the 16 multiplying warps only (named barrier 1) where producer warps run beside them
// (NQ_TILE_WS); the whole block otherwise
__device__ __forceinline__ void tile_consumer_sync() {
  if constexpr (kTileWs)
    asm volatile("bar.sync 1, %0;" ::"n"(kTileThreads) : "memory");
  else
    __syncthreads();
}

// the block that owns work item j when W items are cut into P stripes (the largest b with b W / P <= j)
__device__ __forceinline__ int stripe_of(long long j, long long w_items, int p) {
  return static_cast<int>(((j + 1) * p - 1) / w_items);
}
__device__ __forceinline__ long long stripe_lo(int b, long long w_items, int p) { return b * w_items / p; }

// The ring's start in dynamic shared memory: as it comes, or (the wgmma build) rounded up to 1024 bytes,
// inside the kTileSmemAlignPad the launcher added
__device__ __forceinline__ uint4* tile_ring_base(uint4* raw) {
  if constexpr (!kTileWg) return raw;
  return raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u) / 16;
}

// Issue the weight copies of pair pg of the tile into stage buffers w (INT4 words) and s (scales).
// rows[j]: the row of slot (tid >> 3) + kCopyRows j; srow: the row of slot tid (its scales; threads past
// the 256 slots copy none). Weights are never written during a step, so these may be issued before
// pdl_wait (see gemm_tiles).
template <int K>
__device__ __forceinline__ void issue_w(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc, int pg,
                                        const int (&rows)[kTileSlots / kCopyRows], int srow, uint4* w, uint32_t* s) {
  constexpr int kG = K / kGroup;
  const int tid = threadIdx.x;
  const int chunk = tid & 7, gl = chunk >> 2, c = chunk & 3;
  const int g = 2 * pg + gl;
  if ((NQ_TILE_STATIC_ISSUE && kG % 2 == 0) || g < kG) {  // even kG: every pair holds two groups
#pragma unroll
    for (int j = 0; j < kTileSlots / kCopyRows; ++j) {
      const int rs = (tid >> 3) + kCopyRows * j;
      cp_async16_l2_256(w + rs * 8 + (chunk ^ ((rs & 1) << 2)),
                        qw + static_cast<size_t>(rows[j]) * (K / 8) + g * 16 + c * 4);
    }
  }
  if (tid >= kTileSlots) {
  } else if constexpr (kG % 2 == 0) {  // groups 2pg, 2pg+1 of a row: 4 aligned bytes
    cp_async4(s + tid, sc + static_cast<size_t>(srow) * kG + 2 * pg);
  } else {  // odd group count (small test shapes only): plain loads, the last pair has one group
    const uint16_t* p = sc + static_cast<size_t>(srow) * kG + 2 * pg;
    const uint32_t lo = p[0], hi = (2 * pg + 1 < kG) ? p[1] : 0u;
    s[tid] = lo | (hi << 16);
  }
}

// Issue the activation copies of pair pg (x of every column, k = 256 pg ..) into stage buffer xs. x is
// the previous kernel's output: only after pdl_wait.
template <int K, int kCols>
__device__ __forceinline__ void issue_x(const uint16_t* __restrict__ x, int ncols, int pg, uint4* xs) {
#if NQ_TILE_STATIC_ISSUE
  // a trip count known at compile time (ncols <= kCols), and no bounds check where K is whole pairs
  constexpr int kRounds = (kCols * 32 + kTileThreads - 1) / kTileThreads;
#pragma unroll
  for (int r = 0; r < kRounds; ++r) {
    const int i = threadIdx.x + r * kTileThreads;
    if (i >= ncols * 32) break;
    const int b = i >> 5, j = i & 31;
    const int k = 256 * pg + 8 * j;
    uint4* dst = xs + b * kXRowChunks + xs_slot(j);
    if (K % 256 == 0 || k < K)
      cp_async16(dst, x + static_cast<size_t>(b) * K + k);
    else
      *dst = make_uint4(0u, 0u, 0u, 0u);
  }
  return;
#endif
  for (int i = threadIdx.x; i < ncols * 32; i += kTileThreads) {
    const int b = i >> 5, j = i & 31;
    const int k = 256 * pg + 8 * j;
    uint4* dst = xs + b * kXRowChunks + xs_slot(j);
    if (k < K)
      cp_async16(dst, x + static_cast<size_t>(b) * K + k);
    else
      *dst = make_uint4(0u, 0u, 0u, 0u);  // past K (an odd group count's last pair): never multiplied
  }
}

// The wgmma build's activation copies of pair pg: x of every column, placed as wgmma's B operand
// (wgmma.cuh) in the k order of the A fragments. Lane c of a quad holds the weights of words
// 32 c + 8 w .. + 7 of a group (w = 0..3, one 16-byte chunk per lane, as mma.sync had them) and gives
// the two k16 steps s = 2 w, 2 w + 1 of the group its half2 pairs: step 2 w + h takes k = 32 c + 8 w +
// 4 h + {0, 1} into its slots 2 c, 2 c + 1 and k = .. + {2, 3} into 2 c + 8, 2 c + 9. So the x of step
// s is not 16 consecutive k but 4 bytes from each of 8 places: staged with 4-byte copies. Stage layout:
// step s (0..15 over the pair) of column n is atom (s / 4) x (kCols / 8) + n / 8, row n % 8, chunk
// 2 (s % 4) + j (j = 0: slots 0..7, 1: slots 8..15), 4-byte slot c of it. Launch shape of the copies:
// one warp per (column, 4 steps of a group), lane = 8 c + q with q the (unswizzled) chunk: the 32 lanes
// write 32 different banks (chunk q ^ (n % 8), slot c) and read 4 runs of 32 bytes of x.
template <int K, int kCols>
__device__ __forceinline__ void issue_x_wg(const uint16_t* __restrict__ x, int ncols, int pg, uint4* xs,
                                           int warp = threadIdx.x >> 5, int warps = kTileWarps) {
  const int lane = threadIdx.x & 31;
  const int c = lane >> 3, q = lane & 7;  // q = 2 (s % 4) + j: w % 2 = q >> 2, h = (q >> 1) & 1, j = q & 1
  char* base = reinterpret_cast<char*>(xs);
  for (int item = warp; item < ncols * 4; item += warps) {
    const int n = item >> 2, qq = item & 3;  // qq = s / 4 = 2 gl + w / 2
    const int k = 256 * pg + 128 * (qq >> 1) + 32 * c + 8 * (2 * (qq & 1) + (q >> 2)) + 2 * (q & 3);
    const int off = (qq * (kCols / 8) + (n >> 3)) * 1024 + (n & 7) * 128 + ((q ^ (n & 7)) << 4) + 4 * c;
    if (K % 256 == 0 || k < K) cp_async4(base + off, x + static_cast<size_t>(n) * K + k);  // past K: never read
  }
}

// Zero the x rows of columns ncols .. kCols - 1 in every stage, once per launch (NQ_TILE_X_ALL_COLS):
// issue_x never writes them, so they stay zero for every step. Shared memory only: may run before pdl_wait.
template <int NT>
constexpr bool kTileXAllCols = NQ_TILE_X_ALL_COLS && NT >= 4;  // at 8 and 16 columns the SASS grew (+12, +32)

template <int kCols, int kStages, int kStageChunks>
__device__ __forceinline__ void zero_idle_cols(uint4* smem, int ncols) {
  if constexpr (kTileWg || !kTileXAllCols<kCols / 8>) return;
  const int idle = (kCols - ncols) * kXRowChunks;
  for (int st = 0; st < kStages; ++st) {
    uint4* xs = smem + st * kStageChunks + kTileSlots * 8 + kTileSlots / 4;
    for (int i = threadIdx.x; i < idle; i += kTileThreads) xs[ncols * kXRowChunks + i] = make_uint4(0u, 0u, 0u, 0u);
  }
}

// Multiply one staged pair into acc (the warp's two m16 tiles x NT n-tiles).
// Scales: each unpacked weight is multiplied by its group's fp16 scale (one hmul2 per half2: q * s in one
// rounding, q exact) and the mmas accumulate straight into acc in fp32. The alternative, a fresh fp32
// d = A B per group then acc += d * s, needs another 4 x MT x NT registers (spills at 64 columns) and as
// many FFMAs; q * s in fp16 is still finer than the half2 loop's fp16 partial sums (tests/test_gemv_gpu.py
// holds every build to the same tolerance).
// No early exit over n-tiles past the batch (the build is the smallest of 8/16/32/64 columns that holds
// B; those columns multiply zeros): a data-dependent branch between the mmas made ptxas emit each
// accumulator's two mmas back to back, every second one waiting out the first's latency (4x slower at
// B = 64, measured). Unbranched, the 2 x MT x NT independent accumulators interleave.
template <int K, int NT>
__device__ __forceinline__ void multiply_pair_wg(const uint4* w, const uint32_t* s, const uint4* xs, int pg,
                                                 float (&acc)[kTileMT][NT][4]);
template <int K, int NT>
__device__ __forceinline__ void multiply_pair(const uint4* w, const uint32_t* s, const uint4* xs, int ncols, int pg,
                                              float (&acc)[kTileMT][NT][4]) {
  if constexpr (kTileWg) {
    multiply_pair_wg<K, NT>(w, s, xs, pg, acc);
    return;
  }
  constexpr int kG = K / kGroup;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int gl = 0; gl < 2; ++gl) {
    if (2 * pg + gl >= kG) break;  // block-uniform (an odd group count's last pair)
    uint4 wa[kTileMT], wb[kTileMT];
    uint32_t sa[kTileMT], sb[kTileMT];  // half2 (scale, scale) of rows r0 / r1
#pragma unroll
    for (int m = 0; m < kTileMT; ++m) {
      const int u = warp * 8 * kTileMT + 8 * m + g;
      const int ch = (4 * gl + c) ^ ((u & 1) << 2);  // rows u and kTileUnits + u have u's parity
      wa[m] = w[u * 8 + ch];
      wb[m] = w[(kTileUnits + u) * 8 + ch];
      const uint32_t s0 = s[u], s1 = s[kTileUnits + u];
      const uint32_t h0 = gl ? s0 >> 16 : s0 & 0xffffu, h1 = gl ? s1 >> 16 : s1 & 0xffffu;
      sa[m] = h0 | (h0 << 16);
      sb[m] = h1 | (h1 << 16);
    }
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      uint4 xv[NT];
      const int slot = xs_slot(gl * 16 + 4 * c + wd);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const int col = 8 * nt + g;
        if constexpr (kTileXAllCols<NT>)
          xv[nt] = xs[col * kXRowChunks + slot];  // columns >= ncols hold zeros (zero_idle_cols)
        else
          xv[nt] = col < ncols ? xs[col * kXRowChunks + slot] : make_uint4(0u, 0u, 0u, 0u);
      }
      uint32_t q0[kTileMT][4], q1[kTileMT][4];
#pragma unroll
      for (int m = 0; m < kTileMT; ++m) {
        const uint32_t a[4] = {wa[m].x, wa[m].y, wa[m].z, wa[m].w};
        const uint32_t b[4] = {wb[m].x, wb[m].y, wb[m].z, wb[m].w};
        unpack8(a[wd], q0[m]);
        unpack8(b[wd], q1[m]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          q0[m][i] = hmul2(q0[m][i], sa[m]);
          q1[m][i] = hmul2(q1[m][i], sb[m]);
        }
      }
      // A regs {r0, r1, r0, r1}: half2 0 in k-slots 2c, 2c+1, half2 1 in slots 2c+8, 2c+9
#pragma unroll
      for (int m = 0; m < kTileMT; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma16816(acc[m][nt], q0[m][0], q1[m][0], q0[m][1], q1[m][1], xv[nt].x, xv[nt].y);
#pragma unroll
      for (int m = 0; m < kTileMT; ++m)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
          mma16816(acc[m][nt], q0[m][2], q1[m][2], q0[m][3], q1[m][3], xv[nt].z, xv[nt].w);
    }
  }
}

// The wgmma build's multiply of one staged pair: per group, the warp dequantizes its 16 rows' 128 k (the
// same unpack8 and scale as multiply_pair) into the A fragments of 8 k16 steps, then its warpgroup issues
// them as 8 wgmmas over all the columns at once (x read from the stage by the tensor cores, issue_x_wg's
// layout). Group 1's dequantization overlaps group 0's wgmmas; the wait at the end is what lets the ring
// refill this stage (its x read) and the epilogue read acc. acc is zeroed at a segment's start by plain
// moves: the fence before each group's first wgmma orders those writes too.
template <int K, int NT>
__device__ __forceinline__ void multiply_pair_wg(const uint4* w, const uint32_t* s, const uint4* xs, int pg,
                                                 float (&acc)[kTileMT][NT][4]) {
  constexpr int kG = K / kGroup;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int u = warp * 8 + g;  // the unit of fragment rows g (its row r0) and g + 8 (its row r1)
  // the stage's descriptor once; a step's is a constant on (its start address >> 4 is the low field, and a
  // stage lies far below the field's 256 KB reach, so the add never carries out of it)
  const uint64_t desc0 = wgmma_desc_sw128(smem_u32(xs));
#pragma unroll
  for (int gl = 0; gl < 2; ++gl) {
    if (2 * pg + gl >= kG) break;  // block-uniform (an odd group count's last pair)
    const int ch = (4 * gl + c) ^ ((u & 1) << 2);
    const uint4 wa = w[u * 8 + ch], wb = w[(kTileUnits + u) * 8 + ch];
    const uint32_t s0 = s[u], s1 = s[kTileUnits + u];
    const uint32_t h0 = gl ? s0 >> 16 : s0 & 0xffffu, h1 = gl ? s1 >> 16 : s1 & 0xffffu;
    const uint32_t sa = h0 | (h0 << 16), sb = h1 | (h1 << 16);
    const uint32_t a[4] = {wa.x, wa.y, wa.z, wa.w}, b[4] = {wb.x, wb.y, wb.z, wb.w};
    uint32_t f[4][2][4];  // [word][step half h][a0..a3]
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      uint32_t q0[4], q1[4];
      unpack8(a[wd], q0);
      unpack8(b[wd], q1);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        q0[i] = hmul2(q0[i], sa);
        q1[i] = hmul2(q1[i], sb);
      }
      // A regs {r0, r1, r0, r1}: half2 0 in k-slots 2c, 2c+1, half2 1 in slots 2c+8, 2c+9 (as multiply_pair)
      f[wd][0][0] = q0[0], f[wd][0][1] = q1[0], f[wd][0][2] = q0[1], f[wd][0][3] = q1[1];
      f[wd][1][0] = q0[2], f[wd][1][1] = q1[2], f[wd][1][2] = q0[3], f[wd][1][3] = q1[3];
    }
    wgmma_fence();  // the A fragments (and a fresh segment's zeroed acc) written before the wgmmas read them
#pragma unroll
    for (int wd = 0; wd < 4; ++wd)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int st = 8 * gl + 2 * wd + h;  // the k16 step of the pair: atom row st / 4, 32 bytes per step
        const uint64_t desc = desc0 + static_cast<uint64_t>(((st >> 2) * (NT * 1024) + (st & 3) * 32) >> 4);
        wgmma_rs<NT>(acc[0], f[wd][h][0], f[wd][h][1], f[wd][h][2], f[wd][h][3], desc);
      }
    wgmma_commit();
#if NQ_TILE_WG_GROUP_WAIT
    wgmma_wait<0>();  // this group's A registers free again before the next group's are written
#endif
  }
  wgmma_wait<0>();
}

// A partial segment of tile t (the block's first segment if `first`, else its last): its fp32 sums to
// the block's ws slot, then a ticket; the block that finishes the tile's last segment adds every
// contributor's slot in block order and runs the epilogue. Block-uniform (it holds barriers).
template <int K, int NT, class Map, class Epi>
__device__ __forceinline__ void partial_segment(int t, bool first, float* __restrict__ ws, int* __restrict__ tickets,
                                                int units, int ncols, const Map& map, const Epi& epi, const float (&acc)[kTileMT][NT][4],
                                                int& last_flag) {
  constexpr int kCols = 8 * NT;
  constexpr int kPairs = (K / kGroup + 1) / 2;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int p_blocks = gridDim.x, blk = blockIdx.x;  // re-read here: fewer registers live across the loop
  const long long w_items = static_cast<long long>((units + kTileUnits - 1) / kTileUnits) * kPairs;
  const int slot = 2 * blk + (first ? 0 : 1);
  float2* mine = reinterpret_cast<float2*>(ws) + static_cast<size_t>(slot) * kCols * kTileUnits;
#pragma unroll
  for (int m = 0; m < kTileMT; ++m) {
    const int u = warp * 8 * kTileMT + 8 * m + g;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int col = 8 * nt + 2 * c;
      if (col < ncols) mine[col * kTileUnits + u] = make_float2(acc[m][nt][0], acc[m][nt][2]);
      if (col + 1 < ncols) mine[(col + 1) * kTileUnits + u] = make_float2(acc[m][nt][1], acc[m][nt][3]);
    }
  }
  __threadfence();  // this thread's partial sums visible device-wide before the ticket is taken
  tile_consumer_sync();  // ... for every multiplying thread of the block
  const long long item0 = static_cast<long long>(t) * kPairs;
  const int b_first = stripe_of(item0, w_items, p_blocks);
  const int b_last = stripe_of(item0 + kPairs - 1, w_items, p_blocks);
  if (tid == 0) last_flag = atomicAdd(&tickets[t], 1) == b_last - b_first;
  tile_consumer_sync();
  if (!last_flag) return;  // block-uniform
  __threadfence();  // the other blocks' partial sums (seen through their tickets) before reading them
  // Thread tid sums unit u = tid % 128 of columns tid / 128 + 2 q over the contributors, in block order
  // (the same sums at every batch size). All kPer loads of one contributor are independent and issued
  // together: the reduction costs (contributors) L2 round trips, not (contributors x outputs per thread).
  constexpr int kPer = kTileUnits * kCols / kTileThreads;
  constexpr int kChunk = kPer < 8 ? kPer : 8;  // outputs summed per pass (registers: 2 x kChunk)
  const int u = tid % kTileUnits, col0 = tid / kTileUnits;
  const int p = t * kTileUnits + u;
  int r0 = 0, r1 = 0;
  if (p < units) map(p, r0, r1);
#pragma unroll
  for (int q0 = 0; q0 < kPer; q0 += kChunk) {
    float o0[kChunk], o1[kChunk];
#pragma unroll
    for (int q = 0; q < kChunk; ++q) o0[q] = o1[q] = 0.f;
    for (int b = b_first; b <= b_last; ++b) {
      const int tb = static_cast<int>(stripe_lo(b, w_items, p_blocks) / kPairs);
      const int sb = 2 * b + (tb == t ? 0 : 1);
      const float2* src = reinterpret_cast<const float2*>(ws) + static_cast<size_t>(sb) * kCols * kTileUnits + u;
#pragma unroll
      for (int q = 0; q < kChunk; ++q) {
        const int col = col0 + (kTileThreads / kTileUnits) * (q0 + q);
        if (col < ncols) {
          const float2 v = __ldcg(src + col * kTileUnits);
          o0[q] += v.x;
          o1[q] += v.y;
        }
      }
    }
    if (p < units) {
#pragma unroll
      for (int q = 0; q < kChunk; ++q) {
        const int col = col0 + (kTileThreads / kTileUnits) * (q0 + q);
        if (col < ncols) epi(col, p, r0, r1, o0[q], o1[q]);
      }
    }
  }
  if (tid == 0) tickets[t] = 0;  // ready for the next launch (no other block touches it in this one)
}

// Which builds run the continuous ring (gemm_tiles) and which the drained one (gemm_tiles_drained): chosen
// by measurement (H200, docs/PERF.md "2026-11-30, fifth lease"). 8 and 32 columns: -3 to -12% per
// GEMM. 64 columns: the registers are at the cap of 512 threads (128) and every reshaping of the loop
// tried (the continuous ring, early weights, shared segment helpers) moved spills into it: +5-7% on
// gate/up and down. 16 columns: ptxas split the x fragment loads of the reshaped loop and kept 70 registers
// where the drained loop keeps 121: +10% on gate/up and down at B = 16.
template <int NT>
constexpr bool kTileContinuous = kTileWg || NT == 1 || NT == 4;  // the wgmma build: every width (its own loop)

// The drained ring: the tile GEMM as first written (the ring drained at each segment's end, copy rows
// cached per segment, nothing issued before pdl_wait), kept for the builds above. Its whole-tile epilogue
// and declarations repeat gemm_tiles' on purpose: factoring them into a shared helper changed the SASS
// of the 32- and 64-column builds (3552 -> 3608 instructions at 64), and this code is what was measured.
template <int K, int NT, class Map, class Epi>
__device__ __forceinline__ void gemm_tiles_drained(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, int units, int n_cols,
                                           float* __restrict__ ws, int* __restrict__ tickets, const Map& map,
                                           const Epi& epi) {
  constexpr int kCols = 8 * NT;
  constexpr int kPairs = (K / kGroup + 1) / 2;
  extern __shared__ uint4 smem_raw[];
  uint4* const smem = tile_ring_base(smem_raw);
  __shared__ int last_flag;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int ncols = n_cols;
  const int p_blocks = gridDim.x, blk = blockIdx.x;
  const int tiles = (units + kTileUnits - 1) / kTileUnits;
  const long long w_items = static_cast<long long>(tiles) * kPairs;
  const long long lo = stripe_lo(blk, w_items, p_blocks), hi = stripe_lo(blk + 1, w_items, p_blocks);
  constexpr int kStageChunks = tile_stage_bytes<kCols>() / 16;
  constexpr int kTileStages = tile_stages<kCols>();
  static_assert(kTileStages >= 2, "the ring needs two stages");
  zero_idle_cols<kCols, kTileStages, kStageChunks>(smem, ncols);

  pdl_wait();  // launch overlap (common.cuh): nothing read or written before the previous kernel ends

  for (long long j = lo; j < hi;) {  // block-uniform loop over this block's segments
    const int t = static_cast<int>(j / kPairs);
    const int p0 = static_cast<int>(j - static_cast<long long>(t) * kPairs);
    const int p1 = static_cast<int>(min(static_cast<long long>(kPairs), p0 + (hi - j)));
    const bool first = j == lo;
    j += p1 - p0;
    // this thread's copy duties in the tile: rows of slots (tid >> 3) + kCopyRows j and of slot tid
    int rows[kTileSlots / kCopyRows], srow;
#pragma unroll
    for (int q = 0; q < kTileSlots / kCopyRows; ++q) {
      const int rs = (tid >> 3) + kCopyRows * q;
      int r0, r1;
      map(min(t * kTileUnits + (rs % kTileUnits), units - 1), r0, r1);  // a tail tile recomputes the last
      rows[q] = rs < kTileUnits ? r0 : r1;                              // unit; only real units written
    }
    {
      int r0, r1;
      map(min(t * kTileUnits + (tid % kTileUnits), units - 1), r0, r1);
      srow = (tid % kTileSlots) < kTileUnits ? r0 : r1;
    }
    auto stage = [&](int i) { return smem + (i % kTileStages) * kStageChunks; };
    auto issue = [&](int i) {
      uint4* base = stage(i);
      issue_w<K>(qw, sc, p0 + i, rows, srow, base, reinterpret_cast<uint32_t*>(base + kTileSlots * 8));
      if constexpr (kTileWg)
        issue_x_wg<K, kCols>(x, ncols, p0 + i, base + kTileSlots * 8 + kTileSlots / 4);
      else
        issue_x<K, kCols>(x, ncols, p0 + i, base + kTileSlots * 8 + kTileSlots / 4);
    };
    const int n = p1 - p0;
#pragma unroll
    for (int i = 0; i < kTileStages - 1; ++i) {
      if (i < n) issue(i);
      cp_async_commit();  // possibly empty: every thread commits the same number of groups
    }
    float acc[kTileMT][NT][4];
#pragma unroll
    for (int m = 0; m < kTileMT; ++m)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0.f;
    for (int i = 0; i < n; ++i) {
      cp_async_wait<kTileStages - 2>();
      if constexpr (kTileWg) fence_proxy_async_smem();  // this thread's x copies, seen by the wgmmas
      __syncthreads();  // stage i landed for every thread's copies; stage i - 1's slot is free
      if (i + kTileStages - 1 < n) issue(i + kTileStages - 1);
      cp_async_commit();
      const uint4* base = stage(i);
      multiply_pair<K, NT>(base, reinterpret_cast<const uint32_t*>(base + kTileSlots * 8),
                           base + kTileSlots * 8 + kTileSlots / 4, ncols, p0 + i, acc);
    }
    cp_async_wait<0>();
    __syncthreads();  // every warp done with the ring before the next segment refills it

    if (p0 == 0 && p1 == kPairs) {  // the whole tile: straight to the epilogue
#pragma unroll
      for (int m = 0; m < kTileMT; ++m) {
        const int p = t * kTileUnits + warp * 8 * kTileMT + 8 * m + g;
        if (p >= units) continue;
        int r0, r1;
        map(p, r0, r1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int col = 8 * nt + 2 * c;
          if (col < ncols) epi(col, p, r0, r1, acc[m][nt][0], acc[m][nt][2]);
          if (col + 1 < ncols) epi(col + 1, p, r0, r1, acc[m][nt][1], acc[m][nt][3]);
        }
      }
      continue;
    }
    partial_segment<K, NT>(t, first, ws, tickets, units, ncols, map, epi, acc, last_flag);
  }
}

// The warp-specialized tile GEMM (NQ_TILE_WS): the same stripes, stages, multiply (wgmma) and epilogues as
// gemm_tiles, with the copies in producer warps and the stages handed over by mbarriers (see NQ_TILE_WS).
// Producer thread pt (0 .. 32 NQ_TILE_PRODUCERS - 1) copies, per step: chunk pt % 8 of the weight rows of
// units pt / 8 + 4 NQ_TILE_PRODUCERS j (both rows of each unit), the scales of slots pt + 32 P j, and x
// items (column, quarter) pw, pw + P, .. (issue_x_wg, one warp per item).
template <int K, int NT, class Map, class Epi>
__device__ __forceinline__ void gemm_tiles_ws(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                              const uint16_t* __restrict__ x, int units, int n_cols,
                                              float* __restrict__ ws, int* __restrict__ tickets, const Map& map,
                                              const Epi& epi) {
  constexpr int kCols = 8 * NT;
  constexpr int kPairs = (K / kGroup + 1) / 2;
  constexpr int kG = K / kGroup;
  constexpr int kP = kTileProducers;
  extern __shared__ uint4 smem_raw[];
  uint4* const smem = tile_ring_base(smem_raw);
  __shared__ int last_flag;
  __shared__ uint64_t full_bar[kTileMaxStages], empty_bar[kTileMaxStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int ncols = n_cols;
  const int p_blocks = gridDim.x, blk = blockIdx.x;
  const int tiles = (units + kTileUnits - 1) / kTileUnits;
  const long long w_items = static_cast<long long>(tiles) * kPairs;
  const long long lo = stripe_lo(blk, w_items, p_blocks), hi = stripe_lo(blk + 1, w_items, p_blocks);
  constexpr int kStageChunks = tile_stage_bytes<kCols>() / 16;
  constexpr int kS = tile_stages<kCols>();
  static_assert(kS >= 2 && kS <= kTileMaxStages, "the ring needs 2 .. 8 stages");
  const int n = static_cast<int>(hi - lo), lo_i = static_cast<int>(lo);
  auto stage = [&](int i) { return smem + (i % kS) * kStageChunks; };
  if (tid == 0) {
    for (int st = 0; st < kS; ++st) {
      mbar_init(&full_bar[st], 32 * kP);     // one cp.async arrival per producer thread
      mbar_init(&empty_bar[st], kTileWarps);  // one arrival per consumer warp
    }
  }
  __syncthreads();  // the barriers initialised before anyone uses them (the last block-wide barrier)

  if (warp >= kTileWarps) {  // ---- producers ----
    const int pt = tid - kTileThreads, pw = warp - kTileWarps;
    const int chunk = pt & 7, gl = chunk >> 2, c = chunk & 3;
    for (int i = 0; i < n; ++i) {
      const int st = i % kS;
      if (i >= kS) mbar_wait(&empty_bar[st], ((i / kS) + 1) & 1);  // the consumers' read of step i - kS
      const int t = (lo_i + i) / kPairs, pg = (lo_i + i) % kPairs;
      uint4* base = stage(i);
      uint4* w = base;
      uint32_t* s = reinterpret_cast<uint32_t*>(base + kTileSlots * 8);
      const int g = 2 * pg + gl;
      if (K % 256 == 0 || g < kG) {
#pragma unroll 4
        for (int u = pt >> 3; u < kTileUnits; u += 4 * kP) {
          int r0, r1;
          map(min(t * kTileUnits + u, units - 1), r0, r1);  // a tail tile recomputes the last unit
          const int sw = chunk ^ ((u & 1) << 2);
          cp_async16_l2_256(w + u * 8 + sw, qw + static_cast<size_t>(r0) * (K / 8) + g * 16 + c * 4);
          cp_async16_l2_256(w + (kTileUnits + u) * 8 + sw, qw + static_cast<size_t>(r1) * (K / 8) + g * 16 + c * 4);
        }
      }
      for (int slot = pt; slot < kTileSlots; slot += 32 * kP) {
        const int u = slot % kTileUnits;
        int r0, r1;
        map(min(t * kTileUnits + u, units - 1), r0, r1);
        const int srow = slot < kTileUnits ? r0 : r1;
        if constexpr (kG % 2 == 0) {
          cp_async4(s + slot, sc + static_cast<size_t>(srow) * kG + 2 * pg);
        } else {  // odd group count (small test shapes only): plain loads, the last pair has one group
          const uint16_t* p = sc + static_cast<size_t>(srow) * kG + 2 * pg;
          const uint32_t lo16 = p[0], hi16 = (2 * pg + 1 < kG) ? p[1] : 0u;
          s[slot] = lo16 | (hi16 << 16);
        }
      }
      if (i == 0) pdl_wait();  // x is the previous kernel's output; the weights above may go first
      issue_x_wg<K, kCols>(x, ncols, pg, base + kTileSlots * 8 + kTileSlots / 4, pw, kP);
      cp_async_mbar_arrive(&full_bar[st]);
    }
    if (n == 0) pdl_wait();
    cp_async_wait<0>();  // nothing in flight when the warp exits
    return;
  }

  // ---- consumers: the 16 warps of the wgmma multiply ----
  pdl_wait();  // launch overlap (common.cuh): outputs, workspace and tickets only after the wait
  const int g = lane >> 2, c = lane & 3;
  for (int i = 0; i < n;) {  // block-uniform (among the consumers) loop over this block's segments
    const int t = (lo_i + i) / kPairs;
    const int p0 = lo_i + i - t * kPairs;
    const int seg_end = min(n, i + kPairs - p0);
    float acc[kTileMT][NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[0][nt][0] = acc[0][nt][1] = acc[0][nt][2] = acc[0][nt][3] = 0.f;
    const int i0 = i;
    for (; i < seg_end; ++i) {
      const int st = i % kS;
      mbar_wait(&full_bar[st], (i / kS) & 1);
      fence_proxy_async_smem();  // the producers' x copies (generic proxy), seen by this warp's wgmmas
      const uint4* base = stage(i);
      multiply_pair_wg<K, NT>(base, reinterpret_cast<const uint32_t*>(base + kTileSlots * 8),
                              base + kTileSlots * 8 + kTileSlots / 4, p0 + (i - i0), acc);
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty_bar[st]);  // this warp is done with the stage (wgmmas waited for)
    }
    const int p1 = p0 + (seg_end - i0);
    if (p0 == 0 && p1 == kPairs) {  // the whole tile: straight to the epilogue
      const int p = t * kTileUnits + warp * 8 + g;
      if (p < units) {
        int r0, r1;
        map(p, r0, r1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int col = 8 * nt + 2 * c;
          if (col < ncols) epi(col, p, r0, r1, acc[0][nt][0], acc[0][nt][2]);
          if (col + 1 < ncols) epi(col + 1, p, r0, r1, acc[0][nt][1], acc[0][nt][3]);
        }
      }
    } else {
      partial_segment<K, NT>(t, i0 == 0, ws, tickets, units, ncols, map, epi, acc, last_flag);
    }
  }
}

// out[b] = W . x[b] for b < n_cols (<= 8 NT) over `units` units; x is already normalised (nq_norm_cols_*).
// ws: fp32 [2 P][8 NT][kTileUnits][2]; tickets: int [tiles], zero before the launch (and after it).
template <int K, int NT, class Map, class Epi>
__device__ __forceinline__ void gemm_tiles(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                           const uint16_t* __restrict__ x, int units, int n_cols,
                                           float* __restrict__ ws, int* __restrict__ tickets, const Map& map,
                                           const Epi& epi) {
  if constexpr (kTileWs) {
    gemm_tiles_ws<K, NT>(qw, sc, x, units, n_cols, ws, tickets, map, epi);
    return;
  }
  if constexpr (!kTileContinuous<NT>) {
    gemm_tiles_drained<K, NT>(qw, sc, x, units, n_cols, ws, tickets, map, epi);
    return;
  }
  constexpr int kCols = 8 * NT;
  constexpr int kPairs = (K / kGroup + 1) / 2;
  extern __shared__ uint4 smem_raw[];
  uint4* const smem = tile_ring_base(smem_raw);
  __shared__ int last_flag;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, c = lane & 3;
  const int ncols = n_cols;
  const int p_blocks = gridDim.x, blk = blockIdx.x;
  const int tiles = (units + kTileUnits - 1) / kTileUnits;
  const long long w_items = static_cast<long long>(tiles) * kPairs;
  const long long lo = stripe_lo(blk, w_items, p_blocks), hi = stripe_lo(blk + 1, w_items, p_blocks);
  constexpr int kStageChunks = tile_stage_bytes<kCols>() / 16;
  constexpr int kTileStages = tile_stages<kCols>();
  static_assert(kTileStages >= 2, "the ring needs two stages");

  // The stripe is n = hi - lo steps; step i is pair (lo + i) % kPairs of tile (lo + i) / kPairs, and the
  // steps of one tile form a segment (a block's stripe: the tail of one tile, whole tiles, the head of
  // another).
  const int n = static_cast<int>(hi - lo), lo_i = static_cast<int>(lo);  // items fit an int (tiles x pairs)
  auto stage = [&](int i) { return smem + (i % kTileStages) * kStageChunks; };
  // this thread's copy duties in tile t: the rows of slots (tid >> 3) + kCopyRows q and of slot tid
  auto copy_rows = [&](int t, int (&rows)[kTileSlots / kCopyRows], int& srow) {
#pragma unroll
    for (int q = 0; q < kTileSlots / kCopyRows; ++q) {
      const int rs = (tid >> 3) + kCopyRows * q;
      int r0, r1;
      map(min(t * kTileUnits + (rs % kTileUnits), units - 1), r0, r1);  // a tail tile recomputes the last
      rows[q] = rs < kTileUnits ? r0 : r1;                              // unit; only real units written
    }
    int r0, r1;
    map(min(t * kTileUnits + (tid % kTileUnits), units - 1), r0, r1);
    srow = (tid % kTileSlots) < kTileUnits ? r0 : r1;
  };
  auto issue_weights = [&](int i, const int (&rows)[kTileSlots / kCopyRows], int srow) {
    uint4* base = stage(i);
    issue_w<K>(qw, sc, (lo_i + i) % kPairs, rows, srow, base, reinterpret_cast<uint32_t*>(base + kTileSlots * 8));
  };
  auto issue_acts = [&](int i) {
    if constexpr (kTileWg)
      issue_x_wg<K, kCols>(x, ncols, (lo_i + i) % kPairs, stage(i) + kTileSlots * 8 + kTileSlots / 4);
    else
      issue_x<K, kCols>(x, ncols, (lo_i + i) % kPairs, stage(i) + kTileSlots * 8 + kTileSlots / 4);
  };
  // the end of a segment of tile t over pairs p0 .. p1 - 1
  auto segment_done = [&](int t, int p0, int p1, bool first, const float (&acc)[kTileMT][NT][4]) {
    if (p0 == 0 && p1 == kPairs) {  // the whole tile: straight to the epilogue
#pragma unroll
      for (int m = 0; m < kTileMT; ++m) {
        const int p = t * kTileUnits + warp * 8 * kTileMT + 8 * m + g;
        if (p >= units) continue;
        int r0, r1;
        map(p, r0, r1);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const int col = 8 * nt + 2 * c;
          if (col < ncols) epi(col, p, r0, r1, acc[m][nt][0], acc[m][nt][2]);
          if (col + 1 < ncols) epi(col + 1, p, r0, r1, acc[m][nt][1], acc[m][nt][3]);
        }
      }
    } else {
      partial_segment<K, NT>(t, first, ws, tickets, units, ncols, map, epi, acc, last_flag);
    }
  };

  // Stage 0's weights are issued before pdl_wait (NQ_TILE_EARLY_W = 1, the default): weights are never
  // written during a step, so their HBM round trip may overlap the previous kernel's drain (which
  // nq_norm_cols_* shortens by releasing its successor early, gemv_mma.cuh). x, the outputs and the
  // tickets only after the wait. Group 0 is then {weights 0, x 0} and group i {weights i, x i}, as in the
  // steady state; stage 1's weights issued early too would join group 0 (groups complete in order).
  const int t0 = lo_i / kPairs;
  zero_idle_cols<kCols, kTileStages, kStageChunks>(smem, ncols);
  {
    int rows[kTileSlots / kCopyRows], srow;
    copy_rows(t0, rows, srow);
#if NQ_TILE_EARLY_W
    if (n > 0) issue_weights(0, rows, srow);
#endif
    pdl_wait();  // launch overlap (common.cuh)
#pragma unroll
    for (int i = 0; i < kTileStages - 1; ++i) {
      if (i < n) {
        if (i > 0 && (lo_i + i) % kPairs == 0) copy_rows((lo_i + i) / kPairs, rows, srow);  // next tile
        if (!NQ_TILE_EARLY_W || i > 0) issue_weights(i, rows, srow);
        issue_acts(i);
      }
      cp_async_commit();  // possibly empty: every thread commits the same number of groups
    }
  }

  // The continuous ring: it runs across segment boundaries, so the next segment's first stages are in
  // flight while this one multiplies its last steps and runs its epilogue (a drained ring paid one HBM
  // round trip per segment; measured in docs/PERF.md). The copy rows are recomputed per issued step (a
  // few integer ops; caching them for the issue side's tile spilled at 32 columns).
  for (int i = 0; i < n;) {  // block-uniform loop over this block's segments
    const int t = (lo_i + i) / kPairs;
    const int p0 = lo_i + i - t * kPairs;
    const int seg_end = min(n, i + kPairs - p0);
    float acc[kTileMT][NT][4];
#pragma unroll
    for (int m = 0; m < kTileMT; ++m)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[m][nt][0] = acc[m][nt][1] = acc[m][nt][2] = acc[m][nt][3] = 0.f;
    const int i0 = i, n_seg = seg_end - i;
    for (int s = 0; s < n_seg; ++s) {
      const int ii = i0 + s;
      cp_async_wait<kTileStages - 2>();
      if constexpr (kTileWg) fence_proxy_async_smem();  // this thread's x copies, seen by the wgmmas
      __syncthreads();  // stage ii landed for every thread's copies; stage ii - 1's slot is free
      if (ii + kTileStages - 1 < n) {
        int rows[kTileSlots / kCopyRows], srow;
        copy_rows((lo_i + ii + kTileStages - 1) / kPairs, rows, srow);
        issue_weights(ii + kTileStages - 1, rows, srow);
        issue_acts(ii + kTileStages - 1);
      }
      cp_async_commit();
      const uint4* base = stage(ii);
      multiply_pair<K, NT>(base, reinterpret_cast<const uint32_t*>(base + kTileSlots * 8),
                           base + kTileSlots * 8 + kTileSlots / 4, ncols, p0 + s, acc);
    }
    i = seg_end;
    segment_done(t, p0, p0 + n_seg, i0 == 0, acc);
  }
  cp_async_wait<0>();  // only empty groups remain; nothing may be in flight when the block exits
}

}  // namespace nq
