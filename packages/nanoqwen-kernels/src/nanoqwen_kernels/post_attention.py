"""Launcher of the fused post-attention kernel (cuda/gemv_fused.cuh): o_proj + residual, the post-attention
RMSNorm + gate/up + SiLU, and down_proj + residual of one sequence (B = 1) in one kernel, its three GEMV
phases separated by grid barriers instead of kernel boundaries. The same bits as the three launches it
replaces (gemv_int4 o_proj, gate_up_silu, gemv_int4 down_proj on the B = 1 loop of the GEMV variant: the
half2 loop, or the int8-activation loop with the a8 image handed to down_proj).

    bar = ks.grid_barrier()                      # once per decode state: uint32 [64], zero
    if ks.post_attention_fusable(1):
        ks.post_attention(o_q, o_s, attn, x, y, gu_q, gu_s, post_norm, eps, act, dn_q, dn_s, bar)

The grid is every block the GPU holds at once for this kernel (the occupancy API), never more: a block
waiting at a grid barrier needs every other block resident (docs/KERNELS.md "The fused post-attention
kernel"). One barrier buffer must not be used by two launches that may run at the same time.
"""

from __future__ import annotations

import numpy as np

from . import checks as ck
from .errors import KernelError
from .gemv import A8_BLOCK, A8_IMAGE_GROUPS, A8_VARIANTS, THREADS, GemvKernels

BARRIER_WORDS = 64  # GridBarrier (gemv_fused.cuh): arrivals at word 0, the generation at word 32


class PostAttentionKernels:
    def __init__(self, gemv: GemvKernels):
        self._g = gemv
        self.dims = gemv.dims
        self._a8 = gemv.variant in A8_VARIANTS
        m = gemv.int4_module
        self._fn = m.get_function("nq_post_attention_a8" if self._a8 else "nq_post_attention")

    def fusable(self, b: int) -> bool:
        """Whether rows of B sequences can take the fused kernel: B = 1 with o_proj, gate/up and down_proj
        all on the B = 1 loop (not the tensor-core core or the tile GEMM) in this GEMV variant."""
        return b == 1 and all(self._g.on_b1_loop(kind) for kind in ("h", "i", "gu"))

    def grid_barrier(self):
        """A zeroed uint32 [BARRIER_WORDS] for the kernel's grid barriers (arrivals at word 0, the generation
        at word 32: two 128-byte lines); the arrivals stay zero between launches."""
        return ck.cupy_module().zeros(BARRIER_WORDS, dtype=np.uint32)

    def grid(self) -> int:
        """Blocks of a launch: every block resident at once (a multiple of the SM count)."""
        grid = ck.resident_grid(self._fn, THREADS)
        groups = self.dims.intermediate // A8_BLOCK
        if self._a8 and grid * A8_IMAGE_GROUPS < groups:
            raise KernelError(f"post_attention: {grid} resident blocks cannot hold {groups} groups of the a8 image "
                              f"({A8_IMAGE_GROUPS} a block at most)")
        return grid

    def post_attention(self, o_qweight, o_scales, attn, x, y, gu_qweight, gu_scales, norm_w, eps, act,
                       dn_qweight, dn_scales, barrier) -> None:
        """y = W_o . attn + x; act = silu(W_g . n(y)) * (W_u . n(y)) with n the RMSNorm by norm_w (in the a8
        variant act's storage holds the a8 image of those values); x = W_d . act + y. attn, x, y: fp16
        [1, H] or [H]; act fp16 [1, I] or [I]; barrier: grid_barrier()'s array."""
        g, d = self._g, self.dims
        if not self.fusable(1):
            raise KernelError(f"post_attention: the GEMV variant {g.variant!r} runs these matrices on another "
                              "body at B = 1 (post_attention_fusable says which can be fused)")
        n, _ = g._int4(o_qweight, o_scales, d.hidden)
        if n != d.hidden:
            raise KernelError(f"o_proj qweight must have hidden = {d.hidden} rows, got {n}")
        n, _ = g._int4(gu_qweight, gu_scales, d.hidden)
        if n != 2 * d.intermediate:
            raise KernelError(f"gate/up qweight must have 2 x intermediate = {2 * d.intermediate} rows, got {n}")
        n, _ = g._int4(dn_qweight, dn_scales, d.intermediate)
        if n != d.hidden:
            raise KernelError(f"down_proj qweight must have hidden = {d.hidden} rows, got {n}")
        b, lead = g._x(attn, d.hidden)
        if b != 1:
            raise KernelError(f"post_attention is one sequence's (B = 1), got B = {b}")
        ck.check_array("x", x, np.float16, (*lead, d.hidden), align=16)
        ck.check_array("y", y, np.float16, (*lead, d.hidden), align=16)
        ck.check_array("act", act, np.float16, (*lead, d.intermediate), align=16)
        ck.check_array("norm_w", norm_w, np.float16, (d.hidden,), align=16)
        ck.check_array("barrier", barrier, np.uint32, (BARRIER_WORDS,), align=128)
        e = ck.check_eps(eps)
        ck.check_distinct(attn=attn, x=x, y=y, act=act, barrier=barrier)
        ck.launch(self._fn, self.grid(), THREADS,
                  (o_qweight, o_scales, attn, x, y, gu_qweight, gu_scales, norm_w, e, act, dn_qweight, dn_scales,
                   barrier))
