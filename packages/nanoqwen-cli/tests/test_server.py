"""`nanoqwen-cli serve` answers as OpenAI's API does: a real server process (the `server` fixture, CPU
reference backend, tiny model) driven by the official `openai` client, sync and async, streamed and not.

What the answers are checked against: `nanoqwen-cli run` (CliRunner) for greedy text, and the engine
itself (`tiny_engine`) for token counts and seeded sampling.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from nanoqwen_engine import SamplingParams

PROMPT = "def fib(n):"
USER = [{"role": "user", "content": PROMPT}]


def _run_json(invoke, tiny_model, *args) -> dict:
    result = invoke(["run", "--model", tiny_model, "--device", "cpu", "-t", "0", "--json", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_chat_greedy_equals_cli_run(server, invoke, tiny_model):
    want = _run_json(invoke, tiny_model, "-n", 12, PROMPT)
    got = server.client().chat.completions.create(model="tiny", messages=USER, temperature=0, max_tokens=12)
    assert got.object == "chat.completion" and got.model == "tiny"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want["text"]
    assert got.choices[0].finish_reason == want["finish_reason"] == "length"
    assert got.usage.prompt_tokens == want["prompt_tokens"]
    assert got.usage.completion_tokens == want["generated_tokens"] == 12
    assert got.usage.total_tokens == want["prompt_tokens"] + 12


def test_completion_stream_equals_cli_run_raw(server, invoke, tiny_model):
    want = _run_json(invoke, tiny_model, "-n", 10, "--raw", PROMPT)
    chunks = list(server.client().completions.create(model="tiny-alias", prompt=PROMPT, temperature=0,
                                                     max_tokens=10, stream=True))
    assert all(c.object == "text_completion" and c.model == "tiny-alias" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert "".join(c.choices[0].text for c in chunks) == want["text"]
    assert [c.choices[0].finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks), "no usage chunk unless stream_options.include_usage"


def test_chat_stream_with_usage_async(server, tiny_engine):
    """Async client, streamed chat with stream_options.include_usage: the role first, the text, a chunk
    with the finish reason, then one chunk with no choices and the usage."""

    async def go():
        async with server.async_client() as client:
            stream = await client.chat.completions.create(
                model="tiny", messages=USER, temperature=0, max_tokens=9, stream=True,
                stream_options={"include_usage": True})
            return [c async for c in stream]

    chunks = asyncio.run(go())
    want = tiny_engine.complete(USER, SamplingParams(temperature=0, max_tokens=9))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == want.prompt_tokens
    assert chunks[-1].usage.completion_tokens == len(want.token_ids) == 9
    assert all(c.usage is None for c in chunks[:-1])


def test_async_non_streamed_completion(server, tiny_engine):
    async def go():
        async with server.async_client() as client:
            return await client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=7)

    got = asyncio.run(go())
    want = tiny_engine.complete(PROMPT, SamplingParams(temperature=0, max_tokens=7))
    assert got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (want.prompt_tokens, 7)


def test_sse_framing_ends_with_done(server):
    """The bytes on the wire: `data: {json}` events separated by blank lines, `data: [DONE]` last."""
    body = {"model": "tiny", "messages": USER, "max_tokens": 4, "temperature": 0, "stream": True}
    r = server.request("POST", "/v1/chat/completions", body)
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = r.text.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    for event in events[:-2]:
        assert event.startswith("data: ")
        assert json.loads(event[len("data: "):])["object"] == "chat.completion.chunk"


@pytest.fixture(scope="module")
def greedy24(tiny_engine) -> str:
    return tiny_engine.complete(PROMPT, SamplingParams(temperature=0, max_tokens=24)).text


@pytest.mark.parametrize("as_list", [False, True])
@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_the_text_before_it(server, greedy24, stream, as_list):
    full = greedy24
    assert len(full) >= 6, f"the tiny model's greedy text is too short to cut: {full!r}"
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    client = server.client()
    args = {"model": "tiny", "prompt": PROMPT, "temperature": 0, "max_tokens": 24,
            "stop": [stop, "\x00never"] if as_list else stop}
    if stream:
        chunks = list(client.completions.create(**args, stream=True))
        text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    else:
        got = client.completions.create(**args)
        text, finish = got.choices[0].text, got.choices[0].finish_reason
    assert text == full[: full.find(stop)]
    assert finish == "stop"


def test_seeded_sampling_matches_the_engine(server, tiny_engine):
    """temperature/top_p/seed and the vLLM-style extensions (top_k, min_p, repetition_penalty) reach the
    sampler: the same seed gives the engine's own tokens."""
    extra = {"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1}
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=6, **extra)
    want = tiny_engine.complete(USER, params).text
    got = server.client().chat.completions.create(model="tiny", messages=USER, temperature=0.9, top_p=0.95,
                                                  seed=1234, max_completion_tokens=6, extra_body=extra)
    assert got.choices[0].message.content == want


def test_ignore_eos_generates_exactly_max_tokens(server):
    got = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=1.0,
                                             seed=3, extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 20
    assert got.choices[0].finish_reason == "length"


def test_fim_suffix_builds_qwen_fill_in_the_middle_prompt(server, tiny_engine):
    """`suffix` on /v1/completions: the raw prompt <|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>, no chat
    template; the answer is the middle."""
    prefix, suffix = "def add(a, b):\n    ", "\n    return c\n"
    fim = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    want = tiny_engine.complete(fim, SamplingParams(temperature=0, max_tokens=8))
    got = server.client().completions.create(model="tiny", prompt=prefix, suffix=suffix, temperature=0,
                                             max_tokens=8)
    assert got.choices[0].text == want.text
    assert got.usage.prompt_tokens == want.prompt_tokens == len(tiny_engine.encode_prompt(fim))
    fim_ids = {tiny_engine.tokenizer.token_to_id(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                              "<|fim_middle|>")}
    assert None not in fim_ids and fim_ids <= set(tiny_engine.encode_prompt(fim))


def test_token_id_prompt_equals_its_text(server, tiny_engine):
    """A completions prompt may be token ids (or a list of one such list), as OpenAI's API allows."""
    ids = tiny_engine.encode_prompt(PROMPT)
    client = server.client()
    text = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=5)
    for prompt in (ids, [ids]):
        got = client.completions.create(model="tiny", prompt=prompt, temperature=0, max_tokens=5)
        assert got.choices[0].text == text.choices[0].text
        assert got.usage.prompt_tokens == len(ids)


def test_chat_content_parts_and_system_message(server, tiny_engine):
    messages = [{"role": "system", "content": "Answer in Python."},
                {"role": "user", "content": [{"type": "text", "text": "def "}, {"type": "text", "text": "f"}]}]
    want = tiny_engine.complete([messages[0], {"role": "user", "content": "def f"}],
                                SamplingParams(temperature=0, max_tokens=5))
    got = server.client().chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=5)
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.prompt_tokens


def test_models_health_and_metrics(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == ["tiny", "tiny-alias"]
    assert server.request("GET", "/health").json() == {"status": "ok"}

    before = server.metrics()
    got = server.client().completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=6)
    after = server.wait_idle()
    assert after["nanoqwen_model_loaded"] == 1
    assert after["nanoqwen_prompt_tokens_total"] - before["nanoqwen_prompt_tokens_total"] == got.usage.prompt_tokens
    assert after["nanoqwen_generation_tokens_total"] - before["nanoqwen_generation_tokens_total"] == 6
    assert after["nanoqwen_time_to_first_token_seconds_count"] - before["nanoqwen_time_to_first_token_seconds_count"] == 1
    assert after["nanoqwen_inter_token_latency_seconds_count"] - before["nanoqwen_inter_token_latency_seconds_count"] == 5
    key = 'nanoqwen_http_requests_total{path="/v1/completions",status="200"}'
    assert after[key] - before.get(key, 0) == 1
    key = 'nanoqwen_requests_finished_total{finish_reason="length"}'
    assert after[key] - before.get(key, 0) == 1
    assert after["nanoqwen_kv_pages_used"] == 0
    assert after["nanoqwen_kv_pages_free"] == after["nanoqwen_kv_pages_total"] > 0


def test_model_may_be_omitted(server, tiny_engine):
    """Without `model` the request goes to the served model (curl users need not repeat it)."""
    r = server.request("POST", "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0})
    assert r.status == 200, r.text
    assert r.json()["model"] == "tiny"
    assert r.json()["choices"][0]["text"] == tiny_engine.complete(PROMPT, SamplingParams(temperature=0, max_tokens=3)).text
