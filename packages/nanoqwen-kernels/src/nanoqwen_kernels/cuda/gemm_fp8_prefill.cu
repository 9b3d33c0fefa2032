// gemm_fp8_prefill.cu: the FP8 prefill GEMM (opt-in: prefill_weights="fp8"). out[T, N] = X[T, K] . W^T
// (+ out), both operands e4m3 on the tensor cores (twice the fp16 rate), fp32 sums.
//
// Numerics. W: the INT4 integers q = -8 .. 7 of the stored weights, which e4m3 holds exactly (a resident
// copy, 1 byte a weight, made once at load: half the bytes of the fp16 copy), the fp16 group scale sw[n, g]
// kept apart. X: each token row divided by its own scale sx[t] = amax / 448 and rounded to e4m3
// (nq_quantize_e4m3_rows, prefill_quant.cu): the one new rounding (3 mantissa bits). Each group's partial
// sum (128 k of integer-times-e4m3 products on the tensor cores) is multiplied by its rows' group scale in
// fp32 as it joins the running sum ("promotion"), and the token's scale multiplies the total at the end:
//     out[t, n] = sx[t] sum over groups g of sw[n, g] (sum over the group's k of q[n, k] x8[t, k])
// Why one scale per token rather than per 128 k (DeepSeek-V3's 1 x 128 blocks, tried first): a per-block
// X scale varies along both the tokens and the groups, so the promotion multiplies each partial by
// sw[n, g] sx[t, g], two operations per accumulator and stage instead of one, and it was the bound: 7B
// gate/up 792 TFLOP/s at T = 512 with per-block scales, 1,068 with one scale per token, 1,348 with no
// promotion at all (H200, same call, docs/PERF.md). What the coarser rounding costs a real model: also
// docs/PERF.md (scripts/fp8_prefill_numerics.py).
// Hopper's FP8 tensor cores sum a wgmma chain with fewer bits than fp32 (DeepSeek-V3's report measures it);
// the promotion every 128 k keeps those chains short.
//
// Block: 384 threads = two consumer warpgroups (warps 0-7) + a producer warpgroup of which one thread issues
// every copy. Tile: 128 weight rows (warpgroup i owns rows 64 i .. 64 i + 63) x BN = 8 NT tokens (NT = 16 / 8:
// 128 / 64 tokens). Weights are the M side as in gemm_int4_prefill.cu (a lane's accumulators hold 2 weight
// rows: the promotion needs 2 scales), tokens the N side; the epilogue transposes through shared memory.
// Not 256 tokens: the promotion needs the group's partial sums beside the running ones, and two m64n256
// sets are 256 registers.
//
// Persistent blocks (one per SM, prefill_gemm.py fp8_grid): block b runs tiles b, b + gridDim.x, .. in a
// banded order (Unit, below). The ring's stages run on from one tile into the next, so while the consumers
// run a tile's epilogue the producer is already filling the next tile's stages: a block never starts a tile
// on an empty ring, which is what a block per tile did (its epilogue staged in the drained ring). The
// epilogue has its own staging beside the ring for that; the ring is as deep as fits beside it (stages()).
// Against a block per tile, same call, 7B at 8,192 tokens: gate/up 917-998 -> 1,134 TFLOP/s, down
// 1,061-1,090 -> 1,214 (band 8; band 1 gave 1,083 / 1,048: the band is what down needs); the whole 8k
// prefill 152.3 -> 145.8-146.2 ms (H200, docs/PERF.md "fifteenth lease"). The bits are the same: a tile's
// arithmetic does not depend on where or when it runs.
//
// The ring (stages() stages, each one INT4 group = 128 k, all three copies completing on one mbarrier):
//     X  [BN tokens][128 B]  e4m3, TMA box (the 128-byte swizzle: wgmma's K-major layout, wgmma.cuh)
//     W  [128 rows][128 B]   e4m3, TMA box, same swizzle (tokens / rows past the end read as zeros)
//     SW [128] f32           the rows' group scales (sw is stored [G][n_pad]: one 512-byte bulk copy)
//
// Inside a consumer, per stage: its 4 wgmmas (m64 x BN x k32, the first with scale-d = 0: they overwrite the
// partial set), the rows' 2 scales loaded while they run, wait, the slot back to the producer, promote.
// The two consumer warpgroups take turns on the tensor cores: one promotes while the other's wgmmas run.
// (Two partial sets in flight per warpgroup, promoting one while the other's wgmmas run, measured slower:
// 24 NT registers of sums left the promotion too few temporaries.) Thread-block clusters sharing the X and
// W tiles by TMA multicast (2 x 1, 1 x 2, 2 x 2) were tried and ran 2-3x slower; removed.
//
// Tested: tests/test_prefill_gemm_fp8.py (against float64 on the same e4m3 inputs at T = 1, 17, 511, 513,
// every width, split-K, accumulate, the SiLU build, blocks that each run 30-110 tiles in bands of 1, 3 and 8;
// the conversion and the quantizer bit for bit against numpy's e4m3 rounding; the launcher's shared-memory
// mirror against smem_bytes() at compile time), tests/test_compile.py (SASS: the e4m3 QGMMAs, not
// serialized, setmaxnreg).
#include "gemm_epilogue.cuh"
#include "wgmma.cuh"

namespace nq {
namespace gf8 {

constexpr int kBM = 128;  // weight rows per block
constexpr int kBK = 128;  // k per stage: one INT4 group (128 e4m3 = one 128-byte swizzle row)
constexpr int kConsumerThreads = 256;
constexpr int kThreads = kConsumerThreads + 128;  // prefill_gemm.py GF8_THREADS
constexpr int kConsumerRegs = 232;                // 2 x 128 x 232 + 128 x 40 = 64,512 of the SM's 65,536
constexpr int kProducerRegs = 40;
constexpr int kSmemMax = 227 * 1024;  // an H100/H200 block's dynamic shared memory
constexpr int kMaxStages = 6;

constexpr int kWBytes = kBM * kBK;
constexpr int kSwBytes = kBM * 4;
template <int NT>
__host__ __device__ constexpr int x_bytes() { return NT * 8 * kBK; }
template <int NT>
__host__ __device__ constexpr int stage_bytes() { return (x_bytes<NT>() + kWBytes + kSwBytes + 1023) / 1024 * 1024; }
template <int NT, bool kSilu>
__host__ __device__ constexpr int staging_bytes() { return (epi::staging_bytes<NT, kSilu>() + 1023) / 1024 * 1024; }
// The ring's depth: as many stages as fit beside the epilogue's own staging, at most kMaxStages (n128: 4
// plain, 5 SiLU; n64: 6). prefill_gemm.py fp8_stages mirrors it.
template <int NT, bool kSilu>
__host__ __device__ constexpr int stages() {
  const int fit = (kSmemMax - 1024 - staging_bytes<NT, kSilu>()) / stage_bytes<NT>();
  return fit < kMaxStages ? fit : kMaxStages;
}
// dynamic shared memory of a launch (prefill_gemm.py fp8_smem_bytes mirrors it): the ring, the staging, and
// room to align the ring to 1024 bytes (the swizzle atoms)
template <int NT, bool kSilu>
__host__ __device__ constexpr int smem_bytes() {
  return stages<NT, kSilu>() * stage_bytes<NT>() + staging_bytes<NT, kSilu>() + 1024;
}
static_assert(smem_bytes<16, false>() <= kSmemMax && stages<16, false>() >= 4, "n128: >= 4 stages must fit");
// The launcher sizes each launch's shared memory from prefill_gemm.py's mirror of smem_bytes(); its CPU test
// compiles this file with the mirror's four numbers (tests/test_prefill_gemm_fp8.py), so the two cannot drift.
#ifdef NQ_GF8_MIRROR_N128
static_assert(smem_bytes<16, false>() == NQ_GF8_MIRROR_N128 && smem_bytes<16, true>() == NQ_GF8_MIRROR_N128_SILU &&
                  smem_bytes<8, false>() == NQ_GF8_MIRROR_N64 && smem_bytes<8, true>() == NQ_GF8_MIRROR_N64_SILU,
              "prefill_gemm.py fp8_smem_bytes disagrees with gf8::smem_bytes");
#endif

// Pin the partial sums in place (CUTLASS's warpgroup_fence_operand): the compiler may otherwise move the
// promotion's register reads above the wgmma_wait that completes them (the wait is an asm with a memory
// clobber, which orders memory, not registers), and ptxas, seeing a wgmma's accumulators read while it
// may be in flight, then serializes every wgmma (its warning C7514).
template <int NT>
__device__ __forceinline__ void fence_acc(float (&p)[NT][4]) {
#pragma unroll
  for (int j = 0; j < NT; ++j)
#pragma unroll
    for (int q = 0; q < 4; ++q) asm volatile("" : "+f"(p[j][q])::"memory");
}

// A tile ("unit") of the persistent schedule: tokens t0 .. t0 + BN - 1, weight row block ty, K split z.
// Units are numbered split by split; inside a split, in bands of `band` row blocks, token blocks along the
// band: consecutive units (the ones the SMs run at the same time) share a band's weight rows and a token
// block's X rows, so both come from HBM about once while the other stays in L2.
struct Unit {
  int tx, ty, z;
  __device__ __forceinline__ Unit(int u, int tiles_x, int tiles_y, int band) {
    const int per_split = tiles_x * tiles_y;
    z = u / per_split;
    const int r = u - z * per_split;
    const int b0 = (r / (band * tiles_x)) * band;  // the band's first row block
    const int rows = tiles_y - b0 < band ? tiles_y - b0 : band;
    const int w = r - b0 * tiles_x;                // position inside the band
    ty = b0 + w % rows;
    tx = w / rows;
  }
};

template <int NT, bool kSilu>
__device__ __forceinline__ void gemm_fp8_wg(const TmaMap& xmap, const TmaMap& wmap, const float* __restrict__ sw,
                                            const float* __restrict__ sx, uint16_t* __restrict__ out, int T, int N,
                                            int K, int n_pad, int accumulate, float* __restrict__ ws, int splits,
                                            int band) {
  constexpr int kBN = 8 * NT;
  constexpr int kStages = stages<NT, kSilu>();
  constexpr int kStage = stage_bytes<NT>();
  extern __shared__ uint4 smem_raw[];
  char* const ring = reinterpret_cast<char*>(smem_raw) + ((1024u - (smem_u32(smem_raw) & 1023u)) & 1023u);
  float* const staging = reinterpret_cast<float*>(ring + kStages * kStage);
  __shared__ uint64_t full_bar[kStages], empty_bar[kStages];
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int tiles_x = (T + kBN - 1) / kBN, tiles_y = (N + kBM - 1) / kBM;
  const int units = tiles_x * tiles_y * splits;
  const int G = K / kBK;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full_bar[s], 1);   // the producer's arrival + the copies' bytes
      mbar_init(&empty_bar[s], 8);  // one arrival per consumer warp
    }
    fence_mbarrier_init();  // visible to the TMA unit (async proxy)
  }
  __syncthreads();
  pdl_wait();  // X, sx (and out, when accumulating) are the previous kernels' outputs

  // Persistent: block b takes units b, b + gridDim.x, ... The ring's stages run on across units (stage
  // count `it`), so the producer fills the next unit's stages while the consumers run this one's epilogue:
  // no block starts on an empty ring. split z takes K's groups [z G / splits, (z + 1) G / splits).
  if (warp >= 8) {  // ---- the producer: one thread issues every copy ----
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kProducerRegs));
    if (tid != kConsumerThreads) return;
    int it = 0;
    for (int u = blockIdx.x; u < units; u += gridDim.x) {
      const Unit un(u, tiles_x, tiles_y, band);
      const int t0 = un.tx * kBN, row0 = un.ty * kBM;
      const int g_lo = un.z * G / splits, g_hi = (un.z + 1) * G / splits;
      for (int g = g_lo; g < g_hi; ++g, ++it) {
        const int s = it % kStages;
        if (it >= kStages) mbar_wait(&empty_bar[s], ((it / kStages) + 1) & 1);
        char* base = ring + s * kStage;
        mbar_arrive_expect_tx(&full_bar[s], x_bytes<NT>() + kWBytes + kSwBytes);
        tma_load_2d(base, &xmap, g * kBK, t0, &full_bar[s]);
        tma_load_2d(base + x_bytes<NT>(), &wmap, g * kBK, row0, &full_bar[s]);
        bulk_load(base + x_bytes<NT>() + kWBytes, sw + static_cast<size_t>(g) * n_pad + row0, kSwBytes, &full_bar[s]);
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kConsumerRegs));

  // ---- the consumers ----
  const int wg = warp >> 2, g8 = lane >> 2, c = lane & 3;
  const int r0 = 64 * wg + 16 * (warp & 3) + g8, r1 = r0 + 8;  // the tile rows of this lane's accumulators
  int it = 0;
  for (int u = blockIdx.x; u < units; u += gridDim.x) {
    const Unit un(u, tiles_x, tiles_y, band);
    const int t0 = un.tx * kBN;
    const int n_stages = (un.z + 1) * G / splits - un.z * G / splits;
    float acc[NT][4], p[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
    for (int i = 0; i < n_stages; ++i, ++it) {
      const int s = it % kStages;
      mbar_wait(&full_bar[s], (it / kStages) & 1);
      const uint32_t base = smem_u32(ring + s * kStage);
      const uint64_t da = wgmma_desc_sw128(base + x_bytes<NT>() + 8192u * wg);  // this warpgroup's 64 rows
      const uint64_t db = wgmma_desc_sw128(base);
      fence_acc<NT>(p);
      wgmma_fence();  // p's last reads (the previous promotion) before the wgmmas overwrite it
#pragma unroll
      for (int j = 0; j < 4; ++j) wgmma_ss_e4m3<NT>(p, da + 2 * j, db + 2 * j, j);
      wgmma_commit();
      // the rows' group scales while the tensor cores run
      const float* scales = reinterpret_cast<const float*>(ring + s * kStage + x_bytes<NT>() + kWBytes);
      const float w0 = scales[r0], w1 = scales[r1];
      wgmma_wait<0>();
      fence_acc<NT>(p);
      __syncwarp();  // every lane's loads from the slot done (and its wgmmas complete) before the release
      if (lane == 0) mbar_arrive(&empty_bar[s]);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        acc[j][0] = fmaf(p[j][0], w0, acc[j][0]);
        acc[j][1] = fmaf(p[j][1], w0, acc[j][1]);
        acc[j][2] = fmaf(p[j][2], w1, acc[j][2]);
        acc[j][3] = fmaf(p[j][3], w1, acc[j][3]);
      }
    }
    // the tokens' scales (tokens past T: 0, never written)
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const int t = t0 + 8 * j + 2 * c;
      const float x0 = t < T ? sx[t] : 0.f, x1 = t + 1 < T ? sx[t + 1] : 0.f;
      acc[j][0] *= x0, acc[j][2] *= x0, acc[j][1] *= x1, acc[j][3] *= x1;
    }
    // ---- epilogue: [row][token] sums -> [token][row] fp16 rows of out, through the block's staging (the
    // ring is the producer's, already filling with the next unit's stages) ----
    epi::store<NT, kSilu>(acc, staging, r0, warp, lane, out, T, N, t0, un.ty, accumulate, ws, un.z, splits);
  }
}

}  // namespace gf8
}  // namespace nq

#define NQ_GF8_ENTRY(SUFFIX, NT, SILU)                                                                          \
  extern "C" __global__ void __launch_bounds__(nq::gf8::kThreads, 1) nq_gemm_fp8_wg##SUFFIX(                   \
      const __grid_constant__ nq::TmaMap xmap, const __grid_constant__ nq::TmaMap wmap,                         \
      const float* __restrict__ sw, const float* __restrict__ sx, nq::uint16_t* __restrict__ out, int T, int N, \
      int K, int n_pad, int accumulate, float* __restrict__ ws, int splits, int band) {                         \
    NQ_STAMP();                                                                                                \
    nq::gf8::gemm_fp8_wg<NT / 8, SILU>(xmap, wmap, sw, sx, out, T, N, K, n_pad, accumulate, ws, splits, band); \
  }
NQ_GF8_ENTRY(_n128, 128, false)
NQ_GF8_ENTRY(_n64, 64, false)
NQ_GF8_ENTRY(_silu_n128, 128, true)
NQ_GF8_ENTRY(_silu_n64, 64, true)
