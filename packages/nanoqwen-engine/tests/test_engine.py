"""Engine on the CPU reference backend: completion, streaming, every finish reason, errors, cleanup."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from engine_testutil import pool_idle
from nanoqwen_engine import (
    Engine,
    InvalidRequestError,
    KVPagesExhaustedError,
    ModelFormatError,
    ModelNotFoundError,
    NoGPUError,
    PromptTooLongError,
    SamplingParams,
)

GREEDY = SamplingParams(temperature=0, max_tokens=20)


def random_prompt_ids(rng, n):
    """n ids of ordinary (non-special) tokens."""
    return rng.integers(0, 151643, size=n).tolist()


def test_issue_example_greedy_completion(tiny_path):
    engine = Engine.load(tiny_path, device="cpu", progress=False)
    c = engine.complete("def fib(n):", SamplingParams(temperature=0, max_tokens=32))
    assert c.finish_reason in ("length", "stop")
    assert 1 <= len(c.token_ids) <= 32 and c.prompt_tokens == 4
    assert c.stats["generated_tokens"] == len(c.token_ids) and c.stats["decode_s"] >= 0
    assert engine.info["device"].startswith("cpu") and engine.info["weights_bytes"] > 0
    assert pool_idle(engine.backend.pool)


def test_greedy_tokens_are_the_argmax_of_teacher_forced_logits(tiny_engine):
    prompt = tiny_engine.tokenizer.encode("def fib(n):")
    c = tiny_engine.complete("def fib(n):", GREEDY)
    assert c.finish_reason == "length" and len(c.token_ids) == 20
    logits = tiny_engine.score(prompt + c.token_ids)
    assert c.token_ids == np.argmax(logits[len(prompt) - 1 : -1], axis=-1).tolist()
    assert c.text == tiny_engine.tokenizer.decode(c.token_ids)


def test_stream_events_match_complete(tiny_engine):
    events = list(tiny_engine.generate("import numpy as np\n", GREEDY))
    c = tiny_engine.complete("import numpy as np\n", GREEDY)
    assert [e.token_id for e in events] == c.token_ids
    assert "".join(e.text for e in events) == c.text
    assert all(e.finish_reason is None and e.stats is None for e in events[:-1])
    assert events[-1].finish_reason == "length" and events[-1].stats["prompt_tokens"] == c.prompt_tokens


def test_seeded_sampling_is_reproducible(tiny_engine):
    p = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=12, seed=1234)
    a = tiny_engine.complete("hello", p).token_ids
    assert tiny_engine.complete("hello", p).token_ids == a
    assert tiny_engine.complete("hello", dataclasses.replace(p, seed=4321)).token_ids != a


def test_chat_messages_go_through_the_template(tiny_engine):
    msgs = [{"role": "user", "content": "write fib"}]
    c = tiny_engine.complete(msgs, SamplingParams(temperature=0, max_tokens=3))
    assert c.prompt_tokens == len(tiny_engine.tokenizer.encode(tiny_engine.tokenizer.apply_chat_template(msgs)))
    assert len(c.token_ids) == 3


def test_stop_string_cuts_the_text(tiny_engine):
    full = tiny_engine.complete("def fib(n):", GREEDY)
    # A stop string taken from the middle of the greedy text: generation must end exactly before it.
    text = full.text
    start = len(text) // 2
    stop = text[start : start + 3]
    assert len(stop) == 3
    c = tiny_engine.complete("def fib(n):", dataclasses.replace(GREEDY, stop=("\x00never", stop)))
    assert c.finish_reason == "stop"
    assert c.text == text[: text.find(stop)]
    assert c.token_ids == full.token_ids[: len(c.token_ids)] and len(c.token_ids) < 20
    assert pool_idle(tiny_engine.backend.pool)


def test_eos_ends_with_stop_and_no_eos_text(tiny_engine, monkeypatch):
    full = tiny_engine.complete("def fib(n):", GREEDY)
    eos = full.token_ids[4]
    k = full.token_ids.index(eos)  # first occurrence
    monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, eos_ids=(eos,)))
    c = tiny_engine.complete("def fib(n):", GREEDY)
    assert c.finish_reason == "stop" and c.token_ids == full.token_ids[: k + 1]
    assert c.text == tiny_engine.tokenizer.decode(full.token_ids[:k])


def test_context_limit_finishes_with_context(tiny_engine, rng):
    n = tiny_engine.max_context - 6
    c = tiny_engine.complete(_ids_text(tiny_engine, n, rng), SamplingParams(temperature=0, max_tokens=50))
    assert c.prompt_tokens == n
    # every generated token but the last is fed back; the cache ends exactly full
    assert c.finish_reason == "context" and len(c.token_ids) == tiny_engine.max_context - n + 1
    assert pool_idle(tiny_engine.backend.pool)


def _ids_text(engine, n, rng):
    """A text that encodes to exactly n tokens (found by trimming a random token run)."""
    ids = random_prompt_ids(rng, n + 10)
    while True:
        text = engine.tokenizer.decode(ids)
        got = len(engine.tokenizer.encode(text))
        if got == n:
            return text
        ids = ids[: len(ids) - max(1, (got - n) // 2)] if got > n else ids + random_prompt_ids(rng, n - got)


def test_prompt_too_long_allocates_nothing(tiny_engine, rng):
    text = _ids_text(tiny_engine, tiny_engine.max_context + 1, rng)
    with pytest.raises(PromptTooLongError, match=f"context holds {tiny_engine.max_context}"):
        tiny_engine.generate(text, GREEDY)
    assert pool_idle(tiny_engine.backend.pool)
    exact = tiny_engine.complete(_ids_text(tiny_engine, tiny_engine.max_context, rng), GREEDY)
    assert exact.finish_reason == "context" and len(exact.token_ids) == 1


def test_request_that_can_never_fit_the_pool_is_refused_at_submit(tiny_path, rng):
    engine = Engine.load(tiny_path, device="cpu", max_context=96, kv_pages=3, progress=False)
    text = _ids_text(engine, 40, rng)  # 3 pages; 40 + 30 - 1 cached tokens would need 5
    with pytest.raises(KVPagesExhaustedError, match="KV cache too small for this request.*whole pool has 3"):
        engine.submit(text, SamplingParams(temperature=0, max_tokens=30))
    with pytest.raises(KVPagesExhaustedError):  # the prompt alone needs 4 pages
        engine.complete(_ids_text(engine, 60, rng), SamplingParams(temperature=0, max_tokens=1))
    assert pool_idle(engine.backend.pool) and engine.stats()["waiting"] == 0
    c = engine.complete(text, SamplingParams(temperature=0, max_tokens=9))  # 48 tokens: exactly 3 pages
    assert c.finish_reason == "length" and len(c.token_ids) == 9
    assert pool_idle(engine.backend.pool)


def test_closing_the_stream_frees_the_sequence(tiny_engine):
    gen = tiny_engine.generate("def fib(n):", GREEDY)
    next(gen)
    next(gen)
    assert not pool_idle(tiny_engine.backend.pool)
    gen.close()
    assert pool_idle(tiny_engine.backend.pool)


def test_bad_requests_are_clear_errors(tiny_engine):
    with pytest.raises(InvalidRequestError, match="empty"):
        tiny_engine.complete("", GREEDY)
    with pytest.raises(InvalidRequestError, match="a str, a list of token ids or a list of messages"):
        tiny_engine.complete(42, GREEDY)
    with pytest.raises(InvalidRequestError, match="token ids"):
        tiny_engine.score([0, tiny_engine.config.vocab])
    assert pool_idle(tiny_engine.backend.pool)


def test_score_is_the_backend_forward(tiny_engine, rng):
    ids = random_prompt_ids(rng, 18)
    s = tiny_engine.score(ids)
    assert s.shape == (18, tiny_engine.config.vocab) and s.dtype == np.float32
    # causal: a prefix's logits do not depend on what follows (BLAS blocking differs with T: ~1e-6)
    np.testing.assert_allclose(s[:5], tiny_engine.score(ids[:5]), rtol=0, atol=1e-5 * np.abs(s).max())


def test_load_errors(tmp_path, tiny_path):
    with pytest.raises(ModelNotFoundError, match="no such"):
        Engine.load(tmp_path / "missing.nanoqwen", device="cpu")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        Engine.load(tmp_path, device="cpu")
    bad = tmp_path / "bad.nanoqwen"
    bad.write_bytes(b"not a model" * 100)
    with pytest.raises(ModelFormatError):
        Engine.load(bad, device="cpu")
    with pytest.raises(InvalidRequestError, match="device"):
        Engine.load(tiny_path, device="tpu")


def test_cuda_without_a_gpu_is_no_gpu_error(tiny_path):
    from nanoqwen_kernels import gpu_status

    ok, _ = gpu_status()
    if ok:
        pytest.skip("a GPU is present here, so the no-GPU error cannot be provoked")
    with pytest.raises(NoGPUError):
        Engine.load(tiny_path, device="cuda")


def test_ignore_eos_runs_to_max_tokens(tiny_engine, monkeypatch):
    full = tiny_engine.complete("def fib(n):", GREEDY)
    monkeypatch.setattr(tiny_engine, "config", dataclasses.replace(tiny_engine.config, eos_ids=(full.token_ids[2],)))
    c = tiny_engine.complete("def fib(n):", dataclasses.replace(GREEDY, ignore_eos=True))
    assert c.finish_reason == "length" and c.token_ids == full.token_ids


def test_fim_prompt_is_raw_text_with_special_tokens(tiny_engine):
    prompt = "<|fim_prefix|>def fib(n):\n    <|fim_suffix|>\n    return a<|fim_middle|>"
    ids = tiny_engine.encode_prompt(prompt)
    assert ids[0] == 151659 and ids[-1] == 151660 and 151661 in ids
    c = tiny_engine.complete(prompt, SamplingParams(temperature=0, max_tokens=4))
    assert c.prompt_tokens == len(ids) and len(c.token_ids) == 4


def test_request_times_are_the_engines_not_the_callers(tiny_engine):
    """The engine runs ahead of a slow consumer (events are buffered): the stats are fixed when the
    request ends, so a caller that reads the events later does not stretch decode_s."""
    import time

    t0 = time.perf_counter()
    h = tiny_engine.submit("x", SamplingParams(temperature=0, max_tokens=3))
    assert h.wait()
    ended = time.perf_counter() - t0
    time.sleep(0.3)
    events = list(h)
    stats = events[-1].stats
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert stats["generated_tokens"] == 3 and stats["decode_s"] > 0
    assert stats["queue_s"] + stats["prefill_s"] + stats["decode_s"] <= ended
    assert stats["ttft_s"] == pytest.approx(stats["queue_s"] + stats["prefill_s"])


def test_request_waits_for_pages_then_both_give_their_solo_tokens(tiny_path, rng):
    """A request whose prompt finds too few free pages waits in the queue (it is not failed) while the
    running one continues; both end with exactly the tokens each produces alone."""
    engine = Engine.load(tiny_path, device="cpu", max_context=96, kv_pages=4, progress=False)
    text_a, text_b = _ids_text(engine, 40, rng), _ids_text(engine, 30, rng)  # 3 pages (to 46 tokens), 2 pages
    params = SamplingParams(temperature=0, max_tokens=6)
    solo_a = engine.complete(text_a, params).token_ids
    solo_b = engine.complete(text_b, params).token_ids
    running = engine.generate(text_a, params)
    first = [next(running).token_id]
    other = engine.submit(text_b, params)
    assert first + [e.token_id for e in running] == solo_a
    assert other.result().token_ids == solo_b
    assert pool_idle(engine.backend.pool)


@pytest.mark.parametrize("kw, match", [
    ({"kv_pages": 0}, "kv_pages"), ({"kv_pages": 2.5}, "kv_pages"), ({"max_context": 2.5}, "max_context"),
    ({"max_context": 0}, "max_context"), ({"max_context": "96"}, "max_context"), ({"max_batch": 0}, "max_batch"),
    ({"prefill_chunk": 0}, "prefill_chunk"), ({"max_queue": -1}, "max_queue"), ({"max_batch": True}, "max_batch"),
    ({"prefill_chunk_idle": 0}, "prefill_chunk_idle"), ({"prefill_chunk_idle": 1.5}, "prefill_chunk_idle"),
    ({"progress": "no"}, "progress"), ({"prefill_weights": "bf16"}, "prefill_weights must be one of"),
    ({"prefill_weights": "fp8"}, "device='cuda' only"), ({"prefill_weights": "int4"}, "device='cuda' only"),
    ({"decode_activations": "int4"}, "decode_activations must be one of"),
    ({"decode_activations": "int8"}, "device='cuda' only"),
    ({"lm_head_dtype": "bf16"}, "lm_head_dtype must be one of"), ({"lm_head_dtype": 8}, "lm_head_dtype must be one of"),
])
def test_load_arguments_are_checked_before_the_model_is_opened(tmp_path, kw, match):
    """A missing model would raise ModelNotFoundError: the argument error comes first."""
    with pytest.raises(InvalidRequestError, match=match):
        Engine.load(tmp_path / "missing.nanoqwen", device="cpu", **kw)


class _Patched:
    """A NanoqwenFile whose config dicts are replaced: what a file the reader accepts may hold."""

    def __init__(self, nq, **dicts):
        self._nq, self._dicts = nq, dicts

    def __getattr__(self, name):
        return self._dicts[name] if name in self._dicts else getattr(self._nq, name)


@pytest.mark.parametrize("field, change, match", [
    ("config", {"eos_token_id": "abc"}, "eos_token_id"), ("config", {"eos_token_id": [None]}, "eos_token_id"),
    ("config", {"max_position_embeddings": "x"}, "max_position_embeddings"),
    ("config", {"max_position_embeddings": 0}, "max_position_embeddings"),
    ("tokenizer_config", {"chat_template": 5}, "chat_template"),
    ("generation_config", {"temperature": float("nan")}, "generation_config.temperature"),
    ("generation_config", {"top_k": "20"}, "generation_config.top_k"),
])
def test_bad_values_in_an_accepted_file_are_model_format_errors(tiny_path, monkeypatch, field, change, match):
    import nanoqwen_format

    real = nanoqwen_format.open_model

    def patched(path, *a, **kw):
        nq = real(path, *a, **kw)
        return _Patched(nq, **{field: {**(getattr(nq, field) or {}), **change}})

    monkeypatch.setattr(nanoqwen_format, "open_model", patched)
    with pytest.raises(ModelFormatError, match=match):
        Engine.load(tiny_path, device="cpu", progress=False)
