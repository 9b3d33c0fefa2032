"""GPU: the INT4 GEMV family and the fp16 lm_head for B sequences at once, against numpy (refs.py).

Fresh random weights/activations each test (the seeded `rng` fixture); outputs poisoned with NaN before
every launch. B runs over 1, 2, 3, 5, 8 (one pass of the 8-column build), 9, 16 (the 32-column build),
33, 64 (several passes), at the 7B, 1.5B and tiny shapes; B = 1 also on each GEMV variant's bodies; B > 1
on the two batched builds (gemv_mma's passes and the tile GEMM of the "tiles" variant). The int8-activation
loop ("a8", B = 1) is checked against the same numpy product of the activation it rounds (a8.round_a8).
Tolerances: the INT4 GEMV's products and 4-term partial sums are fp16 on the half2 loop (refs.gemv_tolerance
derives the bound; the tensor-core core is tighter); RoPE'd q/k and silu*up are compared at 8 fp16 ulps of
their own magnitude plus that bound; the fp16 lm_head accumulates in fp32 on either B > 1 body (4e-5 of the row's
sqrt(sum (w x)^2) plus 1e-5 |ref|).
"""

import os

import numpy as np
import pytest
from nanoqwen_kernels import loader
from nanoqwen_kernels.a8 import A8_ACC_START, A8_BLOCK, a8_image, a8_image_bytes, a8_image_values, round_a8
from nanoqwen_kernels.dims import PRESETS
from nanoqwen_kernels.gemv import (
    A8_VARIANTS,
    DEFAULT_LM_HEAD,
    GEMV_VARIANTS,
    LM_HEAD_BODIES,
    GemvKernels,
)
from nanoqwen_kernels.gemv_b1 import B1_SPLIT_DEFINES
from refs import dequant, gemv_tolerance, matvec, pack_valueshuffle, random_int4, rmsnorm, rope

pytestmark = pytest.mark.gpu
EPS = 1e-6
BATCHES = [1, 2, 3, 5, 8, 9, 16, 33, 64]


def _load(sources, defines):
    return loader.load_module(sources, defines)


@pytest.fixture(scope="module", params=sorted(PRESETS))
def dims(request):
    return PRESETS[request.param]


# The int8 loop with down_proj's units split over several warps (gemv_units.cuh gemv_split) at a split other
# than its default build's (gemv_b1.b1_build_defines: in 4 where its unsplit grid leaves SMs empty, as on the
# 1.5B's and the tiny dims; none on the 7B): its own build
A8_SPLIT = "a8/split"
A8_SPLIT_DEFINES = "NQ_SPLIT_DOWN=2"


# The int8 loop's unsplit down_proj with its prologue shared by a cluster of 2 blocks (gemv_a8_cluster.cuh
# NQ_DOWN_CLUSTER), on every dims: the 7B's default build is this (gemv_b1.b1_build_defines); the 1.5B's and
# tiny dims split down_proj by default, and here do not
A8_CLUSTER = "a8/cluster"
A8_CLUSTER_DEFINES = "NQ_SPLIT_DOWN=1,NQ_DOWN_CLUSTER=2"


# The int8 loop's K = hidden kinds with their prologue shared by a cluster (gemv_a8_cluster.cuh
# stage_x_a8_cluster_norm: NQ_QKV_CLUSTER, NQ_O_CLUSTER, NQ_GU_CLUSTER), in 2 and 4 (o_proj: its no-norm
# path; with a norm in the norm + residual mode), on every dims: ranks with no chunk of their own among them
# (the tiny dims' 32 chunks in 2, o_proj's 7B x in 4)
A8_HCLUSTER = "a8/hcluster"
A8_HCLUSTER_DEFINES = "NQ_QKV_CLUSTER=2,NQ_O_CLUSTER=4,NQ_GU_CLUSTER=2"
A8_UNSHARED_DEFINES = "NQ_QKV_CLUSTER=1,NQ_O_CLUSTER=1,NQ_GU_CLUSTER=1"  # the same-bits test's other side


def _a8_kernels_with(dims, defines):
    """GemvKernels("a8") compiled with `defines` added to $NANOQWEN_KERNEL_DEFINES (the build and its launch
    plan read them at construction; the variable is restored after)."""
    old = os.environ.get("NANOQWEN_KERNEL_DEFINES")
    os.environ["NANOQWEN_KERNEL_DEFINES"] = ",".join(filter(None, [old, defines]))
    try:
        return GemvKernels(dims, _load, "a8")
    finally:
        if old is None:
            del os.environ["NANOQWEN_KERNEL_DEFINES"]
        else:
            os.environ["NANOQWEN_KERNEL_DEFINES"] = old


def _a8_split_kernels(dims, default):
    """The int8 loop's split build (A8_SPLIT_DEFINES)."""
    g = _a8_kernels_with(dims, A8_SPLIT_DEFINES)
    assert all(g._split[k] != default._split[k] for k in B1_SPLIT_DEFINES), "the split build must differ"
    return g


def _a8_cluster_kernels(dims):
    """The int8 loop's cluster-prologue build (A8_CLUSTER_DEFINES)."""
    g = _a8_kernels_with(dims, A8_CLUSTER_DEFINES)
    assert g._cluster["i"] == 2 and g._split["i"] == 1
    return g


@pytest.fixture(scope="module")
def kernels(dims, gpu):
    """GemvKernels per variant (B > 1 runs the same tensor-core entries in every variant), and the int8
    loop's split and cluster builds (A8_SPLIT, A8_CLUSTER)."""
    built = {v: GemvKernels(dims, _load, v) for v in GEMV_VARIANTS}
    hcluster = _a8_kernels_with(dims, A8_HCLUSTER_DEFINES)
    assert (hcluster._cluster["qkv"], hcluster._cluster["h"], hcluster._cluster["gu"]) == (2, 4, 2)
    return {**built, A8_SPLIT: _a8_split_kernels(dims, built["a8"]),
            A8_CLUSTER: _a8_cluster_kernels(dims), A8_HCLUSTER: hcluster}


def _runs(b):
    """Variants to run at batch b: every variant and the split and cluster int8 builds at B = 1; beyond, one per
    batched build (gemv_mma's passes: "default"; the tile GEMM: "tiles")."""
    return [*sorted(GEMV_VARIANTS), A8_SPLIT, A8_CLUSTER, A8_HCLUSTER] if b == 1 else ["default", "tiles"]


def _xin(variant, b, xin):
    """The activation a variant multiplies at batch b: the int8-activation loop ("a8", B = 1) rounds it
    (round_a8, the kernel's numpy twin); the others take the fp16 values as they are."""
    return round_a8(xin) if b == 1 and (variant in A8_VARIANTS or variant in (A8_SPLIT, A8_CLUSTER, A8_HCLUSTER)) else xin


def _check(got, ref, tol, what):
    got = np.asarray(got, dtype=np.float64)
    assert np.isfinite(got).all(), f"{what}: non-finite output (unwritten element?)"
    err = np.abs(got - ref)
    bad = err > tol
    assert not bad.any(), f"{what}: {bad.sum()} of {bad.size} beyond tolerance, worst err {err.max():.3g}"


def _batch(b, a):
    """The launch shape of a batch: [B, ...], or the row itself at B = 1 (the 1-D form)."""
    return a if b > 1 else a[0]


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("mode", ["plain", "norm_residual_inplace"])
def test_gemv_int4(kernels, dims, rng, b, mode):
    import cupy as cp

    h, i = dims.hidden, dims.intermediate
    for n, k in [(h, h), (h, i), (2 * dims.kv_dim + 1, h)]:  # o_proj, down_proj, an odd N
        u, s = random_int4(rng, n, k)
        wd = dequant(u, s)
        x = rng.standard_normal((b, k)).astype(np.float16)
        w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        res = rng.standard_normal((b, n)).astype(np.float16)
        xin0 = rmsnorm(x, w, EPS) if "norm" in mode else x
        qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
        for variant in _runs(b):
            xin = _xin(variant, b, xin0)
            ref = matvec(wd, xin.T).T  # [B, N]
            tol = gemv_tolerance(wd, xin, ref)
            if "residual" in mode:
                ref = ref + res.astype(np.float64)
                tol = tol + 2.0**-10 * np.abs(ref)
            g = kernels[variant]
            if mode == "plain":
                out = cp.full((b, n), np.nan, dtype=np.float16)
                g.gemv_int4(qw, sc, _batch(b, cp.asarray(x)), _batch(b, out))
            else:  # out is the residual: x_new = x + W.norm(h)
                out = cp.asarray(res)
                g.gemv_int4(qw, sc, _batch(b, cp.asarray(x)), _batch(b, out), residual=_batch(b, out),
                            norm_w=cp.asarray(w), eps=EPS)
            _check(out.get(), ref, tol, f"{variant} {mode} B={b} N={n} K={k}")


POSITIONS = (0, 37, 131, 600, 1023, 4095, 32767)


def test_int8_cluster_prologue_gives_the_same_bits(kernels, dims, rng):
    """q/k/v's and gate/up's RMSNorm + rounding and o_proj's rounding split over a cluster (A8_HCLUSTER) give
    the unshared build's outputs bit for bit: every block sums x's squares in the same order, so every chunk is
    normed with the same scale whichever block rounds it. So does the decode step's short-context build
    (gemv_b1.b1_short_defines: the 7B's q/k/v and gate/up in clusters of 2; elsewhere the default build). q/k/v
    at positions over the context's range (RoPE's angle grows with them)."""
    import cupy as cp

    d = dims
    H = d.hidden
    x = cp.asarray(rng.standard_normal(H).astype(np.float16))
    w = cp.asarray((1 + 0.1 * rng.standard_normal(H)).astype(np.float16))
    unshared = _a8_kernels_with(dims, A8_UNSHARED_DEFINES)
    assert (unshared._cluster["qkv"], unshared._cluster["h"], unshared._cluster["gu"]) == (1, 1, 1)
    outs = {}
    short = GemvKernels(dims, _load, "a8", short_context=True)
    for variant, g in (("unshared", unshared), (A8_HCLUSTER, kernels[A8_HCLUSTER]), ("short", short)):
        got = []
        for n, what in ((H, "o_proj"), (H, "o_proj+norm"), (2 * d.intermediate, "gate/up")):
            u, s = random_int4(np.random.default_rng(7 + n), n, H)
            qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
            if what == "gate/up":
                out = cp.full(d.intermediate, np.nan, dtype=np.float16)
                g.gate_up_silu(qw, sc, x, w, EPS, out)
            else:
                out = cp.full(n, np.nan, dtype=np.float16)
                g.gemv_int4(qw, sc, x, out, norm_w=w if what.endswith("norm") else None, eps=EPS)
            got.append(out.get())
        u, s = random_int4(np.random.default_rng(5), d.qkv_rows, H)
        for ps in POSITIONS:
            kc = cp.full((1, 4, d.n_kv_heads, 16, 128), np.nan, dtype=np.float16)
            vc = cp.full_like(kc, np.nan)
            q_out = cp.full(d.q_dim, np.nan, dtype=np.float16)
            table = np.full(ps // 16 + 1, 7, np.int32)
            table[ps // 16] = 2
            g.qkv_rope_kv(cp.asarray(pack_valueshuffle(u)), cp.asarray(s), cp.zeros(d.qkv_rows, np.float16), x, w,
                          EPS, cp.asarray(np.array([ps], np.int32)), cp.asarray(table), kc, vc, 0, q_out, settled=True)
            got += [q_out.get(), kc.get()[0, 2, :, ps % 16], vc.get()[0, 2, :, ps % 16]]
        outs[variant] = got
    names = ("o_proj", "o_proj+norm", "gate/up", *(f"{t} at {ps}" for ps in POSITIONS for t in "qkv"))
    for what, a, b, c in zip(names, outs["unshared"], outs[A8_HCLUSTER], outs["short"], strict=True):
        assert np.isfinite(a.astype(np.float32)).all(), what
        assert a.tobytes() == b.tobytes(), f"{what}: the cluster build's bits differ"
        assert a.tobytes() == c.tobytes(), f"{what}: the short-context build's bits differ"


def _positions(rng, b):
    """Positions of B sequences at mixed lengths, page boundaries among them."""
    edge = np.array([0, 1, 15, 16, 17, 31, 32, 4095, 32767])
    pos = rng.integers(0, 3000, size=b)
    pos[: min(b, len(edge))] = rng.permutation(edge)[: min(b, len(edge))]
    return rng.permutation(pos).astype(np.int32)


@pytest.mark.parametrize("b", BATCHES)
def test_qkv_rope_kv(kernels, dims, rng, b):
    import cupy as cp

    d = dims
    rows, H = d.qkv_rows, d.hidden
    u, s = random_int4(rng, rows, H)
    bias = (0.5 * rng.standard_normal(rows)).astype(np.float16)
    x = rng.standard_normal((b, H)).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    pos = _positions(rng, b)
    max_pages = int(pos.max()) // 16 + 2
    n_layers, layer = 2, 1
    n_pages = b + 8
    # every sequence's page of its position is its own (distinct pages), the rest of its table random
    table = rng.integers(0, n_pages, size=(b, max_pages)).astype(np.int32)
    mine = rng.permutation(n_pages)[:b]
    table[np.arange(b), pos // 16] = mine
    pad = b >= 3  # a padding row: its table holds no page; it must write nothing and get NaN q
    if pad:
        table[b - 1] = -1
    xin0 = rmsnorm(x, w, EPS)
    wd = dequant(u, s)
    qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
    # settled (the decode step's promise that pos and the table were written before the previous kernel:
    # here, by the host's copies): the B = 1 loops read them before their wait; the same results either way
    for variant, settled in [(v, st) for v in _runs(b) for st in ((False, True) if b == 1 else (False,))]:
        xin = _xin(variant, b, xin0)
        lin = matvec(wd, xin.T).T + bias.astype(np.float64)  # [B, rows]
        tols = gemv_tolerance(wd, xin, lin)
        kc = cp.full((n_layers, n_pages, d.n_kv_heads, 16, 128), np.nan, dtype=np.float16)
        vc = cp.full_like(kc, np.nan)
        q_out = cp.full((b, d.q_dim), np.nan, dtype=np.float16)
        kernels[variant].qkv_rope_kv(
            qw, sc, cp.asarray(bias), _batch(b, cp.asarray(x)), cp.asarray(w), EPS, cp.asarray(pos),
            cp.asarray(table) if b > 1 else cp.asarray(table[0]), kc, vc, layer, _batch(b, q_out),
            settled=settled,
        )
        kh, vh, qh = kc.get(), vc.get(), q_out.get()
        written = np.zeros(kh.shape, dtype=bool)
        for j in range(b):
            what = f"{variant} B={b} row {j} pos={pos[j]}"
            if pad and j == b - 1:
                assert np.isnan(qh[j]).all(), f"{what}: a row without a page must get NaN q"
                continue
            tol = tols[j]
            q, k, v = np.split(lin[j], [d.q_dim, d.q_dim + d.kv_dim])
            tq, tk, tv = np.split(tol, [d.q_dim, d.q_dim + d.kv_dim])
            qr = rope(q.reshape(d.n_heads, 128), int(pos[j]), d.rope_theta).reshape(-1)
            kr = rope(k.reshape(d.n_kv_heads, 128), int(pos[j]), d.rope_theta)
            # RoPE mixes d and d+64: either one's error can land on both
            halves = tq.reshape(-1, 2, 64)
            m = 2 * np.maximum(halves[:, 0], halves[:, 1])
            tq = np.concatenate([m, m], axis=1).reshape(-1)
            _check(qh[j], qr, tq + 8 * 2.0**-11 * np.abs(qr), f"q {what}")
            page, slot = table[j, pos[j] // 16], pos[j] % 16
            tk2 = np.max(tk.reshape(d.n_kv_heads, 128), axis=1, keepdims=True) * 2 + 8 * 2.0**-11 * np.abs(kr)
            _check(kh[layer, page, :, slot], kr, tk2, f"k {what}")
            _check(vh[layer, page, :, slot], v.reshape(d.n_kv_heads, 128), tv.reshape(d.n_kv_heads, 128),
                   f"v {what}")
            written[layer, page, :, slot] = True
        # nothing else in either cache was written
        assert np.isnan(kh[~written]).all() and np.isnan(vh[~written]).all(), "a write outside the slots"


@pytest.mark.parametrize("b", BATCHES)
def test_gate_up_silu(kernels, dims, rng, b):
    import cupy as cp

    H, inter = dims.hidden, dims.intermediate
    u, s = random_int4(rng, 2 * inter, H)
    x = rng.standard_normal((b, H)).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    xin0 = rmsnorm(x, w, EPS)
    wd = dequant(u, s)
    qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
    for variant in _runs(b):
        xin = _xin(variant, b, xin0)
        lin = matvec(wd, xin.T).T
        tol = gemv_tolerance(wd, xin, lin)
        gate, up = lin[:, :inter], lin[:, inter:]
        silu = gate / (1 + np.exp(-gate))
        ref = silu * up
        # d(silu*up) = silu' up dgate + silu dup, |silu'| <= 1.1
        t = 1.1 * np.abs(up) * tol[:, :inter] + np.abs(silu) * tol[:, inter:] + 8 * 2.0**-11 * np.abs(ref) + 1e-6
        out = cp.full((b, inter), np.nan, dtype=np.float16)
        kernels[variant].gate_up_silu(qw, sc, _batch(b, cp.asarray(x)), cp.asarray(w), EPS, _batch(b, out))
        _check(out.get(), ref, t, f"{variant} gate_up_silu B={b}")


@pytest.mark.parametrize("variant", ["a8", A8_SPLIT])
def test_a8_image_pair(kernels, dims, rng, variant):
    """The int8-activation loop's down_proj pair. gate/up with a8_image writes down_proj's input already
    rounded (a8.a8_image's layout): its values are the numpy gate/up within the fp16 tolerance plus half an
    int8 step, each A8_BLOCK-value block's largest on +-127, its stored sum that of its bytes. down_proj reading an
    image made by numpy matches numpy on round_a8 of that x. And the fused pair gives the unfused a8 pair's
    output bit for bit (the same fp16 values rounded the same way, the same sums)."""
    import cupy as cp

    g = kernels[variant]
    H, inter = dims.hidden, dims.intermediate
    ug, sg = random_int4(rng, 2 * inter, H)
    ud, sd = random_int4(rng, H, inter)
    qg, scg = cp.asarray(pack_valueshuffle(ug)), cp.asarray(sg)
    qd, scd = cp.asarray(pack_valueshuffle(ud)), cp.asarray(sd)
    x = rng.standard_normal(H).astype(np.float16)
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float16)
    res = rng.standard_normal(H).astype(np.float16)
    # gate/up -> image
    xin = round_a8(rmsnorm(x[None], w, EPS))
    wd = dequant(ug, sg)
    lin = matvec(wd, xin.T).T
    tol = gemv_tolerance(wd, xin, lin)
    gate, up = lin[0, :inter], lin[0, inter:]
    silu = gate / (1 + np.exp(-gate))
    ref = silu * up
    t = 1.1 * np.abs(up) * tol[0, :inter] + np.abs(silu) * tol[0, inter:] + 8 * 2.0**-11 * np.abs(ref) + 1e-6
    act = cp.full(inter, np.nan, dtype=np.float16)
    g.gate_up_silu(qg, scg, cp.asarray(x), cp.asarray(w), EPS, act, a8_image=True)
    img = act.get().view(np.uint8)[: a8_image_bytes(inter)].copy()
    vals = a8_image_values(img, inter).astype(np.float64)
    nb = inter // A8_BLOCK
    q = img[:inter].view(np.int8).reshape(2, inter // 32, 16).transpose(1, 0, 2).reshape(nb, A8_BLOCK)
    meta = img[inter:].view(np.int32).reshape(nb, 2)
    assert np.array_equal(meta[:, 1], A8_ACC_START - 8 * q.astype(np.int64).sum(axis=1)), "a block's stored sum"
    nonzero = np.abs(q).max(axis=1) > 0
    assert np.all(np.abs(q).max(axis=1)[nonzero] == 127), "a block's largest value must land on +-127"
    step = np.abs(vals.reshape(-1, A8_BLOCK)).max(axis=1) / 127
    _check(vals, ref, t + 0.51 * np.repeat(step, A8_BLOCK) + 1e-6, "a8 image of gate/up")
    # down_proj reading a numpy image
    h = rng.standard_normal(inter).astype(np.float16)
    buf = cp.zeros(inter, dtype=np.float16)
    buf.view(cp.uint8)[: a8_image_bytes(inter)] = cp.asarray(a8_image(h))
    wdd = dequant(ud, sd)
    hr = round_a8(h[None])
    ref_d = matvec(wdd, hr.T).T[0] + res.astype(np.float64)
    tol_d = gemv_tolerance(wdd, hr, ref_d[None])[0] + 2.0**-10 * np.abs(ref_d)
    out = cp.full(H, np.nan, dtype=np.float16)
    g.gemv_int4(qd, scd, buf, out, residual=cp.asarray(res), x_a8_image=True)
    _check(out.get(), ref_d, tol_d, "down_proj on an a8 image")
    # fused pair == unfused pair, bit for bit
    outs = []
    for fused in (False, True):
        a = cp.full(inter, np.nan, dtype=np.float16)
        o = cp.asarray(res)
        g.gate_up_silu(qg, scg, cp.asarray(x), cp.asarray(w), EPS, a, a8_image=fused)
        g.gemv_int4(qd, scd, a, o, residual=o, x_a8_image=fused)
        outs.append(o.get().view(np.uint16))
    assert np.array_equal(outs[0], outs[1]), "the fused a8 pair differs from the unfused one"


@pytest.mark.parametrize("b", BATCHES)
@pytest.mark.parametrize("head", LM_HEAD_BODIES)
def test_gemv_fp16(kernels, dims, rng, b, head):
    """The lm_head on both of its B > 1 bodies (cuBLAS, gemv_mma's passes); B = 1 is the same kernel in both."""
    import cupy as cp

    # the full vocab where the plan differs (many tiles: passes) and at B = 1; an odd N otherwise
    n = dims.vocab if b in (1, 33, 64) else 1001
    w = (0.02 * rng.standard_normal((n, dims.hidden), dtype=np.float32)).astype(np.float16)
    x = rng.standard_normal((b, dims.hidden)).astype(np.float16)
    out = cp.full((b, n), np.nan, dtype=np.float32)
    g = kernels["default"] if head == DEFAULT_LM_HEAD else GemvKernels(dims, _load, "default", head)
    g.gemv_fp16(cp.asarray(w), _batch(b, cp.asarray(x)), _batch(b, out))
    wf, xf = w.astype(np.float32), x.astype(np.float32)
    ref = matvec(wf, xf.T).T
    spread = np.sqrt(np.square(xf) @ np.square(wf, out=wf).T).astype(np.float64)  # wf squared in place
    tol = 4e-5 * spread + 1e-5 * np.abs(ref) + 1e-7
    _check(out.get(), ref, tol, f"gemv_fp16 B={b} N={n}")


def test_a_row_gets_the_same_bits_at_any_batch_size(kernels, dims, rng):
    """On the tensor-core core a sequence's result does not depend on its batch: B = 1 on the "mma"
    variant, a row of B = 5 and a row of B = 40 (two passes) agree bit for bit."""
    import cupy as cp

    h = dims.hidden
    u, s = random_int4(rng, 2 * dims.intermediate, h)
    qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
    x = cp.asarray(rng.standard_normal((40, h)).astype(np.float16))
    w = cp.asarray((1 + 0.1 * rng.standard_normal(h)).astype(np.float16))
    outs = {}
    for b in (1, 5, 40):
        out = cp.full((b, dims.intermediate), np.nan, dtype=np.float16)
        kernels["mma"].gate_up_silu(qw, sc, _batch(b, x[:b]), w, EPS, _batch(b, out))
        outs[b] = out.get()
    assert np.array_equal(outs[1][0].view(np.uint16), outs[5][0].view(np.uint16))
    assert np.array_equal(outs[5].view(np.uint16), outs[40][:5].view(np.uint16))


def test_tiles_rows_are_batch_invariant_and_deterministic(kernels, dims, rng):
    """The tile GEMM's stripes depend on the matrix only, so a row of B = 3 and the same row of B = 64
    agree bit for bit, on down_proj (K = I: partial segments reduced through the tickets) and on the
    fused gate/up; and a second launch repeats the bits (the tickets were reset by the first)."""
    import cupy as cp

    h, i = dims.hidden, dims.intermediate
    u, s = random_int4(rng, h, i)
    qw, sc = cp.asarray(pack_valueshuffle(u)), cp.asarray(s)
    x = cp.asarray(rng.standard_normal((64, i)).astype(np.float16))
    ug, sg = random_int4(rng, 2 * i, h)
    qg, scg = cp.asarray(pack_valueshuffle(ug)), cp.asarray(sg)
    xg = cp.asarray(rng.standard_normal((64, h)).astype(np.float16))
    w = cp.asarray((1 + 0.1 * rng.standard_normal(h)).astype(np.float16))
    got = {}
    for b in (3, 64, 64):
        out = cp.full((b, h), np.nan, dtype=np.float16)
        kernels["tiles"].gemv_int4(qw, sc, x[:b], out)
        og = cp.full((b, i), np.nan, dtype=np.float16)
        kernels["tiles"].gate_up_silu(qg, scg, xg[:b], w, EPS, og)
        got.setdefault(b, []).append((out.get().view(np.uint16), og.get().view(np.uint16)))
    (d3, g3), = got[3]
    (d64a, g64a), (d64b, g64b) = got[64]
    assert np.array_equal(d64a, d64b) and np.array_equal(g64a, g64b)
    assert np.array_equal(d3, d64a[:3]) and np.array_equal(g3, g64a[:3])


@pytest.mark.parametrize("b", [2, 17, 64])
def test_tiles_odd_group_count(gpu, rng, b):
    """The tile GEMM steps K two 128-k groups at a time; a K of an odd number of groups (Qwen2.5-0.5B's
    hidden 896 has 7) ends on a one-group step and loads its scales without the 4-byte copy. Dims with
    hidden 384 (3 groups) and intermediate 640 (5), the plain GEMV with norm and residual against numpy."""
    import cupy as cp
    from nanoqwen_kernels.dims import ModelDims

    odd = ModelDims(hidden=384, intermediate=640, n_heads=2, n_kv_heads=1, head_dim=128, vocab=1000,
                    n_layers=1, rope_theta=1e6)
    g = GemvKernels(odd, _load, "tiles")
    for n, k in [(odd.hidden, odd.hidden), (odd.hidden, odd.intermediate), (2 * odd.intermediate + 1, odd.hidden)]:
        u, s = random_int4(rng, n, k)
        wd = dequant(u, s)
        x = rng.standard_normal((b, k)).astype(np.float16)
        w = (1 + 0.1 * rng.standard_normal(k)).astype(np.float16)
        res = rng.standard_normal((b, n)).astype(np.float16)
        xin = rmsnorm(x, w, EPS)
        ref = matvec(wd, xin.T).T + res.astype(np.float64)
        tol = gemv_tolerance(wd, xin, ref) + 2.0**-10 * np.abs(ref)
        out = cp.asarray(res)
        g.gemv_int4(cp.asarray(pack_valueshuffle(u)), cp.asarray(s), cp.asarray(x), out, residual=out,
                    norm_w=cp.asarray(w), eps=EPS)
        _check(out.get(), ref, tol, f"tiles odd groups B={b} N={n} K={k}")
