"""Launcher argument checks on the CPU: every bad argument is one KernelError naming it, and a good call
reaches the launch with the expected grid and argument list. Device arrays are stood in for by numpy
arrays that expose a device-style pointer (the checks are duck-typed on exactly that)."""


import numpy as np
import pytest
from fakes import Loaded, assert_each_refused, dev, load
from nanoqwen_kernels import KernelError
from nanoqwen_kernels.dims import QWEN25_7B, TINY
from nanoqwen_kernels.embed import EmbedKernels
from nanoqwen_kernels.norm import NormKernels
from nanoqwen_kernels.prefill import ATTENTION_VARIANTS, PrefillKernels
from nanoqwen_kernels.sampling import SamplingKernels, pack_params, pack_rng


def test_norm_embed_checks(launches):
    d = TINY
    n = NormKernels(d, load)
    x = dev((3, d.hidden), np.float16)
    n.rmsnorm_rows(x, dev((d.hidden,), np.float16), x, 1e-6)  # in place is fine
    assert launches[-1][1] == 3
    n.rmsnorm(x, dev((d.hidden,), np.float16), dev((3, d.hidden), np.float16), 1e-6)  # B rows
    assert launches[-1][1] == 3
    with pytest.raises(KernelError, match="x must be"):
        n.rmsnorm_rows(
            dev((d.hidden,), np.float16), dev((d.hidden,), np.float16), dev((d.hidden,), np.float16), 1e-6
        )
    with pytest.raises(KernelError, match="w must have shape"):
        n.rmsnorm(dev((d.hidden,), np.float16), dev((7,), np.float16), dev((d.hidden,), np.float16), 1e-6)
    e = EmbedKernels(d, load)
    e.embed(dev((d.vocab, d.hidden), np.float16), dev((4,), np.int32), dev((4, d.hidden), np.float16))
    assert launches[-1][1] == (1, 4)
    with pytest.raises(KernelError, match="table must have shape"):
        e.embed(dev((d.vocab - 1, d.hidden), np.float16), dev((1,), np.int32), dev((d.hidden,), np.float16))
    with pytest.raises(KernelError, match="token_dev must be int32"):
        e.embed(dev((d.vocab, d.hidden), np.float16), dev((1,), np.int64), dev((d.hidden,), np.float16))
    with pytest.raises(KernelError, match=r"token_dev must have shape \(4,\)"):
        e.embed(dev((d.vocab, d.hidden), np.float16), dev((1,), np.int32), dev((4, d.hidden), np.float16))


def test_sampling_checks(launches):
    s = SamplingKernels(TINY, load)
    logits, tok = dev((1000,), np.float32), dev((1,), np.int32)
    s.argmax(logits, tok)
    fn, grid, _ = launches[-1]
    assert fn == "nq_argmax" and grid == (128, 1, 1)  # batch 1: 128 blocks on the one row
    s.argmax(dev((64, 1000), np.float32), dev((64,), np.int32))
    assert launches[-1][1] == (8, 64, 1)  # 64 rows: 8 blocks each, 512 in all (the workspace's slots)
    with pytest.raises(KernelError, match="token_out must have shape"):
        s.argmax(dev((3, 1000), np.float32), tok)
    with pytest.raises(KernelError, match="at most 512"):
        s.argmax(dev((513, 8), np.float32), dev((513,), np.int32))
    params, rng = dev((1, 5), np.float32), dev((1, 2), np.uint64)
    s.sample(logits, params, rng, dev((1, 1000), np.uint8), tok)
    assert launches[-1][0] == "nq_sample" and launches[-1][1] == 1
    s.sample(dev((3, 1000), np.float32), dev((3, 5), np.float32), dev((3, 2), np.uint64),
             dev((3, 1000), np.uint8), dev((3,), np.int32))
    assert launches[-1][1] == 3  # one block per row
    with pytest.raises(KernelError, match="history must have shape"):
        s.sample(logits, params, rng, dev((1, 999), np.uint8), tok)
    with pytest.raises(KernelError, match="params must have shape"):
        s.sample(dev((2, 1000), np.float32), params, rng, dev((2, 1000), np.uint8), dev((2,), np.int32))
    with pytest.raises(KernelError, match="logits must be float32"):
        s.argmax(dev((1000,), np.float16), tok)
    with pytest.raises(KernelError, match="rng_state"):
        s.sample(logits, params, dev((1, 2), np.int64), dev((1, 1000), np.uint8), tok)
    for kw, word in [
        (dict(top_p=0.0), "top_p"),
        (dict(temperature=-1.0), "temperature"),
        (dict(top_k=-3), "top_k"),
        (dict(min_p=2.0), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(temperature=float("nan")), "temperature"),
    ]:
        p = dict(temperature=0.7, top_k=0, top_p=0.9, min_p=0.0, repetition_penalty=1.0)
        p.update(kw)
        with pytest.raises(KernelError, match=word):
            pack_params(**p)
    np.testing.assert_array_equal(
        pack_params(temperature=0.5, top_k=10**9, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
        np.array([0.5, 2**24, 0.9, 0.05, 1.1], np.float32))
    with pytest.raises(KernelError, match="seed"):
        pack_rng(-1)
    assert pack_rng(2**70 + 5, 9).tolist() == [5, 9]  # seeds wrap mod 2^64
    s.advance(dev((1,), np.int32), dev((1,), np.int32))
    assert launches[-1][0] == "nq_advance"
    s.advance(dev((300,), np.int32), dev((300,), np.int32))
    assert launches[-1][1] == 3 and int(launches[-1][2][2]) == 300  # ceil(300 / 128) blocks, rows = 300
    with pytest.raises(KernelError, match="seq_len_dev"):
        s.advance(dev((1,), np.int32), dev((2,), np.int32))


def test_attention_decode_launch_and_checks(launches, monkeypatch):
    from nanoqwen_kernels import checks
    from nanoqwen_kernels.attention import (
        LL_ROW,
        TICKET_WORDS,
        AttentionKernels,
        decode_clusters,
        decode_splits,
    )

    d = QWEN25_7B
    W, P, B = d.n_heads * 128, 9, 3
    q, out = dev((B, W), np.float16), dev((B, W), np.float16)
    k, v = dev((2, 40, d.n_kv_heads, 16, 128), np.float16), dev((2, 40, d.n_kv_heads, 16, 128), np.float16)
    table, lens = dev((B, P), np.int32), dev((B,), np.int32)
    assert decode_splits(d, B, 132) == 11  # ceil(132 / (4 KV heads x 3 sequences))
    ak = AttentionKernels(d, load, sms=132)
    ws = dev((ak.workspace_floats(B),), np.float32)
    ak.attention_decode(q, k, v, table, lens, 1, out, ws)
    # 11 splits as 2 clusters of 8 per (sequence, KV head), one launch
    fn, grid, args = launches[-1]
    assert len(launches) == 1 and decode_clusters(d, B, 132) == (8, 2)
    assert (fn, grid, launches.clusters[-1]) == ("nq_attention_decode", (4, 16, B), (1, 8, 1))
    assert args[-1] is out and args[-2] is ws and (int(args[-5]), int(args[-4])) == (8, 2)
    # 24 clusters fit the device at once (33 on the fake): the flagged fold
    assert int(args[-3]) == 1 and ak.flagged_fold(B)
    # the batch of one: 1-D q, out and table; 33 splits -> 5 clusters of 8
    ak.attention_decode(dev((W,), np.float16), k, v, dev((P,), np.int32), dev((1,), np.int32), 1,
                        dev((W,), np.float16), ws)
    assert launches[-1][1] == (4, 40, 1) and launches.clusters[-1] == (1, 8, 1)
    assert ak.workspace_floats(1) == TICKET_WORDS + 5 * d.n_heads * 2 * LL_ROW
    # one cluster a sequence (B = 8): no several-cluster fold to flag; 2 x 3 x 4 = 24 clusters of 8 fit, and
    # a batch whose clusters do not all fit folds through tickets
    assert not ak.flagged_fold(8) and ak.flagged_fold(2)
    ak._flagged.clear()
    monkeypatch.setattr(checks, "max_active_clusters", lambda *a: 23)
    assert not ak.flagged_fold(2) and ak.flagged_fold(1)  # 4 x 5 = 20 clusters at batch 1
    # 8 sequences: 5 splits, one cluster of 5; from 33 sequences one split each: clusters of 1
    assert decode_clusters(d, 8, 132) == (5, 1) and decode_clusters(d, 33, 132) == (1, 1)
    q64, out64 = dev((64, W), np.float16), dev((64, W), np.float16)
    ws64 = dev((ak.workspace_floats(64),), np.float32)
    ak.attention_decode(q64, k, v, dev((64, P), np.int32), dev((64,), np.int32), 1, out64, ws64)
    assert launches[-1][1] == (4, 1, 64) and launches.clusters[-1] == (1, 1, 1)
    # the long-context build: clusters of 16 (3 of them at batch 1, 192 blocks), its function told that a
    # non-portable cluster size is fine and to spread clusters; one workspace serves both builds
    from nanoqwen_kernels.attention import LONG_CLUSTER_MAX, decode_workspace_floats

    ak16 = AttentionKernels(d, load, sms=132, cluster_max=LONG_CLUSTER_MAX)
    assert launches.attributes == [("nq_attention_decode", 14, 1), ("nq_attention_decode", 15, 1)]
    assert ak16.clusters(1) == (16, 3) and ak16.clusters(2) == (16, 2) and ak16.clusters(8) == (5, 1)
    ak16.attention_decode(dev((W,), np.float16), k, v, dev((P,), np.int32), dev((1,), np.int32), 1,
                          dev((W,), np.float16), ws)
    assert launches[-1][1] == (4, 48, 1) and launches.clusters[-1] == (1, 16, 1)
    assert ak16.workspace_floats(64) == ak.workspace_floats(64) >= max(
        decode_workspace_floats(d, b, 132, cm) for b in range(1, 65) for cm in (8, 16))
    with pytest.raises(KernelError, match="clusters of up to 12"):
        AttentionKernels(d, load, sms=132, cluster_max=12)
    # the short-context launch: the default build on one cluster per (sequence, KV head) (batch 1: 32 blocks
    # instead of 160; 3 sequences: 4 x 8 x 3 instead of 4 x 16 x 3), never the several-cluster fold
    from nanoqwen_kernels.attention import SHORT_CONTEXT_TOKENS

    assert SHORT_CONTEXT_TOKENS == 1024
    n_attr = len(launches.attributes)
    short = AttentionKernels(d, load, sms=132, max_clusters=1, pair=True)
    # its build pairs pages (NQ_DECODE_PAIR); the default and long builds do not
    from nanoqwen_kernels.attention import decode_defines

    assert decode_defines(d, pair=True)["NQ_DECODE_PAIR"] == 1 and "NQ_DECODE_PAIR" not in decode_defines(d)
    assert len(launches.attributes) == n_attr  # a portable cluster size: no non-portable size asked
    assert short.clusters(1) == (8, 1) and short.clusters(B) == (8, 1) and short.clusters(8) == (5, 1)
    short.attention_decode(dev((W,), np.float16), k, v, dev((P,), np.int32), dev((1,), np.int32), 1,
                           dev((W,), np.float16), ws)
    assert launches[-1][1] == (4, 8, 1) and launches.clusters[-1] == (1, 8, 1)
    assert (int(launches[-1][2][-5]), int(launches[-1][2][-4]), int(launches[-1][2][-3])) == (8, 1, 0)
    short.attention_decode(q, k, v, table, lens, 1, out, ws)
    assert launches[-1][1] == (4, 8, B) and not short.flagged_fold(B)
    with pytest.raises(KernelError, match="max_clusters=0"):
        AttentionKernels(d, load, sms=132, max_clusters=0)
    bad = dict(
        page_table=(dev((2, P), np.int32), "page_table"),
        seq_len_dev=(dev((2,), np.int32), "seq_len_dev"),
        workspace=(dev((ak.workspace_floats(1) // 2,), np.float32), "workspace"),
        out=(dev((B, W - 1), np.float16), "out"),
        layer=(2, "layer"),
    )
    args = dict(q=q, k_cache=k, v_cache=v, page_table=table, seq_len_dev=lens, layer=1, out=out, workspace=ws)
    for name, (value, word) in bad.items():
        with pytest.raises(KernelError, match=word):
            ak.attention_decode(**{**args, name: value})


def _paged(d, max_pages=4):
    """k/v caches of 2 layers x 4 pages and a page table of max_pages entries: room for 64 positions."""
    shape = (2, 4, d.n_kv_heads, 16, 128)
    return dict(k_cache=dev(shape, np.float16), v_cache=dev(shape, np.float16),
                page_table=dev((max_pages,), np.int32))


def test_prefill_int4_checks(launches):
    p = PrefillKernels(TINY, load)
    qw, sc = dev((8, 256 // 8), np.uint32), dev((8, 2), np.float16)
    p.dequantize_int4(qw, sc, dev((8, 256), np.float16))
    fn, grid, args = launches[-1]
    assert fn == "nq_dequantize_int4" and grid == (1, 1, 1) and [int(a) for a in args[-2:]] == [8, 256]
    good = dict(qweight=qw, scales=sc, X=dev((4, 256), np.float16), out=dev((4, 8), np.float16))
    bad = [
        (dict(qweight=dev((8, 3), np.uint32)), "qweight K = 24 is not a multiple"),
        (dict(qweight=dev((8, 32), np.int32)), "qweight must be uint32"),
        (dict(scales=dev((8, 1), np.float16)), "scales must have shape"),
        (dict(X=dev((4, 128), np.float16)), r"X must be fp16 \[T, 256\]"),
        (dict(out=dev((4, 8), np.float32)), "out must be float16"),
        (dict(workspace=dev((8 * 256 - 1,), np.float16)), "workspace needs at least 2048"),
    ]
    assert_each_refused(p.gemm_int4, good, bad)
    with pytest.raises(KernelError, match=r"out must have shape \(8, 256\)"):
        p.dequantize_int4(qw, sc, dev((8, 255), np.float16))


def test_rope_kv_prefill_checks(launches):
    d = TINY
    p = PrefillKernels(d, load)
    good = dict(qkv=dev((3, d.qkv_rows), np.float16), start_pos=61, layer=1, q_out=dev((3, d.q_dim), np.float16),
                **_paged(d))
    p.rope_kv_prefill(**good)  # positions 61..63: the last slots of 4 pages
    fn, grid, args = launches[-1]
    # the default body: 16 items of 4 pairs per head and token, 256 per block, T passed last
    items = 3 * (d.n_heads + 2 * d.n_kv_heads) * 16
    assert fn == "nq_rope_kv_prefill_vec" and grid == (-(-items // 256), 1, 1) and int(args[10]) == 3
    assert int(args[1]) == 0  # no bias: a null pointer
    assert [int(args[i]) for i in (2, 3, 7, 8)] == [61, 0, 1, 4]  # start_pos, no ctl, layer, n_pages
    bias = dev((d.qkv_rows,), np.float16)
    p.rope_kv_prefill(**good, bias=bias)
    assert launches[-1][2][1] is bias and launches[-1][0] == "nq_rope_kv_prefill_vec"
    # a bias view off an 8-byte boundary: the scalar body, one (token, head) per block, 10 arguments
    odd = dev((d.qkv_rows + 1,), np.float16)[1:]
    p.rope_kv_prefill(**good, bias=odd)
    assert launches[-1][0] == "nq_rope_kv_prefill" and launches[-1][1] == (3, d.n_heads + 2 * d.n_kv_heads, 1)
    assert len(launches[-1][2]) == 10
    p.rope_body = "scalar"  # what $NANOQWEN_ROPE_PREFILL=scalar selects
    p.rope_kv_prefill(**good)
    assert launches[-1][0] == "nq_rope_kv_prefill"
    p.rope_body = "vec"
    # a captured graph's form: start_pos and the valid rows on the device, start_pos None
    ctl = dev((2,), np.int32)
    p.rope_kv_prefill(**{**good, "start_pos": None}, ctl=ctl)
    assert launches[-1][2][3] is ctl and int(launches[-1][2][2]) == 0
    with pytest.raises(KernelError, match="start_pos must be None when ctl"):
        p.rope_kv_prefill(**good, ctl=ctl)
    with pytest.raises(KernelError, match=r"ctl must have shape \(2,\)"):
        p.rope_kv_prefill(**{**good, "start_pos": None}, ctl=dev((3,), np.int32))
    bad = [
        (dict(bias=dev((d.qkv_rows - 1,), np.float16)), "bias must have shape"),
        (dict(bias=dev((d.qkv_rows,), np.float32)), "bias must be float16"),
        (dict(qkv=dev((3, d.qkv_rows - 128), np.float16)), "qkv must be fp16"),
        (dict(q_out=dev((2, d.q_dim), np.float16)), "q_out must have shape"),
        (dict(start_pos=62), r"start_pos \+ T = 65 exceeds the page table's 64 positions"),
        (dict(start_pos=-1), "start_pos"),
        (dict(layer=-1), "layer"),
        (dict(layer=2), "layer"),
        (dict(page_table=dev((4,), np.float32)), "page_table must be int32"),
        (dict(page_table=dev((2, 4), np.int32)), "page_table must be a non-empty 1-D"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads + 1, 16, 128), np.float16)), "k_cache must be"),
        (dict(v_cache=dev((2, 5, d.n_kv_heads, 16, 128), np.float16)), "v_cache shape"),
    ]
    assert_each_refused(p.rope_kv_prefill, good, bad)


@pytest.mark.parametrize("variant", sorted(ATTENTION_VARIANTS))
def test_attention_prefill_checks(launches, variant):
    d = TINY
    p = PrefillKernels(d, load, variant)
    kernel, rows, threads, smem = ATTENTION_VARIANTS[variant]
    good = dict(q=dev((33, d.q_dim), np.float16), start_pos=0, T=33, layer=0, out=dev((33, d.q_dim), np.float16),
                **_paged(d))
    p.attention_prefill(**good)
    fn, grid, args = launches[-1]
    assert fn == kernel and grid == (-(-33 // rows), d.n_heads, 1)
    assert int(args[6]) == 0  # no ctl
    ctl = dev((2,), np.int32)
    p.attention_prefill(**{**good, "start_pos": None}, ctl=ctl)  # the grid still covers q's 33 rows
    assert launches[-1][2][6] is ctl and launches[-1][1] == grid
    with pytest.raises(KernelError, match=r"ctl must be int32"):
        p.attention_prefill(**{**good, "start_pos": None}, ctl=dev((2,), np.int64))
    bad = [
        (dict(q=dev((33, d.q_dim), np.float32)), "q must be float16"),
        (dict(out=dev((34, d.q_dim), np.float16)), "out must have shape"),
        (dict(T=34), "q has 33 rows but T = 34"),
        (dict(T=0), "T = 0 out of range"),
        (dict(start_pos=32), r"start_pos \+ T = 65 exceeds"),
        (dict(k_cache=dev((2, 4, d.n_kv_heads + 1, 16, 128), np.float16)), "k_cache"),
        (dict(layer=True), "layer must be an int"),
    ]
    assert_each_refused(p.attention_prefill, good, bad)


def test_silu_mul_checks(launches):
    d = TINY
    p = PrefillKernels(d, load)
    good = dict(gu=dev((5, 2 * d.intermediate), np.float16), out=dev((5, d.intermediate), np.float16))
    p.silu_mul(**good)
    fn, grid, args = launches[-1]
    assert fn == "nq_silu_mul_rows" and grid == (-(-d.intermediate // 2048), 5, 1) and args == (good["gu"], good["out"])
    bad = [
        (dict(gu=dev((5, 2 * d.intermediate), np.float32)), "gu must be float16"),
        (dict(gu=dev((5, d.intermediate), np.float16)), r"gu must be fp16 \[T, 1024\]"),
        (dict(out=dev((4, d.intermediate), np.float16)), "out must have shape"),
        (dict(out=good["gu"].reshape(-1)[: 5 * d.intermediate].reshape(5, d.intermediate)), "gu and out overlap"),
    ]
    assert_each_refused(p.silu_mul, good, bad)


def test_kernelset_exposes_the_interface(monkeypatch, launches):
    """KernelSet builds every launcher and exposes each name of docs/INTERFACES.md section 4 (plus the
    sampler-state helpers the GPU backend uses)."""
    from nanoqwen_kernels import KernelSet, kernelset

    built = []
    monkeypatch.setattr(
        kernelset, "load_module", lambda sources, defines, arch: built.append(sources) or Loaded()
    )
    ks = KernelSet(TINY, arch="sm_90a")
    names = [
        "rmsnorm",
        "rmsnorm_rows",
        "gemv_int4",
        "qkv_rope_kv",
        "gate_up_silu",
        "attention_decode",
        "gemv_fp16",
        "embed",
        "argmax",
        "sample",
        "advance",
        "gemm_int4",
        "gemm_f16",
        "silu_mul",
        "rope_kv_prefill",
        "attention_prefill",
        "dequantize_int4",
        "make_sampler_state",
        "set_sampler_params",
        "attention_workspace",
    ]
    for name in names:
        assert callable(getattr(ks, name)), name
    srcs = {s for group in built for s in group}
    assert {"gemv_int4.cu", "gemv_fp16.cu", "rmsnorm.cu", "embed.cu", "sampling.cu"} <= srcs
    with pytest.raises(KernelError, match="ModelDims"):
        KernelSet({"hidden_size": 256}, arch="sm_90a")
