"""What inference servers answer, decoded: completions, stream events, errors.

Shared by every engine flavor (SGLang, vLLM, llama.cpp speak the same OpenAI
shapes, with their own error layouts); worker/server.py does the HTTP.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from genq.core.records import Usage


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



_json_decode = msgspec.json.Decoder().decode


# Typed views of the answers: decoding straight into these is several times cheaper
# than into dicts, which matters at thousands of stream events a second. A field of
# an unexpected type fails validation and the answer goes through the generic
# (dict) path instead, so odd servers are still understood.
class _WireUsage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    completion_tokens_details: dict[str, Any] | None = None


class _WireMessage(msgspec.Struct):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's name


class _WireChoice(msgspec.Struct):
    delta: _WireMessage | None = None
    message: _WireMessage | None = None
    text: str | None = None
    finish_reason: str | None = None


class _WireAnswer(msgspec.Struct):
    """A chat/completions response or one stream chunk."""

    id: str | None = None
    model: str | None = None
    object: str | None = None
    choices: list[_WireChoice] | None = None
    usage: _WireUsage | None = None
    error: Any = None
    message: Any = None  # flat error bodies (SGLang): {"object": "error", "message": ...}


_answer_decode = msgspec.json.Decoder(_WireAnswer).decode


@dataclass
class Failure:
    kind: str  # see genq.core.records.ErrorKind
    message: str
    status: int | None = None
    retryable: bool = True


@dataclass
class Completion:
    text: str
    reasoning: str | None
    finish_reason: str | None
    usage: Usage
    model: str
    response_id: str | None



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


def _http_failure(status: int, raw: bytes) -> Failure:
    message = _error_message(raw)
    if status in (400, 413, 422):
        return Failure("bad_request", message, status, retryable=False)
    return Failure("server_error", message, status)


def _event_failure(err: Any, mid_stream: bool = False) -> Failure:
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


def _usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("completion_tokens_details") or {}
    reasoning = raw.get("reasoning_tokens")
    if reasoning is None and isinstance(details, dict):
        reasoning = details.get("reasoning_tokens")
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        reasoning_tokens=reasoning if isinstance(reasoning, int) and reasoning else None,
    )


def parse_completion_bytes(raw: bytes, model: str) -> Completion | Failure:
    """A non-streamed answer. Raises msgspec.DecodeError if it is not JSON."""
    try:
        answer = _answer_decode(raw)
    except msgspec.ValidationError:
        return _parse_completion(_json_decode(raw), model)
    if not answer.choices or answer.error is not None or answer.object == "error":
        return _parse_completion(_json_decode(raw), model)  # errors and oddities: the generic path
    choice = answer.choices[0]
    message = choice.message
    if message is not None:
        text = message.content or ""
        reasoning = message.reasoning_content or message.reasoning
    else:
        text, reasoning = choice.text or "", None
    return Completion(
        text=text,
        reasoning=reasoning,
        finish_reason=choice.finish_reason,
        usage=_wire_usage(answer.usage),
        model=answer.model or model,
        response_id=answer.id,
    )


def _wire_usage(raw: _WireUsage | None) -> Usage:
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


def _parse_completion(body: Any, model: str) -> Completion | Failure:
    if not isinstance(body, dict) or not body.get("choices"):
        if isinstance(body, dict) and ("error" in body or body.get("object") == "error"):
            return _event_failure(body.get("error", body))
        return Failure("protocol", "response has no choices")
    choice = body["choices"][0]
    message = choice.get("message")
    if message is not None:
        text = message.get("content") or ""
        reasoning = message.get("reasoning_content") or message.get("reasoning")
    else:
        text, reasoning = choice.get("text") or "", None
    return Completion(
        text=text,
        reasoning=reasoning,
        finish_reason=choice.get("finish_reason"),
        usage=_usage(body.get("usage")),
        model=body.get("model") or model,
        response_id=body.get("id"),
    )



class _StreamState:
    """What the events of one stream have said so far."""

    __slots__ = ("text", "reasoning", "finish_reason", "usage", "response_id", "model", "done", "events")

    def __init__(self, model: str) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.usage: _WireUsage | None = None
        self.response_id: str | None = None
        self.model = model
        self.done = False
        self.events = 0  # events before this one

    def feed(self, payload: bytes, progress: Progress) -> Failure | None:
        if payload == b"[DONE]":
            self.done = True
            return None
        try:
            event = _answer_decode(payload)
        except msgspec.ValidationError:
            generic = _generic_event(_json_decode(payload))
            if isinstance(generic, Failure):
                return generic
            event = generic
        if event.error is not None:  # the engines report errors in a running stream this way, on HTTP 200
            return _event_failure(event.error, mid_stream=self.events > 0)
        self.events += 1
        usage = event.usage
        if usage is not None:
            self.usage = usage
            if usage.completion_tokens:
                progress.tokens = usage.completion_tokens
        elif self.usage is None:
            progress.tokens += 1  # no usage stats: count events
        if self.response_id is None:
            self.response_id = event.id
        if event.model:
            self.model = event.model
        if event.choices:
            for choice in event.choices:
                delta = choice.delta
                if delta is not None:
                    if delta.content:
                        self.text.append(delta.content)
                    piece = delta.reasoning_content or delta.reasoning
                    if piece:
                        self.reasoning.append(piece)
                elif choice.text:
                    self.text.append(choice.text)
                if choice.finish_reason:
                    self.finish_reason = choice.finish_reason
        return None

    def completion(self) -> Completion:
        return Completion(
            text="".join(self.text),
            reasoning="".join(self.reasoning) if self.reasoning else None,
            finish_reason=self.finish_reason,
            usage=_wire_usage(self.usage),
            model=self.model,
            response_id=self.response_id,
        )


def _generic_event(event: Any) -> _WireAnswer | Failure:
    """A stream event the typed decoder refused (a field of another type): read it as
    a dict, keeping only what genq uses."""
    if not isinstance(event, dict):
        return Failure("protocol", f"stream event is not a JSON object: {str(event)[:200]}")
    if event.get("error") is not None:
        return _WireAnswer(error=event["error"])
    raw_usage = event.get("usage")
    usage = None
    if isinstance(raw_usage, dict):
        u = _usage(raw_usage)
        usage = _WireUsage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                           reasoning_tokens=u.reasoning_tokens)
    choices = []
    for choice in event.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        wire_delta = None
        if isinstance(delta, dict):
            wire_delta = _WireMessage(content=_str_or_none(delta.get("content")),
                                      reasoning_content=_str_or_none(delta.get("reasoning_content")),
                                      reasoning=_str_or_none(delta.get("reasoning")))
        choices.append(_WireChoice(delta=wire_delta, text=_str_or_none(choice.get("text")),
                                   finish_reason=_str_or_none(choice.get("finish_reason"))))
    return _WireAnswer(id=_str_or_none(event.get("id")), model=_str_or_none(event.get("model")),
                       choices=choices, usage=usage)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _capacity_from_props(props: dict[str, Any]) -> tuple[int | None, int | None]:
    """(slots, context per slot) from llama.cpp's /props."""
    slots = props.get("total_slots")
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return (slots if isinstance(slots, int) and slots > 0 else None,
            n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None)
