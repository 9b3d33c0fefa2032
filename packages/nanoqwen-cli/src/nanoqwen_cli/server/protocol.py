"""The OpenAI wire format: request validation, and the JSON / server-sent-event shapes of the answers.

Pure functions and pydantic models, no HTTP: app.py reads a body, calls `parse_chat` / `parse_completion`,
submits the result to the engine and turns its events into the dicts built here.

What a request may carry (docs/SERVER.md has the table):
- accepted and honoured: model, messages / prompt, max_tokens, max_completion_tokens, temperature, top_p,
  stop, seed, stream, stream_options.include_usage, suffix (fill-in-the-middle), and the extensions vLLM
  also accepts: top_k, min_p, repetition_penalty (multiplicative, as transformers defines it), ignore_eos;
- accepted because they do not change the answer: user, metadata, store, service_tier,
  parallel_tool_calls, tool_choice "none", response_format {"type": "text"}, n = 1, best_of = 1,
  echo false, logprobs false / 0 / null, presence_penalty and frequency_penalty 0, an empty logit_bias;
- refused with a 400 naming the field: everything else that would change the answer, because silently
  ignoring it returns something the client did not ask for. presence_penalty and frequency_penalty are
  OpenAI's additive penalties; the sampler's repetition_penalty divides a seen token's logit instead, so
  no value of one reproduces the other and a non-zero additive penalty is refused. logprobs are refused:
  the engine's events do not carry them. Fields OpenAI does not define are refused as OpenAI refuses
  them ("Unrecognized request argument").
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

# Qwen2.5-Coder's fill-in-the-middle markup (special tokens of its tokenizer): the model writes the middle.
FIM_PREFIX, FIM_SUFFIX, FIM_MIDDLE = "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"

# The engine's finish reasons -> OpenAI's. "context" (the sequence reached the context length) is a length
# limit to a client, as vLLM reports it.
FINISH_REASONS = {"stop": "stop", "length": "length", "context": "length"}


class ProtocolError(Exception):
    """A request the server answers with an OpenAI error object: status, message, type, param, code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error object: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ProtocolError:
    return ProtocolError(400, message, param=param, code=code)


# -- request models: types only; values are checked where the rule lives (SamplingParams, below) --

class _Strict(BaseModel):
    # strict: "3" is not an int and 1 is not a bool (an int still fills a float field, as in JSON).
    # extra="forbid": a field OpenAI does not define is a 400 (_unrecognized), not silently dropped.
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]


class StreamOptions(_Strict):
    include_usage: bool = False


class _Common(_Strict):
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's sampling extensions (extra_body in the openai client)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


class ChatRequest(_Common):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None


# -- what the server submits --

@dataclass
class Parsed:
    """A validated request: what to submit to the engine and how to answer."""

    model: str | None  # as the client named it (None: the served model)
    prompt: str | list[int] | list[dict]  # raw text (completions, FIM), token ids, or chat messages
    prompt_param: str  # the field a context-length error names: "messages" or "prompt"
    sampling: dict  # SamplingParams keyword arguments
    max_tokens_given: bool  # the client set a limit (checked against the context; else the default)
    stream: bool
    include_usage: bool


def _loc(loc: tuple) -> str:
    """pydantic's location ("messages", 0, "content") as OpenAI writes a param: messages[0].content."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[TextPart]", "list[str]", "list[int]", "list[list[int]]", "int", "float"):
            continue  # the union member pydantic tried, not a field of the request
        else:
            out += f".{part}" if out else str(part)
    return out


def _validate(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        err = e.errors(include_url=False)[0]
        param = _loc(err["loc"])
        if err["type"] == "extra_forbidden":
            raise bad_request(f"Unrecognized request argument supplied: {param}", param=param) from None
        if err["type"] == "missing":
            raise bad_request(f"missing required field: {param}", param=param) from None
        raise bad_request(f"invalid value for {param}: {err['msg']}", param=param) from None


def _refuse(param: str, why: str) -> ProtocolError:
    return bad_request(f"{param} is not supported by this server: {why}", param=param)


def _check_common(req: _Common) -> None:
    if req.n not in (None, 1):
        raise _refuse("n", "one choice per request (n = 1); send several requests, they are batched")
    if req.logit_bias:
        raise _refuse("logit_bias", "the sampler has no per-token bias")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise _refuse(name, "OpenAI's additive penalties have no equivalent in the sampler; "
                                "repetition_penalty (multiplicative, as in transformers) is accepted instead")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if req.temperature is not None and not 0 <= req.temperature <= 2:
        raise bad_request(f"temperature must be in [0, 2], got {req.temperature}", param="temperature")


def _sampling(req: _Common, max_tokens: int | None) -> dict:
    fields = {
        "max_tokens": max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "seed": req.seed,
        "stop": [req.stop] if isinstance(req.stop, str) else req.stop,
        "ignore_eos": req.ignore_eos or None,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _message_text(m: Message) -> str:
    return m.content if isinstance(m.content, str) else "".join(p.text for p in m.content)


def parse_chat(body: Any) -> Parsed:
    req = _validate(ChatRequest, body)
    _check_common(req)
    if req.logprobs or req.top_logprobs is not None:
        raise _refuse("logprobs" if req.logprobs else "top_logprobs", "the engine's events do not carry log-probabilities")
    if req.tools or req.functions:
        raise _refuse("tools" if req.tools else "functions", "no tool calling")
    if req.tool_choice not in (None, "none") or req.function_call not in (None, "none"):
        raise _refuse("tool_choice" if req.tool_choice not in (None, "none") else "function_call", "no tool calling")
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise _refuse("response_format", "no constrained decoding (only {\"type\": \"text\"})")
    for name in ("modalities", "audio", "prediction", "reasoning_effort", "web_search_options"):
        if getattr(req, name) not in (None, ["text"]):
            raise _refuse(name, "text chat completions only")
    if not req.messages:
        raise bad_request("messages must hold at least one message", param="messages")
    if req.max_tokens is not None and req.max_completion_tokens is not None \
            and req.max_tokens != req.max_completion_tokens:
        raise bad_request("max_tokens and max_completion_tokens disagree; send one", param="max_tokens")
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    messages = [{"role": m.role, "content": _message_text(m)} for m in req.messages]
    return Parsed(req.model, messages, "messages", _sampling(req, max_tokens), max_tokens is not None,
                  req.stream, bool(req.stream_options and req.stream_options.include_usage))


def parse_completion(body: Any) -> Parsed:
    req = _validate(CompletionRequest, body)
    _check_common(req)
    if req.echo:
        raise _refuse("echo", "the answer never repeats the prompt")
    if req.best_of not in (None, 1):
        raise _refuse("best_of", "one candidate per request")
    if req.logprobs:
        raise _refuse("logprobs", "the engine's events do not carry log-probabilities")
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):  # a batch of prompts
        if len(prompt) != 1:
            raise _refuse("prompt", "one prompt per request (send several requests; they are batched)")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("prompt must not be empty", param="prompt")
    if req.suffix is not None:
        if not isinstance(prompt, str):
            raise _refuse("suffix", "fill-in-the-middle needs a text prompt, not token ids")
        prompt = f"{FIM_PREFIX}{prompt}{FIM_SUFFIX}{req.suffix}{FIM_MIDDLE}"
    return Parsed(req.model, prompt, "prompt", _sampling(req, req.max_tokens), req.max_tokens is not None,
                  req.stream, bool(req.stream_options and req.stream_options.include_usage))


def sampling_params(sampling: dict):
    """SamplingParams of a parsed request. Each field is first checked alone, so that a value the engine
    refuses (a negative top_k, top_p 0) is a 400 naming that field; the engine holds the rules."""
    from nanoqwen_engine import InvalidRequestError, SamplingParams

    for name, value in sampling.items():
        try:
            SamplingParams(**{name: value})
        except InvalidRequestError as e:
            raise bad_request(str(e), param=name) from None
    return SamplingParams(**sampling)


# -- answers --

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Shape:
    """The object names and choice layout of one endpoint; `chat` picks message/delta vs text."""

    chat: bool
    id: str
    model: str
    created: int

    @classmethod
    def for_endpoint(cls, chat: bool, model: str) -> Shape:
        return cls(chat, new_id("chatcmpl" if chat else "cmpl"), model, int(time.time()))

    def _envelope(self, object: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "system_fingerprint": None, "choices": choices}

    def response(self, text: str, finish_reason: str, use: dict) -> dict:
        """The whole answer (stream false)."""
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish_reason}
            out = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("text_completion", [choice])
        out["usage"] = use
        return out

    def chunk(self, text: str | None, finish_reason: str | None = None, *, role: bool = False,
              include_usage: bool = False) -> dict:
        """One streamed chunk. Chat: the first carries the role, the last an empty delta and the finish
        reason. With include_usage every chunk has "usage": null and a last one (usage_chunk) the counts."""
        if self.chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("chat.completion.chunk", [choice])
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            out = self._envelope("text_completion", [choice])
        if include_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict:
        out = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [])
        out["usage"] = use
        return out


def sse(obj: dict | str) -> bytes:
    """One server-sent event: `data: <json>` and a blank line (`data: [DONE]` for the string)."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    return f"data: {data}\n\n".encode()


DONE = sse("[DONE]")
