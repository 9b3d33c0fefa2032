// attention_prefill_common.cuh: what every causal prefill attention body shares (attention_prefill.cu's
// tensor-core bodies, attention_prefill_fma.cu's fp32 one): which rows, head and keys a block works on,
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
// K (or V) cache [L, n_pages, NQ_NKV, 16, 128]. The guard and the two loads stay in each body's tile
// loop: with them inside a helper NVRTC 12.9 unrolls the tensor-core body's tile loop less (6 instead
// of 14 16-byte global loads in its SASS), a different kernel from the one measured.
__device__ __forceinline__ size_t kv_offset(const int* __restrict__ page_table, int layer, int n_pages, int kvh,
                                            int kp, int dd) {
  return ((static_cast<size_t>(layer) * n_pages + page_table[kp / nq::kPageTokens]) * nq::kKvHeads + kvh) *
             (nq::kPageTokens * 128) +
         (kp % nq::kPageTokens) * 128 + dd;
}

}  // namespace nq_pre_common

// Chunk ch of the K/V tile that starts at key kb, in both bodies' tile loops: declares kk (the key in the
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
