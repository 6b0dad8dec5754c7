"""What inference servers answer, decoded: completions, stream events, errors.

Shared by every engine flavor (SGLang, vLLM, llama.cpp speak the same OpenAI
shapes, with their own error layouts); worker/server.py does the HTTP.
"""

from __future__ import annotations

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
    # When the first byte of the response body came (time.monotonic()); None before.
    # Until then the request waits in the server's queue: llama.cpp sends nothing at
    # all while a request is deferred, SGLang and vLLM send a stream's headers at
    # once but no event until the request runs. Time before it is queue time, not a stall.
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



_json_decode = msgspec.json.Decoder().decode


# Typed views of the answers: decoding straight into these is several times cheaper
# than into dicts, which matters at thousands of stream events a second. A field of
# an unexpected type fails validation and the answer goes through the generic
# (dict) path instead, so odd servers are still understood.
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
    # Only when asked for (null otherwise): the OpenAI logprobs object of this choice (or of
    # this stream chunk's tokens).
    logprobs: dict[str, Any] | None = None
    matched_stop: int | str | None = None  # SGLang
    stop_reason: int | str | None = None  # vLLM's name


class _WireAnswer(msgspec.Struct):
    """A chat/completions response or one stream chunk."""

    id: str | None = None
    model: str | None = None
    object: str | None = None
    choices: list[_WireChoice] | None = None
    usage: WireUsage | None = None
    error: Any = None
    message: Any = None  # flat error bodies (SGLang): {"object": "error", "message": ...}


_answer_decode = msgspec.json.Decoder(_WireAnswer).decode


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


def _error_message(raw: bytes) -> str:
    try:
        body = _json_decode(raw)
    except msgspec.DecodeError:
        return raw[:500].decode("utf-8", "replace") or "(empty body)"
    if isinstance(body, dict):
        err = body.get("error", body)  # vLLM nests the error, SGLang does not
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    return raw[:500].decode("utf-8", "replace")


def http_failure(status: int, raw: bytes) -> Failure:
    message = _error_message(raw)
    if status in (400, 413, 422):
        return Failure("bad_request", message, status, retryable=False)
    return Failure("server_error", message, status)


def connection_failure(exc: BaseException) -> Failure:
    return Failure("connection", f"{type(exc).__name__}: {exc}".rstrip(": "))


def event_failure(err: Any, mid_stream: bool = False) -> Failure:
    """The failure an error body or stream event names. An error event after the
    stream's first event (the request was accepted and ran) is a server_error to retry
    whatever its code: SGLang sends any exception in a running stream with its blanket
    code 400 (create_streaming_error_response's default), so the code says nothing there."""
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) else None
        message = str(err.get("message") or err)
    else:
        status, message = None, str(err)
    if status in (400, 413, 422) and not mid_stream:
        return Failure("bad_request", message, status, retryable=False)
    return Failure("server_error", message, status)


def decode_answer(raw: bytes) -> _WireAnswer | Failure:
    """A response or one stream event; a protocol Failure if it is not a JSON object."""
    try:
        return _answer_decode(raw)
    except msgspec.ValidationError:  # JSON, a field of another type: the generic path
        return _generic_answer(_json_decode(raw))
    except msgspec.DecodeError as exc:
        return Failure("protocol", f"unparsable answer: {exc} ({raw[:200]!r})")


def parse_completion_bytes(raw: bytes, model: str) -> Completion | Failure:
    """A non-streamed answer."""
    answer = decode_answer(raw)
    if isinstance(answer, Failure):
        return answer
    if answer.error is not None or answer.object == "error":
        return event_failure(answer.error if answer.error is not None else _json_decode(raw))
    if not answer.choices:
        return Failure("protocol", "response has no choices")
    usage = usage_of(answer.usage)
    choices = []
    for wire in sorted(answer.choices, key=lambda c: c.index):
        message = wire.message
        tool_calls = None
        if message is not None:
            text, reasoning = message.content or "", message.reasoning_content or message.reasoning
            tool_calls = message.tool_calls or None  # vLLM answers [] without a call
        else:
            text, reasoning = wire.text or "", None
        choices.append(Choice(index=wire.index, completion=text, finish_reason=wire.finish_reason,
                              reasoning_content=reasoning, logprobs=wire.logprobs,
                              matched_stop=stop_of(wire), tool_calls=tool_calls))
    if len(choices) == 1:  # a whole answer counts only the request's tokens: one choice has them all
        choices[0].completion_tokens = usage.completion_tokens
    return Completion(choices=choices, usage=usage, model=answer.model or model, response_id=answer.id)


def stop_of(choice: _WireChoice) -> int | str | None:
    return choice.matched_stop if choice.matched_stop is not None else choice.stop_reason


def usage_of(raw: WireUsage | None) -> Usage:
    if raw is None:
        return Usage()
    reasoning = raw.reasoning_tokens
    if reasoning is None and raw.completion_tokens_details:
        reasoning = raw.completion_tokens_details.get("reasoning_tokens")
    return Usage(
        prompt_tokens=raw.prompt_tokens or 0,
        completion_tokens=raw.completion_tokens or 0,
        reasoning_tokens=reasoning if isinstance(reasoning, int) and reasoning else None,
    )


def _generic_answer(body: Any) -> _WireAnswer | Failure:
    """An answer or stream event the typed decoder refused (a field of another type): read
    it as a dict, keeping only what genq uses."""
    if not isinstance(body, dict):
        return Failure("protocol", f"answer is not a JSON object: {str(body)[:200]}")
    if body.get("error") is not None:
        return _WireAnswer(error=body["error"])
    if body.get("object") == "error":
        return _WireAnswer(error=body)
    raw_usage = body.get("usage")
    usage = None
    if isinstance(raw_usage, dict):
        details = raw_usage.get("completion_tokens_details")
        usage = WireUsage(prompt_tokens=_int_or_none(raw_usage.get("prompt_tokens")),
                           completion_tokens=_int_or_none(raw_usage.get("completion_tokens")),
                           reasoning_tokens=_int_or_none(raw_usage.get("reasoning_tokens")),
                           completion_tokens_details=details if isinstance(details, dict) else None)
    choices = []
    for choice in body.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        index, logprobs = choice.get("index"), choice.get("logprobs")
        choices.append(_WireChoice(
            index=index if isinstance(index, int) else 0,
            delta=_generic_message(choice.get("delta")), message=_generic_message(choice.get("message")),
            text=_str_or_none(choice.get("text")), finish_reason=_str_or_none(choice.get("finish_reason")),
            logprobs=logprobs if isinstance(logprobs, dict) else None,
            matched_stop=_stop_value(choice.get("matched_stop")), stop_reason=_stop_value(choice.get("stop_reason"))))
    return _WireAnswer(id=_str_or_none(body.get("id")), model=_str_or_none(body.get("model")),
                       object=_str_or_none(body.get("object")), choices=choices, usage=usage)


def _generic_message(message: Any) -> _WireMessage | None:
    if not isinstance(message, dict):
        return None
    calls = message.get("tool_calls")
    return _WireMessage(content=_str_or_none(message.get("content")),
                        reasoning_content=_str_or_none(message.get("reasoning_content")),
                        reasoning=_str_or_none(message.get("reasoning")),
                        tool_calls=[c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else None)


def _stop_value(value: Any) -> int | str | None:
    return value if isinstance(value, (int, str)) and not isinstance(value, bool) else None


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None

