"""The hand-off between two matrices of a decode step: two launches, or one kernel with a grid barrier.

Issue 15's lines left open (q/k/v within 2x its byte floor, down_proj at 85% of the copy rate) lie below what one
launch of those shapes reaches (scripts/read_floor_probe.py, docs/PERF.md thirty-first lease): each launch pays
its wait for the previous kernel, an x prologue after that wait, and a ramp whose first weights only go out once
the previous kernel's blocks have left the SMs (registers). The structural alternative is a persistent kernel
that runs both matrices: its blocks stay resident, issue the second matrix's first weights before a grid-wide
barrier (the second matrix's x is the first's output, so everything after x must wait for every block), and
never relaunch. This probe measures what that buys on pure reads of the 7B's down_proj -> q/k/v pair (the
layer boundary: down_proj writes the residual stream that q/k/v norms), before anyone builds such a kernel.

Per "layer" (28 a graph, each its own regions, together larger than the L2), us a layer:
  launches    two kernels (the step as it is): A (down_proj's 33.95 MB, 224 blocks, 2 an SM, an 18.9 KB x
              prologue) then B (q/k/v's 8.26 MB, 288 blocks, 3 an SM, a 7.2 KB x prologue), each with launch
              overlap: its first loads before griddepcontrol.wait, its successor released right after it
  launches/264  the same, both at the persistent grid (132 x 2 blocks)
  one kernel  A then B in one kernel of 264 blocks (2 an SM, all resident): A as above, then a grid barrier
              (a fence, one atomic a block, thread 0 polling the counter with acquire loads), B's prologue, B
  one kernel, B early  the same, B's first loads issued before the barrier (the weights do not depend on A)
Each warp streams one contiguous span of a region, U = 8 16-byte loads a lane in flight (ld.global.nc
no-allocate, as the GEMVs' weights), xor'd into a value stored only on a 2^-32 chance.

    python3 scripts/handoff_probe.py [--reps 30] [--json out.json]

Needs a GPU (CuPy, and the driver's cuLaunchKernelEx through nanoqwen_kernels.pdl). A timing is a measurement,
never an assertion.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from read_floor_probe import COPY_BW, LD_W, STAGE_X, X16_MAX, time_graph, write_json  # noqa: E402  (shared)

U = 8  # 16-byte loads a lane in flight
A_MB, A_BLOCKS, A_CAP, A_XKB = 33.95, 224, 2, 18.944  # the 7B's down_proj: bytes, grid, blocks an SM, x
B_MB, B_BLOCKS, B_CAP, B_XKB = 8.257, 288, 3, 7.168  # the 7B's q/k/v
PERSISTENT_PER_SM = 2  # blocks an SM of the one-kernel grid (its registers and shared memory allow 2)

SRC = LD_W + STAGE_X + r"""
#define MAGIC 0x9e3779b9u
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void pdl_wait_release() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
// warp `warp` of `warps`: its contiguous span of n16 words, lane-strided ([i, end), 32 words a step)
struct Span {
  u64 i, end;
};
__device__ __forceinline__ Span span_of(u64 n16, u64 warps, u64 warp) {
  const u64 s = (n16 + warps - 1) / warps;
  const u64 e = (warp + 1) * s < n16 ? (warp + 1) * s : n16;
  return {warp * s + (threadIdx.x & 31), e};
}
__device__ __forceinline__ void issue(const uint4* w, Span sp, uint4 (&v)[U]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const u64 j = sp.i + (u64)u * 32;
    v[u] = j < sp.end ? ld_w(w + j) : make_uint4(0, 0, 0, 0);
  }
}
// consume the batch in flight and issue the next, to the span's end
__device__ __forceinline__ unsigned stream(const uint4* w, Span sp, uint4 (&v)[U]) {
  unsigned acc = 0;
  for (u64 i = sp.i; i < sp.end; i += (u64)U * 32) {
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 j = i + (u64)(U + u) * 32;
      v[u] = j < sp.end ? ld_w(w + j) : make_uint4(0, 0, 0, 0);
    }
  }
  return acc;
}
// x's prologue after the wait (x16 = 0: none)
__device__ __forceinline__ unsigned prologue(const uint4* __restrict__ xg, int x16, uint4* xs) {
  return x16 > 0 ? stage_x(xg, x16, xs) : 0u;
}
// one matrix a launch
extern "C" __global__ void __launch_bounds__(256) one(const uint4* __restrict__ w, u64 n16, unsigned* sink,
                                                      const uint4* __restrict__ xg, int x16) {
  extern __shared__ uint4 xs[];
  const u64 warps = (u64)gridDim.x * 8, warp = (u64)blockIdx.x * 8 + threadIdx.x / 32;
  const Span sp = span_of(n16, warps, warp);
  uint4 v[U];
  issue(w, sp, v);
  pdl_wait_release();
  unsigned acc = prologue(xg, x16, xs);
  acc ^= stream(w, sp, v);
  if (acc == MAGIC) sink[0] = acc;
}
// two matrices in one kernel (every block resident): A, then a grid barrier, then B. counter: a word that only
// grows (each block adds 1 a launch; a launch's generation is its first arrival / gridDim.x, so a graph replays
// it without a reset)
extern "C" __global__ void __launch_bounds__(256) two(const uint4* __restrict__ wa, u64 na16,
                                                      const uint4* __restrict__ wb, u64 nb16, unsigned* sink,
                                                      unsigned* counter, const uint4* __restrict__ xg, int xa16,
                                                      int xb16, int b_early) {
  extern __shared__ uint4 xs[];
  const u64 warps = (u64)gridDim.x * 8, warp = (u64)blockIdx.x * 8 + threadIdx.x / 32;
  const Span sa = span_of(na16, warps, warp), sb = span_of(nb16, warps, warp);
  uint4 va[U], vb[U];
  issue(wa, sa, va);
  pdl_wait_release();
  unsigned acc = prologue(xg, xa16, xs);
  acc ^= stream(wa, sa, va);
  if (b_early) issue(wb, sb, vb);  // B's weights do not depend on A
  __syncthreads();  // the block's A done (its outputs, in a real kernel, stored)
  if (threadIdx.x == 0) {
    __threadfence();  // release: A's stores before the arrival
    const unsigned old = atomicAdd(counter, 1u);
    const unsigned target = (old / gridDim.x + 1) * gridDim.x;
    while ((int)(ld_acquire(counter) - target) < 0) {
    }
  }
  __syncthreads();
  if (!b_early) issue(wb, sb, vb);
  acc ^= prologue(xg, xb16, xs);
  acc ^= stream(wb, sb, vb);
  if (acc == MAGIC) sink[0] = acc;
}
"""

VARIANTS = ("launches", "launches/264", "one kernel", "one kernel, B early")


def launch_shapes(spec: str) -> list[tuple[int, int, int, int]]:
    """--launches "224/2:288/3,264/2:264/2": more two-launch variants, A's blocks/blocks an SM : B's."""
    out = []
    for part in filter(None, spec.split(",")):
        a, b = part.split(":")
        (ga, ca), (gb, cb) = (tuple(int(v) for v in x.split("/")) for x in (a, b))
        out.append((ga, ca, gb, cb))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--launches", default="", help="more two-launch shapes, 'A blocks/an SM:B blocks/an SM,...'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    shapes = {"launches": (A_BLOCKS, A_CAP, B_BLOCKS, B_CAP)}
    shapes["launches/264"] = (132 * PERSISTENT_PER_SM, PERSISTENT_PER_SM) * 2  # (the grid on 132 SMs)
    for ga, ca, gb, cb in launch_shapes(args.launches):
        shapes[f"launches {ga}/{ca}:{gb}/{cb}"] = (ga, ca, gb, cb)

    import cupy as cp
    import numpy as np
    from nanoqwen_kernels import pdl

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    smem_sm = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    mod = cp.RawModule(code=SRC, options=("-std=c++17", f"-DU={U}"))
    k_one, k_two = mod.get_function("one"), mod.get_function("two")
    for k in (k_one, k_two):
        k.max_dynamic_shared_size_bytes = smem_sm - 2048
    # the one-kernel grid spins on a grid barrier: every block must be resident at once, or it never returns
    regs_sm = dev.attributes["MaxRegistersPerMultiprocessor"]
    if k_two.num_regs * 256 * PERSISTENT_PER_SM > regs_sm:
        raise SystemExit(f"two(): {k_two.num_regs} registers a thread leave fewer than {PERSISTENT_PER_SM} blocks an SM")
    na16, nb16 = int(A_MB * 1e6) // 16, int(B_MB * 1e6) // 16
    xa16, xb16 = int(A_XKB * 1000) // 16, int(B_XKB * 1000) // 16
    rng = cp.random.default_rng(1)
    wa = rng.integers(0, 2**32, size=(args.layers, na16, 4), dtype=cp.uint64).astype(cp.uint32)
    wb = rng.integers(0, 2**32, size=(args.layers, nb16, 4), dtype=cp.uint64).astype(cp.uint32)
    xg = cp.ones(X16_MAX * 4, dtype=cp.uint32)
    sink = cp.zeros(4, dtype=cp.uint32)
    counter = cp.zeros(1, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    grid2 = sms * PERSISTENT_PER_SM

    def cap(n):  # shared memory that holds an SM to n blocks (and the prologue's x)
        return smem_sm // n - 2048

    def body(variant):
        for layer in range(args.layers):
            if variant.startswith("launches"):
                ga, ca, gb, cb = shapes[variant]
                if variant == "launches/264":
                    ga = gb = grid2
                pdl.launch(k_one.kernel, (ga,), (256,), (wa[layer], np.uint64(na16), sink, xg, np.int32(xa16)),
                           cap(ca), stream.ptr)
                pdl.launch(k_one.kernel, (gb,), (256,), (wb[layer], np.uint64(nb16), sink, xg, np.int32(xb16)),
                           cap(cb), stream.ptr)
            else:
                early = np.int32(variant.endswith("B early"))
                pdl.launch(k_two.kernel, (grid2,), (256,), (wa[layer], np.uint64(na16), wb[layer], np.uint64(nb16),
                                                          sink, counter, xg, np.int32(xa16), np.int32(xb16), early),
                           cap(PERSISTENT_PER_SM), stream.ptr)

    floor_us = (na16 + nb16) * 16 / COPY_BW * 1e6
    rows = []
    for variant in (*VARIANTS, *list(shapes)[2:]):
        times = [t * 1e6 for t in time_graph(stream, lambda v=variant: body(v), args.reps, args.layers, rounds=5)]
        t = statistics.median(times)
        rows.append({"variant": variant, "us_per_layer": t, "floor_us": floor_us, "pct_copy": 100 * floor_us / t,
                     "spread_us": max(times) - min(times)})

    print(f"hand-off probe, {name}: down_proj's {A_MB} MB then q/k/v's {B_MB} MB a layer, {args.layers} layers a "
          f"graph, random data, {time.strftime('%Y-%m-%d')}")
    print(f"{'variant':<30s} {'us a layer':>10s} {'floor':>6s} {'% copy':>7s} {'spread':>6s}")
    for r in rows:
        print(f"{r['variant']:<30s} {r['us_per_layer']:10.2f} {r['floor_us']:6.2f} {r['pct_copy']:6.1f}% "
              f"{r['spread_us']:6.2f}")
    write_json(args.json, name, sms, args.layers, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
