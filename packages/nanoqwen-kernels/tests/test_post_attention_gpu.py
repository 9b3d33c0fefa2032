"""GPU: the fused post-attention kernel (cuda/gemv_fused.cuh) gives the three launches it replaces bit for
bit: o_proj + residual, gate/up + SiLU (the a8 image on the int8-activation loop), down_proj + residual, on
the half2 loop ("tiles", the default variant) and the int8-activation loop ("a8"), at every preset shape.
The three-launch chain is itself checked against numpy (test_gemv_gpu.py), so equality carries that over.
Each case launches several times in a row with fresh inputs (the grid barrier's buffer is reused: it must
come back to zero arrivals, its generation counted up by two a launch) and replays a captured CUDA graph.
Outputs poisoned with NaN before every launch."""

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv import GemvKernels
from nanoqwen_kernels.post_attention import PostAttentionKernels
from refs import pack_valueshuffle, random_int4

pytestmark = pytest.mark.gpu
EPS = 1e-6
LAUNCHES = 3


def _load(sources, defines):
    return loader.load_module(sources, defines)


def _weights(cp, rng, n, k):
    u, s = random_int4(rng, n, k)
    return cp.asarray(pack_valueshuffle(u)), cp.asarray(s)


def _chain(g, cp, w, attn, x, norm_w, a8):
    """The three launches the engine makes without the fused kernel: (x, y, act) after them."""
    (oq, os_), (gq, gs), (dq, ds) = w
    y = cp.full_like(x, np.nan)
    act = cp.full((1, g.dims.intermediate), np.nan, dtype=np.float16)
    g.gemv_int4(oq, os_, attn, y, residual=x)
    g.gate_up_silu(gq, gs, y, norm_w, EPS, act, a8_image=a8)
    g.gemv_int4(dq, ds, act, x, residual=y, x_a8_image=a8)
    return x, y, act


def _bits(a):
    return a.get().view(np.uint16)


@pytest.mark.parametrize("variant", ["tiles", "a8"])
@pytest.mark.parametrize("dims_name", sorted(PRESETS))
def test_fused_post_attention_same_bits_as_three_launches(gpu, rng, dims_name, variant):
    cp = gpu
    d = PRESETS[dims_name]
    g = GemvKernels(d, _load, variant)
    f = PostAttentionKernels(g)
    assert f.fusable(1)
    H, inter = d.hidden, d.intermediate
    w = (_weights(cp, rng, H, H), _weights(cp, rng, 2 * inter, H), _weights(cp, rng, H, inter))
    (oq, os_), (gq, gs), (dq, ds) = w
    norm_w = cp.asarray((1 + 0.1 * rng.standard_normal(H)).astype(np.float16))
    bar = f.grid_barrier()
    a8 = variant == "a8"
    for n in range(LAUNCHES):
        attn = cp.asarray(rng.standard_normal((1, H)).astype(np.float16))
        x0 = cp.asarray(rng.standard_normal((1, H)).astype(np.float16))
        want = _chain(g, cp, w, attn, x0.copy(), norm_w, a8)
        x = x0.copy()
        y = cp.full_like(x, np.nan)
        act = cp.full((1, inter), np.nan, dtype=np.float16)
        f.post_attention(oq, os_, attn, x, y, gq, gs, norm_w, EPS, act, dq, ds, bar)
        cp.cuda.get_current_stream().synchronize()
        assert np.isfinite(x.get().astype(np.float32)).all(), "x has unwritten or non-finite elements"
        for name, got, ref in zip(("x", "y", "act"), (x, y, act), want, strict=True):
            same = _bits(got) == _bits(ref)
            assert same.all(), f"launch {n}: {name} differs from the three launches at {np.flatnonzero(~same)[:8]}"
        b = bar.get()
        assert b[0] == 0 and b[32] == 2 * (n + 1), "the grid barrier's arrivals and generation after a launch"

    # replayed from a captured graph (the engine's decode graphs): the same bits again
    attn = cp.asarray(rng.standard_normal((1, H)).astype(np.float16))
    x0 = cp.asarray(rng.standard_normal((1, H)).astype(np.float16))
    want = _chain(g, cp, w, attn, x0.copy(), norm_w, a8)
    x, y = x0.copy(), cp.empty_like(x0)
    act = cp.empty((1, inter), dtype=np.float16)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        f.post_attention(oq, os_, attn, x, y, gq, gs, norm_w, EPS, act, dq, ds, bar)
        graph = stream.end_capture()
        for _ in range(2):
            x[...] = x0
            y.fill(np.nan)
            act.fill(np.nan)
            graph.launch(stream)
            stream.synchronize()
            for name, got, ref in zip(("x", "y", "act"), (x, y, act), want, strict=True):
                assert np.array_equal(_bits(got), _bits(ref)), f"graph replay: {name} differs"
