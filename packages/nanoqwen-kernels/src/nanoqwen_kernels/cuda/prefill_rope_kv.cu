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
  float y0 = x0, y1 = x1;
  if (head < nq::kHeads + nq::kKvHeads) {
    const float inv_freq = nq::kRopeInvFreq[d];  // fp64-computed, rounded once (common.cuh)
    float sn, cs;
    sincosf(static_cast<float>(pos) * inv_freq, &sn, &cs);
    y0 = x0 * cs - x1 * sn;
    y1 = x1 * cs + x0 * sn;
  }
  nq::uint16_t* dst;
  if (head < nq::kHeads) {
    dst = q_out + static_cast<size_t>(i) * nq::kQDim + head * 128;
  } else {
    const bool is_k = head < nq::kHeads + nq::kKvHeads;
    const int kvh = head - nq::kHeads - (is_k ? 0 : nq::kKvHeads);
    const int page = page_table[pos / nq::kPageTokens];
    const size_t off =
        ((static_cast<size_t>(layer) * n_pages + page) * nq::kKvHeads + kvh) * (nq::kPageTokens * 128) +
        (pos % nq::kPageTokens) * 128;
    dst = (is_k ? k_cache : v_cache) + off;
  }
  dst[d] = nq::f2h(y0);
  dst[d + 64] = nq::f2h(y1);
}
