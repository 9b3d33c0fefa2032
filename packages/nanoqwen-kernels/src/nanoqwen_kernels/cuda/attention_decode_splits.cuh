// attention_decode_splits.cuh: how decode attention deals a sequence's pages to splits; the split kernel
// (attention_decode.cu) and the combine (attention_decode_combine.cu) both derive the runs from it.
#pragma once
#include "common.cuh"

namespace nq_dec {

// The workspace's first words: nq_attention_decode's ticket counters (ints, 0 between calls), before any
// partial; both decode builds leave them there (attention.py's TICKET_WORDS).
constexpr int kTicketWords = 1024;

// The pages of one split: a sequence of seq_len tokens (clamped to what its page-table row can address,
// so a corrupt length cannot walk off the table) has n_seq_pages pages, dealt to n_splits splits in
// contiguous runs of per_split pages. Both kernels derive the same runs from the same device values.
struct SplitRange {
  int seq_len;    // clamped
  int per_split;  // pages per split (0 for an empty sequence)
  int used;       // splits that hold at least one page
};

__device__ __forceinline__ SplitRange split_range(int seq_len_raw, int max_pages, int n_splits) {
  SplitRange r;
  r.seq_len = min(max(seq_len_raw, 0), max_pages * nq::kPageTokens);
  const int n_seq_pages = (r.seq_len + nq::kPageTokens - 1) / nq::kPageTokens;
  r.per_split = (n_seq_pages + n_splits - 1) / n_splits;
  r.used = r.per_split > 0 ? (n_seq_pages + r.per_split - 1) / r.per_split : 0;
  return r;
}

}  // namespace nq_dec
