// attention_prefill_common.cuh: what every causal prefill attention body shares (attention_prefill.cu's
// wgmma body, attention_prefill_fma.cu's fp32 one): which rows, head and keys a block works on,
// where a key's K/V sits in the pages, and the one argument list prefill.py launches every body with.
#pragma once
#include "mma.cuh"

// What both bodies share: which rows, head and keys a block works on, and how a key's K/V is read.
namespace nq_pre_common {

// One block of either body: query rows [q0, q0 + rows) of query head h, which reads KV head kvh (GQA).
// Its keys are positions [0, kv_end): causal, no key past the block's last row's position (and none
// past the sequence, kv_len = start_pos + T).
struct Block {
  int q0, h, kvh, kv_len, kv_end;
  // heavy_first: block x takes query block gridDim.x - 1 - x, so the blocks with the most keys start first
  // and the grid's last wave holds the short ones (the copy pipeline's build; the others as measured)
  __device__ __forceinline__ Block(int rows, int start_pos, int T, bool heavy_first = false) {
    q0 = (heavy_first ? gridDim.x - 1 - blockIdx.x : blockIdx.x) * rows;
    h = blockIdx.y;
    kvh = h / (nq::kHeads / nq::kKvHeads);
    kv_len = start_pos + T;
    kv_end = min(start_pos + q0 + rows, kv_len);
  }
};

// Element offset of dims dd .. dd+7 of key position kp, KV head kvh of `layer`, in its page of the
// K (or V) cache [L, n_pages, NQ_NKV, 16, 128], for the fp32 body's tile loop (the wgmma body copies
// through attention_prefill.cu's KvCopier). The guard and the two loads stay in the loop itself: with them
// inside a helper NVRTC 12.9 unrolled an earlier mma.sync body's tile loop less (6 instead of 14 16-byte
// global loads in its SASS).
__device__ __forceinline__ size_t kv_offset(const int* __restrict__ page_table, int layer, int n_pages, int kvh,
                                            int kp, int dd) {
  return ((static_cast<size_t>(layer) * n_pages + page_table[kp / nq::kPageTokens]) * nq::kKvHeads + kvh) *
             (nq::kPageTokens * 128) +
         (kp % nq::kPageTokens) * 128 + dd;
}


// ---- the tensor-core body's per-warp fragments (attention_prefill.cu) -----------------------------------
// A warp owns 16 query rows; lane (g = lane / 4, t = lane % 4) holds rows r0 = g and r1 = g + 8 of them in
// mma.sync m16n8k16's fragments (mma.cuh), which are also a warpgroup MMA's per-warp A and D fragments
// (wgmma.cuh): the scores' D fragments go straight into the softmax, and P comes out as wgmma A operands.

// Q A fragments for the 8 dim steps: a0 (row r0, dims 16kk+2t, +1), a1 (row r1), a2/a3 (dims +8); zeros
// for rows past T.
__device__ __forceinline__ void load_q_frags(const nq::uint16_t* __restrict__ q, int h, int r0, int r1, int T,
                                             int t, nq::uint32_t (&qa)[8][4]) {
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) {
    const int d0 = 16 * kk + 2 * t;
    const nq::uint16_t* p0 = q + static_cast<size_t>(r0) * nq::kQDim + h * 128;
    const nq::uint16_t* p1 = q + static_cast<size_t>(r1) * nq::kQDim + h * 128;
    qa[kk][0] = r0 < T ? *reinterpret_cast<const nq::uint32_t*>(p0 + d0) : 0u;
    qa[kk][1] = r1 < T ? *reinterpret_cast<const nq::uint32_t*>(p1 + d0) : 0u;
    qa[kk][2] = r0 < T ? *reinterpret_cast<const nq::uint32_t*>(p0 + d0 + 8) : 0u;
    qa[kk][3] = r1 < T ? *reinterpret_cast<const nq::uint32_t*>(p1 + d0 + 8) : 0u;
  }
}

// 2^x in one MUFU.EX2 (ex2.approx.ftz: ~2 ulp, subnormal results flushed to 0). exp2f without fast math
// is 4-5 instructions (a range check and a rescale around the MUFU, for subnormal results) and was a
// third of the wgmma body's softmax instructions; a probability below 2^-126 changes no fp16 output.
__device__ __forceinline__ float ex2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// One key tile (keys kb .. kb+63) once its scores s are in registers (s[nt][0..1]: row r0, keys
// kb + 8nt + 2t, +1; s[nt][2..3]: row r1): the causal mask (kMask), the online-softmax update of (m, l),
// O rescaled by exp(m_old - m_new), and P as the A fragments of the 4 key steps of P V, rounded to fp16
// (as FlashAttention does). m is kept in the log2 domain (scores times kScaleLog2).
// kMask = false is for a tile every one of whose keys every row of the block may see (all but the
// diagonal tiles of a long prompt): no mask, no -inf cases (every score is finite), the scale folded
// into each exponent's FFMA, MUFU.EX2 directly, and O's rescale skipped when no row of the warp got a
// new maximum (alpha = 1 exactly; the common case once a row has seen a few tiles). ~5 instructions per
// score instead of ~14.
template <bool kMask>
__device__ __forceinline__ void tile_softmax(float (&s)[8][4], float (&m)[2], float (&l)[2], float (&o)[16][4],
                                             nq::uint32_t (&pa)[4][4], int kb, int lane, int r0, int r1,
                                             int qpos0, int qpos1, int T) {
  using nq::neg_inf;
  const int t = lane & 3;
  // row maxima: rows r0 (s[][0..1]) and r1 (s[][2..3]); masked scores scaled here and set to -inf,
  // unmasked ones left raw (the scale is positive: it moves into m_new and each exponent's FFMA)
  float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kMask) {
        const int kp = kb + 8 * nt + 2 * t + (j & 1);
        const bool ok = (j < 2) ? (r0 < T && kp <= qpos0) : (r1 < T && kp <= qpos1);
        s[nt][j] = ok ? s[nt][j] * nq::kScaleLog2 : neg_inf();
      }
      mx[j >> 1] = fmaxf(mx[j >> 1], s[nt][j]);
    }
  }
  float alpha[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 1));
    mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], 2));
    if constexpr (kMask) {
      const float m_new = fmaxf(m[i], mx[i]);
      // rows past T, or with nothing visible yet, keep m = -inf: no -inf - -inf
      alpha[i] = m_new == neg_inf() ? 1.f : exp2f(m[i] - m_new);
      m[i] = m_new;
    } else {
      const float m_new = fmaxf(m[i], mx[i] * nq::kScaleLog2);  // finite: every score is
      alpha[i] = ex2_fast(m[i] - m_new);                         // m = -inf before any tile: 0
      m[i] = m_new;
    }
    l[i] *= alpha[i];
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
    float p[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      if constexpr (kMask) {
        p[j] = s[nt][j] == neg_inf() ? 0.f : exp2f(s[nt][j] - m[j >> 1]);
      } else {
        p[j] = ex2_fast(fmaf(s[nt][j], nq::kScaleLog2, -m[j >> 1]));
      }
      l[j >> 1] += p[j];
    }
    // key step kk = nt/2: a0/a1 from the even key tile (keys 16kk+2t..), a2/a3 from the odd one
    pa[nt >> 1][(nt & 1) * 2 + 0] = nq::pack_h2(p[0], p[1]);  // row g
    pa[nt >> 1][(nt & 1) * 2 + 1] = nq::pack_h2(p[2], p[3]);  // row g+8
  }
  // O's rescale; an unmasked tile skips it when no row of the warp got a new maximum (warp-uniform)
  if (kMask || __any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      o[n][0] *= alpha[0]; o[n][1] *= alpha[0];
      o[n][2] *= alpha[1]; o[n][3] *= alpha[1];
    }
  }
}

// The block's end: full row sums (the 4 lanes of a row each hold part of one), O / l written as fp16
// (o[n]: dims 8n + 2t, +1 of rows r0 and r1; rows past T are not written).
__device__ __forceinline__ void write_rows(const float (&o)[16][4], float (&l)[2], nq::uint16_t* __restrict__ out,
                                           int h, int r0, int r1, int T, int t) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 1);
    l[i] += __shfl_xor_sync(0xffffffffu, l[i], 2);
  }
  const float inv0 = l[0] > 0.f ? 1.f / l[0] : 0.f, inv1 = l[1] > 0.f ? 1.f / l[1] : 0.f;
#pragma unroll
  for (int n = 0; n < 16; ++n) {
    const int d = 8 * n + 2 * t;
    if (r0 < T)
      *reinterpret_cast<nq::uint32_t*>(out + static_cast<size_t>(r0) * nq::kQDim + h * 128 + d) =
          nq::pack_h2(o[n][0] * inv0, o[n][1] * inv0);
    if (r1 < T)
      *reinterpret_cast<nq::uint32_t*>(out + static_cast<size_t>(r1) * nq::kQDim + h * 128 + d) =
          nq::pack_h2(o[n][2] * inv1, o[n][3] * inv1);
  }
}

}  // namespace nq_pre_common

// Chunk ch of the K/V tile that starts at key kb, in the fp32 body's tile loop: declares kk (the key in the
// tile), dd (its first dim), kp (its position) and kr, vr (16 bytes of K and of V; zeros beyond the
// sequence, never a page's stale, maybe NaN, bytes). A macro rather than a function for the reason
// kv_offset gives: the same source text, so the same SASS as measured.
#define NQ_KV_CHUNK(ch, kb)                                                        \
  const int kk = (ch) >> 4, dd = ((ch) & 15) * 8;                                  \
  const int kp = (kb) + kk;                                                        \
  uint4 kr = make_uint4(0u, 0u, 0u, 0u), vr = make_uint4(0u, 0u, 0u, 0u);          \
  if (kp < blk.kv_len) {                                                           \
    const size_t off = kv_offset(page_table, layer, n_pages, blk.kvh, kp, dd);     \
    kr = *reinterpret_cast<const uint4*>(k_cache + off);                           \
    vr = *reinterpret_cast<const uint4*>(v_cache + off);                           \
  }

// The arguments of both bodies: one contract, so prefill.py launches either with the same tuple.
#define NQ_ATTENTION_PREFILL_ARGS                                                                   \
  const nq::uint16_t *__restrict__ q,          /* [T, kQDim], roped */                              \
      const nq::uint16_t *__restrict__ k_cache, /* [L, n_pages, NQ_NKV, 16, 128] */                 \
      const nq::uint16_t *__restrict__ v_cache, /* same */                                          \
      const int *__restrict__ page_table,       /* [max_pages] */                                   \
      int start_pos, int T,                                                                         \
      const int *__restrict__ ctl, /* NULL, or [2] = (start_pos, T) read on the device */            \
      int layer, int n_pages,                                                                       \
      nq::uint16_t *__restrict__ out            /* [T, kQDim] */
