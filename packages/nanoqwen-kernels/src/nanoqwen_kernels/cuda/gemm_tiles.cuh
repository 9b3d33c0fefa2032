// gemm_tiles.cuh: the batched INT4 GEMM of decode (B = 2 .. 64 sequences): out[b] = W . x[b], each weight
// byte read from HBM once per step, each activation slice read from L2 once per 256-row tile.
//
// Why this shape (docs/PERF.md "batched GEMVs" has the measurements that led here): gemv_mma.cuh gives a
// block 16 rows at a time and stages x of all B sequences per tile, so at B = 32 it moves ~8x more bytes
// of x (L2 -> shared memory) than of weights (HBM) and ran at 5-10% of the copy rate. Here a block owns
// 256 rows (a "tile": 128 units of 2 rows) and walks K; every 256-k step it stages 256 x 128 B of weights
// and B x 512 B of x, so x costs B / 64 of the weight bytes (half of them at B = 32) and both stream.
//
// Warp specialization (one block per SM, 16 + NQ_TILE_PRODUCERS warps): the producer warps (16 ..) issue
// every copy into a ring of kStages shared-memory stages; the 16 consumer warps only multiply. The stages
// are handed over by mbarriers: full[s] completes when the producers' cp.async copies of stage s have
// landed (cp.async.mbarrier.arrive, one arrival per producer thread), empty[s] when each consumer warp has
// finished with it (its wgmmas waited for). No barrier spans the block after the start: the producers run
// up to kStages steps ahead, straight through the consumers' epilogues and partial-sum reductions, and
// the consumers never wait for each other between steps. Why (docs/PERF.md "sixth lease"): the previous
// ring, every warp copying its share, then one block barrier per step, then every warp multiplying, spent
// ~2.3 us per 256-k step at 8 columns where the step's weights need ~1.1 us, whatever the multiply (mma.sync
// or wgmma) or the ring's depth; with the copies in producer warps a step got faster with each producer
// warp added (their issue slots are shared with 4 consumer warps per scheduler), 4 being the most that
// leaves the consumers their registers. tests/test_gemm_tiles_ring.py emulates the hand-over.
// A stage = one "pair" of 128-k groups of the tile (1024-aligned, the ring aligned by tile_ring_base):
//     W   [256 row slots][128 B]   INT4 words of groups 2pg, 2pg+1; row slot rs = rr * 128 + u holds row
//                                 r0 (rr = 0) or r1 (rr = 1) of unit u (the Map names them)
//     S   [256 row slots][2] fp16  their scales (one 4-byte copy per row: groups 2pg, 2pg+1 are adjacent)
//     X   [B / 8][4][1024 B]      x of the pair in wgmma's B layout (below): 128-byte-swizzled atoms
//   Bank layout of W: lane (g, c) reads 16 B of unit u = ... + g at chunk 4 gl + c; units g and g + 1 of a
//   quarter-warp are 128 B apart (the same banks), so an odd row slot stores its two 64-byte halves
//   swapped (chunk j at j ^ 4): the quarter-warp then covers all 32 banks once.
//
// Fragments: warp w owns units 8 w .. 8 w + 7 of the tile as one m16 tile (fragment rows g and g + 8 =
//   rows r0 and r1 of unit 8 w + g); warps 4 i .. 4 i + 3 form warpgroup i, whose wgmma m64 x (8 NT) x 16
//   takes the 4 warps' m16 fragments as A (registers) and x as B (shared memory, wgmma.cuh). Per group,
//   per 8-k word: 4 half2 of rows r0 / r1 (unpack8, exact) times the group's fp16 scale, the k order inside
//   a wgmma a permutation A and the staged x share (the x layout, below); the wgmmas accumulate in fp32.
//
// Stripes (Marlin's load balance): the work items are (tile, pair), tile-major, W_items = tiles x pairs.
//   Block b of P (gridDim.x) takes items [b W / P, (b + 1) W / P): the tail of one tile, whole tiles, the
//   head of another. A whole tile's sums go straight through the epilogue functor; a partial segment's
//   fp32 sums go to ws slot 2 b (the block's first segment) or 2 b + 1 (its last), and the block that
//   finishes a tile's last segment (an atomic ticket per tile) adds the slots in block order and runs the
//   epilogue, then resets the ticket for the next launch. P depends on the matrix only (tile_plan.py
//   plan_tiles), not on B, so a column's sums are added in the same order at every batch size.
//
// Tested: tests/test_gemv_gpu.py (every entry against numpy, B = 1 .. 64, 7B / 1.5B / tiny shapes);
//   tests/test_gemm_tiles_plan.py emulates the stripes and the reduction's bookkeeping on the CPU,
//   tests/test_wgmma_tile_mapping.py the x layout and the wgmma data flow, tests/test_gemm_tiles_ring.py
//   the mbarrier hand-over; scripts/tile_probe.py shows on a GPU which x element each output read.
#pragma once
#include "wgmma.cuh"

namespace nq {

constexpr int kTileWarps = 16;                      // consumer warps per block: one m16 tile each
constexpr int kTileThreads = 32 * kTileWarps;
constexpr int kTileMT = 1;                          // m16 tiles per warp
constexpr int kTileUnits = kTileWarps * 8 * kTileMT;  // 128 units = 256 rows per tile
static_assert(kTileUnits == 128, "the tile is 128 units (tile_plan.py TILE_UNITS)");
constexpr int kTileSlots = 2 * kTileUnits;         // row slots per stage
// Producer warps (tile_plan.py TILE_PRODUCERS): step time at 1 / 2 / 4 of them (7B step GEMVs at B = 8:
// 3.17 / 2.67 / 2.46 ms, docs/PERF.md); at 6 or 8 the 768-thread block leaves 80 registers a thread and
// the consumers spill
#ifndef NQ_TILE_PRODUCERS
#define NQ_TILE_PRODUCERS 4
#endif
constexpr int kTileProducers = NQ_TILE_PRODUCERS;
constexpr int kTileBlockThreads = kTileThreads + 32 * kTileProducers;  // the launch's block size
// the ring is aligned to 1024 bytes (the swizzle atoms of x) inside the dynamic shared memory: the
// launcher allocates this much more
constexpr int kTileSmemAlignPad = 1024;

// bytes of one stage for kCols columns (the launcher sizes dynamic shared memory with the same formula):
// weights, scales, then x in 1024-byte atoms, so every stage is 1024-aligned (256 x 132 bytes is 33 x 1024)
template <int kCols>
__host__ __device__ constexpr int tile_stage_bytes() {
  return kTileSlots * 128 + kTileSlots * 4 + kCols * 2 * 2 * kGroup;
}
// Ring depth: NQ_TILE_STAGES (default 8) where they fit kTileSmemCap, else as many as fit (5 / 5 / 4 / 3 at
// 8 / 16 / 32 / 64 columns; tile_plan.py tile_stages mirrors this)
#ifndef NQ_TILE_STAGES
#define NQ_TILE_STAGES 8
#endif
constexpr int kTileSmemCap = 220 * 1024;
template <int kCols>
__host__ __device__ constexpr int tile_stages() {
  return NQ_TILE_STAGES < kTileSmemCap / tile_stage_bytes<kCols>() ? NQ_TILE_STAGES
                                                                    : kTileSmemCap / tile_stage_bytes<kCols>();
}
constexpr int kTileMaxStages = 8;  // the mbarrier arrays
static_assert(NQ_TILE_STAGES <= kTileMaxStages, "NQ_TILE_STAGES: at most 8");

// A barrier among the 16 consumer warps only (named barrier 1: the producers run beside them)
__device__ __forceinline__ void tile_consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kTileThreads) : "memory"); }

// the block that owns work item j when W items are cut into P stripes (the largest b with b W / P <= j)
__device__ __forceinline__ int stripe_of(long long j, long long w_items, int p) {
  return static_cast<int>(((j + 1) * p - 1) / w_items);
}
__device__ __forceinline__ long long stripe_lo(int b, long long w_items, int p) { return b * w_items / p; }

// The ring's start in dynamic shared memory, rounded up to 1024 bytes inside the kTileSmemAlignPad the
// launcher added
__device__ __forceinline__ uint4* tile_ring_base(uint4* raw) {
  return raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u) / 16;
}

// The x layout of a stage (X above): x of every column, placed as wgmma's B operand (wgmma.cuh) in the k
// order of the A fragments. Lane c of a quad holds the weights of words 32 c + 8 w .. + 7 of a group
// (w = 0..3, one 16-byte chunk per lane, as mma.sync had them) and gives the two k16 steps s = 2 w, 2 w + 1
// of the group its half2 pairs: step 2 w + h takes k = 32 c + 8 w + 4 h + {0, 1} into its slots 2 c, 2 c + 1
// and k = .. + {2, 3} into 2 c + 8, 2 c + 9. So the x of step s is not 16 consecutive k but 4 bytes from
// each of 8 places. Step s (0..15 over the pair) of column n is atom (s / 4) x (kCols / 8) + n / 8, row
// n % 8, 16-byte chunk 2 (s % 4) + j (j = 0: slots 0..7, 1: slots 8..15) stored at chunk q ^ (n % 8) (the
// 128-byte swizzle), 4-byte slot c of it. tests/test_wgmma_tile_mapping.py checks the map, the banks and
// the data flow in numpy.
//
// Two ways x gets there:
// - issue_x (o_proj and down, whose x comes from the attention and the gate/up epilogue in the natural
//   [B, K] layout): 4-byte copies. Producer warp pw takes the quarters qq = pw, pw + P, .. (qq = s / 4 =
//   2 gl + w / 2) for every column, lane = 8 c + q (q the unswizzled chunk): a lane's source is a fixed
//   pointer plus n K, its destination a fixed offset plus n / 8 atoms plus, for n % 8 = r known at compile
//   time, row r and chunk q ^ r; the 32 lanes write 32 different banks. Why this order: the first version
//   (one warp per (column, quarter) item) recomputed the item's column and quarter for each copy, ~14.5
//   instructions a copy against ~7.8 here, and at B = 64 the 8,192 x copies of a step are most of the
//   producers' issue (step GEMVs at B = 32 / 64: 3,754 / 5,606 -> 3,628 / 5,339 us; H200, fcb65af).
// - issue_x_pre (q/k/v and gate/up, NQ_TILE_X_PREPERM, default 1; tile_plan.py tile_x_preperm mirrors it): their
//   x comes from an RMSNorm anyway, so nq_norm_cols_wg_h (gemv_mma.cuh norm_cols<K, true>) writes it in this
//   layout, pair after pair (pair pg's x is bytes [pg, pg + 1) x 512 x kCols of it), and the producers copy
//   its first ceil(B / 8) atoms of each quarter as 16-byte chunks (at B = 64: 16 per producer thread per
//   step, against 64 four-byte copies). Measured with issue_x's order on the other two (7B step GEMVs at
//   B = 8 / 16 / 32 / 64): 2,459 / 2,878 / 3,754 / 5,606 us before either -> 2,444 / 2,782 / 3,524 / 5,082;
//   engine steps at B = 32 / 64 4.38 / 6.52 -> 4.12 / 5.95 ms (H200, fcb65af, docs/PERF.md "seventh lease").
#ifndef NQ_TILE_X_PREPERM
#define NQ_TILE_X_PREPERM 1
#endif
#ifndef NQ_TILE_PDL_TRIGGER
#define NQ_TILE_PDL_TRIGGER 1
#endif
template <int K, int kCols>
__device__ __forceinline__ void issue_x(const uint16_t* __restrict__ x, int ncols, int pg, uint4* xs, int warp,
                                        int warps) {
  const int lane = threadIdx.x & 31;
  const int c = lane >> 3, q = lane & 7;
  const int klane = 32 * c + 8 * (q >> 2) + 2 * (q & 3);
  for (int qq = warp; qq < 4; qq += warps) {
    const int k0 = 256 * pg + 128 * (qq >> 1);
    if (K % 256 != 0 && k0 >= K) continue;  // past K (an odd group count's last pair): never read
    const uint16_t* src = x + k0 + 16 * (qq & 1) + klane;
    char* dst = reinterpret_cast<char*>(xs) + qq * (kCols / 8) * 1024 + 4 * c;
    for (int n8 = 0; 8 * n8 < ncols; ++n8, dst += 1024) {
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int n = 8 * n8 + r;
        if (n < ncols) cp_async4(dst + r * 128 + ((q ^ r) << 4), src + static_cast<size_t>(n) * K);
      }
    }
  }
}
template <int K, int kCols>
__device__ __forceinline__ void issue_x_pre(const uint16_t* __restrict__ x, int ncols, int pg, uint4* xs, int warp,
                                            int warps) {
  const int lane = threadIdx.x & 31;
  const int chunks = (ncols + 7) / 8 * 64;  // 16-byte chunks of the used atoms of one quarter
  const char* src = reinterpret_cast<const char*>(x) + static_cast<size_t>(pg) * kCols * 512;
  char* dst = reinterpret_cast<char*>(xs);
  for (int qq = warp; qq < 4; qq += warps) {
    if (K % 256 != 0 && 256 * pg + 128 * (qq >> 1) >= K) continue;  // past K: never written, never read
    const int q0 = qq * (kCols / 8) * 1024;
    for (int ch = lane; ch < chunks; ch += 32) cp_async16(dst + q0 + 16 * ch, src + q0 + 16 * ch);
  }
}

// Multiply one staged pair into acc: per group, the warp dequantizes its 16 rows' 128 k (unpack8, exact q,
// then q * scale in fp16: one rounding; the wgmmas accumulate in fp32) into the A fragments of 8 k16
// steps, then its warpgroup issues them as 8 wgmmas over all the columns at once (x read from the stage by
// the tensor cores, the x layout above). Each group waits for its own wgmmas before the next group's
// fragments are written: with both groups' fragments live (64 registers) ptxas ran out of registers at
// 640 threads and serialized every wgmma (ptxas C7511/C7512, a wait after each one) from 16 columns up.
// The final wait is also what lets the ring refill this stage (its x read) and the epilogue read acc.
// acc is zeroed at a segment's start by plain moves: the fence before each group's wgmmas orders those
// writes too.
template <int K, int NT>
__device__ __forceinline__ void multiply_pair(const uint4* w, const uint32_t* s, const uint4* xs, int pg,
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
    wgmma_wait<0>();  // this group's A registers free again before the next group's are written
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
  // Thread tid sums unit u = tid % 128 of columns tid / 128 + 4 q over the contributors, in block order
  // (the same sums at every batch size). The loads of kJ contributors are issued together before any of
  // them is added: the reduction costs contributors / kJ L2 round trips per pass rather than one per
  // contributor (at 8 / 16 columns: 4 / 2 contributors a round trip). Why: o_proj and q/k/v have ~7
  // contributors per tile (2 work items a block) and the last block's reduction is on the kernel's
  // critical path.
  constexpr int kPer = kTileUnits * kCols / kTileThreads;
  constexpr int kChunk = kPer < 8 ? kPer : 8;  // outputs summed per pass (registers: 2 x kChunk)
  // contributors in flight (registers: 2 x kJ x kChunk): 8 float2 a thread; 16 spilled in the gate/up
  // entry for 64 columns (SASS, tests/test_compile.py)
  constexpr int kJ = 8 / kChunk;
  const int u = tid % kTileUnits, col0 = tid / kTileUnits;
  const int p = t * kTileUnits + u;
  int r0 = 0, r1 = 0;
  if (p < units) map(p, r0, r1);
#pragma unroll
  for (int q0 = 0; q0 < kPer; q0 += kChunk) {
    float o0[kChunk], o1[kChunk];
#pragma unroll
    for (int q = 0; q < kChunk; ++q) o0[q] = o1[q] = 0.f;
    for (int b = b_first; b <= b_last; b += kJ) {
      float2 v[kJ][kChunk];
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        const int bj = b + j;
        const int tb = static_cast<int>(stripe_lo(bj, w_items, p_blocks) / kPairs);
        const int sb = 2 * bj + (tb == t ? 0 : 1);
        const float2* src = reinterpret_cast<const float2*>(ws) + static_cast<size_t>(sb) * kCols * kTileUnits + u;
#pragma unroll
        for (int q = 0; q < kChunk; ++q) {
          const int col = col0 + (kTileThreads / kTileUnits) * (q0 + q);
          v[j][q] = (bj <= b_last && col < ncols) ? __ldcg(src + col * kTileUnits) : make_float2(0.f, 0.f);
        }
      }
#pragma unroll
      for (int j = 0; j < kJ; ++j) {
        if (b + j > b_last) break;
#pragma unroll
        for (int q = 0; q < kChunk; ++q) {
          o0[q] += v[j][q].x;
          o1[q] += v[j][q].y;
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

// out[b] = W . x[b] for b < n_cols (<= 8 NT) over `units` units; x is already normalised (nq_norm_cols_*).
// ws: fp32 [2 P][8 NT][kTileUnits][2]; tickets: int [tiles], zero before the launch (and after it).
// Producer thread pt (0 .. 32 NQ_TILE_PRODUCERS - 1) copies, per step: chunk pt % 8 of the weight rows of
// units pt / 8 + 4 NQ_TILE_PRODUCERS j (both rows of each unit), the scales of slots pt + 32 P j, and x
// quarters pw, pw + P, .. of x (issue_x, or issue_x_pre for an x laid out by nq_norm_cols_wg_h).
template <int K, int NT, bool kXPre = false, class Map, class Epi>
__device__ __forceinline__ void gemm_tiles(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
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
      // one cp.async arrival per producer thread; with an odd group count (test shapes) also one plain
      // arrival, which releases the scales that thread stored itself
      mbar_init(&full_bar[st], (kG % 2 == 0 ? 1 : 2) * 32 * kP);
      mbar_init(&empty_bar[st], kTileWarps);  // one arrival per consumer warp
    }
  }
  __syncthreads();  // the barriers initialised before anyone uses them (the last block-wide barrier)
#if NQ_TILE_PDL_TRIGGER
  // The kernel after this one (we are one wave: P <= SMs, every block resident) is launched now; its
  // blocks take SMs as ours exit (or SMs we leave idle) and a tile GEMM among them issues its first
  // weight copies there while our last blocks still reduce. It reads our outputs only after its pdl_wait,
  // which waits for this grid's completion. H200, bc4631e, bench_batch (7B) steps at B = 8 / 32 / 64:
  // 2.84 / 3.82 / 5.33 ms without, 2.72 / 3.71 / 5.23 with, 2.68 / 3.70 / 5.21 with the attention's
  // trigger too (then in its combine kernel, now in attention_decode.cu once every block has its pages).
  // An A/B knob (NQ_TILE_PDL_TRIGGER=0 turns it off).
  pdl_trigger();
#endif

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
      if constexpr (kXPre)
        issue_x_pre<K, kCols>(x, ncols, pg, base + kTileSlots * 8 + kTileSlots / 4, pw, kP);
      else
        issue_x<K, kCols>(x, ncols, pg, base + kTileSlots * 8 + kTileSlots / 4, pw, kP);
      cp_async_mbar_arrive(&full_bar[st]);
      if constexpr (kG % 2 != 0) mbar_arrive(&full_bar[st]);  // the plain scale stores above (release)
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
      multiply_pair<K, NT>(base, reinterpret_cast<const uint32_t*>(base + kTileSlots * 8),
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

}  // namespace nq
