// attention_prefill_fma.cu: causal prefill attention in fp32 on CUDA cores ("fma", prefill.py): the
// numerically tighter fallback beside attention_prefill.cu's tensor-core body (same contract: that
// file's header).
//
// nq_attention_prefill: grid (ceil(T/32), NQ_NHEADS), 256 threads, 46.5 KB static smem.
//   Block = 32 query rows of one head; key tiles of 32 positions (2 pages) up to the block's last
//   query position. fp32 online softmax and fp32 FMAs from fp32 shared-memory tiles. Thread
//   (r = tid/8, c = tid%8) computes scores of row r against keys c, c+8, c+16, c+24 (rows padded to
//   132 floats so 8 keys x 16 B hit 32 distinct banks), the 8 threads of a row reduce max/sum with
//   shuffles (same warp), then accumulate 16 output dims c*4 + 32j.
#include "attention_prefill_common.cuh"

namespace nq_pre {
using nq::uint16_t;
using nq::uint32_t;
constexpr int kBQ = 32;      // query rows per block
constexpr int kBK = 32;      // keys per tile (2 pages)
constexpr int kThreads = 256;
constexpr int kRowF = 132;   // padded fp32 row of Q/K tiles
constexpr int kPRow = 36;    // padded fp32 row of P
using nq::kScaleLog2;
using nq::neg_inf;
using nq_pre_common::Block;
using nq_pre_common::kv_offset;
}  // namespace nq_pre

extern "C" __global__ void __launch_bounds__(nq_pre::kThreads) nq_attention_prefill(NQ_ATTENTION_PREFILL_ARGS) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  nq::pdl_wait();  // launch overlap (common.cuh): nothing read or written before it
  using namespace nq_pre;
  __shared__ __align__(16) float qs[kBQ * kRowF];   // [32][132] fp32, pre-scaled to the log2 domain
  __shared__ __align__(16) float ks[kBK * kRowF];   // [32][132] fp32
  __shared__ __align__(16) uint16_t vs[kBK * 128];  // [32][128] fp16
  __shared__ __align__(16) float ps[kBQ * kPRow];   // [32][36] fp32 probabilities of the tile

  if (ctl != nullptr) {  // a captured prefill graph (prefill_rope_kv.cu): the grid covers its bucket's rows
    start_pos = ctl[0];
    T = ctl[1];
  }
  const Block blk(kBQ, start_pos, T);
  const int q0 = blk.q0, h = blk.h;
  const int tid = threadIdx.x;
  const int r = tid >> 3;   // query row of this thread
  const int c = tid & 7;    // key column group / output dim group
  const int qpos = start_pos + q0 + r;
  const bool row_ok = q0 + r < T;

  // Q tile: 32 rows x 16 chunks of 8 halves; rows past T are zero (their output is not written)
  for (int ch = tid; ch < kBQ * 16; ch += kThreads) {
    const int rr = ch >> 4, dd = (ch & 15) * 8;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (q0 + rr < T)
      raw = *reinterpret_cast<const uint4*>(q + static_cast<size_t>(q0 + rr) * nq::kQDim + h * 128 + dd);
    const float2 a = nq::h22f2(raw.x), b = nq::h22f2(raw.y), e = nq::h22f2(raw.z), f = nq::h22f2(raw.w);
    float* dst = qs + rr * kRowF + dd;
    *reinterpret_cast<float4*>(dst) =
        make_float4(a.x * kScaleLog2, a.y * kScaleLog2, b.x * kScaleLog2, b.y * kScaleLog2);
    *reinterpret_cast<float4*>(dst + 4) =
        make_float4(e.x * kScaleLog2, e.y * kScaleLog2, f.x * kScaleLog2, f.y * kScaleLog2);
  }

  float m = neg_inf(), l = 0.f;
  float acc[4][4];  // dims c*4 + 32j + 0..3
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  for (int kb = 0; kb < blk.kv_end; kb += kBK) {
    __syncthreads();  // previous tile's K/V reads done (and, first time round, Q tile written)
    for (int ch = tid; ch < kBK * 16; ch += kThreads) {
      NQ_KV_CHUNK(ch, kb)
      const float2 a = nq::h22f2(kr.x), b = nq::h22f2(kr.y), e = nq::h22f2(kr.z), f = nq::h22f2(kr.w);
      float* dst = ks + kk * kRowF + dd;
      *reinterpret_cast<float4*>(dst) = make_float4(a.x, a.y, b.x, b.y);
      *reinterpret_cast<float4*>(dst + 4) = make_float4(e.x, e.y, f.x, f.y);
      *reinterpret_cast<uint4*>(vs + kk * 128 + dd) = vr;
    }
    __syncthreads();  // tile visible to all

    float s[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 8
    for (int d4 = 0; d4 < 32; ++d4) {
      const float4 qv = *reinterpret_cast<const float4*>(qs + r * kRowF + d4 * 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float4 kv = *reinterpret_cast<const float4*>(ks + (c + 8 * j) * kRowF + d4 * 4);
        s[j] += qv.x * kv.x + qv.y * kv.y + qv.z * kv.z + qv.w * kv.w;
      }
    }
    float mx = neg_inf();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int kp = kb + c + 8 * j;
      if (!(row_ok && kp <= qpos)) s[j] = neg_inf();  // causal (kp <= qpos also bounds kp < blk.kv_len)
      mx = fmaxf(mx, s[j]);
    }
    // the 8 threads of row r are lanes 8k..8k+7 of one warp
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    const float m_new = fmaxf(m, mx);
    // a row with nothing visible yet (only rows past T: key 0 is visible to every real row in the
    // first tile) keeps m = -inf; guard against -inf - -inf
    const float alpha = m_new == neg_inf() ? 1.f : exp2f(m - m_new);
    float rs = 0.f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float p = s[j] == neg_inf() ? 0.f : exp2f(s[j] - m_new);
      ps[r * kPRow + c + 8 * j] = p;
      rs += p;
    }
    rs += __shfl_xor_sync(0xffffffffu, rs, 1);
    rs += __shfl_xor_sync(0xffffffffu, rs, 2);
    rs += __shfl_xor_sync(0xffffffffu, rs, 4);
    l = l * alpha + rs;
    m = m_new;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      acc[j][0] *= alpha; acc[j][1] *= alpha; acc[j][2] *= alpha; acc[j][3] *= alpha;
    }
    __syncwarp();  // row r's probabilities (written by its 8 lanes) visible to those lanes

#pragma unroll 2
    for (int k4 = 0; k4 < kBK; k4 += 4) {
      const float4 p4 = *reinterpret_cast<const float4*>(ps + r * kPRow + k4);
      const float pk[4] = {p4.x, p4.y, p4.z, p4.w};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint2 raw = *reinterpret_cast<const uint2*>(vs + (k4 + kk) * 128 + c * 4 + 32 * j);
          const float2 a = nq::h22f2(raw.x), b = nq::h22f2(raw.y);
          acc[j][0] += pk[kk] * a.x; acc[j][1] += pk[kk] * a.y;
          acc[j][2] += pk[kk] * b.x; acc[j][3] += pk[kk] * b.y;
        }
      }
    }
  }

  if (row_ok) {
    const float inv = l > 0.f ? 1.f / l : 0.f;
    nq::uint16_t* o = out + static_cast<size_t>(q0 + r) * nq::kQDim + h * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      uint2 w;
      w.x = static_cast<uint32_t>(nq::f2h(acc[j][0] * inv)) | (static_cast<uint32_t>(nq::f2h(acc[j][1] * inv)) << 16);
      w.y = static_cast<uint32_t>(nq::f2h(acc[j][2] * inv)) | (static_cast<uint32_t>(nq::f2h(acc[j][3] * inv)) << 16);
      *reinterpret_cast<uint2*>(o + c * 4 + 32 * j) = w;
    }
  }
}
