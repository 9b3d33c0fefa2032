// gemm_fp8_prefill.cu: the FP8 prefill GEMM (opt-in: prefill_weights="fp8"). out[T, N] = X[T, K] . W^T
// (+ out), both operands e4m3 on the tensor cores at twice the fp16 rate, fp32 sums.
//
// Numerics. W: the INT4 integers q = -8 .. 7 of the stored weights, which e4m3 holds exactly (a resident
// copy, 1 byte a weight, made once at load: half the bytes of the fp16 copy), with the fp16 group scale
// sw[n, g] kept apart. X: every 128 k of a token row (one INT4 group) divided by its own scale
// sx[t, g] = amax / 448 and rounded to e4m3 (nq_quantize_e4m3_rows, prefill_quant.cu): the one new rounding
// (3 mantissa bits; DeepSeek-V3's 1 x 128 activation blocks). So each group's product is exact integer-
// times-e4m3 sums in fp32, and the block scales are applied to each group's partial sum, in fp32, before it
// joins the total ("promotion"):  acc[n, t] += (sum over the group's 128 k of q[n, k] x8[t, k]) sw[n, g] sx[t, g].
// What that rounding costs a real model is measured by scripts/fp8_prefill_numerics.py (docs/PERF.md).
//
// Block: 384 threads = two consumer warpgroups (warps 0-7) + a producer warpgroup of which one thread issues
// every copy. Tile: 128 weight rows (warpgroup i owns rows 64 i .. 64 i + 63) x BN = 8 NT tokens (NT = 16 / 8:
// 128 / 64 tokens). Weights are the M side as in gemm_int4_prefill.cu (a lane's accumulators then hold 2
// weight rows, so the promotion needs 2 weight scales, not 2 NT), tokens the N side; the epilogue transposes
// through shared memory. Not 256 tokens: the promotion needs a second accumulator set beside the running
// sums (the group's partial), and two sets of m64n256 are 256 registers.
//
// The ring (kStages stages, each one INT4 group = 128 k, all four copies completing on one mbarrier):
//     X  [BN tokens][128 B]  e4m3, TMA box (the 128-byte swizzle: wgmma's K-major layout, wgmma.cuh)
//     W  [128 rows][128 B]   e4m3, TMA box, same swizzle (tokens / rows past the end read as zeros)
//     SW [128] f32           the rows' group scales (sw is stored [G][n_pad]: one 512-byte bulk copy)
//     SX [BN] f32            the tokens' group scales (sx is stored [G][t_pad]: one bulk copy)
//
// Inside a consumer: stage i's 4 wgmmas (m64 x BN x k32, the first with scale-d = 0: they overwrite the
// partial set) go out into partial set i % 2, then the warp waits until only they are pending and promotes
// stage i - 1's partials (set (i - 1) % 2) into acc while the tensor cores run stage i, and gives its slot
// back. acc (4 NT registers) + two partial sets (8 NT) = 192 registers at NT = 16.
//
// Tested: tests/test_prefill_gemm_fp8.py (against float64 on the same e4m3 inputs at T = 1, 17, 511, 513,
// every width, split-K, accumulate, the SiLU build; the conversion and the quantizer against numpy's
// e4m3 rounding), tests/test_compile.py (SASS: the e4m3 HGMMAs, not serialized, setmaxnreg).
#include "wgmma.cuh"

namespace nq {
namespace gf8 {

constexpr int kBM = 128;   // weight rows per block
constexpr int kBK = 128;   // k per stage: one INT4 group (128 e4m3 = one 128-byte swizzle row)
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 128;  // prefill_gemm.py GF8_THREADS
constexpr int kConsumerRegs = 232;  // 2 x 128 x 232 + 128 x 40 = 64,512 of the SM's 65,536
constexpr int kProducerRegs = 40;
#ifndef NQ_GF8_STAGES
#define NQ_GF8_STAGES 6
#endif
constexpr int kStages = NQ_GF8_STAGES;
// The cluster: kCX blocks along the tokens x kCY along the weight rows (prefill_gemm.GF8_CLUSTER). The kCX
// blocks of one row tile each copy 1 / kCX of the W tile and multicast it to all of them; the kCY blocks of
// one token tile share the X tile the same way. Why: a 128 x 128 tile at 128 k a stage is 128 FLOP per byte
// copied, and without sharing the kernel ran at ~6 TB/s of L2-to-SM traffic (7B gate/up at T = 512:
// 776 TFLOP/s, the same traffic as the fp16 INT4 GEMM's, docs/PERF.md): the L2's limit, not the tensor
// cores'. 2 x 2 quarters the copies per block.
#ifndef NQ_GF8_CX
#define NQ_GF8_CX 2
#endif
#ifndef NQ_GF8_CY
#define NQ_GF8_CY 2
#endif
constexpr int kCX = NQ_GF8_CX, kCY = NQ_GF8_CY, kCluster = kCX * kCY;
static_assert((kCX == 1 || kCX == 2) && (kCY == 1 || kCY == 2), "clusters of 1 or 2 along each side");


constexpr int kWBytes = kBM * kBK;
constexpr int kSwBytes = kBM * 4;
template <int NT>
__host__ __device__ constexpr int x_bytes() { return NT * 8 * kBK; }
template <int NT>
__host__ __device__ constexpr int sx_bytes() { return NT * 8 * 4; }
template <int NT>
__host__ __device__ constexpr int stage_bytes() {
  return (x_bytes<NT>() + kWBytes + kSwBytes + sx_bytes<NT>() + 1023) / 1024 * 1024;
}
constexpr int kEpiPitch = 132;  // floats per token of the epilogue's staging: 128 rows + 4 (bank spread)
template <int NT>
__host__ __device__ constexpr int epi_bytes() { return NT * 8 * kEpiPitch * 4; }
// dynamic shared memory of a launch (prefill_gemm.py fp8_smem_bytes mirrors it)
template <int NT>
__host__ __device__ constexpr int smem_bytes() {
  return (kStages * stage_bytes<NT>() > epi_bytes<NT>() ? kStages * stage_bytes<NT>() : epi_bytes<NT>()) + 1024;
}
static_assert(smem_bytes<16>() <= 227 * 1024, "the ring must fit the 227 KB of an H100/H200 block");

__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kConsumerThreads) : "memory"); }
__device__ __forceinline__ float silu(float x) { return x / (1.f + __expf(-x)); }
// Pin the accumulators in place (CUTLASS's warpgroup_fence_operand): the compiler may otherwise move the
// promotion's register reads of a partial set above the wgmma_wait that completes it (the wait is an asm
// with a memory clobber, which orders memory, not registers), and ptxas, seeing a wgmma's accumulators read
// while it may be in flight, then serializes every wgmma (its warning C7514).
template <int NT>
__device__ __forceinline__ void fence_acc(float (&p)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+f"(p[j][q])::"memory");
}

template <int NT, bool kSilu>
__device__ __forceinline__ void gemm_fp8_wg(const TmaMap& xmap, const TmaMap& wmap, const float* __restrict__ sw,
                                            const float* __restrict__ sx, uint16_t* __restrict__ out, int T, int N,
                                            int K, int n_pad, int t_pad, int accumulate, float* __restrict__ ws,
                                            int splits) {
  constexpr int kBN = 8 * NT;
  constexpr int kStage = stage_bytes<NT>();
  extern __shared__ uint4 smem_raw[];
  char* const ring = reinterpret_cast<char*>(smem_raw) + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  __shared__ uint64_t full_bar[kStages], empty_bar[kStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int t0 = blockIdx.x * kBN, row0 = blockIdx.y * kBM;
  // split-K: split z of `splits` takes groups [z G / splits, (z + 1) G / splits)
  const int G = K / kBK;
  const int g_lo = static_cast<int>(blockIdx.z) * G / splits, g_hi = (static_cast<int>(blockIdx.z) + 1) * G / splits;
  const int n_stages = g_hi - g_lo;
  // cluster position: cx along the tokens (the blocks sharing a W tile), cy along the rows (sharing an X tile)
  const int crank = kCluster > 1 ? static_cast<int>(cluster_ctarank()) : 0;
  const int cx = crank % kCX, cy = crank / kCX;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);                // the producer's arrival + the copies' bytes (its own and its peers')
      mbar_init(&empty_bar[s], 8 * kCluster);    // every consumer warp of the cluster (a slot is written by peers too)
    }
    fence_mbarrier_init();  // visible to the TMA unit (async proxy) and to the cluster
  }
  if constexpr (kCluster > 1) {
    cluster_barrier();  // no peer copies into this block or arrives on its barriers before they exist
  } else {
    __syncthreads();
  }
  pdl_wait();  // X, sx (and out, when accumulating) are the previous kernels' outputs

  if (warp >= 8) {  // ---- the producer: one thread issues every copy ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (tid != kConsumerThreads) return;
    // this block's share: X tokens [t0 + cy BN / kCY, + BN / kCY) to the blocks of its token tile (same cx),
    // W rows [row0 + cx 128 / kCX, + 128 / kCX) to the blocks of its row tile (same cy)
    uint16_t xmask = 0, wmask = 0;
    for (int j = 0; j < kCY; ++j) xmask |= static_cast<uint16_t>(1u << (cx + kCX * j));
    for (int j = 0; j < kCX; ++j) wmask |= static_cast<uint16_t>(1u << (j + kCX * cy));
    constexpr int kXPart = kBN / kCY, kWPart = kBM / kCX;
    for (int i = 0; i < n_stages; ++i) {
      const int s = i % kStages;
      if (i >= kStages) mbar_wait(&empty_bar[s], ((i / kStages) + 1) & 1);
      char* base = ring + s * kStage;
      const int g = g_lo + i;
      // the whole stage's bytes land on this block's barrier: its own copies' and its peers' multicasts
      mbar_arrive_expect_tx(&full_bar[s], x_bytes<NT>() + kWBytes + kSwBytes + sx_bytes<NT>());
      char* xdst = base + cy * kXPart * kBK;
      char* wdst = base + x_bytes<NT>() + cx * kWPart * kBK;
      if constexpr (kCY > 1) {
        tma_load_2d_multicast(xdst, &xmap, g * kBK, t0 + cy * kXPart, &full_bar[s], xmask);
      } else {
        tma_load_2d(xdst, &xmap, g * kBK, t0, &full_bar[s]);
      }
      if constexpr (kCX > 1) {
        tma_load_2d_multicast(wdst, &wmap, g * kBK, row0 + cx * kWPart, &full_bar[s], wmask);
      } else {
        tma_load_2d(wdst, &wmap, g * kBK, row0, &full_bar[s]);
      }
      bulk_load(base + x_bytes<NT>() + kWBytes, sw + static_cast<size_t>(g) * n_pad + row0, kSwBytes, &full_bar[s]);
      bulk_load(base + x_bytes<NT>() + kWBytes + kSwBytes, sx + static_cast<size_t>(g) * t_pad + t0, sx_bytes<NT>(),
                &full_bar[s]);
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));

  // ---- the consumers ----
  const int wg = warp >> 2, g8 = lane >> 2, c = lane & 3;
  const int r0 = 64 * wg + 16 * (warp & 3) + g8, r1 = r0 + 8;  // the tile rows of this lane's accumulators
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  // stage i's 4 wgmmas into partial set p (after its copies landed)
  auto issue = [&](int i, float(&p)[NT][4]) {
    const int s = i % kStages;
    mbar_wait(&full_bar[s], (i / kStages) & 1);
    const uint32_t base = smem_u32(ring + s * kStage);
    const uint64_t da = wgmma_desc_sw128(base + x_bytes<NT>() + 8192u * wg);  // this warpgroup's 64 rows
    const uint64_t db = wgmma_desc_sw128(base);
    fence_acc<NT>(p);
    wgmma_fence();  // p's last reads (the promotion) before the wgmmas overwrite it
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_ss_e4m3<NT>(p, da + 2 * j, db + 2 * j, j);
    wgmma_commit();
    fence_acc<NT>(p);
  };
  // stage i's partials (complete) times the block scales into acc; then its slot back to the producer
  auto promote = [&](int i, float(&p)[NT][4]) {
    fence_acc<NT>(p);  // after the wait that completed p's wgmmas
    const int s = i % kStages;
    const float* scales = reinterpret_cast<const float*>(ring + s * kStage + x_bytes<NT>() + kWBytes);
    const float w0 = scales[r0], w1 = scales[r1];
    const float* sxs = scales + kBM;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float2 x = *reinterpret_cast<const float2*>(sxs + 8 * j + 2 * c);
      acc[j][0] = fmaf(p[j][0], w0 * x.x, acc[j][0]);
      acc[j][1] = fmaf(p[j][1], w0 * x.y, acc[j][1]);
      acc[j][2] = fmaf(p[j][2], w1 * x.x, acc[j][2]);
      acc[j][3] = fmaf(p[j][3], w1 * x.y, acc[j][3]);
    }
    __syncwarp();  // every lane's scale loads done (and the wgmmas that read the slot: waited) before the release
    if (lane == 0) {
      if constexpr (kCluster > 1) {
        for (int r = 0; r < kCluster; ++r) mbar_arrive_cluster(&empty_bar[s], r);  // peers write this slot too
      } else {
        mbar_arrive(&empty_bar[s]);
      }
    }
  };
  // Each set is complete whenever the loop passes its back edge (wait<0> before it): a wgmma in flight across
  // the back edge would have its accumulators copied there (loop-carried registers), and ptxas then
  // serializes every wgmma (warning C7514). Within an iteration a set's wgmmas run while the other set is
  // promoted: issue stage i + 1 into pb, promote stage i from pa, wait; issue i + 2 into pa, promote pb, wait.
  float pa[NT][4], pb[NT][4];
  issue(0, pa);
  wgmma_wait<0>();
  for (int i = 0; i < n_stages; i += 2) {
    if (i + 1 < n_stages) issue(i + 1, pb);
    promote(i, pa);
    wgmma_wait<0>();
    if (i + 1 >= n_stages) break;
    if (i + 2 < n_stages) issue(i + 2, pa);
    promote(i + 1, pb);
    wgmma_wait<0>();
  }

  // ---- epilogue: [row][token] sums -> [token][row] fp16 rows of out (as gemm_int4_prefill.cu's) ----
  if constexpr (kCluster > 1) {
    // every block of the cluster is past its last stage: no copy or arrival comes here any more, so the
    // ring can be reused and the block may exit (the producers have exited: the barrier counts the rest)
    cluster_barrier();
  }
  consumer_sync();  // every consumer's wgmmas done: the ring is free for the staging
  float* ep = reinterpret_cast<float*>(ring);
  if constexpr (kSilu) {  // rows arrive permuted (fp8 copy of gate|up): r0 the gate, r1 = r0 + 8 the up of output a
    constexpr int kPitch = 68;
    const int al = 8 * (r0 >> 4) + g8;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int tl = 8 * j + 2 * c;
      ep[tl * kPitch + al] = silu(acc[j][0]) * acc[j][2];
      ep[(tl + 1) * kPitch + al] = silu(acc[j][1]) * acc[j][3];
    }
    consumer_sync();
    const int I = N / 2, a = 64 * static_cast<int>(blockIdx.y) + 4 * (lane & 15);
    if (a < I) {
      for (int tl = 2 * warp + (lane >> 4); tl < kBN; tl += 16) {
        const int tok = t0 + tl;
        if (tok >= T) break;
        const float4 v = *reinterpret_cast<const float4*>(ep + tl * kPitch + 4 * (lane & 15));
        *reinterpret_cast<uint2*>(out + static_cast<size_t>(tok) * I + a) = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tl = 8 * j + 2 * c;
    ep[tl * kEpiPitch + r0] = acc[j][0];
    ep[(tl + 1) * kEpiPitch + r0] = acc[j][1];
    ep[tl * kEpiPitch + r1] = acc[j][2];
    ep[(tl + 1) * kEpiPitch + r1] = acc[j][3];
  }
  consumer_sync();
  const int row = row0 + 4 * lane;
  if (row < N) {
    for (int tl = warp; tl < kBN; tl += 8) {
      const int tok = t0 + tl;
      if (tok >= T) break;
      const float4 v = *reinterpret_cast<const float4*>(ep + tl * kEpiPitch + 4 * lane);
      if (splits > 1) {  // this split's fp32 partial sums; nq_gemm_splitk_reduce (gemm_int4_prefill.cu) adds them
        *reinterpret_cast<float4*>(ws + (static_cast<size_t>(blockIdx.z) * T + tok) * N + row) = v;
        continue;
      }
      float r[4] = {v.x, v.y, v.z, v.w};
      uint2* dst = reinterpret_cast<uint2*>(out + static_cast<size_t>(tok) * N + row);
      if (accumulate) {
        const uint2 old = *dst;
        const float2 o0 = h22f2(old.x), o1 = h22f2(old.y);
        r[0] += o0.x, r[1] += o0.y, r[2] += o1.x, r[3] += o1.y;
      }
      *dst = make_uint2(pack_h2(r[0], r[1]), pack_h2(r[2], r[3]));
    }
  }
}

}  // namespace gf8
}  // namespace nq

#define NQ_GF8_ENTRY(SUFFIX, NT, SILU)                                                                           \
  extern "C" __global__ void __launch_bounds__(nq::gf8::kThreads, 1) nq_gemm_fp8_wg##SUFFIX(                    \
      const __grid_constant__ nq::TmaMap xmap, const __grid_constant__ nq::TmaMap wmap,                          \
      const float* __restrict__ sw, const float* __restrict__ sx, nq::uint16_t* __restrict__ out, int T, int N,  \
      int K, int n_pad, int t_pad, int accumulate, float* __restrict__ ws, int splits) {                         \
    nq::gf8::gemm_fp8_wg<NT / 8, SILU>(xmap, wmap, sw, sx, out, T, N, K, n_pad, t_pad, accumulate, ws, splits); \
  }
NQ_GF8_ENTRY(_n128, 128, false)
NQ_GF8_ENTRY(_n64, 64, false)
NQ_GF8_ENTRY(_silu_n128, 128, true)
NQ_GF8_ENTRY(_silu_n64, 64, true)
