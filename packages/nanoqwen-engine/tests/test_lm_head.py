"""lm_head_dtype: the lm_head stored as int8 with one fp16 scale per 128 values (the default) or as the
file's fp16 matrix, on both backends (nanoqwen_engine.lm_head).

What the int8 head must be: the CPU reference multiplies s * q in float32 (head_i8_logits's values); the
CUDA backend (on the host stand-ins, and on the GPU when there is one) multiplies s * q with fp32 sums for
a batch of one row (gemv_head_i8) and the fp16 copy fp16(s * q) for larger batches and score()
(gemv_fp16 and the host matmul); a tied model's embedding keeps the file's values for token lookups.
The logits are checked against the head applied to the normed hidden rows the backend itself left in
its buffers, so a path that multiplied the file's fp16 values instead (~3e-3 of the largest logit away
on these models) fails by ~30x the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_testutil import GREEDY, make_backend, open_file
from nanoqwen_engine import Engine
from nanoqwen_engine.errors import InvalidRequestError
from nanoqwen_engine.reference import ReferenceBackend
from nanoqwen_engine.reference.weights import ReferenceWeights
from nanoqwen_engine.sampler import SamplerState
from nanoqwen_kernels.errors import KernelError
from nanoqwen_kernels.head_i8 import dequantize_head_i8, head_i8_logits, quantize_head_i8

TOL = 1e-4  # of the largest |logit|: fp32 sums in another order (the int8-vs-fp16 gap is ~3e-3)


def file_head(nq, cfg) -> np.ndarray:
    """The file's fp16 lm_head [V, H] (the embedding when tied)."""
    return np.asarray(nq.tensor("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"))


def close(got: np.ndarray, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got, want, rtol=0, atol=TOL * float(np.abs(want).max()), err_msg=what)


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Recorder:
    """Wraps the lm_head launchers of a backend's kernels (eager mode: every launch goes through Python),
    recording per call (launcher, which weight buffer it got, rows of x)."""

    def __init__(self, be, monkeypatch):
        self.be = be
        self.calls: list[tuple[str, str, int]] = []
        for name in ("gemv_head_i8", "gemv_fp16"):
            monkeypatch.setattr(be.ks, name, self._wrap(name, getattr(be.ks, name)))

    def _which(self, w) -> str:
        i8, head = self.be.w.lm_head_i8, self.be.w.lm_head
        return "q" if i8 is not None and w is i8.q else "lm_head" if w is head else "other"

    def _wrap(self, name, fn):
        def launcher(*args, **kwargs):
            x = args[2] if name == "gemv_head_i8" else args[1]
            self.calls.append((name, self._which(args[0]), 1 if x.ndim == 1 else int(x.shape[0])))
            return fn(*args, **kwargs)

        return launcher

    def take(self) -> list[tuple[str, str, int]]:
        out, self.calls = self.calls, []
        return out


# ---------------------------------------------------------------- the option


def test_lm_head_dtype_is_checked_with_one_clear_error(tied_path, tmp_path, monkeypatch):
    """An unknown value, from the argument or from $NANOQWEN_LM_HEAD_DTYPE, is one InvalidRequestError
    naming where it came from and the choices, before Engine.load opens the model (a missing file would
    be ModelNotFoundError); each backend refuses it too."""
    nq, cfg = open_file(tied_path)
    with pytest.raises(InvalidRequestError, match=r"lm_head_dtype must be one of \('int8', 'fp16'\), got 'bf16'"):
        Engine.load(tmp_path / "missing.nanoqwen", device="cpu", lm_head_dtype="bf16")
    with pytest.raises(InvalidRequestError, match=r"lm_head_dtype must be one of"):
        ReferenceBackend.create(nq, cfg, max_context=64, lm_head_dtype="int4")
    with pytest.raises(InvalidRequestError, match=r"lm_head_dtype must be one of"):
        make_backend(tied_path, "host", max_context=64, lm_head_dtype="int4")
    monkeypatch.setenv("NANOQWEN_LM_HEAD_DTYPE", "q6_k")
    with pytest.raises(InvalidRequestError, match=r"\$NANOQWEN_LM_HEAD_DTYPE must be one of .*got 'q6_k'"):
        Engine.load(tmp_path / "missing.nanoqwen", device="cuda", lm_head_dtype=None)
    with pytest.raises(InvalidRequestError, match="NANOQWEN_LM_HEAD_DTYPE"):
        ReferenceBackend.create(nq, cfg, max_context=64)


def test_default_env_and_argument_reach_both_backends(tied_path, monkeypatch):
    """int8 by default; $NANOQWEN_LM_HEAD_DTYPE when no argument is given; the argument over both. Engine.load
    passes the choice to the backend (its info says which runs)."""
    nq, cfg = open_file(tied_path)
    monkeypatch.delenv("NANOQWEN_LM_HEAD_DTYPE", raising=False)
    assert ReferenceBackend.create(nq, cfg, max_context=64).info["lm_head_dtype"] == "int8"
    assert make_backend(tied_path, "host", max_context=64).info["lm_head_dtype"] == "int8"
    monkeypatch.setenv("NANOQWEN_LM_HEAD_DTYPE", "fp16")
    assert ReferenceBackend.create(nq, cfg, max_context=64).info["lm_head_dtype"] == "fp16"
    host = make_backend(tied_path, "host", max_context=64)
    assert host.info["lm_head_dtype"] == "fp16" and host.w.lm_head_i8 is None
    assert ReferenceBackend.create(nq, cfg, max_context=64, lm_head_dtype="int8").info["lm_head_dtype"] == "int8"
    engine = Engine.load(tied_path, device="cpu", max_context=64, progress=False, lm_head_dtype="int8")
    assert engine.info["lm_head_dtype"] == "int8"
    assert engine.backend.weights.head_i8 is not None


# ---------------------------------------------------------------- the CPU reference


@pytest.mark.parametrize("resident", [True, False])
def test_reference_int8_logits_are_head_i8_logits(model_path, open_file, rng, resident):
    """The reference's int8 head is quantize_head_i8 of the file's head, kept from load; its logits are
    head_i8_logits of it, from the resident float32 copy or (a budget too small for one) chunk by chunk,
    for one row and for several; the fp16 head's logits differ from them by the rounding (~3e-3 of the
    largest)."""
    nq, cfg = open_file(model_path)
    budget = 8 << 30 if resident else 1 << 20
    w8 = ReferenceWeights(nq, cfg, budget=budget, lm_head_dtype="int8")
    w16 = ReferenceWeights(nq, cfg, budget=budget, lm_head_dtype="fp16")
    assert (w8._head_f32 is not None) == resident
    q, s = quantize_head_i8(file_head(nq, cfg))
    assert np.array_equal(w8.head_i8[0], q) and np.array_equal(w8.head_i8[1], s)
    assert w16.head_i8 is None and w8.head_i8_bytes == q.nbytes + s.nbytes
    h = rng.standard_normal((3, cfg.hidden)).astype(np.float32)
    for rows in (h[:1], h):
        want = head_i8_logits(q, s, rows)
        close(w8.logits(rows), want, f"{len(rows)} row(s)")
        gap = float(np.abs(w16.logits(rows) - want).max()) / float(np.abs(want).max())
        assert 1e-3 < gap < 2e-2, gap


# ---------------------------------------------------------------- the CUDA backend


def test_int8_head_calls_the_i8_gemv_for_one_row_and_the_dequantized_copy_for_more(model_path, kind, rng,
                                                                                     monkeypatch):
    """Eager mode, every lm_head launch recorded: a prefill that samples one row, and a decode step of one
    sequence, go through gemv_head_i8 (q, s of the int8 head); a decode step of two and a prefill_many
    that samples two go through gemv_fp16 on the fp16 matrix, which holds fp16(s * q). q and s are
    quantize_head_i8's bits, the matrix dequantize_head_i8's; the embedding keeps the file's values."""
    be = make_backend(model_path, kind, "eager", max_context=64, max_batch=4)
    nq, cfg = be._nq, be.config
    d2h = be.dev.d2h
    head16 = file_head(nq, cfg)
    q, s = quantize_head_i8(head16)
    i8 = be.w.lm_head_i8
    assert np.array_equal(d2h(i8.q), q) and np.array_equal(d2h(i8.s), s)
    assert np.array_equal(d2h(be.w.lm_head), dequantize_head_i8(q, s, np.float16))
    assert np.array_equal(d2h(be.w.embed), np.asarray(nq.tensor("model.embed_tokens.weight")))
    assert be.info["launcher_calls_per_token"] == 1 + 5 * cfg.n_layers + 4  # the head is still one launch

    rec = Recorder(be, monkeypatch)
    V = cfg.vocab
    seqs = [be.pool.new_sequence() for _ in range(4)]
    sts = [SamplerState(GREEDY, V) for _ in seqs]
    toks = [be.prefill(seqs[0], rng.integers(0, V, size=9), sts[0])]
    assert rec.take() == [("gemv_head_i8", "q", 1)]
    toks[0] = be.decode(seqs[:1], toks, sts[:1])[0]
    assert rec.take() == [("gemv_head_i8", "q", 1)]
    toks.append(be.prefill(seqs[1], rng.integers(0, V, size=5), sts[1]))
    rec.take()
    be.decode(seqs[:2], toks, sts[:2])
    assert rec.take() == [("gemv_fp16", "lm_head", 2)]
    be.prefill_many([(seqs[k], rng.integers(0, V, size=6), sts[k]) for k in (2, 3)])
    assert rec.take() == [("gemv_fp16", "lm_head", 2)]
    with pytest.raises(KernelError, match="takes one row"), be.dev.use():  # the GEMV's contract: batch 1 only
        be.ks.gemv_head_i8(i8.q, i8.s, be.step.xn[:2], be.step.logits[:2])


def test_int8_head_logits_are_its_values_on_every_path(model_path, kind, rng):
    """Graph mode (each bucket eager, captured, replayed): every step's logits are the int8 head applied
    to the normed rows the step left in its xn buffer: head_i8_logits for a batch of one, the fp16 copy
    for a batch of two; score()'s are close to the reference's int8 logits, and closer to them than to the
    fp16 reference's."""
    be = make_backend(model_path, kind, max_context=64, max_batch=2)
    nq, cfg = be._nq, be.config
    d2h = be.dev.d2h
    q, s = quantize_head_i8(file_head(nq, cfg))
    w16 = dequantize_head_i8(q, s, np.float16).astype(np.float32)
    V = cfg.vocab
    a, b = be.pool.new_sequence(), be.pool.new_sequence()
    sa, sb = SamplerState(GREEDY, V), SamplerState(GREEDY, V)
    ta = be.prefill(a, rng.integers(0, V, size=11), sa)
    close(be.last_logits()[0], head_i8_logits(q, s, d2h(be.pf_xn[0]).astype(np.float32)), "prefill")
    for step in range(4):  # eager, capture, replays
        ta = be.decode([a], [ta], [sa])[0]
        xn = d2h(be.step.xn[:1]).astype(np.float32)
        close(d2h(be.step.logits[:1]), head_i8_logits(q, s, xn), f"B=1 step {step}")
    tb = be.prefill(b, rng.integers(0, V, size=7), sb)
    for step in range(4):
        ta, tb = be.decode([a, b], [ta, tb], [sa, sb])
        xn = d2h(be.step.xn[:2]).astype(np.float32)
        close(d2h(be.step.logits[:2]), xn @ w16.T, f"B=2 step {step}")
    assert {k[0] for k in be.step.graphs} == {1, 2}

    ids = rng.integers(0, V, size=23)
    got = be.score(ids)
    r8 = ReferenceBackend.create(nq, cfg, max_context=64, lm_head_dtype="int8").score(ids)
    r16 = ReferenceBackend.create(nq, cfg, max_context=64, lm_head_dtype="fp16").score(ids)
    assert rel(got, r8) < 1e-2  # fp16 activations and KV against float32: ~1e-3
    assert rel(got, r8) < rel(got, r16), (rel(got, r8), rel(got, r16))


def test_tied_int8_head_keeps_the_embedding(tied_path, kind, rng):
    """Tied: the head's fp16 copy is a buffer of its own (the embed buffer keeps the file's values, and the
    memory account says 2 V H bytes more than untied); a prompt's embedding rows are the file's rows."""
    be = make_backend(tied_path, kind, "eager", max_context=64)
    nq, cfg = be._nq, be.config
    d2h = be.dev.d2h
    embed = np.asarray(nq.tensor("model.embed_tokens.weight"))
    assert be.w.lm_head is not be.w.embed
    assert np.array_equal(d2h(be.w.embed), embed)
    assert not np.array_equal(d2h(be.w.lm_head), embed)  # the head multiplies the rounded values
    V, H = cfg.vocab, cfg.hidden
    assert be.info["lm_head_i8_bytes"] == V * H + 2 * V * (H // 128) + 2 * V * H
    ids = rng.integers(0, V, size=3)
    x = be.dev.xp.empty((1, H), dtype=np.float16)
    with be.dev.use():
        be.ks.embed(be.w.embed, be.dev.xp.asarray(ids[:1].astype(np.int32)), x)
    assert np.array_equal(d2h(x)[0], embed[ids[0]])


def test_untied_int8_head_is_dequantized_in_place(tiny_path, kind):
    """Untied: no fp16 buffer beside the file's head (it is overwritten with fp16(s * q)): q and s only."""
    be = make_backend(tiny_path, kind, max_context=64)
    V, H = be.config.vocab, be.config.hidden
    assert be.info["lm_head_i8_bytes"] == V * H + 2 * V * (H // 128)
    assert be.w.lm_head is not be.w.embed


def test_fp16_head_is_the_old_behaviour(model_path, kind, rng, monkeypatch):
    """lm_head_dtype="fp16": no int8 head, the lm_head buffer is the file's matrix (the embed buffer
    itself when tied), no extra memory, every batch through gemv_fp16, and the logits are the file's
    head applied to the normed rows; they differ from the int8 backend's."""
    be = make_backend(model_path, kind, "eager", max_context=64, lm_head_dtype="fp16")
    nq, cfg = be._nq, be.config
    d2h = be.dev.d2h
    head16 = file_head(nq, cfg)
    assert be.w.lm_head_i8 is None and be.info["lm_head_i8_bytes"] == 0 and be.info["lm_head_dtype"] == "fp16"
    assert np.array_equal(d2h(be.w.lm_head), head16)
    assert (be.w.lm_head is be.w.embed) == cfg.tie_word_embeddings
    rec = Recorder(be, monkeypatch)
    ids = rng.integers(0, cfg.vocab, size=13)
    seq, st = be.pool.new_sequence(), SamplerState(GREEDY, cfg.vocab)
    tok = be.prefill(seq, ids, st)
    got = be.last_logits()[0]
    close(got, head16.astype(np.float32) @ d2h(be.pf_xn[0]).astype(np.float32), "fp16 prefill")
    be.decode([seq], [tok], [st])
    assert rec.take() == [("gemv_fp16", "lm_head", 1)] * 2
    i8 = make_backend(model_path, kind, "eager", max_context=64)
    i8.prefill(i8.pool.new_sequence(), ids, SamplerState(GREEDY, cfg.vocab))
    gap = float(np.abs(i8.last_logits()[0] - got).max()) / float(np.abs(got).max())
    assert gap > 1e-3, gap
