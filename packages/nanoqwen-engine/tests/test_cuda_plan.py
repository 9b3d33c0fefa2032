"""The GPU backend's pure-Python plans: what is uploaded where, how the KV pool is sized, the DOT count."""

from __future__ import annotations

import numpy as np
import pytest
from nanoqwen_engine.config import ModelConfig
from nanoqwen_engine.cuda.device import HostDevice, count_kernel_nodes
from nanoqwen_engine.cuda.plan import FUSED, build_upload_plan, chunks, kv_page_bytes, size_pool
from nanoqwen_format import open_model


def _tensors(nq):
    return {n: (nq.tensor(n).shape, nq.tensor(n).dtype) for n in nq.tensor_names}


@pytest.mark.parametrize("which", ["tiny", "tied"])
def test_plan_places_every_file_tensor_once_without_overlap(which, tiny_path, tied_path):
    nq = open_model({"tiny": tiny_path, "tied": tied_path}[which])
    cfg = ModelConfig.from_hf(nq.config)
    t = _tensors(nq)
    plan = build_upload_plan(t, cfg.n_layers, cfg.tie_word_embeddings)
    assert sorted(c.src for c in plan.copies) == sorted(t)  # each file tensor copied exactly once
    for key, (shape, dt) in plan.buffers.items():
        parts = sorted((c.offset, c.nbytes) for c in plan.copies if c.key == key)
        # the parts tile the buffer: contiguous, no gap, no overlap
        assert parts[0][0] == 0
        for (o1, n1), (o2, _) in zip(parts, parts[1:], strict=False):
            assert o1 + n1 == o2
        assert parts[-1][0] + parts[-1][1] == int(np.prod(shape)) * np.dtype(dt).itemsize
    assert ("lm_head" in plan.aliases) == cfg.tie_word_embeddings
    rows = cfg.q_dim + 2 * cfg.kv_dim
    assert plan.buffers["0.qkv.w"][0] == (rows, cfg.hidden // 8)
    assert plan.buffers["0.qkv.s"][0] == (rows, cfg.hidden // 128)
    assert plan.buffers["0.qkv.b"][0] == (rows,)
    assert plan.buffers["0.gu.w"][0] == (2 * cfg.intermediate, cfg.hidden // 8)
    assert plan.buffers["0.down.w"][0] == (cfg.hidden, cfg.intermediate // 8)
    assert plan.total_bytes == sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in plan.buffers.values())


def test_uploaded_fused_buffers_hold_the_file_rows_in_order(tied_path):
    nq = open_model(tied_path)
    cfg = ModelConfig.from_hf(nq.config)
    plan = build_upload_plan(_tensors(nq), cfg.n_layers, cfg.tie_word_embeddings)
    bufs = HostDevice().upload(plan, nq.tensor, progress=False)
    for i in range(cfg.n_layers):
        for key, projs in FUSED.items():
            for suffix, kind in (("w", "qweight"), ("s", "scales")):
                parts = [np.asarray(nq.tensor(f"model.layers.{i}.{p}.{kind}")) for p in projs]
                np.testing.assert_array_equal(bufs[f"{i}.{key}.{suffix}"], np.concatenate(parts))
    assert bufs["lm_head"] is bufs["embed"]


def test_missing_tensor_is_named():
    with pytest.raises(KeyError, match="model.embed_tokens.weight"):
        build_upload_plan({}, 1, False)


def test_chunks_cover_exactly():
    for n, c in [(0, 4), (1, 4), (8, 4), (9, 4), (1 << 20, 65536 + 3)]:
        pieces = list(chunks(n, c))
        assert sum(k for _, k in pieces) == n
        assert all(0 < k <= c for _, k in pieces)
        assert [o for o, _ in pieces] == [sum(k for _, k in pieces[:j]) for j in range(len(pieces))]


def test_pool_sizing():
    seven = dict(n_layers=28, n_kv_heads=4, head_dim=128, max_position=32768)
    assert kv_page_bytes(28, 4, 128) == 917504  # 2 x 28 layers x 4 KV heads x 16 tokens x 128 x 2 B (56 KiB per token)
    gib = 1 << 30
    p = size_pool(**seven, max_context=4096, free_bytes=100 * gib, total_bytes=140 * gib)
    assert (p.n_pages, p.max_pages_per_seq) == (512, 256)  # two sequences of 4096 tokens
    p = size_pool(**seven, max_context=None, free_bytes=130 * gib, total_bytes=140 * gib)
    assert p.max_pages_per_seq == 2048 and p.n_pages == 8 * 2048  # capped at 8 full sequences
    p = size_pool(**seven, max_context=None, free_bytes=20 * gib, total_bytes=140 * gib)
    headroom = int(0.08 * 140 * gib)
    assert p.n_pages == (20 * gib - headroom) // 917504  # what free memory allows after headroom
    assert p.kv_bytes <= 20 * gib - headroom
    p = size_pool(**seven, max_context=100, free_bytes=gib, total_bytes=gib, n_pages=10)
    assert (p.n_pages, p.max_pages_per_seq) == (10, 7)
    with pytest.raises(ValueError, match="needs"):
        size_pool(**seven, max_context=10**6, free_bytes=gib, total_bytes=gib)
    with pytest.raises(ValueError, match="no room"):
        size_pool(**seven, max_context=None, free_bytes=gib, total_bytes=gib)


def test_count_kernel_nodes_reads_a_dot_dump():
    # the shape of cudaGraphDebugDotPrint's output (a real dump from the H200, shortened; a memset added)
    dot = "\n".join([
        "digraph dot {",
        "subgraph cluster_7 {",
        'label="graph_7" graph[style="dashed"];',
        '"graph_7_node_0"[style="bold" shape="octagon" label="0', "nq_embed", '"];', "",
        '"graph_7_node_1"[style="bold" shape="octagon" label="1', "nq_qkv_rope_kv", '"];', "",
        '"graph_7_node_2"[style="solid" shape="rectangle" label="2', "MEMSET", '"];',
        '"graph_7_node_0" -> "graph_7_node_1" [style="solid"];',
        "}", "}",
    ])
    assert count_kernel_nodes(dot) == 2


def test_prefill_weights_choice():
    from nanoqwen_engine.cuda.plan import HEADROOM_MIN, choose_prefill_weights

    gib = 2**30
    seven = 13 * gib  # the 7B's INT4 matrices as f16
    assert choose_prefill_weights("auto", seven, 130 * gib) == "fp16"  # an H200 after the upload
    assert choose_prefill_weights("auto", seven, 40 * gib) == "int4"  # more than a quarter of what is free
    assert choose_prefill_weights("int4", seven, 130 * gib) == "int4"
    assert choose_prefill_weights("fp16", seven, seven + HEADROOM_MIN) == "fp16"
    with pytest.raises(ValueError, match="resident fp16 prefill weights need"):
        choose_prefill_weights("fp16", seven, seven + HEADROOM_MIN - 1)
    assert choose_prefill_weights("fp8", seven, seven // 2 + HEADROOM_MIN) == "fp8"  # half the fp16 copy
    with pytest.raises(ValueError, match="fp8"):
        choose_prefill_weights("fp8", seven, seven // 2 + HEADROOM_MIN - 1)
    with pytest.raises(ValueError, match="must be one of"):
        choose_prefill_weights("bf16", seven, 130 * gib)
