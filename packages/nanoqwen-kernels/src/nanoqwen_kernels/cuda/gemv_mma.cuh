// gemv_mma.cuh: the batched GEMV on tensor cores: out[b] = W . xin[b] for up to 8*NT columns (sequences)
// per pass, each weight read once per pass. Used by gemv_int4.cu (INT4 ValueShuffle weights, every batch
// size; at B = 1 for the matrices where it beats the half2 loop) and gemv_fp16.cu (the lm_head, B >= 2).
//
// What: for each column b of the pass and each row r: out[b][r] = sum_k W[r][k] * xin[b][k], where
//   xin[b] = x[b], or RMSNorm(x[b]) * norm_w when norm_w is given (HF order, common.cuh rms_apply8).
//   Rows come in units of 2 (the row maps below and in gemv_int4.cu); an epilogue functor receives
//   (column, unit, its 2 rows, their 2 sums), so every fused epilogue is written once for all B.
//
// Work split: a block (8 warps) takes one tile of 8 units = 16 rows at a time (grid-stride over tiles);
//   blockIdx.y is the pass (columns pass_cols * y ..; n-tiles past the pass's columns are skipped, so
//   the 32-column build serves any pass of 9..32 columns at the cost of its columns). Per tile, mma.sync m16n8k16 (mma.cuh):
//     A (16 x 16 k):  rows r0 of the 8 units in A rows 0..7, rows r1 in A rows 8..15
//     B (16 k x 8):   column n of n-tile nt = x of sequence 8 nt + n
//     lane (g, c):    unit g of the tile; c picks the 32 k of each 128-k group the lane loads:
//                     one 16-byte piece of each of its two rows (INT4: 4 words = 32 k; fp16: 4 pieces)
//   Warp w takes the groups g = w, w + 8, w + 16, ... of K, so even a 16-row tile keeps 8 warps of
//   weight loads in flight; the 8 warps' partial sums meet in shared memory at the end of the tile.
//   Per group and lane, word wd (8 k) of each row becomes 4 half2 (A operands); two mmas per word and
//   n-tile consume them with the lane's 16 bytes of x (B operands) at the same k. The k order inside
//   an mma is a permutation that A and B share, so each dot product is exact in any order.
//   Per group: d = A B (fp32, fresh), acc += d * scale[row][group] (INT4) or acc += d (fp16).
//   So column b's result does not depend on how many other columns ride along: a sequence gets the same
//   bits at any batch size (the order of every sum is fixed by k, warp and group alone).
//
// x in shared memory (dynamic): [columns of the pass][slice_k + 16] fp16, slice_k = slice_groups * 128.
//   When all of K fits (the launcher's plan, gemv.py) the block stages it once and runs every tile over
//   it; else K is cut into slices of a multiple of 8 groups (the warp of a group stays g % 8, so the
//   sums' order is the same as unsliced) and each tile restages them in turn.
//   Bank layout: lane (g, c) reads 16 bytes of row (column) 8 nt + g at chunk j = 16 gl + 4 c + wd; a
//   quarter-warp (8 lanes: 2 columns x 4 c) must hit 8 distinct 16-byte bank groups. Chunk j is stored
//   at slot j ^ ((j >> 3) & 1) (c = 2, 3 land 16 bytes off c = 0, 1 instead of 128 bytes, the same banks)
//   and a row is padded by 32 bytes (consecutive columns 32 bytes apart modulo 128): conflict-free.
//   Columns past the batch read zeros (a select, no shared-memory access) and are never written out.
//
// Tested: tests/test_gemv_mma_mapping.py emulates this lane mapping, the swizzle and the mma fragments
//   in numpy (CPU); tests/test_gemv_gpu.py runs every entry against numpy for B = 1 .. 64.
#pragma once
#include "mma.cuh"

namespace nq {

constexpr int kThreads = 256;  // 8 warps: 4 schedulers per SM, 2 warps each
constexpr int kWarps = kThreads / 32;
constexpr int kXPad = 16;      // halves of padding per staged x row (bank offset between columns)

// ---- row maps shared by every GEMV -----------------------------------------------------------------
struct PlainRows {  // rows (2p, 2p+1); odd N: the last unit recomputes row N-1 and writes it once
  int n_rows;
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = 2 * p;
    r1 = min(2 * p + 1, n_rows - 1);
  }
};

// ---- weight sources: what one lane loads of one row per 128-k group, and its 4 words as half2 -------
struct Int4Weights {  // ValueShuffle-v1 words (docs/INTERFACES.md section 2) and fp16 group scales
  const uint32_t* __restrict__ qweight;  // [N, K/8]
  const uint16_t* __restrict__ scales;   // [N, K/128]
  // groups per load batch; two batches are in flight (the loop is software-pipelined)
  __device__ static constexpr int in_flight(int) { return 2; }
  static constexpr bool kScaled = true;
  struct Piece {
    uint4 v;     // 4 words = the lane's 32 k
    uint16_t s;  // the group's scale
  };
  template <int K>
  __device__ __forceinline__ Piece load(int row, int g, int c) const {
    Piece p;
    p.v = ld_stream_v4(reinterpret_cast<const uint4*>(qweight + static_cast<size_t>(row) * (K / 8)) + 4 * g + c);
    p.s = scales[static_cast<size_t>(row) * (K / kGroup) + g];
    return p;
  }
  __device__ __forceinline__ static void word(const Piece& p, int wd, uint32_t out[4]) {
    const uint32_t w[4] = {p.v.x, p.v.y, p.v.z, p.v.w};
    unpack8(w[wd], out);  // wd is a constant after unrolling: no local array
  }
  __device__ __forceinline__ static float scale(const Piece& p) { return h2f(p.s); }
};

struct Fp16Weights {  // dense fp16 rows (the lm_head)
  const uint16_t* __restrict__ w;  // [N, K]
  // 4 x 16 B per row per group already: one group per batch, two batches in flight
  __device__ static constexpr int in_flight(int) { return 1; }
  static constexpr bool kScaled = false;
  struct Piece {
    uint4 v[4];  // k = 32c + 8wd .. +7 for wd = 0..3
  };
  template <int K>
  __device__ __forceinline__ Piece load(int row, int g, int c) const {
    const uint4* p4 = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * K + g * kGroup + 32 * c);
    Piece p;
#pragma unroll
    for (int i = 0; i < 4; ++i) p.v[i] = ld_stream_v4(p4 + i);
    return p;
  }
  __device__ __forceinline__ static void word(const Piece& p, int wd, uint32_t out[4]) {
    out[0] = p.v[wd].x;
    out[1] = p.v[wd].y;
    out[2] = p.v[wd].z;
    out[3] = p.v[wd].w;
  }
  __device__ __forceinline__ static float scale(const Piece&) { return 1.f; }
};

// slot of 16-byte chunk j inside a staged x row (see the bank layout above)
__device__ __forceinline__ int xs_slot(int j) { return j ^ ((j >> 3) & 1); }

// RMSNorm factor of each column of the pass into rs[] (norm_w != null; block-uniform). Every thread
// holds one partial per column over the same chunks whatever the column count, and the warps' partials
// are added in warp order: a column's factor is the same bits at every batch size. The column loop is
// inside the chunk loop so each thread has up to kCols independent loads in flight. Barrier inside.
template <int K, int kCols>
__device__ __forceinline__ void column_rms(const uint16_t* __restrict__ x, int ncols, float eps, float* rs,
                                           float (*red)[kCols]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float ss[kCols];
#pragma unroll
  for (int b = 0; b < kCols; ++b) ss[b] = 0.f;
  for (int i = threadIdx.x; i < K / 8; i += kThreads) {
#pragma unroll
    for (int b = 0; b < kCols; ++b)
      if (b < ncols) ss[b] += sum_squares8(x4[static_cast<size_t>(b) * (K / 8) + i]);
  }
#pragma unroll
  for (int b = 0; b < kCols; ++b) {
    const float s = warp_sum(ss[b]);
    if (lane == 0) red[warp][b] = s;
  }
  __syncthreads();  // partials visible
  if (threadIdx.x < ncols) {
    float s = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += red[w][threadIdx.x];
    rs[threadIdx.x] = rsqrtf(s / K + eps);
  }
}

// Stage slice s of every column of the pass into xs (normed when norm_w is given). Every thread calls it;
// the caller's barrier makes it visible. Plain x goes by cp.async (every copy of a thread in flight at
// once, no registers); normed x needs the values in registers, 4 loads batched per thread.
template <int K>
__device__ __forceinline__ void stage_slice(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                            const float* rs, int ncols, int s, int slice_k, uint4* xs) {
  const int row_chunks = (slice_k + kXPad) / 8;
  const int chunks = slice_k / 8;
  const int n = ncols * chunks;
  if (norm_w == nullptr) {
    for (int i = threadIdx.x; i < n; i += kThreads) {
      const int b = i / chunks, j = i - b * chunks;
      const int k = s * slice_k + 8 * j;
      uint4* dst = xs + b * row_chunks + xs_slot(j);
      if (k < K)
        cp_async16(dst, x + static_cast<size_t>(b) * K + k);
      else
        *dst = make_uint4(0u, 0u, 0u, 0u);  // past K (the last slice's tail): zeros, never used
    }
    cp_async_wait_all();
    return;
  }
#pragma unroll 4
  for (int i = threadIdx.x; i < n; i += kThreads) {
    const int b = i / chunks, j = i - b * chunks;
    const int k = s * slice_k + 8 * j;
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (k < K) {
      v = *reinterpret_cast<const uint4*>(x + static_cast<size_t>(b) * K + k);
      v = rms_apply8(v, *reinterpret_cast<const uint4*>(norm_w + k), rs[b]);
    }
    xs[b * row_chunks + xs_slot(j)] = v;
  }
}

// Load batch i0 .. i0+kIF-1 of this warp's groups in the slice (group g_lo + warp + 8 i) of rows r0, r1.
template <int K, int kIF, class W>
__device__ __forceinline__ void load_batch(const W& wsrc, typename W::Piece (&p0)[kIF], typename W::Piece (&p1)[kIF],
                                           int i0, int n_i, int g_lo, int r0, int r1, int c) {
  const int warp = threadIdx.x >> 5;
#pragma unroll
  for (int f = 0; f < kIF; ++f) {
    if (i0 + f < n_i) {  // warp-uniform
      const int gg = g_lo + warp + kWarps * (i0 + f);
      p0[f] = wsrc.template load<K>(r0, gg, c);
      p1[f] = wsrc.template load<K>(r1, gg, c);
    }
  }
}

// Multiply batch i0 of loaded pieces with the staged x: acc[nt] += (A B)_group * scale, group by group.
template <int NT, int kIF, class W>
__device__ __forceinline__ void mma_batch(const typename W::Piece (&p0)[kIF], const typename W::Piece (&p1)[kIF],
                                          int i0, int n_i, const uint4* xs, int row_chunks, int ncols,
                                          float (&acc)[NT][4]) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
#pragma unroll
  for (int f = 0; f < kIF; ++f) {
    if (i0 + f < n_i) {  // warp-uniform: mma.sync needs the whole warp
      const int gl = warp + kWarps * (i0 + f);  // the group's index inside the slice
      float d[NT][4];
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) d[nt][0] = d[nt][1] = d[nt][2] = d[nt][3] = 0.f;
#pragma unroll
      for (int wd = 0; wd < 4; ++wd) {
        uint32_t q0[4], q1[4];
        W::word(p0[f], wd, q0);
        W::word(p1[f], wd, q1);
        const int slot = xs_slot(gl * 16 + 4 * c + wd);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          if (8 * nt >= ncols) break;  // block-uniform: an n-tile with no column costs nothing
          const int col = 8 * nt + g;
          const uint4 xv = col < ncols ? xs[col * row_chunks + slot] : make_uint4(0u, 0u, 0u, 0u);
          // A regs {r0, r1, r0, r1}: half2 0 in k-slots 2c, 2c+1, half2 1 in slots 2c+8, 2c+9
          mma16816(d[nt], q0[0], q1[0], q0[1], q1[1], xv.x, xv.y);
          mma16816(d[nt], q0[2], q1[2], q0[3], q1[3], xv.z, xv.w);
        }
      }
      const float s0 = W::scale(p0[f]), s1 = W::scale(p1[f]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        acc[nt][0] = fmaf(d[nt][0], s0, acc[nt][0]);
        acc[nt][1] = fmaf(d[nt][1], s0, acc[nt][1]);
        acc[nt][2] = fmaf(d[nt][2], s1, acc[nt][2]);
        acc[nt][3] = fmaf(d[nt][3], s1, acc[nt][3]);
      }
    }
  }
}
// The rest of a slice's software pipeline, once batch 0 is in (a0, a1): batch b+1's weight loads are in
// flight while batch b is multiplied, the two register sets taking turns (two batches of loads in flight).
template <int K, int NT, int kIF, class W>
__device__ __forceinline__ void pipelined_slice(const W& wsrc, typename W::Piece (&a0)[kIF],
                                                typename W::Piece (&a1)[kIF], int n_i, int g_lo, int r0, int r1,
                                                int c, const uint4* xs, int row_chunks, int ncols,
                                                float (&acc)[NT][4]) {
  typename W::Piece b0[kIF], b1[kIF];
  for (int i0 = 0; i0 < n_i; i0 += 2 * kIF) {
    load_batch<K, kIF>(wsrc, b0, b1, i0 + kIF, n_i, g_lo, r0, r1, c);
    mma_batch<NT, kIF, W>(a0, a1, i0, n_i, xs, row_chunks, ncols, acc);
    load_batch<K, kIF>(wsrc, a0, a1, i0 + 2 * kIF, n_i, g_lo, r0, r1, c);
    mma_batch<NT, kIF, W>(b0, b1, i0 + kIF, n_i, xs, row_chunks, ncols, acc);
  }
}

// The C fragments of a tile into part[warp][unit][row][column]: acc[nt][0..1] = row r0 of unit g,
// columns 8nt + 2c, +1; acc[nt][2..3] = row r1.
template <int NT, class Part>
__device__ __forceinline__ void store_fragments(Part& part, int warp, int g, int c, const float (&acc)[NT][4]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    part[warp][g][0][8 * nt + 2 * c] = acc[nt][0];
    part[warp][g][0][8 * nt + 2 * c + 1] = acc[nt][1];
    part[warp][g][1][8 * nt + 2 * c] = acc[nt][2];
    part[warp][g][1][8 * nt + 2 * c + 1] = acc[nt][3];
  }
}


// n_cols = B; pass_cols (<= 8 NT) = columns per pass (pass y: columns pass_cols * y ..); slice_groups =
// 128-k groups of x staged at a time (all of K, or a multiple of 8). Every thread calls it.
template <int K, int NT, class W, class Map, class Epi>
__device__ __forceinline__ void gemv_mma(const W& wsrc, const uint16_t* __restrict__ x,
                                         const uint16_t* __restrict__ norm_w, float eps, int units, int n_cols,
                                         int pass_cols, int slice_groups, const Map& map, const Epi& epi) {
  constexpr int kCols = 8 * NT;  // most columns per pass
  constexpr int kG = K / kGroup;
  constexpr int kIF = W::in_flight(NT);
  extern __shared__ uint4 xs[];                 // [ncols][slice_k + kXPad] fp16, swizzled chunks
  __shared__ float part[kWarps][8][2][kCols];   // per warp: unit, row (r0 / r1), column
  __shared__ float red[kWarps][kCols];
  __shared__ float rs[kCols];
  const int col0 = blockIdx.y * pass_cols;
  const int ncols = min(pass_cols, n_cols - col0);  // <= kCols (the launcher's plan)
  const uint16_t* xp = x + static_cast<size_t>(col0) * K;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, c = lane & 3;
  const int slice_k = slice_groups * kGroup;
  const int row_chunks = (slice_k + kXPad) / 8;
  const int n_slices = (kG + slice_groups - 1) / slice_groups;

  pdl_wait();  // launch overlap (common.cuh): nothing read or written before the previous kernel ends
  if (norm_w != nullptr) column_rms<K, kCols>(xp, ncols, eps, rs, red);  // block-uniform branch
  // block-uniform loop (t depends on the block only): the barriers inside are reached by every thread
  const int tiles = (units + 7) / 8;
  bool staged = false;  // block-uniform
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int r0, r1;
    map(min(t * 8 + g, units - 1), r0, r1);  // a tail tile recomputes the last unit; only real units written
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    for (int s = 0; s < n_slices; ++s) {
      const int g_lo = s * slice_groups, g_hi = min(kG, g_lo + slice_groups);
      const int n_i = (g_hi - g_lo - warp + kWarps - 1) / kWarps;  // this warp's groups in the slice
      // Software pipeline over batches of kIF groups: batch b+1's weight loads are in flight while batch b
      // is multiplied, and the first batch's while x is (re)staged (weights do not depend on x).
      typename W::Piece a0[kIF], a1[kIF];
      load_batch<K, kIF>(wsrc, a0, a1, 0, n_i, g_lo, r0, r1, c);
      if (n_slices > 1 || !staged) {
        __syncthreads();  // the previous slice's reads of xs are done; rs is visible
        stage_slice<K>(xp, norm_w, rs, ncols, s, slice_k, xs);
        __syncthreads();  // xs complete
        staged = true;
      }
      pipelined_slice<K, NT, kIF, W>(wsrc, a0, a1, n_i, g_lo, r0, r1, c, xs, row_chunks, ncols, acc);
    }
    store_fragments<NT>(part, warp, g, c, acc);
    __syncthreads();  // all warps' partials of this tile visible
    for (int i = threadIdx.x; i < 8 * ncols; i += kThreads) {
      const int u = i / ncols, b = i - u * ncols;
      const int p = t * 8 + u;
      if (p < units) {
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
          o0 += part[w][u][0][b];
          o1 += part[w][u][1][b];
        }
        int q0, q1;
        map(p, q0, q1);
        epi(col0 + b, p, q0, q1, o0, o1);
      }
    }
    __syncthreads();  // part[] read before the next tile overwrites it
  }
}

#ifndef NQ_PDL_TRIGGER_NORM
#define NQ_PDL_TRIGGER_NORM 1
#endif
// xn[b] = RMSNorm(x[b]) * norm_w for column b = blockIdx.x: the same column_rms factor and rms_apply8 that
// gemv_mma's staging uses, so the tile GEMM (gemm_tiles.cuh) multiplies the same normalised x bits.
// kTileLayout (NQ_TILE_X_PREPERM's nq_norm_cols_wg_h): xn is written in the tile GEMM's stage layout for x
// instead (gemm_tiles.cuh's x layout, pair after pair, tile_cols = the build's columns), and norm_w may be NULL
// (x only re-laid out). Chunk i (k = 8 i .. + 7) of column n: in its 128-k group gl, c = lane quad's 32-k
// slice, w = word; its 4 half2 go to q = 4 (w % 2) + {0, 1, 2, 3} of quarter qq = 2 gl + w / 2.
template <int K, bool kTileLayout = false>
__device__ __forceinline__ void norm_cols(const uint16_t* __restrict__ x, const uint16_t* __restrict__ norm_w,
                                          float eps, uint16_t* __restrict__ xn, int tile_cols = 0) {
  __shared__ float red[kWarps][1];
  __shared__ float rs[1];
  const size_t base = static_cast<size_t>(blockIdx.x) * K;
  pdl_wait();  // launch overlap (common.cuh)
#if NQ_PDL_TRIGGER_NORM
  pdl_trigger();  // the tile GEMM after it may place its blocks and issue its weight copies now (common.cuh)
#endif
  const bool norm = !kTileLayout || norm_w != nullptr;  // block-uniform
  if (norm) {
    column_rms<K, 1>(x + base, 1, eps, rs, red);
    __syncthreads();  // rs visible
  }
  const uint4* x4 = reinterpret_cast<const uint4*>(x + base);
  const uint4* w4 = reinterpret_cast<const uint4*>(norm_w);
  if constexpr (!kTileLayout) {
    uint4* o4 = reinterpret_cast<uint4*>(xn + base);
    for (int i = threadIdx.x; i < K / 8; i += kThreads) o4[i] = rms_apply8(x4[i], w4[i], rs[0]);
  } else {
    char* out = reinterpret_cast<char*>(xn);
    const int n = blockIdx.x, r = n & 7;
    for (int i = threadIdx.x; i < K / 8; i += kThreads) {
      const uint4 v = norm ? rms_apply8(x4[i], w4[i], rs[0]) : x4[i];
      const int k = 8 * i, pg = k >> 8, gl = (k >> 7) & 1, c = (k >> 5) & 3, w = (k >> 3) & 3;
      const int qq = 2 * gl + (w >> 1);
      char* atom = out + static_cast<size_t>(pg) * tile_cols * 512 + (qq * (tile_cols / 8) + (n >> 3)) * 1024 +
                   r * 128 + 4 * c;
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) *reinterpret_cast<uint32_t*>(atom + (((4 * (w & 1) + j) ^ r) << 4)) = h[j];
    }
  }
}

}  // namespace nq
