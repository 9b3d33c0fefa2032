// gemv_epilogues.cuh: what a GEMV unit's 2 sums become, shared by every body of gemv_int4.cu (the half2 and
// int8-activation loops, the tensor-core core, the tile GEMM): the row maps that pick a unit's 2 rows
// (PlainRows is gemv_mma.cuh's) and the fused epilogues. gemv_int4.cu's header says why a unit's 2 rows
// are chosen so that every epilogue stays inside one warp (or one thread).
#pragma once

namespace nq {

// ---- epilogues: what happens to the 2 sums of a unit for column (sequence) b ----------------------------
struct PlainEpi {
  const uint16_t* residual;  // [B, n_rows] or null; may alias out: each element is read, then written,
  uint16_t* out;             // by one thread
  int n_rows;
  __device__ void operator()(int b, int, int r0, int r1, float o0, float o1) const {
    const size_t base = static_cast<size_t>(b) * n_rows;
    if (residual != nullptr) {
      o0 += h2f(residual[base + r0]);
      o1 += h2f(residual[base + r1]);
    }
    out[base + r0] = f2h(o0);
    if (r1 != r0) out[base + r1] = f2h(o1);
  }
};

struct QkvRows {  // unit p: head p/64 (q heads, then k, then v), rows d and d+64 of it (d = p % 64)
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = (p / 64) * kHeadDim + p % 64;
    r1 = r0 + 64;  // the pair HF's rotate-half RoPE mixes
  }
};
struct QkvEpi {
  const uint16_t* bias;
  const int32_t* pos;         // [B] position of each sequence's new token
  const int32_t* page_table;  // [B, max_pages]
  int max_pages;
  uint16_t* k_cache;
  uint16_t* v_cache;
  int layer, n_pages;
  uint16_t* q_out;            // [B, kQDim]
  // settled (the B = 1 entries' last argument; 0 elsewhere): pos and page_table were written before the
  // previous kernel released this one (the engine's decode step: the host's control copy and the previous
  // step's `advance`; why that holds: gemv_units.cuh EpiPre), so the B = 1 loop reads column 0's position and
  // page id before its launch-overlap wait, with the weights and the bias (a weight: always settled),
  // instead of two dependent L2 round trips after its sums (pos, then the table entry it indexes).
  int settled;
  // q/k/v's reads that no kernel of the step writes during it, for the B = 1 loop to issue before its wait
  // (gemv_units.cuh EpiPre); at(pre, ...) is the epilogue given them, operator() reads them itself
  struct Pre {
    int ps, page;      // the position, and its page id (-1: none; a padding row)
    float bias0, bias1;
  };
  __device__ Pre pre(int b, int, int r0, int r1) const {
    const int ps = pos[b];
    // A row whose position has no page (a padding row of a batch bucket: page id -1) writes no K/V and
    // gets NaN q, so nothing outside its own outputs changes and garbage shows rather than hides.
    const int blk = ps >= 0 ? ps / kPageTokens : -1;
    const int page = (blk >= 0 && blk < max_pages) ? page_table[static_cast<size_t>(b) * max_pages + blk] : -1;
    return {ps, page, h2f(bias[r0]), h2f(bias[r1])};
  }
  __device__ bool pre_settled() const { return settled != 0; }
  __device__ void operator()(int b, int p, int r0, int r1, float x0, float x1) const {
    at(pre(b, p, r0, r1), b, p, r0, r1, x0, x1);
  }
  __device__ void at(const Pre& pr, int b, int p, int r0, int r1, float x0, float x1) const {
    const int head = p / 64, d = p % 64;
    const int ps = pr.ps, page = pr.page;
    const bool ok = page >= 0 && page < n_pages;
    x0 += pr.bias0;
    x1 += pr.bias1;
    if (head < kHeads + kKvHeads) {  // q or k: rotate the pair (d, d + 64)
      // HF: inv_freq[d] = 1 / theta^(2d/128), angle = pos * inv_freq in fp32. inv_freq is computed in
      // fp64 and rounded once (kRopeInvFreq, common.cuh), so it is the correctly rounded fp32 value (as
      // the engine's numpy reference computes it): an ulp of inv_freq is ~2e-3 rad of angle at pos 32k.
      // Precise sincosf (no fast math) because the angle reaches ~3e4 rad at 32k context.
      const float inv = kRopeInvFreq[d];
      const float ang = static_cast<float>(ps) * inv;
      float sn, cs;
      sincosf(ang, &sn, &cs);
      const float ra = x0 * cs - x1 * sn;
      const float rb = x1 * cs + x0 * sn;
      x0 = ra;
      x1 = rb;
    }
    if (head < kHeads) {
      uint16_t* q = q_out + static_cast<size_t>(b) * kQDim;
      q[r0] = ok ? f2h(x0) : kHalfNaN;
      q[r1] = ok ? f2h(x1) : kHalfNaN;
    } else if (ok) {
      const bool is_k = head < kHeads + kKvHeads;
      const int kvh = head - kHeads - (is_k ? 0 : kKvHeads);
      // k_cache[layer][page][kvh][pos % 16][:]
      const size_t base =
          ((((static_cast<size_t>(layer) * n_pages + page) * kKvHeads + kvh) * kPageTokens) + ps % kPageTokens) *
          kHeadDim;
      uint16_t* dst = is_k ? k_cache : v_cache;
      dst[base + d] = f2h(x0);
      dst[base + d + 64] = f2h(x1);
    }
  }
};

struct GateUpRows {  // gate row p and the up row of the same output element
  __device__ void operator()(int p, int& r0, int& r1) const {
    r0 = p;
    r1 = kInter + p;
  }
};
struct GateUpEpi {
  uint16_t* out;  // [B, kInter]
  __device__ void operator()(int b, int p, int, int, float g, float u) const {
    // HF rounds gate and up to fp16 before the activation; we keep fp32 (within the test tolerance)
    out[static_cast<size_t>(b) * kInter + p] = f2h(g / (1.f + __expf(-g)) * u);
  }
};

}  // namespace nq
