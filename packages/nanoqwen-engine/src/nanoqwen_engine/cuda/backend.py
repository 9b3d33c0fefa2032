"""CudaBackend: the Backend protocol (docs/INTERFACES.md section 5) on an sm_90 GPU.

    create: check the GPU -> build the KernelSet for the model's dims -> upload the weights (pinned,
            chunked, q|k|v and gate|up stacked: plan.py) -> size and allocate the KV pool -> buffers
    prefill: the prompt through the GEMM path (prefill.py), last row -> lm_head -> on-device sampler
    decode:  one CUDA graph replay per token (decode.py); the host reads back only the sampled id
    score:   teacher-forced logits of every position, in a temporary sequence

Failures are NanoqwenError subclasses: NoGPUError / WrongGPUError (no usable GPU), GPUOutOfMemoryError
(load or request), KVPagesExhaustedError (from the shared PagePool, raised before any GPU work). After a
failed request the device state this file caches (ctrl, the sampler's buffers) is marked stale, so the
next request re-uploads it and the loaded model stays usable.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import InvalidRequestError, ModelFormatError, NoGPUError
from ..kv_pages import PagePool, kv_cache_shape
from .decode import DecodeStep
from .device import CupyDevice, Timer
from .errors import GPUBackendError, GPUOutOfMemoryError, WrongGPUError
from .plan import build_upload_plan, size_pool
from .prefill import PrefillPass
from .sampling import DeviceSampler, mode_of

DECODE_MODES = ("graph", "eager")


def _dims_of(config):
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


class CudaBackend:
    def __init__(self, dev, ks, weights: dict, config, pool: PagePool, k_cache, v_cache, decode_mode: str,
                 info: dict):
        self.dev, self.ks, self.w, self.config, self.pool = dev, ks, weights, config, pool
        self.k_cache, self.v_cache = k_cache, v_cache  # f16 [L, n_pages, n_kv, 16, 128] each
        self.decode_mode = decode_mode
        self.sampler_dev = DeviceSampler(dev, ks, config.vocab)
        self.step = DecodeStep(dev, ks, weights, config, k_cache, v_cache, pool.max_pages_per_seq,
                               self.sampler_dev)
        self.prefill_pass = PrefillPass(dev, ks, weights, config, k_cache, v_cache)
        self.info = info
        self.info["workspace_bytes"] = self.step.workspace_bytes
        self.info["launcher_calls_per_token"] = self.step.count_launcher_calls()

    # ------------------------------------------------------------------ load
    @classmethod
    def create(cls, nqfile, config, max_context: int | None = None, progress: bool = True,
               **kwargs) -> CudaBackend:
        """Load nqfile (an open NanoqwenFile) onto the GPU.

        kwargs: decode_mode "graph" (default) or "eager"; n_pages (pool size, overriding the sizing from
        max_context / free memory). Test hooks: `device` (a HostDevice) and
        `kernels` (a KernelSet stand-in) replace the GPU and the compiled kernels.
        """
        decode_mode = kwargs.pop("decode_mode", None) or "graph"
        if decode_mode not in DECODE_MODES:
            raise InvalidRequestError(f"decode_mode must be one of {DECODE_MODES}, got {decode_mode!r}")
        n_pages = kwargs.pop("n_pages", None)
        dev = kwargs.pop("device", None)
        ks = kwargs.pop("kernels", None)
        if kwargs:
            raise InvalidRequestError(f"CudaBackend.create: unknown options {sorted(kwargs)}")
        t_all = time.perf_counter()
        if dev is None:
            _check_gpu()
            dev = CupyDevice()
        info: dict = {"device": dev.name, "decode_mode": decode_mode}
        with Timer() as tk:
            if ks is None:
                ks = cls._build_kernels(config)
        info["kernel_build_s"] = tk.s

        tensors = {n: (nqfile.tensor(n).shape, nqfile.tensor(n).dtype) for n in nqfile.tensor_names}
        try:
            plan = build_upload_plan(tensors, config.n_layers, config.tie_word_embeddings)
        except (KeyError, ValueError) as e:
            raise ModelFormatError(f"the file lacks what the GPU backend needs: {e}") from None
        free, total = dev.mem_info()
        if plan.total_bytes > free:
            raise GPUOutOfMemoryError(
                f"the weights need {plan.total_bytes / 2**30:.2f} GiB of GPU memory, {free / 2**30:.2f} GiB free"
            )
        try:
            with Timer() as tu:
                weights = dev.upload(plan, nqfile.tensor, progress)
            free, total = dev.mem_info()
            try:
                ps = size_pool(n_layers=config.n_layers, n_kv_heads=config.n_kv_heads,
                               head_dim=config.head_dim, max_position=config.max_position,
                               max_context=max_context, free_bytes=free, total_bytes=total,
                               n_pages=n_pages)
            except ValueError as e:
                raise GPUOutOfMemoryError(f"KV cache: {e}") from None
            shape = kv_cache_shape(config.n_layers, ps.n_pages, config.n_kv_heads, config.head_dim)
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
            upload_s=tu.s,
            upload_GBps=plan.total_bytes / max(tu.s, 1e-9) / 1e9,
            kv_bytes=ps.kv_bytes,
            kv_pages=ps.n_pages,
            max_context=ps.max_pages_per_seq * 16,
        )
        pool = PagePool(ps.n_pages, ps.max_pages_per_seq)
        with dev.use():  # buffers zeroed on the backend's stream, ordered before its first launch
            be = cls(dev, ks, weights, config, pool, k_cache, v_cache, decode_mode, info)
        dev.synchronize()
        info["load_s"] = time.perf_counter() - t_all
        return be

    @staticmethod
    def _build_kernels(config):
        try:
            from nanoqwen_kernels import KernelSet
            from nanoqwen_kernels.errors import KernelError
        except Exception as e:
            raise NoGPUError(f"the kernel package is unavailable: {e}") from None
        try:
            return KernelSet(_dims_of(config))
        except KernelError as e:
            raise GPUBackendError(f"cannot build the kernels for this model: {e}") from None

    # ------------------------------------------------------------------ protocol
    def prefill(self, seq, token_ids: np.ndarray, sampler) -> int:
        ids = self._check_ids(token_ids)
        start, T = seq.length, int(ids.shape[0])
        self.pool.grow(seq, start + T)  # raises before any GPU work; pool and seq unchanged then
        sampler.observe(ids)
        mode = mode_of(sampler.params)
        with self._guard(), self.dev.use():
            self.step.sync_ctrl(seq, 0)  # puts seq's page table on the device
            x = self.prefill_pass.hidden(ids, start, self.step.page_table)
            self.step.launch_head(self.ks, x[T - 1])
            self.sampler_dev.invalidate()
            self.sampler_dev.load((seq.seq_id, id(sampler)), sampler)
            self.sampler_dev.launch(self.ks, mode, self.step.logits, self.step.token)
            tok = int(self.dev.d2h(self.step.token)[0])
            # ctrl now holds (tok, start, start+1): stale for the next decode, which re-syncs it.
            self.step.invalidate()
        seq.length = start + T
        sampler.observe([tok])
        return tok

    def decode(self, seq, token_id: int, sampler) -> int:
        token_id = int(token_id)
        if not 0 <= token_id < self.config.vocab:
            raise InvalidRequestError(f"token id {token_id} outside the vocabulary 0..{self.config.vocab - 1}")
        pos = seq.length
        self.pool.grow(seq, pos + 1)  # a new page at a boundary: the next sync_ctrl copies its id over
        sampler.observe([token_id])
        mode = mode_of(sampler.params)
        with self._guard(), self.dev.use():
            if self.step.sync_ctrl(seq, token_id):
                # Another sequence or a token the device did not sample: its seen-mask must be re-sent.
                self.sampler_dev.invalidate()
            if mode != "greedy":
                self.sampler_dev.load((seq.seq_id, id(sampler)), sampler)
            tok = self.step.step(mode, eager=self.decode_mode == "eager")
        self._count_launches()
        seq.length = pos + 1
        sampler.observe([tok])
        return tok

    def score(self, token_ids: np.ndarray) -> np.ndarray:
        """float32 [T, V]: the logits after each prefix, teacher-forced, in a temporary sequence freed
        afterwards. The layers are prefill's; the final norm and lm_head of every row run as fp32
        matmuls (prefill's last row uses the decode path's fp16 GEMV: same weights, fp32 sums)."""
        ids = self._check_ids(token_ids)
        seq = self.pool.new_sequence()
        try:
            self.pool.grow(seq, int(ids.shape[0]))
            with self._guard(), self.dev.use():
                self.step.sync_ctrl(seq, 0)
                x = self.prefill_pass.hidden(ids, 0, self.step.page_table)
                out = self.prefill_pass.all_logits(x)
                self.step.invalidate()
            return out
        finally:
            self.pool.free(seq)

    def last_logits(self) -> np.ndarray:
        """float32 [V] of the last prefill/decode (a D2H copy; for debugging and the ladder)."""
        with self.dev.use():
            return self.dev.d2h(self.step.logits)

    # ------------------------------------------------------------------ helpers
    def _check_ids(self, token_ids) -> np.ndarray:
        ids = np.asarray(token_ids).reshape(-1)
        if ids.shape[0] == 0:
            raise InvalidRequestError("at least one token id is needed")
        if ids.min() < 0 or ids.max() >= self.config.vocab:
            raise InvalidRequestError(f"token id out of range 0..{self.config.vocab - 1}")
        return ids.astype(np.int32)

    def _count_launches(self) -> None:
        if self.step.launcher_calls is not None:
            self.info["launcher_calls_per_token"] = self.step.launcher_calls
        for mode, n in self.step.graph_nodes.items():
            self.info[f"graph_kernel_nodes_{mode}"] = n

    def _guard(self):
        return _RequestGuard(self)

    def close(self) -> None:
        """Drop every device buffer (the pool of cupy frees them) so another model can load."""
        for name in ("w", "k_cache", "v_cache", "step", "prefill_pass", "sampler_dev", "ks"):
            setattr(self, name, None)
        self.dev.release_cached()


class _RequestGuard:
    """Marks cached device state stale on any failure; turns out-of-memory into GPUOutOfMemoryError."""

    def __init__(self, be: CudaBackend):
        self.be = be

    def __enter__(self):
        return self

    def __exit__(self, et, e, tb):
        if e is None:
            return False
        be = self.be
        be.step.invalidate()
        be.sampler_dev.invalidate()
        if be.dev.is_oom(e):
            be.dev.release_cached()
            raise GPUOutOfMemoryError(f"out of GPU memory during the request: {e}") from None
        return False
