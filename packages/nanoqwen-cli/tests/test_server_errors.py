"""Every error status of `nanoqwen-cli serve`, in OpenAI's error shape:
{"error": {"message", "type", "param", "code"}}.

The `server` fixture (no limits) answers the 400s and 404s; a second server, `strict`, has the limits that
the other statuses need: an API key (401), a 64-token context, one running sequence and one waiting
request (429), a 2 KiB body limit (413).
"""

from __future__ import annotations

import signal
import threading

import openai
import pytest

USER = [{"role": "user", "content": "def fib(n):"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KEY = "sk-test-7f3a"


def _error(answer, status: int) -> dict:
    assert answer.status == status, answer.text
    assert answer.headers["content-type"] == "application/json"
    err = answer.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# (path, fields added to a valid request, the param the 400 names)
REFUSED = [
    (CHAT, {"n": 2}, "n"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    (CHAT, {"tool_choice": "auto"}, "tool_choice"),
    (CHAT, {"logit_bias": {"42": 5}}, "logit_bias"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty"),
    (CHAT, {"frequency_penalty": -1.0}, "frequency_penalty"),
    (CHAT, {"logprobs": True}, "logprobs"),
    (CHAT, {"top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"not_an_openai_field": 1}, "not_an_openai_field"),
    (CHAT, {"temperature": 3}, "temperature"),
    (CHAT, {"temperature": "hot"}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"),
    (CHAT, {"top_k": -1}, "top_k"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_tokens": 5, "max_completion_tokens": 6}, "max_tokens"),
    (CHAT, {"seed": -5}, "seed"),
    (CHAT, {"stop": [""]}, "stop"),
    (CHAT, {"stream_options": {"include_usage": True}}, "stream_options"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"best_of": 2}, "best_of"),
    (COMPLETIONS, {"logprobs": 1}, "logprobs"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [3]]}, "prompt"),
    (COMPLETIONS, {"prompt": [1, 2, 3], "suffix": "x"}, "suffix"),
    (COMPLETIONS, {"prompt": [1, 10**9]}, "prompt"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
]


@pytest.mark.parametrize(("path", "fields", "param"), REFUSED, ids=[f"{p[-11:]}-{f}" for p, f, _ in REFUSED])
def test_refused_fields_are_a_400_naming_the_field(server, path, fields, param):
    body = {"model": "tiny", "max_tokens": 4, **({"messages": USER} if path == CHAT else {"prompt": "x"})}
    body.update(fields)
    err = _error(server.request("POST", path, body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_the_openai_client_sees_the_400(server):
    with pytest.raises(openai.BadRequestError) as e:
        server.client().chat.completions.create(model="tiny", messages=USER, n=3)
    assert e.value.param == "n"


@pytest.mark.parametrize("body", [b"{not json", b"[1, 2]", "\u00e9".encode("latin-1")])
def test_a_body_that_is_not_a_json_object_is_a_400(server, body):
    _error(server.request("POST", CHAT, body), 400)


def test_unknown_model_is_a_404(server):
    with pytest.raises(openai.NotFoundError) as e:
        server.client().chat.completions.create(model="gpt-4o", messages=USER)
    assert (e.value.code, e.value.param) == ("model_not_found", "model")
    assert "tiny" in e.value.message


def test_unknown_route_is_a_404_in_openai_shape(server):
    _error(server.request("POST", "/v1/embeddings", {"input": "x"}), 404)


def test_prompt_plus_max_tokens_beyond_the_context_is_a_400(server):
    err = _error(server.request("POST", COMPLETIONS, {"model": "tiny", "prompt": "x", "max_tokens": 40000}), 400)
    assert (err["code"], err["param"]) == ("context_length_exceeded", "max_tokens")
    assert server.wait_idle()["nanoqwen_kv_pages_used"] == 0


# -- the strict server: limits --

@pytest.fixture(scope="module")
def strict(tiny_model, tmp_path_factory):
    from server_process import ServeProcess

    proc = ServeProcess(tiny_model, tmp_path_factory.mktemp("strict"), "--served-model-name", "tiny",
                        "--max-context", "64", "--max-batch", "1", "--max-queue", "1",
                        "--max-body-bytes", "2048", api_key=KEY)
    try:
        proc.health_statuses()
        yield proc
    finally:
        rc = proc.stop(signal.SIGINT)  # Ctrl-C: the same graceful path as SIGTERM
    assert rc == 0, proc.output()


AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}])
def test_api_key_is_required_on_v1(strict, headers):
    for method, path, body in (("POST", CHAT, {"model": "tiny", "messages": USER, "max_tokens": 2}),
                               ("GET", "/v1/models", None)):
        answer = strict.request(method, path, body, headers=headers)
        err = _error(answer, 401)
        assert err["code"] == "invalid_api_key"
        assert answer.headers["www-authenticate"] == "Bearer"


def test_api_key_admits_the_client(strict):
    with pytest.raises(openai.AuthenticationError):
        strict.client().models.list()
    got = strict.client(api_key=KEY).chat.completions.create(model="tiny", messages=USER, max_tokens=2)
    assert got.usage.completion_tokens == 2
    assert strict.request("GET", "/health").status == 200, "/health and /metrics stay open for probes"
    assert strict.request("GET", "/metrics").status == 200


def test_body_over_the_limit_is_a_413(strict):
    big = {"model": "tiny", "prompt": "x" * 4096, "max_tokens": 2}
    err = _error(strict.request("POST", COMPLETIONS, big, headers=AUTH), 413)
    assert err["code"] == "request_too_large"


def test_prompt_longer_than_the_context_is_a_400(strict):
    long_prompt = " ".join(["word"] * 100)  # 100 tokens, the context is 64
    with pytest.raises(openai.BadRequestError) as e:
        strict.client(api_key=KEY).completions.create(model="tiny", prompt=long_prompt, max_tokens=1)
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "prompt")
    with pytest.raises(openai.BadRequestError) as e:
        strict.client(api_key=KEY).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": long_prompt}])
    assert (e.value.code, e.value.param) == ("context_length_exceeded", "messages")


def test_a_full_queue_is_a_429_and_nothing_leaks(strict):
    """One sequence runs (max_batch 1), one request waits (max_queue 1): the next gets 429 at once."""
    client = strict.client(api_key=KEY)
    long = {"model": "tiny", "prompt": "a", "max_tokens": 60, "temperature": 0, "stream": True,
            "extra_body": {"ignore_eos": True}}
    running = client.completions.create(**long)
    next(iter(running))  # its first chunk: it is in the batch
    waiting_done = threading.Event()
    waiting_result = {}

    def wait_in_queue():
        try:
            waiting_result["text"] = client.completions.create(**{**long, "stream": False, "max_tokens": 2})
        finally:
            waiting_done.set()

    threading.Thread(target=wait_in_queue, daemon=True).start()
    _wait_for(lambda: strict.metrics()["nanoqwen_requests_waiting"] == 1)
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model="tiny", prompt="b", max_tokens=2)
    assert e.value.code == "queue_full"
    assert e.value.response.headers["retry-after"] == "1"
    running.close()  # the running request's client leaves: the waiting one is admitted and finishes
    assert waiting_done.wait(120)
    assert waiting_result["text"].usage.completion_tokens == 2
    m = strict.wait_idle()
    assert m["nanoqwen_kv_pages_used"] == 0


def _wait_for(cond, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)
