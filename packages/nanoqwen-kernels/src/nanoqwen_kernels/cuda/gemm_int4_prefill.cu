// gemm_int4_prefill.cu: the prefill GEMM on the INT4 weights: out[T, N] = X[T, K] . W^T (+ out), W read
// as stored (ValueShuffle-v1 words + fp16 group scales), dequantized in registers straight into wgmma's A
// fragments; no fp16 copy of W anywhere. fp32 sums, one fp16 rounding at the end (with the residual add
// when accumulating, as cuBLAS's beta = 1 did).
//
// Why the weights are A (the M side) and the tokens B (the N side): wgmma takes A from registers, so the
// INT4 -> fp16 conversion lands in the operand registers with no shared-memory round trip, and the tensor
// cores read X (fp16, already in the layout they want) from shared memory. The accumulator tile is
// [weight rows][tokens]; the epilogue transposes it through shared memory into out's [token][row] rows.
//
// Block: 384 threads = two consumer warpgroups (warps 0-7) + one producer warpgroup (warps 8-11). Tile:
// 128 weight rows (warpgroup i owns rows 64 i .. 64 i + 63, warp w % 4 of it rows 16 (w % 4) + {g, g + 8},
// g = lane / 4) x BN = 8 NT tokens (NT = 32 / 16 / 8: 256 / 128 / 64 tokens; prefill_gemm.choose_plan picks
// by shape). One block per SM (the n256 ring takes 222 KB), and the producers give their registers to the
// consumers (kConsumerRegs). Split-K (grid.z, when a shape has too few tiles): each split writes its fp32
// sums to a workspace and nq_gemm_splitk_reduce (below) adds them. The SiLU build (tile_row<true>) maps
// its rows so a lane holds an output's gate and up sums and writes silu(gate) * up.
//
// The ring (kStages stages, each one 64-k slice of the tile, handed over by mbarriers as in gemm_tiles.cuh):
//     X [BN tokens][128 B]  the slice's 64 k of each token, wgmma's K-major B in the 128-byte swizzle
//                           (wgmma.cuh): token n at 1024 (n / 8) + 128 (n % 8), 16-byte chunk j at j ^ (n % 8)
//     W [128 rows][32 B]    the slice's 8 INT4 words of each row; chunk j (words 4j .. 4j+3) of row r at
//                           16 (j ^ ((r / 4) & 1)): the 8 rows one load instruction reads (g = 0..7) then hit
//                           8 different 16-byte bank groups
//     S [128 rows] u32      the 4-byte-aligned pair of fp16 scales that holds the row's scale of this group
//                           (cp.async moves 4 bytes at least; the consumer picks the half by parity)
// X comes by TMA: producer thread 0 issues one bulk tensor copy of the [BN][64] box per stage (tma.py's map
// of X: the 128-byte swizzle above is the TMA's own; tokens past T read as zeros) on fullx[s]. Why: with
// X copied by the 128 producer threads as 16-byte cp.async pieces the kernel ran at 566 TFLOP/s (7B gate/up,
// T = 2048), at 811 with those copies skipped, at 578 with the dequantization skipped instead (H200,
// docs/PERF.md "eleventh lease"): the copies' issue and address arithmetic were the bound. W and S (4.5 KB
// a stage) stay cp.async from the 128 producer threads (rows past N repeat row N - 1: read, multiplied,
// never written), each thread arriving on full[s] when its copies land; they are read by the consumers'
// own loads (generic proxy), so no proxy fence. Each consumer warp arrives on empty[s] once its wgmmas that
// read stage s have completed.
//
// A fragments from a natural-order X: a k16 step's lane (g, c) needs k = 2c, 2c+1, 2c+8, 2c+9 of the step,
// i.e. value pair c (of 4) of word 2s and of word 2s + 1 (8 k per word). ValueShuffle-v1 keeps pair c in
// bytes 2 (c & 1), 2 (c & 1) + 1, low nibbles for c < 2 and high ones for c >= 2, so the lane shifts the
// word by 4 (c >> 1), masks, and builds the half2 {1024 + u, 1024 + u'} with one prmt (selector 0x4140 or
// 0x4342), then q = that - 1032 (exact), times the group's scale (one rounding): 5 instructions a pair. The
// 4 lanes of a quad read the same 16 bytes (a shared-memory broadcast). The alternative, lane c taking
// words 4c .. 4c+3 whole as the GEMVs do, needs X permuted within each 128-k group (the tile GEMM's x
// layout), i.e. every producer of X (RMSNorm, attention, SiLU) writing that order.
//
// Pipelining inside a consumer: stage i's 4 wgmmas are issued from fragment set i % 2, then the warp waits
// until only they are pending (stage i - 1's done: its slot goes back to the producer), and dequantizes
// stage i + 1 into the other set while the tensor cores run stage i; the two warpgroups interleave on the
// tensor cores besides. The loop is unrolled by two so each set is a fixed group of registers.
//
// Tested: tests/test_prefill_gemm.py (against float64 at T = 1, 17, 511, 513, 7B / 1.5B / tiny shapes,
// every tile width, split-K, accumulate, the SiLU build), tests/test_gemm_int4_prefill_mapping.py (the
// whole data flow emulated in numpy: the TMA box, the W / scale copies, each lane's fragments, wgmma's reads
// of X, the SiLU row map), tests/test_compile.py (SASS per width: 8 HGMMA not serialized, setmaxnreg, no
// local memory).
#include "gemm_epilogue.cuh"
#include "wgmma.cuh"

namespace nq {
namespace gw {

constexpr int kBM = 128;                 // weight rows per block
constexpr int kBK = 64;                  // k per stage: half an INT4 group
constexpr int kConsumerThreads = 256;    // warps 0-7: two warpgroups
constexpr int kThreads = kConsumerThreads + 128;  // + the producer warpgroup (prefill_gemm.py GW_THREADS)
// Registers (setmaxnreg): a block's warps are allocated in whole warpgroups (ptxas gave a 288-thread build
// 168 registers, 65536 / 384), so the producer warpgroup hands most of its share to the two consumer
// warpgroups: 2 x 128 x 232 + 128 x 40 = 64,512 of the 65,536. The consumers hold the m64n256 accumulators
// (128 registers) and two fragment sets (32).
constexpr int kConsumerRegs = 232;
constexpr int kProducerRegs = 40;
#ifndef NQ_GW_STAGES
#define NQ_GW_STAGES 6
#endif
constexpr int kStages = NQ_GW_STAGES;
// Stages of wgmmas a consumer leaves in flight while it dequantizes the next one. 2 (three fragment sets,
// the loop unrolled by three with guards) made ptxas serialize every wgmma and measured 3% slower.
constexpr int kDepth = 1;
static_assert(kStages > kDepth + 1, "the ring needs a free stage beyond those the consumers hold");

constexpr int kWBytes = kBM * 32;
constexpr int kSBytes = kBM * 4;
template <int NT>
__host__ __device__ constexpr int x_bytes() { return NT * 8 * 128; }
// a stage, rounded to 1024 bytes so every stage's X atoms stay 1024-aligned
template <int NT>
__host__ __device__ constexpr int stage_bytes() { return (x_bytes<NT>() + kWBytes + kSBytes + 1023) / 1024 * 1024; }
template <int NT>
__host__ __device__ constexpr int epi_bytes() { return epi::staging_bytes<NT>(); }
// dynamic shared memory of the launch (prefill_gemm.py smem_bytes mirrors it): the ring (the epilogue's
// staging reuses it) + 1024 to align it
template <int NT>
__host__ __device__ constexpr int smem_bytes() {
  return (kStages * stage_bytes<NT>() > epi_bytes<NT>() ? kStages * stage_bytes<NT>() : epi_bytes<NT>()) + 1024;
}
static_assert(smem_bytes<32>() <= 227 * 1024, "the ring must fit the 227 KB of an H100/H200 block");


// the half2 of pair c of word w (shift = 4 (c >> 1), sel = 0x4140 or 0x4342), times the scale pair s2
__device__ __forceinline__ uint32_t dq_pair(uint32_t w, uint32_t shift, uint32_t sel, uint32_t s2) {
  const uint32_t v = (w >> shift) & 0x0F0F0F0Fu;
  return hmul2(hsub2(prmt(v, 0x64646464u, sel), 0x64086408u), s2);
}

// The A fragments of one stage (4 k16 steps) for fragment rows r0 (= g) and r1 (= g + 8) of this warp:
// f[4 j + 0..3] = a0..a3 of step j.
__device__ __forceinline__ void load_frags(const char* stage_w, const uint32_t* stage_s, int r0, int r1, uint32_t p0,
                                           uint32_t p1, uint32_t shift, uint32_t sel, uint32_t (&f)[16]) {
  const uint4 a0 = *reinterpret_cast<const uint4*>(stage_w + r0 * 32 + 16 * (0 ^ ((r0 >> 2) & 1)));
  const uint4 a1 = *reinterpret_cast<const uint4*>(stage_w + r0 * 32 + 16 * (1 ^ ((r0 >> 2) & 1)));
  const uint4 b0 = *reinterpret_cast<const uint4*>(stage_w + r1 * 32 + 16 * (0 ^ ((r1 >> 2) & 1)));
  const uint4 b1 = *reinterpret_cast<const uint4*>(stage_w + r1 * 32 + 16 * (1 ^ ((r1 >> 2) & 1)));
  const uint32_t sa = stage_s[r0] >> p0 & 0xffffu, sb = stage_s[r1] >> p1 & 0xffffu;
  const uint32_t s2a = sa | (sa << 16), s2b = sb | (sb << 16);
  const uint32_t wa[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
  const uint32_t wb[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    f[4 * j + 0] = dq_pair(wa[2 * j], shift, sel, s2a);
    f[4 * j + 1] = dq_pair(wb[2 * j], shift, sel, s2b);
    f[4 * j + 2] = dq_pair(wa[2 * j + 1], shift, sel, s2a);
    f[4 * j + 3] = dq_pair(wb[2 * j + 1], shift, sel, s2b);
  }
}

template <int NT>
__device__ __forceinline__ void issue_stage(float (&acc)[NT][4], const uint32_t (&f)[16], uint32_t x_addr) {
  const uint64_t desc0 = wgmma_desc_sw128(x_addr);
  wgmma_fence();  // the fragments (and, at the first stage, the zeroed accumulators) before the wgmmas
#pragma unroll
  for (int j = 0; j < 4; ++j) wgmma_rs<NT>(acc, f[4 * j], f[4 * j + 1], f[4 * j + 2], f[4 * j + 3], desc0 + 2 * j);
  wgmma_commit();
}

// The weight row of tile row r (0 .. 127). Plain: row0 + r. kSilu (the gate|up matrix, gate rows 0 .. I - 1
// then up rows I .. 2I - 1, N = 2I): a tile covers 64 outputs a = 64 y + 8 (r / 16) + r % 8, its row r the
// gate row a when (r / 8) is even and the up row I + a when odd: fragment rows g and g + 8 of a lane (r and
// r + 8) are then output a's gate and up, both in the lane's accumulators. Past the end: the last row.
template <bool kSilu>
__device__ __forceinline__ int tile_row(int r, int N) {
  if constexpr (kSilu) {
    const int I = N / 2;
    const int a = min(64 * static_cast<int>(blockIdx.y) + 8 * (r >> 4) + (r & 7), I - 1);
    return ((r >> 3) & 1) ? I + a : a;
  } else {
    return min(static_cast<int>(blockIdx.y) * kBM + r, N - 1);
  }
}


template <int NT, bool kSilu>
__device__ __forceinline__ void gemm_int4_wg(const TmaMap& xmap, const uint32_t* __restrict__ qw,
                                             const uint16_t* __restrict__ sc, uint16_t* __restrict__ out, int T,
                                             int N, int K, int accumulate, float* __restrict__ ws, int splits) {
  constexpr int kBN = 8 * NT;
  constexpr int kStage = stage_bytes<NT>();
  extern __shared__ uint4 smem_raw[];
  char* const ring = reinterpret_cast<char*>(smem_raw) + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  __shared__ uint64_t full_bar[kStages], fullx_bar[kStages], empty_bar[kStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t0 = blockIdx.x * kBN;
  // split-K: split z = blockIdx.z of `splits` takes groups [z G / splits, (z + 1) G / splits) of K (an even
  // stage count: the loop below is unrolled by two)
  const int G = K / kGroup;
  const int g_lo = static_cast<int>(blockIdx.z) * G / splits, g_hi = (static_cast<int>(blockIdx.z) + 1) * G / splits;
  const int k_begin = g_lo * kGroup;
  const int n_stages = (g_hi - g_lo) * (kGroup / kBK);
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 128);  // W, S: one cp.async arrival per producer thread
      mbar_init(&fullx_bar[s], 1);   // X: the TMA thread's arrival + the copy's bytes
      mbar_init(&empty_bar[s], 8);   // one arrival per consumer warp
    }
    fence_mbarrier_init();  // the initialised barriers visible to the TMA unit (async proxy)
  }
  __syncthreads();
  pdl_wait();  // X (and out, when accumulating) are the previous kernels' outputs

  if (warp >= 8) {  // ---- the producer warpgroup ----
    // its registers go to the consumers (setmaxnreg: the copies need few); pt = 0 .. 127
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    const int pt = tid - kConsumerThreads;
    // W: chunk j = pt % 2 of rows r = pt / 2 and pt / 2 + 64; S: the scale pair of row pt
    const int j = pt & 1;
    const int wr0 = tile_row<kSilu>(pt >> 1, N), wr1 = tile_row<kSilu>((pt >> 1) + 64, N);
    const int wo0 = (pt >> 1) * 32 + 16 * (j ^ (((pt >> 1) >> 2) & 1));
    const int wo1 = wo0 + 64 * 32;  // row + 64: the same (r / 4) & 1
    const size_t se = static_cast<size_t>(tile_row<kSilu>(pt, N)) * G;
    for (int i = 0; i < n_stages; ++i) {
      const int s = i % kStages;
      if (i >= kStages) mbar_wait(&empty_bar[s], ((i / kStages) + 1) & 1);
      char* base = ring + s * kStage;
      const int k0 = k_begin + i * kBK;
      if (pt == 0) {  // X: one bulk tensor copy of the [BN tokens][64 k] box (tokens past T: zeros)
        mbar_arrive_expect_tx(&fullx_bar[s], x_bytes<NT>());
        tma_load_2d(base, &xmap, k0, t0, &fullx_bar[s]);
      }
      char* wbase = base + x_bytes<NT>();
      cp_async16(wbase + wo0, qw + static_cast<size_t>(wr0) * (K / 8) + k0 / 8 + 4 * j);
      cp_async16(wbase + wo1, qw + static_cast<size_t>(wr1) * (K / 8) + k0 / 8 + 4 * j);
      const size_t e = se + k0 / kGroup;
      cp_async4(wbase + kWBytes + 4 * pt, sc + (e & ~static_cast<size_t>(1)));
      cp_async_mbar_arrive(&full_bar[s]);  // W and S are read by the consumers' loads (generic proxy)
    }
    cp_async_wait_all();  // nothing in flight when the warps exit
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));

  // ---- the consumers ----
  const int g = lane >> 2, c = lane & 3;
  const int r0 = 64 * (warp >> 2) + 16 * (warp & 3) + g, r1 = r0 + 8;
  const size_t e0 = static_cast<size_t>(tile_row<kSilu>(r0, N)) * G, e1 = static_cast<size_t>(tile_row<kSilu>(r1, N)) * G;
  const uint32_t shift = 4u * (c >> 1), sel = (c & 1) ? 0x4342u : 0x4140u;
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  uint32_t fa[16], fb[16];
  // stage i's fragments into f (after waiting for its copies)
  auto fetch = [&](int i, uint32_t(&f)[16]) {
    const int s = i % kStages;
    mbar_wait(&full_bar[s], (i / kStages) & 1);   // W, S landed
    mbar_wait(&fullx_bar[s], (i / kStages) & 1);  // X landed (TMA: async proxy, what the wgmmas read)
    const char* base = ring + s * kStage;
    const int gi = (k_begin + i * kBK) / kGroup;
    load_frags(base + x_bytes<NT>(), reinterpret_cast<const uint32_t*>(base + x_bytes<NT>() + kWBytes), r0, r1,
               16u * static_cast<uint32_t>((e0 + gi) & 1), 16u * static_cast<uint32_t>((e1 + gi) & 1), shift, sel, f);
  };
  // stage i's wgmmas from f, then (with at most kDepth stages pending: stage i - kDepth done) that stage's
  // slot back to the producer and stage i + 1's fragments into the set stage i - kDepth used
  auto step = [&](int i, const uint32_t(&f)[16], uint32_t(&f_next)[16]) {
    issue_stage<NT>(acc, f, smem_u32(ring + (i % kStages) * kStage));
    wgmma_wait<kDepth>();
    if (i >= kDepth && lane == 0) mbar_arrive(&empty_bar[(i - kDepth) % kStages]);
    if (i + 1 < n_stages) fetch(i + 1, f_next);
  };
  fetch(0, fa);
  for (int i = 0; i < n_stages; i += 2) {  // n_stages is even (K % 128 == 0)
    step(i, fa, fb);
    step(i + 1, fb, fa);
  }
  wgmma_wait<0>();

  // ---- epilogue: [row][token] sums -> [token][row] fp16 rows of out, staged in the ring ----
  epi::store<NT, kSilu>(acc, reinterpret_cast<float*>(ring), r0, warp, lane, out, T, N, t0, static_cast<int>(blockIdx.y),
                        accumulate, ws, static_cast<int>(blockIdx.z), splits);
}

}  // namespace gw
}  // namespace nq

#define NQ_GW_ENTRY(SUFFIX, NT, SILU)                                                                             \
  extern "C" __global__ void __launch_bounds__(nq::gw::kThreads, 1) nq_gemm_int4_wg##SUFFIX(                       \
      const __grid_constant__ nq::TmaMap xmap, const nq::uint32_t* __restrict__ qw,                                \
      const nq::uint16_t* __restrict__ sc, nq::uint16_t* __restrict__ out, int T, int N, int K, int accumulate,   \
      float* __restrict__ ws, int splits) {                                                                        \
    NQ_STAMP();                                                                                                  \
    nq::gw::gemm_int4_wg<NT / 8, SILU>(xmap, qw, sc, out, T, N, K, accumulate, ws, splits);                      \
  }
NQ_GW_ENTRY(_n256, 256, false)
NQ_GW_ENTRY(_n128, 128, false)
NQ_GW_ENTRY(_n64, 64, false)
// the gate|up GEMM with SiLU(gate) * up in its epilogue: out [T][I] (the MLP's activation), no split-K
NQ_GW_ENTRY(_silu_n256, 256, true)
NQ_GW_ENTRY(_silu_n128, 128, true)
NQ_GW_ENTRY(_silu_n64, 64, true)

// out[t][n] = fp16(sum over the splits of ws[z][t][n] (+ out[t][n])): the split-K GEMM's second launch, the
// splits added in order (the same sums on every run). 4 outputs a thread (N % 4 == 0), grid-stride.
extern "C" __global__ void __launch_bounds__(256) nq_gemm_splitk_reduce(const float* __restrict__ ws,
                                                                       nq::uint16_t* __restrict__ out, int T, int N,
                                                                       int splits, int accumulate) {
  NQ_STAMP();  // the step timeline (common.cuh, NQ_STAMPS): nothing in a real build
  using namespace nq;
  pdl_wait();
  const size_t quads = static_cast<size_t>(T) * N / 4, plane = static_cast<size_t>(T) * N;
  for (size_t q = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; q < quads;
       q += static_cast<size_t>(gridDim.x) * blockDim.x) {
    float4 a = reinterpret_cast<const float4*>(ws)[q];
    for (int z = 1; z < splits; ++z) {
      const float4 b = reinterpret_cast<const float4*>(ws + z * plane)[q];
      a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
    }
    uint2* dst = reinterpret_cast<uint2*>(out) + q;
    if (accumulate) {
      const uint2 old = *dst;
      const float2 o0 = h22f2(old.x), o1 = h22f2(old.y);
      a.x += o0.x, a.y += o0.y, a.z += o1.x, a.w += o1.y;
    }
    *dst = make_uint2(pack_h2(a.x, a.y), pack_h2(a.z, a.w));
  }
}
