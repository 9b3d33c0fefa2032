// prefill_rope_kv.cu: RoPE on q and k of a whole prompt, K and V written into the KV pages.
//
// What, for token i at position p = start_pos + i, x = qkv[i] + bias (bias optional: NULL adds nothing):
//   q_out[i, h]        = rope(x[q head h], p)                 h < NQ_NHEADS
//   k_cache[layer, page_table[p/16], j, p%16, :] = rope(x[k head j], p)
//   v_cache[layer, page_table[p/16], j, p%16, :] = x[v head j]
//   rope (HF rotate-half): for d < 64, with f = p * theta^(-2d/128) in fp32,
//     y[d] = x[d] cos f - x[d+64] sin f,   y[d+64] = x[d+64] cos f + x[d] sin f
// Shapes: qkv fp16 [T, (NQ_NHEADS + 2 NQ_NKV) * 128] (rows q heads, then k, then v: the fused
//   projection's order), q_out fp16 [T, NQ_NHEADS*128], k/v_cache fp16 [L, n_pages, NQ_NKV, 16, 128],
//   page_table int32 [max_pages] (pages for positions < start_pos + T must be assigned).
// Launch: nq_rope_kv_prefill grid (T, NQ_NHEADS + 2*NQ_NKV), 64 threads: thread d owns the pair (d, d+64).
//   ctl (device int32 [2], or NULL): start_pos and the number of real rows, read on the device, so a
//   prefill captured in a CUDA graph for a bucket of T rows serves any prompt of <= T tokens at any
//   position; rows past ctl[1] are padding: their q is written (and never used), their K/V is not.
// Why: one small elementwise pass, with the projection's bias added here in fp32 (as the decode path's
//   qkv_rope_kv adds it: one rounding to fp16, and no separate bias-add kernel per layer); T and start_pos are host ints because prefill is launched eagerly
//   (the decode path, captured in a graph, reads its position from the device instead).
//   inv_freq = 1 / theta^(2d/128) is computed in fp64 and rounded once to fp32 (the correctly rounded
//   value, as the numpy reference and the decode path's qkv_rope_kv in gemv_int4.cu compute it), then
//   angle = fp32(p) * inv_freq and accurate sincosf. Both paths must agree bit for bit: K written by
//   prefill is read by decode, and an ulp of inv_freq is ~2e-3 rad of angle at position 32k.
// Tested: tests/test_prefill_rope_kv.py (numpy float64 reference, pages scattered).
#include "common.cuh"

// The pair (x0, x1) = dims (d, d + 64) of one head at position pos, rotated when `roped` (q and k heads;
// v is copied): the rotate-half RoPE above, inv_freq from the host-computed table (common.cuh).
__device__ __forceinline__ void rope_pair(float x0, float x1, int pos, int d, bool roped, float& y0, float& y1) {
  y0 = x0;
  y1 = x1;
  if (roped) {
    const float inv_freq = nq::kRopeInvFreq[d];  // fp64-computed, rounded once (common.cuh)
    float sn, cs;
    sincosf(static_cast<float>(pos) * inv_freq, &sn, &cs);
    y0 = x0 * cs - x1 * sn;
    y1 = x1 * cs + x0 * sn;
  }
}

// Where head `head` of token i (position pos) goes: its q_out row, or its slot in the K / V page.
__device__ __forceinline__ nq::uint16_t* out_row(int head, int i, int pos, const int* __restrict__ page_table,
                                                 nq::uint16_t* k_cache, nq::uint16_t* v_cache, int layer,
                                                 int n_pages, nq::uint16_t* q_out) {
  if (head < nq::kHeads) return q_out + static_cast<size_t>(i) * nq::kQDim + head * 128;
  const bool is_k = head < nq::kHeads + nq::kKvHeads;
  const int kvh = head - nq::kHeads - (is_k ? 0 : nq::kKvHeads);
  const int page = page_table[pos / nq::kPageTokens];
  const size_t off = ((static_cast<size_t>(layer) * n_pages + page) * nq::kKvHeads + kvh) *
                         (nq::kPageTokens * 128) + (pos % nq::kPageTokens) * 128;
  return (is_k ? k_cache : v_cache) + off;
}

extern "C" __global__ void __launch_bounds__(64)
    nq_rope_kv_prefill(const nq::uint16_t* __restrict__ qkv,     // [T, kQkvRows] fp16
                    const nq::uint16_t* __restrict__ bias,    // [kQkvRows] fp16, or NULL
                    int start_pos,
                    const int* __restrict__ ctl,              // NULL, or [2] = (start_pos, valid rows)
                    const int* __restrict__ page_table,       // [max_pages]
                    nq::uint16_t* __restrict__ k_cache,       // [L, n_pages, NQ_NKV, 16, 128]
                    nq::uint16_t* __restrict__ v_cache,       // same
                    int layer, int n_pages,
                    nq::uint16_t* __restrict__ q_out) {       // [T, kQDim] fp16
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  int valid = gridDim.x;  // rows with a real token
  if (ctl != nullptr) {    // a captured prefill graph: its bucket's rows past ctl[1] are padding
    start_pos = ctl[0];
    valid = ctl[1];
  }
  const int i = blockIdx.x;
  const int head = blockIdx.y;  // 0..kHeads-1 q, then kKvHeads k heads, then kKvHeads v heads
  const int d = threadIdx.x;    // 0..63
  if (i >= valid && head >= nq::kHeads) return;  // a padding row writes no K/V (its page may not exist)
  const int pos = start_pos + i;
  const nq::uint16_t* x = qkv + static_cast<size_t>(i) * nq::kQkvRows + head * 128;
  float x0 = nq::h2f(x[d]), x1 = nq::h2f(x[d + 64]);
  if (bias != nullptr) {
    x0 += nq::h2f(bias[head * 128 + d]);
    x1 += nq::h2f(bias[head * 128 + d + 64]);
  }
  float y0, y1;
  rope_pair(x0, x1, pos, d, head < nq::kHeads + nq::kKvHeads, y0, y1);
  nq::uint16_t* dst = out_row(head, i, pos, page_table, k_cache, v_cache, layer, n_pages, q_out);
  dst[d] = nq::f2h(y0);
  dst[d + 64] = nq::f2h(y1);
}

// nq_rope_kv_prefill_vec: the same results, element for element (the same fp32 operations on each pair),
// with each thread on 4 adjacent pairs (d0..d0+3, d0+64..d0+67) of one head of one token: 8-byte loads
// and stores instead of 2-byte ones, and a flat grid of 256-thread blocks instead of one 64-thread block
// per (token, head) (18,432 blocks at T = 512 on the 7B, each too small to keep loads in flight).
// Launch: grid ceil(rows * kQkvHeads * 16 / 256), 256 threads; rows = T of the launch (the bucket's rows
// when ctl is given: ctl[1] of them are real, as above).
extern "C" __global__ void __launch_bounds__(256)
    nq_rope_kv_prefill_vec(const nq::uint16_t* __restrict__ qkv, const nq::uint16_t* __restrict__ bias,
                           int start_pos, const int* __restrict__ ctl, const int* __restrict__ page_table,
                           nq::uint16_t* __restrict__ k_cache, nq::uint16_t* __restrict__ v_cache, int layer,
                           int n_pages, nq::uint16_t* __restrict__ q_out, int rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  constexpr int kHeadsAll = nq::kHeads + 2 * nq::kKvHeads;
  constexpr int kPerRow = kHeadsAll * 16;  // work items per token: 16 groups of 4 pairs per head
  int valid = rows;
  if (ctl != nullptr) {
    start_pos = ctl[0];
    valid = ctl[1];
  }
  const int item = blockIdx.x * blockDim.x + threadIdx.x;
  if (item >= rows * kPerRow) return;
  const int i = item / kPerRow;
  const int head = (item % kPerRow) / 16;
  const int d0 = (item % 16) * 4;
  if (i >= valid && head >= nq::kHeads) return;  // a padding row writes no K/V (its page may not exist)
  const int pos = start_pos + i;
  const nq::uint16_t* x = qkv + static_cast<size_t>(i) * nq::kQkvRows + head * 128;
  const uint2 lo = *reinterpret_cast<const uint2*>(x + d0);  // halves d0..d0+3, low half first
  const uint2 hi = *reinterpret_cast<const uint2*>(x + d0 + 64);
  uint2 blo = make_uint2(0u, 0u), bhi = make_uint2(0u, 0u);
  if (bias != nullptr) {
    blo = *reinterpret_cast<const uint2*>(bias + head * 128 + d0);
    bhi = *reinterpret_cast<const uint2*>(bias + head * 128 + d0 + 64);
  }
  const bool roped = head < nq::kHeads + nq::kKvHeads;
  // the 4 pairs in a loop that stays rolled: sincosf's slow path (Payne-Hanek reduction for large
  // angles) keeps a local array, and four inlined copies of it spilled (40 local loads/stores in SASS)
  nq::uint32_t ol0 = 0u, ol1 = 0u, oh0 = 0u, oh1 = 0u;  // the outputs, packed two per word as loaded
#pragma unroll 1
  for (int j = 0; j < 4; ++j) {
    const int w = j >> 1, sh = 16 * (j & 1);
    const nq::uint32_t xw0 = w ? lo.y : lo.x, xw1 = w ? hi.y : hi.x;
    const nq::uint32_t bw0 = w ? blo.y : blo.x, bw1 = w ? bhi.y : bhi.x;
    {
      float x0 = nq::h2f(static_cast<nq::uint16_t>(xw0 >> sh)), x1 = nq::h2f(static_cast<nq::uint16_t>(xw1 >> sh));
      if (bias != nullptr) {
        x0 += nq::h2f(static_cast<nq::uint16_t>(bw0 >> sh));
        x1 += nq::h2f(static_cast<nq::uint16_t>(bw1 >> sh));
      }
      float y0, y1;
      rope_pair(x0, x1, pos, d0 + j, roped, y0, y1);
      const nq::uint32_t h0 = static_cast<nq::uint32_t>(nq::f2h(y0)) << sh;
      const nq::uint32_t h1 = static_cast<nq::uint32_t>(nq::f2h(y1)) << sh;
      if (w) { ol1 |= h0; oh1 |= h1; } else { ol0 |= h0; oh0 |= h1; }  // registers, not an indexed array
    }
  }
  nq::uint16_t* dst = out_row(head, i, pos, page_table, k_cache, v_cache, layer, n_pages, q_out);
  *reinterpret_cast<uint2*>(dst + d0) = make_uint2(ol0, ol1);
  *reinterpret_cast<uint2*>(dst + d0 + 64) = make_uint2(oh0, oh1);
}
