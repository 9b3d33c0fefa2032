// attention_decode_ring.cuh: one decode-attention block's page ring and its consumer warps
// (attention_decode.cu has the kernel: what it computes, its shapes, launch and the cluster fold).
//
// Why a ring: decode attention is a stream of K/V bytes (56 KiB per token of context at 7B) with
// little arithmetic, so what matters is keeping bytes in flight. One producer warp (one lane of it)
// issues cp.async.bulk copies of whole 4 KiB K and V slices into a ring; the copy engine, not
// registers, carries them, and completion lands on an mbarrier as transaction bytes. The consumer
// warps (NQ_DECODE_CONSUMERS: 4, attention.py's variants) take ring slots round-robin (page i -> warp
// i % consumers), each keeping its own online-softmax state (fp32) for the G query heads of this KV head,
// and hand a slot back through its "empty" mbarrier. Consumers never wait for each other inside the loop; their states
// merge once at the end. Two consumer bodies (NQ_DECODE_MMA): fp32 FMAs on CUDA cores, or mma.sync on
// tensor cores (fp16 operands as stored, fp32 accumulate, P rounded to fp16 as FlashAttention does).
// The CUDA-core body runs at ~41% of the copy rate at 32k context (docs/PERF.md): it is
// instruction-bound (~1700 instructions per page per warp), which is why the tensor-core body exists.
//
// Shared-memory ring (dynamic smem, kStages = NQ_DECODE_STAGES slots of 8 KiB):
//
//   slot:   0                 1                       kStages-1
//         +--------+--------+--------+--------+     +--------+--------+
//   ring  | K page | V page | K page | V page | ... | K page | V page |   8 KiB per slot
//         | 16x128 | 16x128 |  fp16  |  fp16  |     |        |        |
//         +--------+--------+--------+--------+     +--------+--------+
//   full[s]  (count 1): producer arrive.expect_tx(8192) + 2 bulk copies complete_tx -> phase flips
//   empty[s] (count 1): the consumer warp that read slot s arrives once (lane 0, after __syncwarp)
//   then: merge area fp32 [consumers][G][128] + m,l [consumers][8] each; p buffer fp32 [consumers][16][8]
//
//   page i of the block's run -> slot i % kStages, use u = i / kStages:
//     producer waits empty[slot] parity (u-1)&1 (u > 0), consumer waits full[slot] parity u&1.
//
// Tested through the kernel: tests/test_attention_decode.py (every consumer body against float64).
#pragma once
#include "common.cuh"
#include "mma.cuh"

#ifndef NQ_DECODE_STAGES
#define NQ_DECODE_STAGES 8
#endif
#ifndef NQ_DECODE_CONSUMERS
#define NQ_DECODE_CONSUMERS 4
#endif
#ifndef NQ_DECODE_MMA
#define NQ_DECODE_MMA 1  // 1: consumers on tensor cores (mma.sync, attention.py's default), 0: fp32 FMAs
#endif

namespace nq_dec {

using nq::uint16_t;
using nq::uint32_t;
using nq::uint64_t;
using nq::kScaleLog2;  // scores in the log2 domain (common.cuh)
using nq::neg_inf;
using nq::pack_h2;
using nq::smem_u32;

constexpr int kG = nq::kHeads / nq::kKvHeads;  // query heads per KV head
constexpr int kGPad = 8;                        // p-buffer row width (two float4 reads per token)
static_assert(kG >= 1 && kG <= kGPad, "GQA group above 8 is not supported by the p buffer layout");
constexpr int kConsumers = NQ_DECODE_CONSUMERS;  // consumer warps; + 1 producer warp
constexpr int kThreads = 32 * (1 + kConsumers);
constexpr int kStages = NQ_DECODE_STAGES;
constexpr int kPageElems = nq::kPageTokens * nq::kHeadDim;  // 2048 halves
constexpr int kPageBytes = kPageElems * 2;                     // 4096
constexpr int kSlotBytes = 2 * kPageBytes;                     // K + V
constexpr int kRingBytes = kStages * kSlotBytes;

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}

// one arrival that also tells the barrier how many bytes the copy engine will complete on it
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}

// release semantics (the default .release.cta): this warp's reads of the slot happen before the
// producer's next bulk copy into it
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}

// acquire semantics: once the phase of parity `parity` has completed, its bytes are visible
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}"
        : "=r"(done)
        : "r"(smem_u32(bar)), "r"(parity)
        : "memory");
  } while (!done);
}

// 4 KiB global -> shared through the bulk copy engine (SASS: UBLKCP), completion counted in bytes on bar
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(src), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}

// One halving step of the warp reduce-scatter of s[16 tokens][kG]: lanes with bit kO set keep tokens
// kN..2kN-1, the others tokens 0..kN-1, each adding its partner's (lane ^ kO) partials of the kept
// tokens. Templated so every index is a compile-time constant and s stays in registers.
template <int kO, int kN>
__device__ __forceinline__ void reduce_scatter_step(float (&s)[16][kG], int lane) {
  const bool upper = (lane & kO) != 0;
#pragma unroll
  for (int t = 0; t < kN; ++t) {
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float send = upper ? s[t][g] : s[t + kN][g];
      const float keep = upper ? s[t + kN][g] : s[t][g];
      s[t][g] = keep + __shfl_xor_sync(0xffffffffu, send, kO);
    }
  }
}

// Page i of this block's run, once its copies have landed in the ring (both consumer bodies start a page
// here): its slot (handed back through empty[slot] when the warp is done), its K and V slices ([16][128]
// fp16 each), and how many of its 16 tokens lie below seq_len. The tail page's other slots still hold
// whatever the page had (stale or never-written data, possibly NaN): the consumers mask them by position.
struct RingPage {
  int slot;
  const uint16_t* k;
  const uint16_t* v;
  int valid;
};

__device__ __forceinline__ RingPage wait_page(const unsigned char* ring, uint64_t* full, int i, int p0,
                                              int seq_len) {
  const int slot = i % kStages;
  mbar_wait(&full[slot], (i / kStages) & 1);
  const uint16_t* k = reinterpret_cast<const uint16_t*>(ring + slot * kSlotBytes);
  return {slot, k, k + kPageElems, min(nq::kPageTokens, seq_len - (p0 + i) * nq::kPageTokens)};
}

// ---- consumer, CUDA cores: lane owns dims 4*lane .. 4*lane+3 of every head ---------------------------
__device__ __forceinline__ void consume_fma(int c, int lane, const unsigned char* ring, uint64_t* full,
                                            uint64_t* empty, const uint16_t* q, int kvh, int p0, int count,
                                            int seq_len, float* merge_acc, float* merge_m, float* merge_l,
                                            float* pbuf_all) {
    // consumer warp c: pages c, c+4, c+8, ... of this block's run; lane owns dims 4*lane .. 4*lane+3
    float* pbuf = pbuf_all + c * 16 * kGPad;  // [16 tokens][kGPad] probabilities of the current page
    float qr[kG][4];                          // q of the G heads, pre-scaled into the log2 domain
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const uint2 raw = *reinterpret_cast<const uint2*>(q + (kvh * kG + g) * 128 + lane * 4);
      const float2 a = nq::h22f2(raw.x);
      const float2 b = nq::h22f2(raw.y);
      qr[g][0] = a.x * kScaleLog2; qr[g][1] = a.y * kScaleLog2;
      qr[g][2] = b.x * kScaleLog2; qr[g][3] = b.y * kScaleLog2;
    }
    float m[kG], l[kG], acc[kG][4];
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      m[g] = neg_inf(); l[g] = 0.f;
      acc[g][0] = acc[g][1] = acc[g][2] = acc[g][3] = 0.f;
    }

    for (int i = c; i < count; i += kConsumers) {
      const auto [slot, ks, vs, valid] = wait_page(ring, full, i, p0, seq_len);

      // partial dots: s[t][g] = sum over this lane's 4 dims of q[g] * K[t]
      float s[16][kG];
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        const uint2 raw = *reinterpret_cast<const uint2*>(ks + t * 128 + lane * 4);  // conflict-free row
        const float2 a = nq::h22f2(raw.x);
        const float2 b = nq::h22f2(raw.y);
#pragma unroll
        for (int g = 0; g < kG; ++g)
          s[t][g] = qr[g][0] * a.x + qr[g][1] * a.y + qr[g][2] * b.x + qr[g][3] * b.y;
      }
      // reduce-scatter across the warp: 16G shuffles instead of 5 x 16G for 16G separate
      // butterflies; afterwards lane holds the full score of token lane >> 1 in s[0][g]
      reduce_scatter_step<16, 8>(s, lane);
      reduce_scatter_step<8, 4>(s, lane);
      reduce_scatter_step<4, 2>(s, lane);
      reduce_scatter_step<2, 1>(s, lane);
      const int tok = lane >> 1;
      float p[kG];
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float sc = s[0][g] + __shfl_xor_sync(0xffffffffu, s[0][g], 1);
        sc = tok < valid ? sc : neg_inf();
        float mx = sc;  // lanes 2j, 2j+1 hold token j: reduce over bits 1..4
#pragma unroll
        for (int o = 2; o < 32; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        const float m_new = fmaxf(m[g], mx);  // finite: a page in range has >= 1 valid token
        const float alpha = exp2f(m[g] - m_new);  // exp2(-inf) = 0 on the first page
        p[g] = exp2f(sc - m_new);
        float ps = p[g];
#pragma unroll
        for (int o = 2; o < 32; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
        l[g] = l[g] * alpha + ps;
        m[g] = m_new;
        acc[g][0] *= alpha; acc[g][1] *= alpha; acc[g][2] *= alpha; acc[g][3] *= alpha;
      }
      if ((lane & 1) == 0) {
#pragma unroll
        for (int g = 0; g < kG; ++g) pbuf[tok * kGPad + g] = p[g];
      }
      __syncwarp();  // p of all 16 tokens visible to the whole warp
#pragma unroll
      for (int t = 0; t < 16; ++t) {
        if (t < valid) {  // warp-uniform; skipping masked rows keeps 0 * NaN out of acc
          const uint2 raw = *reinterpret_cast<const uint2*>(vs + t * 128 + lane * 4);
          const float2 a = nq::h22f2(raw.x);
          const float2 b = nq::h22f2(raw.y);
          const float4 pa = *reinterpret_cast<const float4*>(pbuf + t * kGPad);
          const float4 pb = *reinterpret_cast<const float4*>(pbuf + t * kGPad + 4);
          const float pt[8] = {pa.x, pa.y, pa.z, pa.w, pb.x, pb.y, pb.z, pb.w};
#pragma unroll
          for (int g = 0; g < kG; ++g) {
            acc[g][0] += pt[g] * a.x; acc[g][1] += pt[g] * a.y;
            acc[g][2] += pt[g] * b.x; acc[g][3] += pt[g] * b.y;
          }
        }
      }
      __syncwarp();  // every lane done with the slot and with pbuf before the slot is handed back
      if (lane == 0) mbar_arrive(&empty[slot]);
    }

    // publish this warp's state for the merge
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      *reinterpret_cast<float4*>(merge_acc + (c * kG + g) * 128 + lane * 4) =
          make_float4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    }
    if (lane == 0) {
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        merge_m[c * kGPad + g] = m[g];
        merge_l[c * kGPad + g] = l[g];
      }
    }
}

// ---- consumer, tensor cores (mma.sync m16n8k16, fp16 in, fp32 accumulate) ----------------------------
//
// Per page, with the G heads as the M rows (padded to 16; rows >= G are zero or ignored):
//   S^T [16 heads x 16 tokens] = Q [heads x 128] . K^T        2 token tiles x 8 k-steps = 16 mma
//   O   [16 heads x 128]      += P [heads x 16 tokens] . V   16 dim tiles x 1 k-step   = 16 mma
// lane = 4 g + t (g = groupID: head row / token col / dim col, t = thread in group).
// The dot product's dim order is free (same order for Q and K), so each lane loads 16 contiguous bytes:
//   k-steps 2m, 2m+1 use dims 8(4m+t) .. 8(4m+t)+7 of its row ({0,1} -> k 2t,2t+1; {2,3} -> k 2t+8,2t+9;
//   {4..7} the same for k-step 2m+1); row stride 256 B costs a 2-way bank conflict, not 8-way.
// S's C fragment (head g, tokens 2t, 2t+1 of each tile) is P's A fragment as is (FlashAttention-2's
// register reuse). For P.V, B = V[tokens][dims]: lane needs tokens 2t, 2t+1, 2t+8, 2t+9 at one dim
// per tile; dim tile n2, column g <-> dim 16 g + n2, so a lane loads 32 contiguous bytes of each of its
// 4 V rows and pairs rows with one PRMT per register. Output: lane holds O[g][32t + 16j + n2].
// A's rows 8..15 (heads 8..15) do not exist for G <= 8: a1 = a3 = 0
__device__ __forceinline__ void mma_heads(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
  nq::mma16816(d, a0, 0u, a2, 0u, b0, b1);
}

// One step of a consumer warp over kN (1 or 2) pages of its run (pg[0], and pg[1] = the page kConsumers
// later), once their copies have landed: S for every page (2 kN independent chains of 8 MMAs, interleaved
// by k-step), one online-softmax update over the kN * 16 tokens, and P.V accumulated page after page into
// acc. Why two pages as one step (NQ_DECODE_PAIR): a step's chain (the Q.K chain of 8 dependent MMAs,
// the shuffles and exp2 of the softmax, then 16 MMAs) is latency, not issue slots, and at <= 1,024 tokens a
// consumer holds at most two pages (the 7B at 640 tokens: 5 pages a block, consumer 0 two; at 1,024: 8
// pages, every consumer two), so the second page's chain runs beside the first instead of after it. What it
// measured (H200, docs/PERF.md thirtieth lease): slower alone (7B 4.19 -> 4.28 us a call at 640 tokens, 4.50
// -> 4.66 at 1,024: the step waits for both pages), faster in the decode step (7B 1.370 -> 1.351 ms/token),
// part of which its registers' one block an SM gives (attention.py SHORT_PAIR).
template <int kN>
__device__ __forceinline__ void mma_page_step(const RingPage (&pg)[2], const uint4 (&qa)[4], int g, int t,
                                              float& m_run, float& l_run, float (&acc)[16][4]) {
  float s[kN][2][4];  // [page][token tile][D fragment]: s[p][nt][j] = S^T[g][8 nt + 2t + j], j < 2
#pragma unroll
  for (int p = 0; p < kN; ++p)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[p][nt][0] = s[p][nt][1] = s[p][nt][2] = s[p][nt][3] = 0.f;
  if constexpr (kN == 1) {  // one page: its two token tiles' chains one after the other, as ever
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const uint4 kb = *reinterpret_cast<const uint4*>(pg[0].k + (8 * nt + g) * 128 + 8 * (4 * m + t));
        mma_heads(s[0][nt], qa[m].x, qa[m].y, kb.x, kb.y);
        mma_heads(s[0][nt], qa[m].z, qa[m].w, kb.z, kb.w);
      }
    }
  } else {  // two pages: the four chains interleaved by k-step
#pragma unroll
    for (int m = 0; m < 4; ++m) {
#pragma unroll
      for (int p = 0; p < kN; ++p) {
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const uint4 kb = *reinterpret_cast<const uint4*>(pg[p].k + (8 * nt + g) * 128 + 8 * (4 * m + t));
          mma_heads(s[p][nt], qa[m].x, qa[m].y, kb.x, kb.y);
          mma_heads(s[p][nt], qa[m].z, qa[m].w, kb.z, kb.w);
        }
      }
    }
  }
  // V rows 2t, 2t+1, 2t+8, 2t+9, dims 16g .. 16g+15 (issued before the softmax math to hide latency)
  uint4 v[kN][4][2];
#pragma unroll
  for (int p = 0; p < kN; ++p) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int tok = 2 * t + (r & 1) + 8 * (r >> 1);
      v[p][r][0] = *reinterpret_cast<const uint4*>(pg[p].v + tok * 128 + 16 * g);
      v[p][r][1] = *reinterpret_cast<const uint4*>(pg[p].v + tok * 128 + 16 * g + 8);
      if (tok >= pg[p].valid) {  // tail page: 0 * NaN would poison every head's output through the mma
        v[p][r][0] = make_uint4(0u, 0u, 0u, 0u);
        v[p][r][1] = make_uint4(0u, 0u, 0u, 0u);
      }
    }
  }
  // online softmax for head g over the step's tokens (4 a page per lane, lanes 4g..4g+3)
  float mx = neg_inf();
#pragma unroll
  for (int p = 0; p < kN; ++p) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int tok = 8 * nt + 2 * t + j;
        s[p][nt][j] = tok < pg[p].valid ? s[p][nt][j] * kScaleLog2 : neg_inf();  // select: a NaN K row is dropped
        mx = fmaxf(mx, s[p][nt][j]);
      }
    }
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  const float m_new = fmaxf(m_run, mx);  // finite for real heads: every page in range has a token
  const float alpha = exp2f(m_run - m_new);
  float e[kN][2][2], ps = 0.f;
#pragma unroll
  for (int p = 0; p < kN; ++p) {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        e[p][nt][j] = exp2f(s[p][nt][j] - m_new);
        ps += e[p][nt][j];
      }
    }
  }
  ps += __shfl_xor_sync(0xffffffffu, ps, 1);
  ps += __shfl_xor_sync(0xffffffffu, ps, 2);
  l_run = l_run * alpha + ps;
  m_run = m_new;
  uint32_t pa[kN][2];  // P's A fragments: [p][0] = P[g][2t], P[g][2t+1]; [p][1] = P[g][2t+8], P[g][2t+9]
#pragma unroll
  for (int p = 0; p < kN; ++p) {
    pa[p][0] = pack_h2(e[p][0][0], e[p][0][1]);
    pa[p][1] = pack_h2(e[p][1][0], e[p][1][1]);
  }
#pragma unroll
  for (int p = 0; p < kN; ++p) {
    const uint32_t* v0 = reinterpret_cast<const uint32_t*>(&v[p][0][0]);  // 8 regs: row 2t, dims 16g..+15
    const uint32_t* v1 = reinterpret_cast<const uint32_t*>(&v[p][1][0]);  // row 2t+1
    const uint32_t* v2 = reinterpret_cast<const uint32_t*>(&v[p][2][0]);  // row 2t+8
    const uint32_t* v3 = reinterpret_cast<const uint32_t*>(&v[p][3][0]);  // row 2t+9
#pragma unroll
    for (int n2 = 0; n2 < 16; ++n2) {
      if (p == 0) {  // the running sums rescaled once, before the step's first page adds to them
        acc[n2][0] *= alpha;
        acc[n2][1] *= alpha;
      }
      const uint32_t sel = (n2 & 1) ? 0x7632u : 0x5410u;  // high or low halves of the two rows
      const uint32_t b0 = nq::prmt(v0[n2 >> 1], v1[n2 >> 1], sel);
      const uint32_t b1 = nq::prmt(v2[n2 >> 1], v3[n2 >> 1], sel);
      mma_heads(acc[n2], pa[p][0], pa[p][1], b0, b1);
    }
  }
}

// 1: a consumer takes its pages two at a time (mma_page_step<2>), 0: one at a time. The short-context launch's
// build sets it (attention.py SHORT_PAIR, with its measurements); the default and long builds do not: the
// pair's registers (153 -> 173) leave them one block an SM, where their several-cluster grids lose the flagged
// fold and a 7B call at 32k tokens took 46.8 us against 24.9.
#ifndef NQ_DECODE_PAIR
#define NQ_DECODE_PAIR 0
#endif
// two pages of each consumer fit in the ring at once (a build with as many consumers as slots takes one at a
// time)
constexpr bool kPair = NQ_DECODE_PAIR && kStages >= 2 * kConsumers;

__device__ __forceinline__ void consume_mma(int c, int lane, const unsigned char* ring, uint64_t* full,
                                            uint64_t* empty, const uint16_t* q, int kvh, int p0, int count,
                                            int seq_len, float* merge_acc, float* merge_m, float* merge_l) {
  const int g = lane >> 2, t = lane & 3;
  const bool head_ok = g < kG;
  uint4 qa[4];  // A fragments of Q (unscaled fp16): k-steps 2m (.x, .y) and 2m+1 (.z, .w)
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    qa[m] = head_ok ? *reinterpret_cast<const uint4*>(q + (kvh * kG + g) * 128 + 8 * (4 * m + t))
                    : make_uint4(0u, 0u, 0u, 0u);
  }
  float m_run = neg_inf(), l_run = 0.f;  // this lane's head g
  float acc[16][4];                      // [dim tile n2] D fragment; [2], [3] are the absent rows g+8
#pragma unroll
  for (int n2 = 0; n2 < 16; ++n2) acc[n2][0] = acc[n2][1] = acc[n2][2] = acc[n2][3] = 0.f;

  // Pages c, c + kConsumers, c + 2 kConsumers, ... of the block's run. With NQ_DECODE_PAIR a step takes
  // two of them (i and i + kConsumers): both sit in the ring at once (kStages >= 2 kConsumers), and the
  // slot of the later one was last used by page i + kConsumers - kStages, this warp's own earlier page, so
  // holding the first while waiting for the second cannot stall the producer on another warp.
  constexpr int kStride = kPair ? 2 * kConsumers : kConsumers;
  for (int i = c; i < count; i += kStride) {
    RingPage pg[2];
    pg[0] = wait_page(ring, full, i, p0, seq_len);
    if (kPair && i + kConsumers < count) {  // warp-uniform
      pg[1] = wait_page(ring, full, i + kConsumers, p0, seq_len);
      mma_page_step<2>(pg, qa, g, t, m_run, l_run, acc);
      __syncwarp();  // every lane done with both slots before they are handed back
      if (lane == 0) {
        mbar_arrive(&empty[pg[0].slot]);
        mbar_arrive(&empty[pg[1].slot]);
      }
    } else {
      mma_page_step<1>(pg, qa, g, t, m_run, l_run, acc);
      __syncwarp();  // every lane done with the slot before it is handed back
      if (lane == 0) mbar_arrive(&empty[pg[0].slot]);
    }
  }

  if (head_ok) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float* dst = merge_acc + (c * kG + g) * 128 + 32 * t + 16 * j;  // dims 32t + 16j + n2
#pragma unroll
      for (int n4 = 0; n4 < 4; ++n4) {
        *reinterpret_cast<float4*>(dst + 4 * n4) = make_float4(acc[4 * n4][j], acc[4 * n4 + 1][j],
                                                               acc[4 * n4 + 2][j], acc[4 * n4 + 3][j]);
      }
    }
    if (t == 0) {
      merge_m[c * kGPad + g] = m_run;
      merge_l[c * kGPad + g] = l_run;
    }
  }
}

}  // namespace nq_dec
