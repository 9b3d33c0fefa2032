"""The fused post-attention launcher on the CPU (test_launchers.py's method): which GEMV variants can fuse,
the good call's entry, grid and argument order, and each bad argument refused by name."""

import numpy as np
import pytest
from fakes import assert_each_refused, dev, load
from nanoqwen_kernels import KernelError
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.gemv import GemvKernels
from nanoqwen_kernels.post_attention import PostAttentionKernels


@pytest.mark.parametrize("variant, fusable", [("tiles", True), ("default", True), ("a8", True), ("mma", False),
                                              ("mixed", False), ("tiles1", False)])
def test_fusable_only_where_the_three_matrices_run_the_b1_loop(variant, fusable, launches):
    f = PostAttentionKernels(GemvKernels(TINY, load, variant))
    assert f.fusable(1) is fusable
    assert f.fusable(2) is False


def _good(d):
    h, i = d.hidden, d.intermediate
    return dict(
        o_qweight=dev((h, h // 8), np.uint32), o_scales=dev((h, h // 128), np.float16),
        attn=dev((1, h), np.float16), x=dev((1, h), np.float16), y=dev((1, h), np.float16),
        gu_qweight=dev((2 * i, h // 8), np.uint32), gu_scales=dev((2 * i, h // 128), np.float16),
        norm_w=dev((h,), np.float16), eps=1e-6, act=dev((1, i), np.float16),
        dn_qweight=dev((h, i // 8), np.uint32), dn_scales=dev((h, i // 128), np.float16),
        barrier=dev((64,), np.uint32),
    )


@pytest.mark.parametrize("variant, entry", [("tiles", "nq_post_attention"), ("a8", "nq_post_attention_a8")])
def test_good_call(variant, entry, launches):
    """One launch of every resident block (the fixture's 132 SMs x 2), the arguments in the entry's order."""
    d = QWEN25_7B
    f = PostAttentionKernels(GemvKernels(d, load, variant))
    good = _good(d)
    f.post_attention(**good)
    fn, grid, args = launches[-1]
    assert fn == entry and grid == 264
    order = ["o_qweight", "o_scales", "attn", "x", "y", "gu_qweight", "gu_scales", "norm_w", "eps", "act",
             "dn_qweight", "dn_scales", "barrier"]
    assert len(args) == len(order)
    for name, a in zip(order, args, strict=True):
        if name == "eps":
            assert a == np.float32(1e-6)
        else:
            assert a is good[name], name
    # 1-D rows are one sequence too
    f.post_attention(**{**good, "attn": dev((d.hidden,), np.float16), "x": dev((d.hidden,), np.float16),
                        "y": dev((d.hidden,), np.float16), "act": dev((d.intermediate,), np.float16)})


def test_bad_arguments_are_refused(launches):
    d = TINY
    f = PostAttentionKernels(GemvKernels(d, load, "tiles"))
    good = _good(d)
    h, i = d.hidden, d.intermediate
    x = good["x"]
    bad = [
        (dict(o_qweight=dev((h - 2, h // 8), np.uint32), o_scales=dev((h - 2, h // 128), np.float16)),
         "o_proj qweight must have hidden"),
        (dict(gu_qweight=dev((i, h // 8), np.uint32), gu_scales=dev((i, h // 128), np.float16)),
         "gate/up qweight must have 2 x intermediate"),
        (dict(dn_qweight=dev((h, h // 8), np.uint32), dn_scales=dev((h, h // 128), np.float16)),
         rf"qweight must be \[N, {i // 8}\]"),
        (dict(attn=dev((2, h), np.float16)), "one sequence"),
        (dict(x=dev((1, h), np.float32)), "x must be float16"),
        (dict(y=dev((h,), np.float16)), "y must have shape"),
        (dict(act=dev((1, h), np.float16)), "act must have shape"),
        (dict(norm_w=dev((h - 8,), np.float16)), "norm_w must have shape"),
        (dict(barrier=dev((64,), np.int32)), "barrier must be uint32"),
        (dict(barrier=dev((2,), np.uint32)), "barrier must have shape"),
        (dict(barrier=dev((65,), np.uint32)[1:]), "barrier must be 128-byte aligned"),
        (dict(y=x), "x and y overlap"),
        (dict(eps=0.0), "eps must be"),
    ]
    assert_each_refused(f.post_attention, good, bad)
    n = len(launches)
    with pytest.raises(KernelError, match="post_attention_fusable"):
        PostAttentionKernels(GemvKernels(d, load, "mma")).post_attention(**good)
    assert len(launches) == n  # nothing launched
