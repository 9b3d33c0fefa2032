// sampling.cu: picking the next token of every row of a batch on the device (no host sync: a decode
// step stays one CUDA graph).
//
// What (row b of a batch of B; logits row b = logits + b * n):
//   nq_argmax   token_out[b] = argmax(logits[b]), the lowest id on ties (numpy's rule). NaN logits are
//               skipped.
//   nq_sample   the engine's sampler pipeline (nanoqwen_engine.sampler, transformers' order) with row b's
//               own parameters, RNG stream and presence mask: repetition penalty over the mask ->
//               temperature -> top-k -> top-p -> min-p -> softmax -> one draw from a counter-based RNG;
//               temperature 0 is the argmax of the penalised logits, so greedy and sampled rows mix in
//               one launch. It marks the drawn id in row b's mask and advances row b's RNG step.
//   nq_advance  pos[b] += 1, seq_len[b] += 1 for every active row (seq_len > 0); idle (padding) rows,
//               seq_len 0, stay idle.
// Shapes/dtypes: logits fp32 [B, n]; token_out int32 [B]; history uint8 [B, n] (1 = id seen in row b's
//   sequence); params fp32 [B, 5] = temperature, top_k, top_p, min_p, repetition_penalty; rng uint64
//   [B, 2] = seed, step. All in device memory, so one captured graph serves every request mix.
// Launch: nq_argmax: grid (blocks_per_row, B) x 256 threads; in each row the last block to finish (an
//   atomic ticket per row) reduces the row's per-block winners and re-arms its ticket, so the kernel
//   replays in a graph. blocks_per_row is a launch argument (sampling.py: 128 at B = 1, fewer per row
//   as B grows, so the grid stays a few hundred blocks). nq_sample: grid (B) x 1024 threads, one block
//   per row (V = 152064 is 149 logits per thread). nq_advance: ceil(B / 128) x 128.
//
// nq_sample, step by step for one row (x_i = processed logit of id i, key_i = x_i's bits mapped to an
//   unsigned integer of the same order):
//   1. M = max x_i (and the argmax, which is the answer when temperature == 0).
//   2. K = top_k when 0 < top_k < V, else V; capped at kCand = 1024. Radix select (4 passes of 8 bits,
//      shared-memory histograms) finds the K-th largest key; the ids at or above it are gathered (ties
//      with the K-th kept, up to the cap) and bitonic-sorted by (x descending, id ascending).
//   3. Z = sum exp(x_i - M) over the top-k survivors: all of V when top-k is off (exact), else over the
//      candidates. top-p keeps a candidate when the probability mass strictly above it is < top_p
//      (transformers' rule: remove when the ascending cumulative sum including it is <= 1 - top_p);
//      min-p keeps x_i >= M + log(min_p). The best candidate always stays.
//   4. u = uniform(seed, step) * (kept mass); the first candidate (in sorted order) whose inclusive
//      cumulative mass exceeds u is the token.
// Approximation, stated: when top-k is off or above 1024, only the 1024 largest logits can be drawn. For
//   an LLM's logits the mass beyond the 1024th token is normally tiny; with top_p < 1 the kept set
//   is usually far smaller than 1024 anyway; the draw is then renormalised over the kept candidates, so
//   the result is a proper distribution. The same seed does not reproduce the numpy sampler's ids (a
//   different RNG and cumulative order); the distribution is the same (tested empirically).
// RNG: splitmix64 of (seed, step) -> 53-bit uniform; counter-based, so a row's draw depends only on its
//   seed, its step and its logits, never on which row of which batch it ran in; no state but the step
//   counter lives on the device. The engine sets step = the position of the token being drawn, so a
//   sequence's stream survives moving between rows.
// Tested: tests/test_sampling_gpu.py (argmax exact incl. ties, per row; masks respected, seeded
//   reproducible, rows independent of their batch, empirical distribution vs the expected one by a
//   chi-square bound).
#include "common.cuh"

namespace nq {

constexpr int kArgThreads = 256;
constexpr int kSampThreads = 1024;
constexpr int kCand = 1024;  // candidate cap (see header)

__device__ __forceinline__ uint32_t order_key(float f) {
  const uint32_t b = __float_as_uint(f);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);  // larger float -> larger key
}

__device__ __forceinline__ uint64_t splitmix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// (value, id) max with the lowest id on ties; NaN never wins.
__device__ __forceinline__ void better(float& v, int& i, float v2, int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float v2 = __shfl_xor_sync(0xffffffffu, v, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, i, o);
    better(v, i, v2, i2);
  }
}

// Block argmax; every thread must call it; result valid in every thread.
template <int kThreads>
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
  warp_argmax(v, i);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if (lane == 0) {
    sv[warp] = v;
    si[warp] = i;
  }
  __syncthreads();  // per-warp winners visible
  v = lane < kThreads / 32 ? sv[lane] : -NQ_INF;
  i = lane < kThreads / 32 ? si[lane] : 0x7fffffff;
  warp_argmax(v, i);
  __syncthreads();  // sv/si reusable
}

__device__ __forceinline__ float processed(const float* logits, const uint8_t* history, int i, float penalty,
                                           float inv_temp) {
  float x = logits[i];
  if (history[i]) x = x > 0.f ? x / penalty : x * penalty;
  return x * inv_temp;
}

}  // namespace nq

using namespace nq;

extern "C" __global__ void __launch_bounds__(kArgThreads) nq_argmax(
    const float* __restrict__ logits,  // [B, n] fp32
    int n,                             // V
    float* part_v, int* part_i,        // [B, gridDim.x] workspace: per-block winners
    unsigned int* ticket,              // [B] workspace, 0 between launches
    int32_t* __restrict__ token_out) { // [B]
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ bool last;
  const int row = blockIdx.y, nblk = gridDim.x;
  const float* x = logits + static_cast<size_t>(row) * n;
  float v = -NQ_INF;
  int idx = 0x7fffffff;
  for (int i = blockIdx.x * kArgThreads + threadIdx.x; i < n; i += nblk * kArgThreads) better(v, idx, x[i], i);
  block_argmax<kArgThreads>(v, idx, sv, si);
  if (threadIdx.x == 0) {
    part_v[row * nblk + blockIdx.x] = v;
    part_i[row * nblk + blockIdx.x] = idx;
    __threadfence();  // winner visible device-wide before the ticket says so
    last = atomicAdd(&ticket[row], 1u) == static_cast<unsigned int>(nblk - 1);
  }
  __syncthreads();  // `last` visible to the block
  if (!last) return;  // block-uniform exit: no barrier is skipped by part of a block
  __threadfence();    // pairs with the writers' fence: read the other blocks' winners fresh
  v = -NQ_INF;
  idx = 0x7fffffff;
  for (int b = threadIdx.x; b < nblk; b += kArgThreads) {
    const float pv = *reinterpret_cast<volatile float*>(part_v + row * nblk + b);
    const int pi = *reinterpret_cast<volatile int*>(part_i + row * nblk + b);
    better(v, idx, pv, pi);
  }
  block_argmax<kArgThreads>(v, idx, sv, si);
  if (threadIdx.x == 0) {
    token_out[row] = idx == 0x7fffffff ? 0 : idx;  // all-NaN logits: id 0 rather than garbage
    ticket[row] = 0;  // re-arm for the next launch (graph replay)
  }
}

extern "C" __global__ void __launch_bounds__(kSampThreads) nq_sample(
    const float* __restrict__ logits_all,   // [B, n] fp32
    int n,                                  // V
    const float* __restrict__ params_all,   // [B, 5] temperature, top_k, top_p, min_p, repetition_penalty
    uint64_t* __restrict__ rng_all,         // [B, 2] seed, step (step += 1 here)
    uint8_t* __restrict__ history_all,      // [B, n] presence masks; the drawn id is marked
    int32_t* __restrict__ token_all) {      // [B]
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  // one block per row: everything below is row b's
  const int row = blockIdx.x;
  const float* logits = logits_all + static_cast<size_t>(row) * n;
  const float* params = params_all + row * 5;
  uint64_t* rng = rng_all + row * 2;
  uint8_t* history = history_all + static_cast<size_t>(row) * n;
  int32_t* token_out = token_all + row;
  __shared__ float sv[32];
  __shared__ int si[32];
  __shared__ float sred[32];
  __shared__ unsigned int hist[256];         // radix-select histogram
  __shared__ uint32_t s_prefix;              // key prefix of the K-th largest, built 8 bits a pass
  __shared__ unsigned int s_remaining;       // rank still to find inside the current prefix
  __shared__ unsigned int s_count;           // candidates gathered
  __shared__ uint64_t cand[kCand];           // (key << 32) | (0xffffffff - id), sorted descending: 8 KB
  __shared__ float scan[kSampThreads];       // prefix sums over the sorted candidates
  const int tid = threadIdx.x;

  const float temperature = params[0];
  const int top_k = static_cast<int>(params[1]);
  const float top_p = params[2];
  const float min_p = params[3];
  const float penalty = params[4];
  const bool greedy = !(temperature > 0.f);
  const float inv_temp = greedy ? 1.f : 1.f / temperature;

  // 1. max (and argmax) of the processed logits
  float m = -NQ_INF;
  int am = 0x7fffffff;
  for (int i = tid; i < n; i += kSampThreads) better(m, am, processed(logits, history, i, penalty, inv_temp), i);
  block_argmax<kSampThreads>(m, am, sv, si);
  if (greedy) {  // block-uniform
    if (tid == 0) {
      const int tok = am == 0x7fffffff ? 0 : am;
      token_out[0] = tok;
      history[tok] = 1;
      rng[1] += 1;
    }
    return;
  }

  // 2. radix select of the K-th largest key
  const unsigned int k_want = static_cast<unsigned int>(min((top_k > 0 && top_k < n) ? top_k : n, kCand));
  if (tid == 0) {
    s_prefix = 0;
    s_remaining = k_want;
    s_count = 0;
  }
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (tid < 256) hist[tid] = 0;
    __syncthreads();  // histogram cleared, s_prefix/s_remaining of the previous pass visible
    const uint32_t prefix = s_prefix;
    const uint32_t hmask = shift == 24 ? 0u : (0xffffffffu << (shift + 8));
    for (int i = tid; i < n; i += kSampThreads) {
      const uint32_t key = order_key(processed(logits, history, i, penalty, inv_temp));
      if ((key & hmask) == prefix) atomicAdd(&hist[(key >> shift) & 0xffu], 1u);
    }
    __syncthreads();  // histogram complete
    if (tid < 32) {
      // warp 0 finds the digit: bins scanned from the top (digit 255) down, 8 per lane
      const unsigned int want = s_remaining;  // every lane reads before the one lane below writes
      unsigned int c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        c[j] = hist[255 - (8 * tid + j)];
        sum += c[j];
      }
      unsigned int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const unsigned int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (tid >= o) incl += t;
      }
      const unsigned int excl = incl - sum;
      __syncwarp();  // all lanes' reads of s_remaining done
      if (excl < want && want <= incl) {  // exactly one lane
        unsigned int acc = excl;
        for (int j = 0; j < 8; ++j) {
          if (acc + c[j] >= want) {
            s_prefix = prefix | (static_cast<uint32_t>(255 - (8 * tid + j)) << shift);
            s_remaining = want - acc;
            break;
          }
          acc += c[j];
        }
      }
    }
    __syncthreads();  // new prefix visible
  }
  const uint32_t kth = s_prefix;

  // gather: strictly above the K-th first (fewer than K of them), then ties up to the cap
  float zpart = 0.f;
  for (int i = tid; i < n; i += kSampThreads) {
    const float x = processed(logits, history, i, penalty, inv_temp);
    const uint32_t key = order_key(x);
    if (key > kth) {
      const unsigned int s = atomicAdd(&s_count, 1u);
      cand[s] = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    }
    if (key >= kth) zpart += expf(x - m);  // the top-k survivors' mass (all of V when top-k is off)
  }
  __syncthreads();  // strict candidates placed
  for (int i = tid; i < n; i += kSampThreads) {
    const uint32_t key = order_key(processed(logits, history, i, penalty, inv_temp));
    if (key == kth) {
      const unsigned int s = atomicAdd(&s_count, 1u);
      if (s < kCand) cand[s] = (static_cast<uint64_t>(key) << 32) | (0xffffffffu - static_cast<uint32_t>(i));
    }
  }
  const float z_topk = block_sum<kSampThreads>(zpart, sred);  // barriers inside: gathers complete
  const unsigned int count = min(s_count, static_cast<unsigned int>(kCand));
  for (int s = count + tid; s < kCand; s += kSampThreads) cand[s] = 0;  // pads sort last
  __syncthreads();
  // top-k off: Z is over all of V; top-k on: the same sum covers exactly the survivors (ties beyond
  // the cap excepted), so z_topk serves both.
  const float z = z_topk;

  // bitonic sort, descending; each thread owns one element index per compare step
  for (int size = 2; size <= kCand; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      const int i = tid, j = i ^ stride;
      if (j > i) {
        const bool desc = (i & size) == 0;
        const uint64_t a = cand[i], b = cand[j];
        if ((a < b) == desc) {
          cand[i] = b;
          cand[j] = a;
        }
      }
      __syncthreads();  // one compare-exchange layer complete
    }
  }

  // 3. keep rules over the sorted candidates; thread t owns candidate t
  const bool valid = tid < static_cast<int>(count);
  const uint64_t c = cand[tid];
  const int id = static_cast<int>(0xffffffffu - static_cast<uint32_t>(c & 0xffffffffu));
  const float x = valid ? processed(logits, history, id, penalty, inv_temp) : -NQ_INF;
  const float e = valid ? expf(x - m) : 0.f;
  // inclusive scan of probabilities (Hillis-Steele in shared memory; 10 steps)
  scan[tid] = e / z;
  __syncthreads();
  for (int o = 1; o < kSampThreads; o <<= 1) {
    const float t = tid >= o ? scan[tid - o] : 0.f;
    __syncthreads();  // all reads of this step before any write
    scan[tid] += t;
    __syncthreads();
  }
  const float above = scan[tid] - e / z;  // probability mass strictly above this candidate
  bool keep = valid;
  if (top_p < 1.f && tid > 0 && !(above < top_p)) keep = false;
  if (min_p > 0.f && tid > 0 && x < m + logf(min_p)) keep = false;
  const float wgt = keep ? e : 0.f;
  __syncthreads();  // scan[] reads done before reuse
  scan[tid] = wgt;
  __syncthreads();
  for (int o = 1; o < kSampThreads; o <<= 1) {
    const float t = tid >= o ? scan[tid - o] : 0.f;
    __syncthreads();
    scan[tid] += t;
    __syncthreads();
  }
  const float total = scan[kSampThreads - 1];

  // 4. the draw
  const uint64_t seed = rng[0], step = rng[1];
  const uint64_t h = splitmix64(seed ^ splitmix64(step + 0x632BE59BD9B4E019ull));
  const float u = static_cast<float>(static_cast<double>(h >> 11) * (1.0 / 9007199254740992.0)) * total;
  const float prev = tid > 0 ? scan[tid - 1] : 0.f;
  // first kept candidate whose inclusive sum exceeds u; u < total, so one exists (rounding aside)
  __shared__ int s_pick;
  if (tid == 0) s_pick = 0x7fffffff;
  __syncthreads();
  if (keep && prev <= u && u < scan[tid]) atomicMin(&s_pick, tid);
  __syncthreads();
  if (tid == 0) {
    int p = s_pick;
    if (p == 0x7fffffff) {  // u landed on a rounding gap at the top: the last kept candidate
      p = 0;
      for (int t = static_cast<int>(count) - 1; t >= 0; --t)
        if (t == 0 || scan[t] > scan[t - 1]) {
          p = t;
          break;
        }
    }
    const int tok = static_cast<int>(0xffffffffu - static_cast<uint32_t>(cand[p] & 0xffffffffu));
    token_out[0] = tok;
    history[tok] = 1;
    rng[1] = step + 1;
  }
}

extern "C" __global__ void nq_advance(int32_t* pos_dev, int32_t* seq_len_dev, int rows) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b < rows && seq_len_dev[b] > 0) {  // idle rows (seq_len 0) stay idle
    pos_dev[b] += 1;
    seq_len_dev[b] += 1;
  }
}
