"""Paged decode attention on the GPU against a numpy float64 reference kept here.

Fresh random q/K/V each run (seeded by the `rng` fixture); a batch of sequences of mixed lengths shares
one pool, each sequence's pages scattered at random through it; every slot the kernel must not read
(free pages, the other layer, the tail page's slots past seq_len, the page-table entries past a
sequence's pages) holds NaN, so reading one shows up as NaN in the output; out and the workspace's
partials are NaN before launch (its ticket words stay 0, as the one-kernel build requires between calls,
and are checked to be 0 again after). A row of length 0 is an idle (padding) row: its output must be
exactly 0.

Tolerance (fp16 output of an fp32 computation): |out - ref| <= 2e-4 + 4e-3 |ref|. fp16 rounding alone
is 2^-11 |ref| ~ 4.9e-4 |ref|; the rest is fp32 accumulation over up to 32768 positions and exp2f.
The tensor-core body ("mma") rounds p to fp16 before P.V (as FlashAttention does): at most
2^-11 sum_t p_t |v_t| (p normalised) more, added with a 25% margin for them.
"""

import numpy as np
import pytest
from nanoqwen_kernels import KernelError, gpu_status
from nanoqwen_kernels.attention import TICKET_WORDS
from nanoqwen_kernels.dims import QWEN25_7B, TINY

OK, REASON = gpu_status()
gpu = pytest.mark.skipif(not OK, reason=REASON)
DIMS = {"7b": QWEN25_7B, "tiny": TINY}


VARIANTS = ["fma", "mma"]  # consumer bodies (nanoqwen_kernels.attention.VARIANTS)
MIXED = [1, 15, 16, 17, 1000, 5000]
LL_FLAG = 0x4E514C4C  # attention_decode.cu's kLlFlag: a flagged-fold word's high half  # lengths the batches cycle through (page boundaries and long rows)


class _Builds(dict):
    """(dims name, variant) or (dims name, variant, extra defines) -> AttentionKernels, built on first use."""

    def __missing__(self, key):
        from nanoqwen_kernels.attention import LONG_CLUSTER_MAX, SHORT_PAIR, AttentionKernels
        from nanoqwen_kernels.loader import load_module

        name, variant, *extra = key
        long = "long" in extra  # the long-context build (clusters of up to 16)
        short = "short" in extra  # the short-context launch (the default build on one cluster a sequence)
        added = dict(extra[0]) if extra and extra[0] not in ("long", "short") else {}

        def load(sources, defines):
            return load_module(sources, {**defines, **added})

        ak = AttentionKernels(DIMS[name], load, variant, cluster_max=LONG_CLUSTER_MAX if long else 8,
                              max_clusters=1 if short else None, pair=short and SHORT_PAIR)
        self[key] = ak
        return ak


@pytest.fixture(scope="module")
def kernels():
    return _Builds()


P_ROUNDING = 1.25 * 2.0**-11  # fp16 rounding of p in [0, 1] (relative), with a margin


def reference(q, k_seq, v_seq, n_kv):
    """q [nh,128], k_seq/v_seq [L, n_kv, 128] -> (out [nh,128], P.|V| [nh,128]), all float64."""
    nh = q.shape[0]
    g = nh // n_kv
    if k_seq.shape[0] == 0:  # an idle row
        return np.zeros((nh, 128)), np.zeros((nh, 128))
    qg = q.reshape(n_kv, g, 128)
    s = np.einsum("kgd,tkd->kgt", qg, k_seq) / np.sqrt(128.0)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("kgt,tkd->kgd", p, v_seq).reshape(nh, 128)
    pv_abs = np.einsum("kgt,tkd->kgd", p, np.abs(v_seq)).reshape(nh, 128)
    return out, pv_abs


def tolerance(ref, pv_abs, variant):
    tol = 2e-4 + 4e-3 * np.abs(ref)
    return tol + P_ROUNDING * pv_abs if variant.startswith("mma") else tol


def to_pages(seq: np.ndarray, n_pages: int) -> np.ndarray:
    """token-major [n, n_kv, 128] -> pages [n_pages, n_kv, 16, 128] (a new array); the tail slots are NaN."""
    pad = np.full((n_pages * 16, *seq.shape[1:]), np.nan, np.float16)
    pad[: seq.shape[0]] = seq
    return np.ascontiguousarray(pad.reshape(n_pages, 16, *seq.shape[1:]).transpose(0, 2, 1, 3))


def make_batch(cp, dims, lengths, rng, n_layers=2, layer=1, spare_pages=7, extra_table=5):
    """A pool shared by len(lengths) sequences, pages scattered; everything the kernel must not read is NaN.

    Returns device q [B, nh*128], k/v caches, page table [B, max_pages] (rows longer than each sequence:
    the unused tail points at pages the kernel must not read), seq_len [B], and the float64 references.
    """
    n_seq_pages = [(n + 15) // 16 for n in lengths]
    n_pages = sum(n_seq_pages) + spare_pages
    max_pages = max(n_seq_pages) + extra_table
    shape = (n_layers, n_pages, dims.n_kv_heads, 16, 128)
    k = cp.full(shape, np.nan, dtype=cp.float16)
    v = cp.full(shape, np.nan, dtype=cp.float16)
    perm = rng.permutation(n_pages).astype(np.int32)
    table = rng.integers(0, n_pages, size=(len(lengths), max_pages)).astype(np.int32)
    q = (2.0 * rng.standard_normal((len(lengths), dims.n_heads * 128))).astype(np.float16)
    refs, pvs, at = [], [], 0
    for b, n in enumerate(lengths):
        pages = perm[at : at + n_seq_pages[b]]
        at += n_seq_pages[b]
        table[b, : len(pages)] = pages
        k_seq = rng.standard_normal((n, dims.n_kv_heads, 128)).astype(np.float16)
        v_seq = rng.standard_normal((n, dims.n_kv_heads, 128)).astype(np.float16)
        if n:
            idx = cp.asarray(pages)
            k[layer, idx] = cp.asarray(to_pages(k_seq, len(pages)))
            v[layer, idx] = cp.asarray(to_pages(v_seq, len(pages)))
        ref, pv = reference(q[b].astype(np.float64).reshape(dims.n_heads, 128), k_seq.astype(np.float64),
                            v_seq.astype(np.float64), dims.n_kv_heads)
        refs.append(ref)
        pvs.append(pv)
    return dict(
        q=cp.asarray(q),
        k=k,
        v=v,
        table=cp.asarray(table),
        seq=cp.asarray(np.array(lengths, np.int32)),
        layer=layer,
        ref=np.stack(refs),
        pv_abs=np.stack(pvs),
    )


def poisoned_workspace(ak, B):
    """A workspace whose partials are NaN and whose ticket words are 0 (what every call must leave)."""
    ws = ak.new_workspace(max_batch=B)
    ws[TICKET_WORDS:].fill(np.nan)
    return ws


def tickets_clear(cp, ws):
    """No ticket counter left counting and no flagged-fold word left flagged (what every call leaves)."""
    words = cp.asnumpy(ws).view(np.uint32)
    flags = words[TICKET_WORDS + 1 :: 2]  # each 8-byte word's high half (the flag's place)
    return not words[:TICKET_WORDS].any() and not (flags == LL_FLAG).any()


def run(cp, ak, dims, c, B):
    out = cp.full((B, dims.n_heads * 128), np.nan, dtype=cp.float16)
    ws = poisoned_workspace(ak, B)
    ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out, ws)
    assert tickets_clear(cp, ws), "a call left a ticket counter non-zero"
    return cp.asnumpy(out).astype(np.float64).reshape(B, dims.n_heads, 128)


def check(got, c, variant, lengths):
    assert np.isfinite(got).all(), "NaN/inf in the output: a masked or foreign slot was read"
    err = np.abs(got - c["ref"])
    tol = tolerance(c["ref"], c["pv_abs"], variant)
    bad = sorted({int(b) for b in np.nonzero(err > tol)[0]})
    assert not bad, (f"rows {bad} (lengths {[lengths[b] for b in bad]}): max err {err.max():.3g}, "
                     f"worst excess {(err - tol).max():.3g}")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("seq_len", [1, 15, 16, 17, 1024, 1025, 4095, 32768])
def test_decode_matches_reference(kernels, name, seq_len, variant, rng):
    """Batch 1 (a 1-D q, as the single-sequence callers pass it) over the context lengths that matter
    (1,024 / 1,025: the last length one cluster holds alone, and the first that spreads over two)."""
    import cupy as cp

    dims, ak = DIMS[name], kernels[name, variant]
    c = make_batch(cp, dims, [seq_len], rng)
    out = cp.full(dims.n_heads * 128, np.nan, dtype=cp.float16)
    ws = poisoned_workspace(ak, 1)
    ak.attention_decode(c["q"][0], c["k"], c["v"], c["table"][0], c["seq"], c["layer"], out, ws)
    got = cp.asnumpy(out).astype(np.float64).reshape(1, dims.n_heads, 128)
    check(got, c, variant, [seq_len])
    assert tickets_clear(cp, ws)


# (dims, consumer body): both bodies on the 7B shape, the default body on the tiny one
BUILDS = [("7b", "fma"), ("7b", "mma"), ("tiny", "fma")]


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name,variant", BUILDS)
@pytest.mark.parametrize("B", [1, 2, 3, 8, 33, 64])
def test_batch_of_mixed_lengths(kernels, name, B, variant, rng):
    """B sequences of mixed lengths (cycling through MIXED from a random offset, one idle row of length 0
    when B > 1) in one launch: every row matches its own float64 reference. B <= 8 at 7B fold in clusters
    (one, or several through the workspace); B = 33, 64 launch clusters of 1, the local path."""
    import cupy as cp

    dims, ak = DIMS[name], kernels[name, variant]
    off = int(rng.integers(len(MIXED)))
    lengths = [MIXED[(off + b) % len(MIXED)] for b in range(B)]
    if B > 1:
        lengths[int(rng.integers(B))] = 0
    c = make_batch(cp, dims, lengths, rng)
    check(run(cp, ak, dims, c, B), c, variant, lengths)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name,variant", [("7b", "mma"), ("7b", "fma"), ("tiny", "mma")])
def test_short_context_grid(kernels, name, variant, rng):
    """The short-context launch (one cluster per sequence and KV head, its consumers taking pages two at a
    time): on batches whose sequences are all of at most SHORT_CONTEXT_TOKENS it matches the reference and the
    default grid (both read each sequence with the first cluster alone; the pairs only regroup the online
    softmax, so the two agree to fp16 rounding of p, not bit for bit); on longer ones (one cluster then
    streams every page) it still matches the reference. The same inputs give it the same bits twice."""
    import cupy as cp
    from nanoqwen_kernels.attention import SHORT_CONTEXT_TOKENS

    dims, ak, short = DIMS[name], kernels[name, variant], kernels[name, variant, "short"]
    for lengths in ([SHORT_CONTEXT_TOKENS], [int(rng.integers(1, 700))],
                    [1, 640, 0, 17, SHORT_CONTEXT_TOKENS, int(rng.integers(2, SHORT_CONTEXT_TOKENS))]):
        c = make_batch(cp, dims, lengths, rng)
        want = run(cp, ak, dims, c, len(lengths))
        got = run(cp, short, dims, c, len(lengths))
        check(got, c, variant, lengths)
        np.testing.assert_allclose(got, want, rtol=4e-3, atol=2e-3)
        np.testing.assert_array_equal(run(cp, short, dims, c, len(lengths)), got)
    for lengths in ([SHORT_CONTEXT_TOKENS + 1], [5000, 3, 0, 1025]):
        c = make_batch(cp, dims, lengths, rng)
        check(run(cp, short, dims, c, len(lengths)), c, variant, lengths)


@gpu
@pytest.mark.gpu
def test_rows_are_independent_of_the_batch(kernels, rng):
    """Row b of a batch of 8 and the same sequence launched alone both match the reference; a row of one
    page is one block's in both launches (the same arithmetic), so those agree bit for bit."""
    import cupy as cp

    dims, ak = QWEN25_7B, kernels["7b", "fma"]
    lengths = [17, 5000, 1, 1000, 16, 15, 333, 2048]
    c = make_batch(cp, dims, lengths, rng)
    batch = run(cp, ak, dims, c, 8)
    for b, n in enumerate(lengths):
        one = {**c, "q": c["q"][b : b + 1], "table": c["table"][b : b + 1], "seq": c["seq"][b : b + 1],
               "ref": c["ref"][b : b + 1], "pv_abs": c["pv_abs"][b : b + 1]}
        alone = run(cp, ak, dims, one, 1)
        check(alone, one, "fma", [n])
        if n <= 16:  # one page: one block holds it in both launches, the same arithmetic
            np.testing.assert_array_equal(alone[0], batch[b])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
def test_decode_reads_seq_len_on_device(kernels, variant, rng):
    """The page tables cover 40 and 20 positions, seq_len_dev says 33 and 5: the result follows the device
    values (what a replayed graph relies on)."""
    import cupy as cp

    dims, ak = TINY, kernels["tiny", variant]
    c = make_batch(cp, dims, [40, 20], rng)
    k = cp.asnumpy(c["k"])[c["layer"]]
    v = cp.asnumpy(c["v"])[c["layer"]]
    table = cp.asnumpy(c["table"])
    c["seq"][...] = cp.asarray(np.array([33, 5], np.int32))
    got = run(cp, ak, dims, c, 2)
    for b, n in enumerate((33, 5)):
        k_seq = np.stack([k[table[b, t // 16], :, t % 16] for t in range(n)]).astype(np.float64)
        v_seq = np.stack([v[table[b, t // 16], :, t % 16] for t in range(n)]).astype(np.float64)
        q = cp.asnumpy(c["q"][b]).astype(np.float64).reshape(dims.n_heads, 128)
        ref, pv_abs = reference(q, k_seq, v_seq, dims.n_kv_heads)
        assert (np.abs(got[b] - ref) <= tolerance(ref, pv_abs, variant)).all(), f"row {b}"


@gpu
@pytest.mark.gpu
def test_replays_in_a_graph_as_lengths_change(kernels, rng):
    """One captured launch serves every step: lengths and page tables change on the device between replays,
    across the single-cluster / several-cluster line (1,024 tokens), and every replay leaves the ticket
    counters at 0 for the next."""
    replay_in_a_graph(kernels["tiny", "fma"], rng)


def replay_in_a_graph(ak, rng):
    """test_replays_in_a_graph_as_lengths_change's body, for a build of the tiny dims."""
    import cupy as cp

    dims = TINY
    c = make_batch(cp, dims, [3000, 37, 1100], rng)
    out = cp.empty((3, dims.n_heads * 128), dtype=cp.float16)
    ws = ak.new_workspace(max_batch=3)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out, ws)
        stream.begin_capture()
        ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out, ws)
        graph = stream.end_capture()
    for lens in ([1, 1, 1], [17, 0, 64], [3000, 37, 1100], [1025, 37, 1024], [2999, 0, 1099], [2999, 0, 1099]):
        with stream:
            c["seq"].set(np.array(lens, np.int32), stream=stream)
        graph.launch(stream)
        stream.synchronize()
        assert tickets_clear(cp, ws), lens
        got = cp.asnumpy(out).astype(np.float64).reshape(3, dims.n_heads, 128)
        with stream:
            out2 = cp.empty_like(out)
            ak.attention_decode(c["q"], c["k"], c["v"], c["table"], c["seq"], c["layer"], out2, ws)
            stream.synchronize()
        np.testing.assert_array_equal(got, cp.asnumpy(out2).astype(np.float64).reshape(3, dims.n_heads, 128))


# ---- batch 1 across the single-cluster / several-cluster line ------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("seq_len", [1, 17, 640, 1024, 1025, 4095, 32768])
def test_batch_one_matches_reference(kernels, name, seq_len, variant, rng):
    """Batch 1: one cluster (C = 8 on 132 SMs) up to 1,024 tokens, several above (the workspace fold)."""
    import cupy as cp

    dims, ak = DIMS[name], kernels[name, variant]
    assert ak.clusters(1)[0] > 1, "batch 1 should launch clusters (the fold under test)"
    c = make_batch(cp, dims, [seq_len], rng)
    check(run(cp, ak, dims, c, 1), c, variant, [seq_len])


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("name", ["7b", "tiny"])
@pytest.mark.parametrize("B,lengths", [(1, [1]), (1, [640]), (1, [1025]), (1, [32768]), (2, [4095, 0]),
                                       (3, [5000, 17, 2049]), (8, [1, 15, 16, 17, 1000, 5000, 0, 1025])])
def test_long_build_matches_the_reference(kernels, name, B, lengths, rng):
    """The long-context build (clusters of up to 16 blocks, a non-portable size: 7B at batch 1 3 clusters
    of 16) against the float64 reference, over one cluster, several, idle rows; no ticket, no flag left."""
    import cupy as cp

    dims, ak = DIMS[name], kernels[name, "mma", "long"]
    c16 = ak.clusters(B)[0]
    assert B > 2 or c16 == 16, "batch 1 and 2 should launch clusters of 16 (the build under test)"
    c = make_batch(cp, dims, lengths, rng)
    check(run(cp, ak, dims, c, B), c, "mma", lengths)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("B,lengths", [(1, [32768]), (1, [1025]), (2, [4095, 0]), (3, [5000, 17, 2049])])
def test_both_folds_match_the_reference(kernels, B, lengths, rng):
    """The several-cluster fold both ways on the same inputs: flagged words (the launcher's choice where
    every cluster fits on the device at once, which batch 1 to 3 at 7B do) and tickets (its choice where
    they would not), each against the float64 reference, each leaving no ticket and no flag behind."""
    import cupy as cp

    dims, ak = QWEN25_7B, kernels["7b", "mma"]
    assert ak.clusters(B)[1] > 1 and ak.flagged_fold(B), "the launch should fold several clusters, flagged"
    c = make_batch(cp, dims, lengths, rng)
    flagged = run(cp, ak, dims, c, B)
    check(flagged, c, "mma", lengths)
    ak._flagged[B] = False  # what the launcher picks where the clusters would not all fit
    try:
        tickets = run(cp, ak, dims, c, B)
    finally:
        ak._flagged.pop(B)
    check(tickets, c, "mma", lengths)
    np.testing.assert_allclose(flagged, tickets, rtol=2e-3, atol=1e-4)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fma", "mma"])
def test_same_inputs_same_bits(kernels, variant, rng):
    """The fold adds the cluster's partials in rank order whichever block's pushes land first: two launches
    on the same inputs give the same bits (7B, a batch of 8 mixed lengths: one cluster, several, idle)."""
    import cupy as cp

    dims, lengths = QWEN25_7B, [1, 15, 16, 17, 640, 1000, 1025, 5000]
    c = make_batch(cp, dims, lengths, rng)
    first = run(cp, kernels["7b", variant], dims, c, 8)
    check(first, c, variant, lengths)
    np.testing.assert_array_equal(first, run(cp, kernels["7b", variant], dims, c, 8))


@gpu
@pytest.mark.gpu
def test_decode_rejects_bad_arguments(kernels, rng):
    import cupy as cp

    dims, ak = TINY, kernels["tiny", "fma"]
    c = make_batch(cp, dims, [20, 3], rng)
    out = cp.empty((2, dims.n_heads * 128), dtype=cp.float16)
    ws = ak.new_workspace(max_batch=2)
    args = dict(
        q=c["q"],
        k_cache=c["k"],
        v_cache=c["v"],
        page_table=c["table"],
        seq_len_dev=c["seq"],
        layer=c["layer"],
        out=out,
        workspace=ws,
    )
    bad = {
        "q": c["q"].astype(cp.float32),
        "k_cache": c["k"][:, :, :, :8],
        "v_cache": c["v"][:1],
        "page_table": c["table"][:1],
        "seq_len_dev": c["seq"][:1],
        "layer": 2,
        "out": cp.empty((3, dims.n_heads * 128), dtype=cp.float16),
        "workspace": ws[:10],
    }
    for name, value in bad.items():
        with pytest.raises(KernelError, match=name):
            ak.attention_decode(**{**args, name: value})


def test_page_layout_of_the_test_cache(rng):
    """The helper that builds the tests' pages (no GPU): token t of a sequence lands at page t // 16, slot
    t % 16 of every KV head, K and V from their own arrays, the tail slots NaN."""
    k = rng.standard_normal((37, 4, 128)).astype(np.float16)
    v = rng.standard_normal((37, 4, 128)).astype(np.float16)
    kp, vp = to_pages(k, 3), to_pages(v, 3)
    assert kp.shape == (3, 4, 16, 128)
    for t in range(37):
        np.testing.assert_array_equal(kp[t // 16, :, t % 16], k[t])
        np.testing.assert_array_equal(vp[t // 16, :, t % 16], v[t])
    assert np.isnan(kp[2, :, 5:]).all() and np.isnan(vp[2, :, 5:]).all()
