"""The read floor of one launch: how fast a kernel that only reads N bytes (and does nothing with them) runs
when launched back to back in a CUDA graph, as the decode step's GEMV families are timed.

Issue 15 asks each decode GEMV family for a share of the copy bandwidth (gate/up and down_proj >= 85%) or a
multiple of its byte floor (q/k/v and o_proj within 2x). Those floors are the bytes over the copy rate of a
large copy; a launch that reads 8-70 MB also pays its ramp (the first bytes arrive a DRAM round trip after
the blocks start), its tail (the last blocks finish alone) and, under launch overlap, the wait for its
predecessor. This probe measures what a pure read of each family's bytes costs with the same launch
machinery and no arithmetic, so a family's time splits into "what any launch of its bytes costs" and "what
our kernel adds".

Each case: 28 launches (one per layer, each reading its own region, 28 regions larger than the L2 together)
captured into a graph, replayed --reps times between events; us per launch and the share of the copy rate.
The kernel (256 threads a block) loads U 16-byte words a thread (ld.global.nc.L1::no_allocate, as the
GEMVs' weights) and xors them into a value it stores only if it equals a fixed number (on random data a
chance of 2^-32 a thread), so the loads cannot be optimized away.
Access patterns:
  stride  the whole grid walks the region in U-word steps of gridDim * 256 words (a copy kernel's pattern)
  span    each warp owns a contiguous span of the region (region / warps), U words a lane in flight, as a
          decode GEMV's warp owns its unit's rows (down_proj: one 2-row unit a warp)
  rows2   the same span read as two rows side by side (step t of the warp in row t % 2), as a unit's loads
          walk its row pair
Launch modes:
  plain   no launch attribute (each launch after the previous one drained and flushed)
  pdl     programmatic stream serialization; the first U words are loaded before griddepcontrol.wait
          (the GEMVs' weight preload), nothing released early
  pdl+trig  the same, each block releasing its successor (launch_dependents) right after its wait, as the
          int8 GEMVs do (gemv_units.cuh NQ_TRIG_*)

    python3 scripts/read_floor_probe.py [--sizes-mb 8.53,6.63,35.0,70.0] [--json out.json]

Needs a GPU (CuPy, and the driver's cuLaunchKernelEx through nanoqwen_kernels.pdl).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import NamedTuple

COPY_BW = 4.19e12  # B/s, device-to-device copy measured on the H200 (docs/PERF.md "Method")

# The CUDA pieces the probes share (scripts/handoff_probe.py builds its kernels from them too): a weight load
# (16 bytes, no L1 allocation, as the GEMVs' weights) and a GEMV's staging of x.
LD_W = r"""
typedef unsigned long long u64;
__device__ __forceinline__ uint4 ld_w(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
"""
STAGE_X = r"""
// a GEMV's staging of x: the block copies x16 (> 0) uint4s of xg (L2-resident) into shared memory, one load each
// a thread first, then the stores, then a block barrier; returns one of them (so the copy is not dropped)
__device__ __forceinline__ unsigned stage_x(const uint4* __restrict__ xg, int x16, uint4* xs) {
  uint4 t[10];
#pragma unroll
  for (int k = 0; k < 10; ++k) {
    const int i = k * 256 + threadIdx.x;
    if (i < x16) t[k] = xg[i];
  }
#pragma unroll
  for (int k = 0; k < 10; ++k) {
    const int i = k * 256 + threadIdx.x;
    if (i < x16) xs[i] = t[k];
  }
  __syncthreads();
  return xs[(threadIdx.x * 7) % x16].x;
}
"""

SRC = LD_W + STAGE_X + r"""
// word j of a warp's walk: itself, or in mode 2 (two rows) step j / 32 alternating between the rows
__device__ __forceinline__ u64 at(u64 j, int mode, u64 half, u64 wbase) {
  if (mode != 2) return j;
  const u64 t = j / 32, off = (t >> 1) * 32 + j % 32;
  return off < half ? wbase + (t & 1) * half + off : ~0ull;  // ~0: past the row's end, not loaded
}
// MODE 0: grid stride; 1: a contiguous span per warp. PDL 0: none; 1: wait; 2: wait, then release.
// D batches of U words a thread in flight (a ring of registers); `pre` of them issued before the wait, the
// rest right after it. x16 > 0: a prologue after the wait (and after those loads), as a GEMV's staging of x
// (stage_x; xg is the same for every block).
// xbulk = 1: the same bytes by one cp.async.bulk (the copy engine, not the threads' load queue, which holds
// the weights' loads), thread 0 issuing it right after the wait; every thread waits on its mbarrier.
__device__ __forceinline__ unsigned su32(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
extern "C" __global__ void __launch_bounds__(256) read_floor(const uint4* __restrict__ w, u64 n16,
                                                             unsigned* sink, int mode, int pdl, int pre,
                                                             const uint4* __restrict__ xg, int x16, int xbulk) {
  extern __shared__ uint4 xs[];
  __shared__ u64 xbar;
  if (xbulk && x16 > 0) {
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(su32(&xbar)) : "memory");
      asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
  }
  uint4 v[D][U];
  unsigned acc = 0;
  u64 first, step, end, half = 0, wbase = 0;
  if (mode == 2) {  // two rows a warp, read side by side (a GEMV unit's row pair): step t reads row t % 2
    const u64 warps = (u64)gridDim.x * 8, warp = (u64)blockIdx.x * 8 + threadIdx.x / 32;
    const u64 span = ((n16 + warps - 1) / warps + 1) / 2 * 2;  // even: two rows of `half` words
    half = span / 2;
    wbase = warp * span;
    first = threadIdx.x & 31;  // lane, then 32 words a step
    step = 32;
    end = 2 * ((half + 31) / 32) * 32;  // the steps covering both rows (at() drops what is past a row's end)
  } else if (mode == 0) {
    first = (u64)blockIdx.x * 256 + threadIdx.x;
    step = (u64)gridDim.x * 256;
    end = n16;
  } else {
    const u64 warps = (u64)gridDim.x * 8, warp = (u64)blockIdx.x * 8 + threadIdx.x / 32;
    const u64 span = (n16 + warps - 1) / warps;
    first = warp * span + (threadIdx.x & 31);
    step = 32;
    end = min(n16, (warp + 1) * span);
  }
  const u64 bstep = (u64)U * step;  // one batch
#pragma unroll
  for (int d = 0; d < D; ++d) {
    if (d == pre) {
      if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
      if (pdl == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const u64 j = first + d * bstep + (u64)u * step, a = at(j, mode, half, wbase);
      v[d][u] = j < end && a < n16 ? ld_w(w + a) : make_uint4(0, 0, 0, 0);
    }
  }
  if (pre >= D) {
    if (pdl) asm volatile("griddepcontrol.wait;" ::: "memory");
    if (pdl == 2) asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  }
  if (x16 > 0 && xbulk) {
    if (threadIdx.x == 0) {
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(su32(&xbar)), "r"(x16 * 16)
                   : "memory");
      asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                   ::"r"(su32(xs)), "l"(xg), "r"(x16 * 16), "r"(su32(&xbar)) : "memory");
    }
    unsigned done;
    do {
      asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], 0;\n\t"
                   "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(su32(&xbar)) : "memory");
    } while (!done);
    acc ^= xs[(threadIdx.x * 7) % x16].x;
  } else if (x16 > 0) {
    acc ^= stage_x(xg, x16, xs);
  }
  for (u64 i = first;; ) {
#pragma unroll
    for (int d = 0; d < D; ++d) {
#pragma unroll
      for (int u = 0; u < U; ++u) acc ^= v[d][u].x ^ v[d][u].y ^ v[d][u].z ^ v[d][u].w;
      const u64 nb = i + (u64)(d + D) * bstep;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const u64 j = nb + (u64)u * step, a = at(j, mode, half, wbase);
        v[d][u] = j < end && a < n16 ? ld_w(w + a) : make_uint4(0, 0, 0, 0);
      }
    }
    i += (u64)D * bstep;
    if (i >= end) break;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // (random data: a chance of 2^-32 a thread; the store costs nothing)
}
"""

def time_graph(stream, body, reps: int, per: int, rounds: int = 3) -> list[float]:
    """Capture body() (after one eager warm-up) into a CUDA graph on `stream`, replay it once, then `rounds`
    times replay it `reps` times between events: seconds per graph / per (the launches a graph), each round."""
    import cupy as cp

    with stream:
        body()
        stream.synchronize()
        stream.begin_capture()
        body()
        g = stream.end_capture()
        g.launch(stream)
        stream.synchronize()
        times = []
        for _ in range(rounds):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record(stream)
            for _ in range(reps):
                g.launch(stream)
            e1.record(stream)
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) / 1e3 / reps / per)
    return times


def write_json(path: str | None, name: str, sms: int, layers: int, rows: list[dict]) -> None:
    """A probe's record (docs/perf/): the device, the layers a graph and its rows, dated."""
    if path:
        with open(path, "w") as f:
            json.dump({"gpu_name": name, "sms": sms, "layers": layers, "rows": rows,
                       "date": time.strftime("%Y-%m-%d")}, f, indent=2)


MODES = {"stride": 0, "span": 1, "rows2": 2}
X16_MAX = 10 * 256  # the prologue's uint4s: 10 a thread (the kernel's t[10])
PDL = {"plain": 0, "pdl": 1, "pdl+trig": 2}


class Case(NamedTuple):
    mb: float  # MB a launch reads
    pattern: str  # MODES
    blocks: int
    u: int  # 16-byte loads a thread, a batch
    d: int  # batches in flight
    launch: str  # PDL
    pre: int  # batches issued before the wait
    x_kb: float  # the prologue's KB of x (0: none)
    cap: int  # blocks an SM at most (0: not held)
    x_bulk: int = 0  # 1: the prologue's x by one bulk copy (the copy engine), 0: by the threads' loads


def cases(args, sms) -> list[Case]:
    """The cases the options ask for."""
    out = []
    for mb in [float(x) for x in args.sizes_mb.split(",")]:
        grids = [("stride", b * sms) for b in (int(x) for x in args.blocks_per_sm.split(","))]
        grids += [("span", int(x)) for x in args.span_blocks.split(",")]
        for mode, grid in grids:
            for u in (int(x) for x in args.unroll.split(",")):
                for pname in PDL:
                    out.append(Case(mb, mode, grid, u, 1, pname, 1, 0, 0))
    if args.down:
        # down_proj's shape (7B: 35 MB, one 19.5 KB span a warp, 224 blocks, 2 blocks an SM by its
        # registers) with a prologue of x after the wait: none, its cluster-shared half (18.9 KB a block),
        # the whole intermediate (37.9 KB); one or two batches in flight, the second before or after the wait
        for xkb in (0.0, 18.944, 37.888):
            for d, pre in ((1, 1), (2, 1), (2, 2)):
                for pname in ("pdl", "pdl+trig"):
                    out.append(Case(35.0, "span", 224, 8, d, pname, pre, xkb, 2))
        # the same with each warp's two rows read side by side, as a unit's loads are
        for xkb in (0.0, 18.944):
            for pname in ("pdl", "pdl+trig"):
                out.append(Case(35.0, "rows2", 224, 8, 1, pname, 1, xkb, 2))
                out.append(Case(35.0, "span", 224, 8, 1, pname, 1, xkb, 2))
    for spec in filter(None, args.shape.split(";")):
        # MB:blocks:blocks an SM:x KB, e.g. q/k/v's 8.257:288:3:7.168 (8.257 MB: one 2-row unit of 3,584 B a warp,
        # 3 blocks an SM by its 80 registers, all of x in the prologue)
        mb, blocks, cap, xkb = spec.split(":")
        if float(xkb) * 1000 / 16 > X16_MAX:
            raise SystemExit(f"--shape {spec}: the prologue copies at most {X16_MAX * 16} bytes")
        for x in sorted({0.0, float(xkb)}):
            for pname in ("pdl", "pdl+trig"):
                out.append(Case(float(mb), "rows2", int(blocks), 8, 1, pname, 1, x, int(cap)))
    if args.x_bulk:  # every case with a prologue again, its x by one bulk copy
        out += [c._replace(x_bulk=1) for c in out if c.x_kb > 0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="8.53,6.63,35.0,70.0",
                    help="MB a launch reads (the 7B's q/k/v, o_proj, down_proj, gate/up with their scales)")
    ap.add_argument("--blocks-per-sm", default="1,2,4")
    ap.add_argument("--unroll", default="4,8,16")
    ap.add_argument("--span-blocks", default="224",
                    help="grids of the span pattern, in blocks (224: down_proj's 1,792 warps)")
    ap.add_argument("--down", action="store_true", help="also down_proj's shape with an emulated x prologue")
    ap.add_argument("--shape", default="", help="more cases, 'MB:blocks:blocks an SM:x KB;...' (rows2, U = 8)")
    ap.add_argument("--x-bulk", action="store_true",
                    help="also every case with a prologue, its x copied by one cp.async.bulk instead of loads")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    import cupy as cp
    import numpy as np
    from nanoqwen_kernels import pdl

    dev = cp.cuda.Device()
    sms = dev.attributes["MultiProcessorCount"]
    smem_sm = dev.attributes["MaxSharedMemoryPerMultiprocessor"]
    name = cp.cuda.runtime.getDeviceProperties(dev.id)["name"].decode()
    todo = cases(args, sms)
    fns = {}
    for u, d in sorted({(c.u, c.d) for c in todo}):
        k = cp.RawModule(code=SRC, options=("-std=c++17", f"-DU={u}", f"-DD={d}")).get_function("read_floor")
        k.max_dynamic_shared_size_bytes = smem_sm - 2048
        fns[u, d] = k.kernel  # the driver Function (.ptr) for cuLaunchKernelEx
    sink = cp.zeros(4, dtype=cp.uint32)
    xg = cp.ones(X16_MAX * 4, dtype=cp.uint32)
    stream = cp.cuda.Stream(non_blocking=True)
    rng = cp.random.default_rng(1)

    rows = []
    for mb in sorted({c.mb for c in todo}):
        n16 = int(mb * 1e6) // 16
        nbytes = n16 * 16
        buf = rng.integers(0, 2**32, size=(args.layers, n16, 4), dtype=cp.uint64).astype(cp.uint32)
        for _, mode, grid, u, d, pname, pre, xkb, cap, xbulk in (c for c in todo if c.mb == mb):
            fn, p = fns[u, d], PDL[pname]
            x16 = int(xkb * 1000) // 16
            smem = max(x16 * 16, smem_sm // cap - 2048 if cap else 0)  # cap: at most that many blocks an SM

            def body(fn=fn, grid=grid, mode=mode, p=p, pre=pre, x16=x16, smem=smem, buf=buf, n16=n16, xb=xbulk):
                for layer in range(args.layers):
                    pdl.launch(fn, (grid,), (256,), (buf[layer], np.uint64(n16), sink, np.int32(MODES[mode]),
                                                     np.int32(p), np.int32(pre), xg, np.int32(x16), np.int32(xb)),
                               smem, stream.ptr, programmatic=p > 0)
            t = statistics.median(time_graph(stream, body, args.reps, args.layers))
            rows.append({"mb": nbytes / 1e6, "pattern": mode, "blocks": grid, "unroll": u, "depth": d,
                         "launch": pname, "pre_wait_batches": pre, "x_kb": xkb, "x_bulk": xbulk,
                         "blocks_per_sm_cap": cap,
                         "us": t * 1e6, "floor_us": nbytes / COPY_BW * 1e6, "pct_copy": 100 * nbytes / COPY_BW / t})
        del buf
        cp.get_default_memory_pool().free_all_blocks()

    print(f"read floor of one launch, {name}, {args.layers} launches a graph, random data, {time.strftime('%Y-%m-%d')}")
    print(f"{'MB':>6s} {'pattern':>7s} {'blocks':>6s} {'U':>3s} {'D':>2s} {'pre':>3s} {'x KB':>5s} {'x by':>4s} "
          f"{'cap':>3s} {'launch':>9s} {'us':>7s} {'floor':>6s} {'% copy':>7s}")
    for r in rows:
        print(f"{r['mb']:6.2f} {r['pattern']:>7s} {r['blocks']:6d} {r['unroll']:3d} {r['depth']:2d} "
              f"{r['pre_wait_batches']:3d} {r['x_kb']:5.1f} {'bulk' if r['x_bulk'] else 'ld':>4s} "
              f"{r['blocks_per_sm_cap']:3d} {r['launch']:>9s} "
              f"{r['us']:7.2f} {r['floor_us']:6.2f} {r['pct_copy']:6.1f}%")
    print("best per size (no prologue, no cap):")
    for mb in sorted({r["mb"] for r in rows}):
        free = [r for r in rows if r["mb"] == mb and r["x_kb"] == 0 and r["blocks_per_sm_cap"] == 0]
        if not free:
            continue
        best = min(free, key=lambda r: r["us"])
        print(f"  {mb:6.2f} MB: {best['us']:.2f} us ({best['pct_copy']:.1f}% of the copy rate; floor "
              f"{best['floor_us']:.2f}): {best['pattern']} {best['blocks']} blocks, U={best['unroll']}, {best['launch']}")
    write_json(args.json, name, sms, args.layers, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
