"""Compile every kernel build the launchers load for the given shapes into the disk cache, without a GPU:

    NANOQWEN_KERNEL_CACHE=dir python packages/nanoqwen-kernels/bench/precompile.py [7b 1.5b tiny] [-j N]

The builds are found by constructing each launcher class with a loader that compiles instead of loading,
so the list is the launchers' own (every variant included). Run it with the NVRTC major.minor of the GPU
machine (the cache key holds it) and carry the directory there: the GPU runs then spend no time compiling.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor


class _Unloaded:
    def get_function(self, name, max_dynamic_smem=0):
        return name


class _HostArrays:
    """Stands in for CuPy where a launcher class allocates its device scratch at construction (the tile
    GEMM's workspace and tickets): numpy, so the builds can be listed on a machine without a GPU."""

    def __getattr__(self, name):
        import numpy as np

        return getattr(np, name)


@contextlib.contextmanager
def _without_gpu():
    """Let the launcher classes be built with no GPU: an H200's SM count (it sizes launch plans and
    scratch buffers, never a build's defines) and numpy for their scratch buffers; restored after."""
    from nanoqwen_kernels import checks

    saved = checks.sm_count, checks.cupy_module, checks.set_function_attribute
    checks.sm_count = lambda device_id=None: 132
    checks.cupy_module = lambda: _HostArrays()
    checks.set_function_attribute = lambda fn, attribute, value: None  # a loaded function's, at run time
    try:
        yield
    finally:
        checks.sm_count, checks.cupy_module, checks.set_function_attribute = saved


def builds(dims_names: list[str]) -> list[tuple[tuple[str, ...], tuple]]:
    from nanoqwen_kernels.attention import LONG_CLUSTER_MAX, SHORT_PAIR, AttentionKernels
    from nanoqwen_kernels.attention import VARIANTS as DECODE_VARIANTS
    from nanoqwen_kernels.dims import PRESETS
    from nanoqwen_kernels.embed import EmbedKernels
    from nanoqwen_kernels.gemv import A8_VARIANTS, GEMV_VARIANTS, GemvKernels
    from nanoqwen_kernels.head_i8 import HeadI8Kernels
    from nanoqwen_kernels.norm import NormKernels
    from nanoqwen_kernels.prefill import ATTENTION_VARIANTS, PrefillKernels
    from nanoqwen_kernels.sampling import SamplingKernels

    found = set()

    def record(sources, defines):
        found.add((tuple(sources), tuple(sorted(defines.items()))))
        return _Unloaded()

    with _without_gpu():
        for name in dims_names:
            d = PRESETS[name]
            for v in GEMV_VARIANTS:  # the int8 loop's build may add its split defines (gemv_b1.b1_build_defines)
                GemvKernels(d, record, v)
                if v in A8_VARIANTS:  # and the decode step's short-context build (gemv_b1.b1_short_defines)
                    GemvKernels(d, record, v, short_context=True)
            HeadI8Kernels(d, record)
            NormKernels(d, record)
            EmbedKernels(d, record)
            try:  # it allocates device scratch after loading its module: the build is recorded by then
                SamplingKernels(d, record)
            except Exception:
                pass
            for v in DECODE_VARIANTS:
                AttentionKernels(d, record, v)
                AttentionKernels(d, record, v, cluster_max=LONG_CLUSTER_MAX)
                AttentionKernels(d, record, v, max_clusters=1, pair=SHORT_PAIR)  # the short-context launch's
            for v in ATTENTION_VARIANTS:
                PrefillKernels(d, record, v)
    return sorted(found)


def _compile(build) -> tuple[str, float]:
    from nanoqwen_kernels.loader import compile_cubin

    sources, defines = build
    t = time.perf_counter()
    compile_cubin(list(sources), dict(defines))
    return f"{'+'.join(sources)} H={dict(defines)['NQ_HIDDEN']}", time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("dims", nargs="*", default=["7b", "1.5b", "tiny"])
    ap.add_argument("-j", type=int, default=2, help="parallel compiles")
    args = ap.parse_args(argv)
    from nanoqwen_kernels.loader import cache_dir, nvrtc_version

    todo = builds(args.dims)
    print(f"{len(todo)} builds, NVRTC {nvrtc_version()}, cache {cache_dir()}", flush=True)
    # the slowest builds first, so the pool ends together
    todo.sort(key=lambda b: "gemv_int4.cu" not in b[0])
    with ProcessPoolExecutor(args.j) as pool:
        for what, secs in pool.map(_compile, todo):
            print(f"  {what}: {secs:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
