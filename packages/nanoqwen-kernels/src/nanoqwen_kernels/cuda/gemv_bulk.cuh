// gemv_bulk.cuh: the INT4 GEMV of one sequence (B = 1) fed by bulk copies: a producer warp streams the
// weights into a ring of shared-memory stages with cp.async.bulk (the TMA's 1-D copy), the consumer warps
// dequantize them from shared memory into mma.sync's A operand. gemv_int4.cu has its entries (suffix _bulk),
// the same arguments and row maps / epilogues as the half2 loop's.
//
// Why (docs/PERF.md "twelfth lease" has the measurements): the half2 loop keeps its bytes in flight in
// registers, so a warp issues a row pair's loads, waits, multiplies, and the SM's warps fall into step:
// ncu saw the 7B gate/up at 0.63 instructions issued per scheduler per cycle with 1.9 eligible warps, DRAM
// at 53%, phases of everyone waiting and then everyone computing. A bulk copy costs one instruction for a
// whole row slice and lands in shared memory, so the bytes in flight are bounded by the ring (up to ~200 KB
// per SM) instead of by registers, and the consumers compute while the next stages arrive. And the weights
// never change during a decode, so the producer fills the ring before griddepcontrol.wait: for q/k/v and
// o_proj a block's whole share (<= 64 KB on the 7B) is in flight while the previous kernel drains.
//
// Block: kBulkWarps consumer warps + 1 producer warp, one block per SM (the launcher: gemv.py plan_bulk).
// Work: tiles of 8 units (16 rows: rows r0 of units 8t .. 8t+7, then their rows r1, as the Map names them);
//   block b takes tiles [b T / P, (b + 1) T / P) and walks each in K slices of kBulkGroups 128-k groups.
// A stage = one (tile, slice):
//     W  [16 row slots][kBulkRowStride B]  slot i < 8: row r0 of unit 8t + i; slot 8 + i: its row r1;
//                                          slot row = ng x 64 bytes of ValueShuffle words (ng groups)
//     S  [16 row slots][kBulkGroups] fp16  the slice's group scales of each row
//   One bulk copy per row slot (producer lane i), scale pairs by 4-byte cp.async from the same lane (for
//   an odd K / 128, as the test dims have, plain loads and stores: a row's scales are then 2-byte aligned).
//   Bank layout: lane (g, c) reads 16 bytes of slots g and 8 + g at byte 64 gi + 16 c (group gi of the
//   slice); a quarter-warp is slots 2m, 2m+1 x c = 0..3, so the row stride is an odd multiple of 64 bytes
//   (their two 64-byte runs fall in different halves of the 128 banks' bytes): conflict-free.
// Hand-over (mbarriers, as the tile GEMM's ring, gemm_tiles.cuh): full[s] = 1 expect_tx arrival (the
//   weight bytes) + 16 cp.async arrivals (the scales); empty[s] = one arrival per consumer warp.
// Multiply: warp w takes groups gi = w, w + kBulkWarps, .. of each stage; per group and word wd, 4 half2 of
//   rows g and g + 8 (unpack8, exact) are the A fragment of two mma.sync m16n8k16 whose B column 0 is x at
//   the same k (lanes g = 0; the other 7 columns are zeros): the k order inside an mma is a permutation A
//   and B share (gemv_mma.cuh's lane map, x in its swizzled layout). d (fp32, fresh per group) times the
//   group's scale into the lane's two sums (c = 0 lanes hold column 0: row g in d[0], row g + 8 in d[2]).
// Tile end: each warp's 16 sums into part[tile parity], a barrier of the consumer warps, and lanes 0..7 of
//   warp 0 add the warps' sums in warp order and run the epilogue of unit 8t + lane.
//
// Tested: tests/test_gemv_bulk_mapping.py emulates the stage layout, the banks, the work split and the
//   ring's phases in numpy; tests/test_gemv_gpu.py runs every entry against numpy (variant "bulk");
//   tests/test_compile.py checks the SASS (bulk copies, HMMA, no spills).
#pragma once
#include "gemv_mma.cuh"
#include "wgmma.cuh"

namespace nq {

#ifndef NQ_BULK_WARPS
#define NQ_BULK_WARPS 8  // consumer warps per block (gemv.py BULK_WARPS)
#endif
#ifndef NQ_BULK_GROUPS
#define NQ_BULK_GROUPS 16  // 128-k groups per stage (gemv.py BULK_GROUPS)
#endif
constexpr int kBulkWarps = NQ_BULK_WARPS;
constexpr int kBulkConsumers = 32 * kBulkWarps;
constexpr int kBulkThreads = kBulkConsumers + 32;  // + the producer warp
constexpr int kBulkGroups = NQ_BULK_GROUPS;
static_assert(kBulkGroups % 2 == 0, "scale pairs: kBulkGroups must be even");
constexpr int kBulkRows = 16;                                   // row slots per stage (8 units)
constexpr int kBulkRowStride = 64 * (kBulkGroups | 1);          // odd multiple of 64 bytes
constexpr int kBulkStageW = kBulkRows * kBulkRowStride;
constexpr int kBulkStageBytes = kBulkStageW + kBulkRows * kBulkGroups * 2;  // gemv.py bulk_stage_bytes
static_assert(kBulkStageBytes % 16 == 0, "stages must stay 16-byte aligned");
constexpr int kBulkMaxStages = 32;                              // the mbarrier arrays

// A barrier among the consumer warps only (named barrier 1; the producer runs beside them)
__device__ __forceinline__ void bulk_consumer_sync() {
  asm volatile("bar.sync 1, %0;" ::"n"(kBulkConsumers) : "memory");
}

// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared by the TMA unit; the copy
// counts its bytes against `bar`'s expected transaction count
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_u32(dst)), "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// x (RMS-normed when norm_w is given) into xs in gemv_mma.cuh's swizzled chunk order; consumers only.
template <int K>
__device__ __forceinline__ void bulk_stage_x(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                             float eps, uint4* xs, float* red) {
  constexpr int kChunks = K / 8;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  float r = 1.f;
  if (norm_w != nullptr) {  // block-uniform
    float ss = 0.f;
    for (int i = threadIdx.x; i < kChunks; i += kBulkConsumers) ss += sum_squares8(x4[i]);
    ss = warp_sum(ss);
    if (lane == 0) red[warp] = ss;
    bulk_consumer_sync();  // partials visible
    float t = 0.f;
#pragma unroll
    for (int w = 0; w < kBulkWarps; ++w) t += red[w];
    r = rsqrtf(t / K + eps);
  }
  const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
  for (int i = threadIdx.x; i < kChunks; i += kBulkConsumers) {
    uint4 v = x4[i];
    if (norm_w != nullptr) v = rms_apply8(v, w4[i], r);
    xs[xs_slot(i)] = v;
  }
  bulk_consumer_sync();  // xs complete
}

// The producer warp: every stage of the block's tiles, in order, into the ring.
template <int K, class Map>
__device__ __forceinline__ void bulk_produce(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                             int units, int t_lo, int t_hi, int n_stages, char* ring,
                                             uint64_t* full, uint64_t* empty, const Map& map) {
  constexpr int kG = K / kGroup;
  constexpr int kSlices = (kG + kBulkGroups - 1) / kBulkGroups;
  const int lane = threadIdx.x & 31;
  int j = 0;  // the block's stage counter: slot j % n_stages, round j / n_stages
  for (int t = t_lo; t < t_hi; ++t) {
    int row = 0;
    if (lane < kBulkRows) {
      int r0, r1;
      map(min(8 * t + (lane & 7), units - 1), r0, r1);  // a tail tile repeats the last unit (not written)
      row = lane < 8 ? r0 : r1;
    }
    const uint32_t* wrow = qw + static_cast<size_t>(row) * (K / 8);
    const uint16_t* srow = sc + static_cast<size_t>(row) * kG;
    for (int s = 0; s < kSlices; ++s, ++j) {
      const int slot = j % n_stages;
      if (j >= n_stages) mbar_wait(&empty[slot], ((j / n_stages) - 1) & 1);  // its last round consumed
      const int g_lo = s * kBulkGroups, ng = min(kBulkGroups, kG - g_lo);
      char* st = ring + static_cast<size_t>(slot) * kBulkStageBytes;
      if (lane == 0) mbar_arrive_expect_tx(&full[slot], kBulkRows * ng * 64);
      if (lane < kBulkRows) {
        bulk_copy_g2s(st + lane * kBulkRowStride, wrow + g_lo * 16, ng * 64, &full[slot]);
        uint16_t* sdst = reinterpret_cast<uint16_t*>(st + kBulkStageW) + lane * kBulkGroups;
        if constexpr (kG % 2 == 0) {  // scale pairs are 4-byte aligned: cp.async, no wait here
          for (int i = 0; i < ng; i += 2) cp_async4(sdst + i, srow + g_lo + i);
          cp_async_mbar_arrive(&full[slot]);
        } else {  // odd K / 128 (test dims only): plain loads, published by the arrival's release
          for (int i = 0; i < ng; ++i) sdst[i] = srow[g_lo + i];
          mbar_arrive(&full[slot]);
        }
      }
    }
  }
  if constexpr (kG % 2 == 0) cp_async_wait_all();  // nothing of this thread's left in flight when it exits
}

// One block of the bulk GEMV over `units` units (Map / Epi as gemv_int4.cu's half2 loop). Dynamic shared
// memory: xs (K x 2 bytes) then n_stages stages of kBulkStageBytes (gemv.py bulk_smem).
template <int K, class Map, class Epi>
__device__ __forceinline__ void gemv_bulk(const uint32_t* __restrict__ qw, const uint16_t* __restrict__ sc,
                                          const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                          float eps, int units, int n_stages, const Map& map, const Epi& epi) {
  constexpr int kG = K / kGroup;
  constexpr int kSlices = (kG + kBulkGroups - 1) / kBulkGroups;
  extern __shared__ __align__(128) uint4 bulk_dyn[];
  uint4* xs = bulk_dyn;                                      // [K / 8] chunks, swizzled
  char* ring = reinterpret_cast<char*>(bulk_dyn + K / 8);
  __shared__ __align__(8) uint64_t full[kBulkMaxStages], empty[kBulkMaxStages];
  __shared__ float part[2][kBulkWarps][kBulkRows];
  __shared__ float red[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int tiles = (units + 7) / 8;
  const int t_lo = static_cast<int>(static_cast<long long>(blockIdx.x) * tiles / gridDim.x);
  const int t_hi = static_cast<int>(static_cast<long long>(blockIdx.x + 1) * tiles / gridDim.x);
  if (threadIdx.x == 0) {
    for (int s = 0; s < n_stages; ++s) {
      mbar_init(&full[s], 1 + kBulkRows);
      mbar_init(&empty[s], kBulkWarps);
    }
    fence_mbarrier_init();
  }
  __syncthreads();  // barriers initialised before anyone uses them (the only block-wide barrier)
  if (warp == kBulkWarps) {
    // Weights and scales are constant during a decode: the producer starts before the launch-overlap
    // wait (common.cuh pdl_wait) and fills the whole ring while the previous kernel drains.
    bulk_produce<K>(qw, sc, units, t_lo, t_hi, n_stages, ring, full, empty, map);
    return;
  }
  pdl_wait();  // launch overlap (common.cuh): x is the previous kernel's output
  bulk_stage_x<K>(x, norm_w, eps, xs, red);
  const int g = lane >> 2, c = lane & 3;
  int j = 0;
  for (int t = t_lo; t < t_hi; ++t) {
    const int buf = (t - t_lo) & 1;
    float acc0 = 0.f, acc1 = 0.f;  // column 0 of rows g (r0) and g + 8 (r1), in the c = 0 lanes
    for (int s = 0; s < kSlices; ++s, ++j) {
      const int slot = j % n_stages;
      const int g_lo = s * kBulkGroups, ng = min(kBulkGroups, kG - g_lo);
      const char* st = ring + static_cast<size_t>(slot) * kBulkStageBytes;
      const uint16_t* ss = reinterpret_cast<const uint16_t*>(st + kBulkStageW);
      mbar_wait(&full[slot], (j / n_stages) & 1);
      for (int gi = warp; gi < ng; gi += kBulkWarps) {
        const uint4 w0 = *reinterpret_cast<const uint4*>(st + g * kBulkRowStride + gi * 64 + c * 16);
        const uint4 w1 = *reinterpret_cast<const uint4*>(st + (g + 8) * kBulkRowStride + gi * 64 + c * 16);
        const float s0 = h2f(ss[g * kBulkGroups + gi]), s1 = h2f(ss[(g + 8) * kBulkGroups + gi]);
        const int gl = g_lo + gi;
        const uint32_t a[4] = {w0.x, w0.y, w0.z, w0.w}, b[4] = {w1.x, w1.y, w1.z, w1.w};
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};  // two chains of 4 mmas
#pragma unroll
        for (int wd = 0; wd < 4; ++wd) {
          uint32_t q0[4], q1[4];
          unpack8(a[wd], q0);
          unpack8(b[wd], q1);
          const uint4 xv = g == 0 ? xs[xs_slot(gl * 16 + 4 * c + wd)] : make_uint4(0u, 0u, 0u, 0u);
          // A regs {r0, r1, r0, r1}: half2 0 in k-slots 2c, 2c+1, half2 1 in slots 2c+8, 2c+9 (gemv_mma.cuh)
          mma16816(d0, q0[0], q1[0], q0[1], q1[1], xv.x, xv.y);
          mma16816(d1, q0[2], q1[2], q0[3], q1[3], xv.z, xv.w);
        }
        acc0 = fmaf(d0[0] + d1[0], s0, acc0);
        acc1 = fmaf(d0[2] + d1[2], s1, acc1);
      }
      __syncwarp();  // every lane's reads of the stage done
      if (lane == 0) mbar_arrive(&empty[slot]);
    }
    if (c == 0) {
      part[buf][warp][g] = acc0;
      part[buf][warp][g + 8] = acc1;
    }
    bulk_consumer_sync();  // the warps' sums of tile t visible (part[buf] is rewritten two tiles later,
                           // after the next tile's barrier, which warp 0 reaches only past this epilogue)
    if (threadIdx.x < 8) {
      const int p = 8 * t + threadIdx.x;
      if (p < units) {
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < kBulkWarps; ++w) {
          o0 += part[buf][w][threadIdx.x];
          o1 += part[buf][w][threadIdx.x + 8];
        }
        int r0, r1;
        map(p, r0, r1);
        epi(0, p, r0, r1, o0, o1);
      }
    }
  }
}

}  // namespace nq
