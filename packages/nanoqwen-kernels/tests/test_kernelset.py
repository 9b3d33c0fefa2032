"""KernelSet's choice of GEMV variant (CPU: the choice is checked before anything compiles), and what each
variant runs at B = 1, seen through the launches it makes."""

import numpy as np
import pytest
from fakes import dev, fake_cupy
from nanoqwen_kernels import KernelError, KernelSet, checks
from nanoqwen_kernels.dims import TINY
from nanoqwen_kernels.gemv import DEFAULT_GEMV_VARIANT, GEMV_KINDS, GEMV_VARIANTS, GemvKernels


@pytest.mark.parametrize("how", ["argument", "environment"])
@pytest.mark.parametrize("kwarg,env,message", [
    ("gemv_variant", "NANOQWEN_GEMV_VARIANT", "unknown INT4 GEMV variant 'fastest'.*default, mma, tiles, a8"),
    ("attention_variant", "NANOQWEN_ATTENTION_VARIANT", "unknown decode attention variant 'fastest'.*fma, mma"),
])
def test_unknown_variant_is_a_clear_error(how, kwarg, env, message, monkeypatch):
    kw = {}
    if how == "argument":
        kw[kwarg] = "fastest"
    else:
        monkeypatch.setenv(env, "fastest")
    with pytest.raises(KernelError, match=message):
        KernelSet(TINY, arch="sm_90a", **kw)


def test_default_variant_is_known():
    assert DEFAULT_GEMV_VARIANT in GEMV_VARIANTS


class _Module:
    def get_function(self, name, max_dynamic_smem=0):
        return name


def _batch1_kernels(variant, monkeypatch) -> dict[str, str]:
    """The kernel each GEMV launches at B = 1 under `variant`."""
    calls = []
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: calls.append(fn))
    monkeypatch.setattr(checks, "even_grid", lambda fn, units, threads, shared_mem=0, copies=1: 1)
    monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 132)
    monkeypatch.setattr(checks, "cupy_module", fake_cupy)
    d = TINY
    g = GemvKernels(d, lambda sources, defines: _Module(), variant)
    h, i = d.hidden, d.intermediate
    g.gemv_int4(dev((h, h // 8), np.uint32), dev((h, h // 128), np.float16), dev((h,), np.float16),
                dev((h,), np.float16))
    g.gemv_int4(dev((h, i // 8), np.uint32), dev((h, i // 128), np.float16), dev((i,), np.float16),
                dev((h,), np.float16))
    rows = d.qkv_rows
    g.qkv_rope_kv(dev((rows, h // 8), np.uint32), dev((rows, h // 128), np.float16), dev((rows,), np.float16),
                  dev((h,), np.float16), dev((h,), np.float16), 1e-6, dev((1,), np.int32), dev((4,), np.int32),
                  dev((1, 4, d.n_kv_heads, 16, 128), np.float16), dev((1, 4, d.n_kv_heads, 16, 128), np.float16),
                  0, dev((d.q_dim,), np.float16))
    g.gate_up_silu(dev((2 * i, h // 8), np.uint32), dev((2 * i, h // 128), np.float16), dev((h,), np.float16),
                   None, 1e-6, dev((i,), np.float16))
    gemvs = [c for c in calls if not c.startswith("nq_norm_cols")]  # the tile GEMM's input norm
    return dict(zip(GEMV_KINDS, gemvs, strict=True))


@pytest.mark.parametrize("variant", sorted(GEMV_VARIANTS))
def test_variant_picks_the_body_per_matrix(variant, monkeypatch):
    got = _batch1_kernels(variant, monkeypatch)
    for kind, kernel in got.items():
        on_tensor_cores = kernel.endswith(("_mma8", "_tile8"))
        assert on_tensor_cores == (kind in GEMV_VARIANTS[variant]), (variant, kind, kernel)


def test_mma_runs_every_matrix_on_tensor_cores(monkeypatch):
    got = _batch1_kernels("mma", monkeypatch)
    assert got == {
        "h": "nq_gemv_int4_h_mma8",
        "i": "nq_gemv_int4_i_mma8",
        "qkv": "nq_qkv_rope_kv_mma8",
        "gu": "nq_gate_up_silu_mma8",
    }
    for removed in ("mixed", "tiles1"):  # measured slower everywhere and removed (gemv.py)
        assert removed not in GEMV_VARIANTS


def test_a8_runs_every_matrix_on_the_int8_activation_loop(monkeypatch):
    assert _batch1_kernels("a8", monkeypatch) == {
        "h": "nq_gemv_int4_h_a8",
        "i": "nq_gemv_int4_i_a8",
        "qkv": "nq_qkv_rope_kv_a8",
        "gu": "nq_gate_up_silu_a8",
    }


def test_a8_image_holds_round_a8_in_the_staged_layout():
    """a8.a8_image (what nq_gate_up_silu_a8x writes, nq_gemv_int4_i_a8x stages): K bytes of int8 in the
    [2][K/32][16] layout, then {scale / 16, A8_ACC_START - 8 sum} per A8_BLOCK (16) values; read back it is
    round_a8 exactly."""
    from nanoqwen_kernels.a8 import (
        A8_ACC_START,
        A8_BLOCK,
        a8_image,
        a8_image_bytes,
        a8_image_values,
        round_a8,
    )

    rng = np.random.default_rng()
    k = 8 * 128
    x = (rng.standard_normal(k) * rng.choice([1e-2, 1.0, 50.0])).astype(np.float16)
    x[32:48] = 0  # one zero block (block 2: the first half of piece 1)
    x[48:64] *= np.float16(100)  # its neighbour in the same piece much larger: the scales are per half-piece
    img = a8_image(x)
    assert img.dtype == np.uint8 and img.shape == (a8_image_bytes(k),) == (k * 3 // 2,)
    assert np.array_equal(a8_image_values(img, k), round_a8(x))
    amax = np.abs(x.astype(np.float32)).reshape(-1, A8_BLOCK).max(1)
    q = np.rint(round_a8(x) / np.repeat(amax / 127, A8_BLOCK).clip(min=1e-30)).astype(np.int8)
    assert np.all(np.abs(q.reshape(-1, A8_BLOCK)).max(1)[amax > 0] == 127)  # each block's largest on +-127
    u, h, i = 5, 1, 3  # byte i of half h of piece u is x_int[32u + 16h + i]
    assert img[(h * (k // 32) + u) * 16 + i].view(np.int8) == q[32 * u + 16 * h + i]
    meta = img[k:].view(np.int32).reshape(-1, 2)
    assert meta.shape[0] == k // A8_BLOCK
    assert meta[2, 0] == 0 and meta[2, 1] == A8_ACC_START  # the zero block
    assert meta[3, 0] != 0
    assert np.array_equal(meta[:, 1], A8_ACC_START - 8 * q.astype(np.int64).reshape(-1, A8_BLOCK).sum(1))
    assert np.allclose(meta[:, 0].view(np.float32) * 16, amax / 127)


def test_a8_image_calls_need_the_a8_variant_and_one_sequence(monkeypatch):
    monkeypatch.setattr(checks, "launch", lambda fn, grid, block, args, shared_mem=0: None)
    monkeypatch.setattr(checks, "even_grid", lambda fn, units, threads, shared_mem=0, copies=1: 1)
    monkeypatch.setattr(checks, "sm_count", lambda device_id=None: 132)
    monkeypatch.setattr(checks, "cupy_module", fake_cupy)
    d = TINY
    h, i = d.hidden, d.intermediate
    for variant, b, match in (("tiles", 1, "variant 'a8'"), ("a8", 2, "B = 1")):
        g = GemvKernels(d, lambda sources, defines: _Module(), variant)
        x = dev((b, h), np.float16) if b > 1 else dev((h,), np.float16)
        out = dev((b, i), np.float16) if b > 1 else dev((i,), np.float16)
        with pytest.raises(KernelError, match=match):
            g.gate_up_silu(dev((2 * i, h // 8), np.uint32), dev((2 * i, h // 128), np.float16), x, None, 1e-6, out,
                           a8_image=True)
    g = GemvKernels(d, lambda sources, defines: _Module(), "a8")
    with pytest.raises(KernelError, match="down_proj"):  # an image x is K = I only
        g.gemv_int4(dev((h, h // 8), np.uint32), dev((h, h // 128), np.float16), dev((h,), np.float16),
                    dev((h,), np.float16), x_a8_image=True)


def test_round_a8_is_the_int8_rounding_the_kernel_applies():
    """a8.round_a8 (the int8-activation loop's numpy twin): per A8_BLOCK k, the largest |x| lands on +-127
    exactly, every value within half a step (amax / 254) of itself, a zero block stays zero, and K not a
    multiple of 32 (a piece) is refused."""
    from nanoqwen_kernels.a8 import A8_BLOCK, round_a8
    from nanoqwen_kernels.errors import KernelError

    rng = np.random.default_rng()
    x = (rng.standard_normal((3, 8 * A8_BLOCK)) * rng.choice([1e-3, 1.0, 300.0], size=(3, 1))).astype(np.float16)
    x[1, :A8_BLOCK] = 0  # an all-zero block
    r = round_a8(x)
    xf = x.astype(np.float32).reshape(3, 8, A8_BLOCK)
    rb = r.reshape(3, 8, A8_BLOCK)
    amax = np.abs(xf).max(axis=-1, keepdims=True)
    step = amax / 127
    assert np.all(np.abs(rb - xf) <= 0.5 * step * (1 + 1e-5) + 1e-30)
    on_grid = np.divide(rb, step, out=np.zeros_like(rb), where=step > 0)
    assert np.allclose(on_grid, np.rint(on_grid), atol=1e-3) and np.abs(on_grid).max() <= 127 + 1e-3
    top = np.abs(xf).argmax(axis=-1)[..., None]
    assert np.allclose(np.abs(np.take_along_axis(on_grid, top, -1))[amax > 0], 127, atol=1e-3)
    assert not np.any(rb[1, 0])
    with pytest.raises(KernelError, match="multiple of 32"):
        round_a8(np.ones(48, dtype=np.float16))


@pytest.mark.parametrize("how", ["default", "argument", "environment"])
def test_attention_variant_reaches_the_attention_build(how, monkeypatch):
    """The variant picks the consumer body's defines and the launch's threads (1 producer + consumers)."""
    from nanoqwen_kernels import attention, kernelset

    builds = []

    class Attn(attention.AttentionKernels):
        def __init__(self, dims, load, variant=attention.DEFAULT_VARIANT, sms=None,
                     cluster_max=attention.CLUSTER_MAX, max_clusters=None, pair=False):
            builds.append((variant, attention.decode_defines(dims, variant)["NQ_DECODE_MMA"],
                           32 * (1 + attention.VARIANTS[variant][1]), cluster_max, max_clusters, pair))
            self.attention_decode = self.new_workspace = None

    for name in ("GemvKernels", "NormKernels", "EmbedKernels", "SamplingKernels", "PrefillKernels", "HeadI8Kernels"):
        monkeypatch.setattr(kernelset, name, lambda *a, **k: _Anything())
    monkeypatch.setattr(kernelset, "AttentionKernels", Attn)
    kw = {}
    if how == "argument":
        kw["attention_variant"] = "fma"
    elif how == "environment":
        monkeypatch.setenv("NANOQWEN_ATTENTION_VARIANT", "fma")
    ks = KernelSet(TINY, arch="sm_90a", **kw)
    want = attention.DEFAULT_VARIANT if how == "default" else "fma"
    assert ks.attention_variant == want
    # the default build, the long-context one (clusters of up to 16) and the short-context launch (one cluster
    # a sequence, its consumers taking pages two at a time), all of the variant
    assert attention.SHORT_PAIR
    assert builds == [(want, attention.VARIANTS[want][0], 32 * (1 + attention.VARIANTS[want][1]), cm, mc, pair)
                      for cm, mc, pair in ((8, None, False), (16, None, False), (8, 1, True))]


class _Anything:
    def __getattr__(self, name):
        return None
