"""What inference servers answer, decoded: completions, stream events, errors.

SGLang, vLLM and llama.cpp speak the same OpenAI shapes, each with its own error layout
(docs/engines.md, "Errors"): one tolerant reader decodes them all. worker/server.py does the HTTP.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgspec

from genq.core.records import Choice, ErrorKind, Usage


class Meter(Protocol):
    """What books a stream's tokens (worker/decoding.py DecodeMeter)."""

    def advance(self, progress: Progress, tokens: int) -> None: ...


@dataclass
class Progress:
    """Live state of one request, read by the watchdog and the in-flight report."""

    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    tokens: int = 0
    # When the first byte of the body came (None before). Until then the request waits in the
    # server's queue (llama.cpp sends nothing while it defers one; SGLang and vLLM send a stream's
    # headers but no event): queue time, not a stall.
    first_byte: float | None = None
    # worker/decoding.py: the meter that books this request's streamed tokens (None: none), the
    # sequences it is on the server (its n), and whether it has begun decoding (its first token).
    meter: Meter | None = None
    sequences: int = 1
    decoding: bool = False
    waiting: bool = False  # sent, no token yet: the server queues or prefills it

    def advance(self, tokens: int) -> None:
        """The request has made `tokens` output tokens so far (a stream's count)."""
        if self.meter is None:
            self.tokens = tokens
        else:
            self.meter.advance(self, tokens)


@dataclass
class Failure:
    kind: ErrorKind
    message: str
    status: int | None = None
    retryable: bool = True


@dataclass
class Completion:
    """A whole answer: every choice in index order (one unless the request asked for n > 1)."""

    choices: list[Choice]
    usage: Usage
    model: str
    response_id: str | None

    # The first choice, what a request for one sample is about.
    @property
    def text(self) -> str:
        return self.choices[0].completion

    @property
    def reasoning(self) -> str | None:
        return self.choices[0].reasoning_content

    @property
    def finish_reason(self) -> str | None:
        return self.choices[0].finish_reason


# Typed views of the answers: decoding straight into these is several times cheaper than into
# dicts, which matters at thousands of stream events a second.
class WireUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    completion_tokens_details: dict[str, Any] | None = None


class _WireMessage(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name
    # Whole calls in an answer; in a stream, pieces: {"index", "id"?, "function": {"name"?, "arguments"}}.
    tool_calls: list[dict[str, Any]] | None = None


class _WireChoice(msgspec.Struct):
    index: int = 0
    delta: _WireMessage | None = None
    message: _WireMessage | None = None
    text: str | None = None
    finish_reason: str | None = None
    logprobs: dict[str, Any] | None = None  # only when asked for: the choice's (or chunk's) OpenAI logprobs
    matched_stop: int | str | None = None  # SGLang
    stop_reason: int | str | None = None  # vLLM's name

    @property
    def stop(self) -> int | str | None:
        return self.matched_stop if self.matched_stop is not None else self.stop_reason


class _WireAnswer(msgspec.Struct):
    """A chat/completions response, one stream chunk, or an error body."""

    id: str | None = None
    model: str | None = None
    object: str | None = None
    choices: list[_WireChoice] | None = None
    usage: WireUsage | None = None
    error: Any = None  # nested error bodies (vLLM, llama.cpp, SGLang's stream events)
    message: Any = None  # flat error bodies (SGLang): {"object": "error", "message", "code", ...}
    code: Any = None


_json_decode = msgspec.json.Decoder().decode
_answer_decode = msgspec.json.Decoder(_WireAnswer).decode
_PATH_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def decode_answer(raw: bytes) -> _WireAnswer | Failure:
    """A response or one stream event; a protocol Failure if it is not a JSON object. A flat
    error body is read as a nested one."""
    answer: _WireAnswer | None
    try:
        try:
            answer = _answer_decode(raw)
        except msgspec.ValidationError:  # JSON with a field of another type
            answer = _lenient(_json_decode(raw))
    except msgspec.DecodeError as exc:
        return Failure("protocol", f"unparsable answer: {exc} ({raw[:200]!r})")
    if answer is None:
        return Failure("protocol", f"answer is not a JSON object: {raw[:200]!r}")
    if answer.error is None and answer.object == "error":
        answer.error = {"message": answer.message, "code": answer.code}
    return answer


def _lenient(body: Any) -> _WireAnswer | None:
    """An answer the typed decoder refused, read with each field of another type taken as absent
    and each list item of another type left out, so odd servers are still understood. None: the
    body is not a JSON object."""
    while True:
        try:
            return msgspec.convert(body, _WireAnswer)
        except msgspec.ValidationError as exc:
            where = str(exc).rpartition(" - at `$")[2]
            steps: list[Any] = [int(i) if i else k for k, i in _PATH_STEP.findall(where)]
            if not steps:
                return None
            parent = body
            for step in steps[:-1]:
                parent = parent[step]
            del parent[steps[-1]]


def _failure(status: int | None, message: str, mid_stream: bool = False) -> Failure:
    if status in (400, 413, 422) and not mid_stream:
        return Failure("bad_request", message, status, retryable=False)
    return Failure("server_error", message, status)


def http_failure(status: int, raw: bytes) -> Failure:
    """A non-200 answer: judged by its HTTP status, told by its error's message."""
    answer = decode_answer(raw)
    error = answer.error if isinstance(answer, _WireAnswer) else None
    if isinstance(error, dict) and error.get("message"):
        return _failure(status, str(error["message"]))
    return _failure(status, error if isinstance(error, str) else raw[:500].decode("utf-8", "replace") or "(empty body)")


def connection_failure(exc: BaseException) -> Failure:
    return Failure("connection", f"{type(exc).__name__}: {exc}".rstrip(": "))


def event_failure(err: Any, mid_stream: bool = False) -> Failure:
    """The failure an error body or stream event names. After the stream's first event (the
    request was accepted and ran) it is a server_error to retry whatever its code: SGLang sends
    any exception in a running stream with its blanket code 400."""
    if not isinstance(err, dict):
        return _failure(None, str(err))
    code = err.get("code")
    return _failure(code if isinstance(code, int) else None, str(err.get("message") or err), mid_stream)


def parse_completion_bytes(raw: bytes, model: str) -> Completion | Failure:
    """A non-streamed answer."""
    answer = decode_answer(raw)
    if isinstance(answer, Failure):
        return answer
    if answer.error is not None:
        return event_failure(answer.error)
    if not answer.choices:
        return Failure("protocol", "response has no choices")
    usage = usage_of(answer.usage)
    choices = []
    for wire in sorted(answer.choices, key=lambda c: c.index):
        message = wire.message or _WireMessage(content=wire.text)
        choices.append(Choice(index=wire.index, completion=message.content or "", finish_reason=wire.finish_reason,
                              reasoning_content=message.reasoning_content or message.reasoning,
                              logprobs=wire.logprobs, matched_stop=wire.stop,
                              tool_calls=message.tool_calls or None))  # vLLM answers [] without a call
    if len(choices) == 1:  # a whole answer counts only the request's tokens: one choice has them all
        choices[0].completion_tokens = usage.completion_tokens
    return Completion(choices=choices, usage=usage, model=answer.model or model, response_id=answer.id)


def usage_of(raw: WireUsage | None) -> Usage:
    if raw is None:
        return Usage()
    reasoning = raw.reasoning_tokens
    if reasoning is None and raw.completion_tokens_details:
        reasoning = raw.completion_tokens_details.get("reasoning_tokens")
    return Usage(prompt_tokens=raw.prompt_tokens or 0, completion_tokens=raw.completion_tokens or 0,
                 reasoning_tokens=reasoning if isinstance(reasoning, int) and reasoning else None)
