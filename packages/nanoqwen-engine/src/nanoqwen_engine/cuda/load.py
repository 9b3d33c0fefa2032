"""Loading a model onto the GPU: everything CudaBackend.create does before the backend object exists.

    check the GPU -> build the KernelSet for the model's dims -> upload the weights (pinned, chunked,
    q|k|v and gate|up stacked: plan.py; typed records: weights.py) -> the lm_head in int8 (unless
    lm_head_dtype="fp16": weights.with_int8_head) -> the prefill weights' copy -> size and allocate the
    KV pool (plus one scratch page for idle rows)

Every option is checked before the GPU is touched (InvalidRequestError); a model the GPU cannot hold is a
GPUOutOfMemoryError naming what it needs, and nothing stays allocated after a failed load.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import InvalidRequestError, ModelFormatError, NoGPUError
from ..kv_pages import PagePool, kv_cache_shape
from ..lm_head import lm_head_dtype_arg
from .device import CupyDevice, Timer
from .errors import GPUBackendError, GPUOutOfMemoryError, WrongGPUError
from .plan import PREFILL_WEIGHTS, build_upload_plan, choose_prefill_weights, size_pool
from .weights import (
    DenseLayer,
    Fp8Layer,
    GpuWeights,
    dense_bytes,
    dense_layers,
    fp8_bytes,
    fp8_layers,
    gpu_weights,
    int8_head_bytes,
    with_int8_head,
)

DECODE_MODES = ("graph", "eager")
DECODE_ACTIVATIONS = ("fp16", "int8")  # batch-1 decode GEMVs: fp16 activations, or int8 (GEMV variant "a8")
# int8, as llama.cpp's q8_1 GEMVs do: one scale per 16 values, products by dp4a. On the real
# Qwen2.5-Coder-1.5B at batch 1 it agrees with transformers fp32 as fp16 does (100 prompts x 48 tokens each
# alone: 13 / 9 of 4,800 positions differ, worst gap 0.044 for both, bound 0.1), and the 7B decodes in
# 1.51 ms/token instead of 1.83 (docs/PERF.md, twentieth and twenty-first leases). What it changes: on
# random-weight models its rounding moves a logit gap by ~0.11 rms (fp16: ~0.01), so the synthetic tiers judge it with its own eps and bounds
# (nanoqwen_engine.validation.EPS, docs/VALIDATION.md); and a sequence alone (int8) and the same sequence in
# a batch (fp16 tile GEMM) round differently, so their greedy tokens may part at a near-tie: the batch
# invariance tests hold fp16, which keeps it (docs/INTERFACES.md).
DEFAULT_DECODE_ACTIVATIONS = "int8"
FP16_GEMV_VARIANT = "tiles"  # the kernels' default (nanoqwen_kernels.gemv.DEFAULT_GEMV_VARIANT): half2 at B = 1
MAX_BATCH = 64  # decode rows the buffers are sized for unless create() is given max_batch


@dataclass
class Loaded:
    """What load() leaves on the device, for CudaBackend's constructor."""

    dev: Any
    ks: Any
    weights: GpuWeights
    pool: PagePool
    k_cache: Any
    v_cache: Any
    decode_mode: str
    max_batch: int
    info: dict
    dense: list[DenseLayer] | None
    fp8: list[Fp8Layer] | None


def load(nqfile, config: ModelConfig, max_context: int | None, progress: bool, **kwargs) -> Loaded:
    """nqfile (an open NanoqwenFile) onto the GPU; kwargs as CudaBackend.create's."""
    decode_mode = kwargs.pop("decode_mode", None) or "graph"
    if decode_mode not in DECODE_MODES:
        raise InvalidRequestError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
    max_batch = kwargs.pop("max_batch", None)
    max_batch = MAX_BATCH if max_batch is None else max_batch
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or not 1 <= max_batch <= 512:
        raise InvalidRequestError(f"max_batch must be an int in 1..512, got {max_batch!r}")
    n_pages = kwargs.pop("n_pages", None)
    prefill_weights = kwargs.pop("prefill_weights", None) or os.environ.get("NANOQWEN_PREFILL_WEIGHTS") or "auto"
    if prefill_weights not in PREFILL_WEIGHTS:
        raise InvalidRequestError(
            f"prefill_weights (NANOQWEN_PREFILL_WEIGHTS) must be one of {PREFILL_WEIGHTS}, got {prefill_weights!r}"
        )
    asked = kwargs.pop("decode_activations", None) or os.environ.get("NANOQWEN_DECODE_ACTIVATIONS")
    if asked is not None and asked not in DECODE_ACTIVATIONS:
        raise InvalidRequestError(f"decode_activations (NANOQWEN_DECODE_ACTIVATIONS) must be one of "
                                  f"{DECODE_ACTIVATIONS}, got {asked!r}")
    head_dtype = lm_head_dtype_arg(kwargs.pop("lm_head_dtype", None))
    dev = kwargs.pop("device", None)
    ks = kwargs.pop("kernels", None)
    if kwargs:
        raise InvalidRequestError(f"CudaBackend.create: unknown options {sorted(kwargs)}")
    if dev is None:
        _check_gpu()
        dev = CupyDevice()
    info: dict = {"device": dev.name, "decode_mode": decode_mode, "lm_head_dtype": head_dtype}
    decode_act, variant = decode_activations_plan(asked, os.environ.get("NANOQWEN_GEMV_VARIANT"), ks)
    with Timer() as tk:
        if ks is None:
            ks = build_kernels(config, variant)
    if decode_act == "int8" and getattr(ks, "gemv_variant", None) != "a8":
        raise InvalidRequestError("decode_activations='int8' needs kernels built with GEMV variant 'a8', got "
                                  f"{getattr(ks, 'gemv_variant', None)!r}")
    # what runs (a user may also have picked the variant through $NANOQWEN_GEMV_VARIANT)
    info["decode_activations"] = "int8" if getattr(ks, "gemv_variant", None) == "a8" else "fp16"
    info["kernel_build_s"] = tk.s

    tensors = {n: (nqfile.tensor(n).shape, nqfile.tensor(n).dtype) for n in nqfile.tensor_names}
    try:
        plan = build_upload_plan(tensors, config.n_layers, config.tie_word_embeddings)
    except (KeyError, ValueError) as e:
        raise ModelFormatError(f"the file lacks what the GPU backend needs: {e}") from None
    head_bytes = (int8_head_bytes(config.vocab, config.hidden, "lm_head" in plan.aliases)
                  if head_dtype == "int8" else 0)
    need = plan.total_bytes + head_bytes
    free, total = dev.mem_info()
    if need > free:
        head = f" (the int8 lm_head's {head_bytes / 2**30:.2f} GiB included)" if head_bytes else ""
        raise GPUOutOfMemoryError(
            f"the weights need {need / 2**30:.2f} GiB of GPU memory{head}, {free / 2**30:.2f} GiB free"
        )
    try:
        with Timer() as tu:
            weights = gpu_weights(dev.upload(plan, nqfile.tensor, progress), config.n_layers)
        if head_dtype == "int8":
            with Timer() as th, dev.use():
                weights = with_int8_head(dev.xp, ks, weights)
                dev.synchronize()
            info["lm_head_i8_s"] = th.s
        free, total = dev.mem_info()
        nbytes = dense_bytes(weights)
        try:
            pw = choose_prefill_weights(prefill_weights, nbytes, free)
        except ValueError as e:
            raise GPUOutOfMemoryError(str(e)) from None
        dense = fp8 = None
        if pw == "fp16":
            with Timer() as td, dev.use():
                dense = dense_layers(dev.xp, ks, weights)
                dev.synchronize()
            info.update(prefill_dense_bytes=nbytes, prefill_dense_s=td.s)
            free, total = dev.mem_info()
        elif pw == "fp8":
            with Timer() as td, dev.use():
                fp8 = fp8_layers(ks, weights)
                dev.synchronize()
            info.update(prefill_fp8_bytes=fp8_bytes(weights), prefill_fp8_s=td.s)
            free, total = dev.mem_info()
        info["prefill_weights"] = pw
        try:
            ps = size_pool(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads,
                           head_dim=config.head_dim, max_position=config.max_position,
                           max_context=max_context, free_bytes=free, total_bytes=total,
                           n_pages=n_pages)
        except ValueError as e:
            raise GPUOutOfMemoryError(f"KV cache: {e}") from None
        # one page more than the pool hands out: the scratch page of idle decode rows
        shape = kv_cache_shape(config.n_layers, ps.n_pages + 1, config.n_kv_heads, config.head_dim)
        # Zeroed, not empty: a never-written slot read by a buggy mask would then give 0, not NaN
        # garbage that hides where it came from.
        with dev.use():
            k_cache = dev.xp.zeros(shape, dtype=np.float16)
            v_cache = dev.xp.zeros(shape, dtype=np.float16)
    except Exception as e:
        if dev.is_oom(e):
            dev.release_cached()
            raise GPUOutOfMemoryError(f"out of GPU memory while loading the model: {e}") from None
        raise
    info.update(
        weights_bytes=plan.total_bytes,
        lm_head_i8_bytes=head_bytes,
        upload_s=tu.s,
        upload_GBps=plan.total_bytes / max(tu.s, 1e-9) / 1e9,
        kv_bytes=ps.kv_bytes,
        kv_pages=ps.n_pages,
        max_context=ps.max_pages_per_seq * 16,
    )
    pool = PagePool(ps.n_pages, ps.max_pages_per_seq)
    return Loaded(dev, ks, weights, pool, k_cache, v_cache, decode_mode, max_batch, info, dense, fp8)


def decode_activations_plan(asked: str | None, env_variant: str | None, given: Any = None
                            ) -> tuple[str, str | None]:
    """(decode activations, GEMV variant to build) from what was asked (decode_activations or
    $NANOQWEN_DECODE_ACTIVATIONS; None: nothing), $NANOQWEN_GEMV_VARIANT and a `kernels` stand-in (None:
    none given, the kernels are built).
    - asked: that; int8 builds the variant "a8", fp16 $NANOQWEN_GEMV_VARIANT unless it names "a8", else
      FP16_GEMV_VARIANT (the half2 loop at B = 1).
    - not asked, a stand-in given: what its GEMV variant runs; not asked, $NANOQWEN_GEMV_VARIANT set: that
      variant and what it runs (a user who picked a GEMV variant by name keeps it).
    - not asked, nothing named: DEFAULT_DECODE_ACTIVATIONS."""
    if asked is None and (given is not None or env_variant is not None):
        variant = getattr(given, "gemv_variant", None) if given is not None else env_variant
        return ("int8" if variant == "a8" else "fp16"), variant
    act = asked or DEFAULT_DECODE_ACTIVATIONS
    if act == "int8":
        return act, "a8"
    return act, env_variant if env_variant not in (None, "a8") else FP16_GEMV_VARIANT


def build_kernels(config: ModelConfig, gemv_variant: str | None = None):
    """The KernelSet for the model's dims (NoGPUError without the kernel package, GPUBackendError when its
    dims are not buildable)."""
    try:
        from nanoqwen_kernels import KernelSet
        from nanoqwen_kernels.errors import KernelError
    except Exception as e:
        raise NoGPUError(f"the kernel package is unavailable: {e}") from None
    try:
        return KernelSet(_dims_of(config), gemv_variant=gemv_variant)
    except KernelError as e:
        raise GPUBackendError(f"cannot build the kernels for this model: {e}") from None


def _dims_of(config: ModelConfig):
    from nanoqwen_kernels.dims import ModelDims

    return ModelDims(hidden=config.hidden, intermediate=config.intermediate, n_heads=config.n_heads,
                     n_kv_heads=config.n_kv_heads, head_dim=config.head_dim, vocab=config.vocab,
                     n_layers=config.n_layers, rope_theta=float(config.rope_theta))


def _check_gpu() -> None:
    try:
        from nanoqwen_kernels import gpu_status
    except Exception as e:
        raise NoGPUError(f"the kernel package is unavailable: {e}") from None
    ok, reason = gpu_status()
    if ok:
        return
    if "compute capability" in reason:
        raise WrongGPUError(f"unsupported GPU: {reason}; nanoqwen's kernels need an sm_90 (Hopper) GPU")
    raise NoGPUError(f"no usable GPU: {reason}")
