"""One request's path to an inference server and back as the record, through the public API only
(docs/engines.md), streamed. One tolerant reader decodes every engine's answers and errors; n samples
asked come back as n choices or a failure, and a record keeps only what was asked (docs/fidelity.md).
"""

from __future__ import annotations

import contextlib
import email.utils
import re
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec
from yarl import URL

from genq.core.records import Choice, ErrorKind, JobConfig, Prompt, Result, Usage
from genq.worker.engines import Metrics, ServerInfo, detect, metrics_from_text
from genq.worker.http1 import Http1Pool

# SGLang's /health runs a one-token generation and answers 503 itself after 20 s, and its /server_info
# waits on the scheduler too: giving up sooner on any GET of the server check reads a busy server as down.
HEALTH_TIMEOUT_S = 30.0
# The most trailing tokens SGLang's chat stream counts without sending their logprobs: those that
# decode to no text, the end-of-sequence token or the bytes of an unfinished UTF-8 character (<= 4).
UNSENT_MAX = 4
HEAD_MAX = 1 << 16  # the most of a stream's body kept to read it whole when it is not SSE

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


class ServerUnavailable(Exception):
    """Refused, reset, 503 from /health."""


@dataclass
class Progress:
    """Live state of one request, read by the watchdog, the decode meter and the in-flight report."""

    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    tokens: int = 0
    first_byte: float | None = None  # None until the body's first byte: till then it is queued, not stalled
    meter: Any = None  # what books a stream's tokens (worker/controller.py DecodeMeter)
    sequences: int = 1  # its n: each sample is a sequence on the server
    decoding: bool = False  # it has its first token
    waiting: bool = False  # sent, no token yet: queued or prefilling
    whole: Any = None  # its StreamSink once [DONE] came: the answer is whole, recorded even if the body never ends

    def advance(self, tokens: int) -> None:
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
    retry_after: float | None = None  # seconds the server asked to wait (Retry-After)


@dataclass
class Completion:
    choices: list[Choice]  # in index order
    usage: Usage
    model: str
    response_id: str | None


def build_body(config: JobConfig, prompt: Prompt, model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens}
    body.update({k: v for k, v in (("temperature", config.temperature), ("top_p", config.top_p)) if v is not None})
    body.update(config.extra_body)
    if prompt.sampling:
        body.update(prompt.sampling)
        # The row's token cap wins over the job's, whichever name each used (the servers take
        # max_completion_tokens over max_tokens).
        for mine, other in (("max_completion_tokens", "max_tokens"), ("max_tokens", "max_completion_tokens")):
            if mine in prompt.sampling and other not in prompt.sampling:
                body.pop(other, None)
        if "top_logprobs" in prompt.sampling and "logprobs" not in prompt.sampling:  # (chat) needs logprobs: true,
            body["logprobs"] = True  # which `jobs set --extra-body` may have dropped since the row was queued
    if prompt.messages is not None:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.prompt
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


def samples(config: JobConfig, prompt: Prompt) -> int:
    """The request's n: how many sequences it is on the server."""
    n = (prompt.sampling or {}).get("n", config.extra_body.get("n", 1))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


class ServerClient:
    def __init__(self, base_url: str, *, connections: int = 4096) -> None:
        self.base_url = base_url.rstrip("/")
        self.pool = Http1Pool(URL(self.base_url), connections)  # `connections`: idle ones kept

    async def close(self) -> None:
        self.pool.close()

    async def _get(self, path: str, timeout: float = HEALTH_TIMEOUT_S) -> tuple[int, bytes]:
        try:
            return await self.pool.get(path, timeout)
        except (OSError, ValueError) as exc:  # refused, reset, timed out, not HTTP
            raise ServerUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from None

    async def _get_json(self, path: str) -> Any:  # None: no such endpoint
        status, body = await self._get(path)
        with contextlib.suppress(msgspec.DecodeError):
            return _json_decode(body) if status == 200 else None
        return None

    async def healthy(self) -> bool:
        with contextlib.suppress(ServerUnavailable):
            return (await self._get("/health"))[0] == 200
        return False

    async def discover(self) -> ServerInfo:
        """Which server it is and what it tells; ServerUnavailable if it is not up."""
        status, _ = await self._get("/health")
        if status != 200:
            raise ServerUnavailable(f"{self.base_url}/health answered {status}")
        models = await self._get_json("/v1/models")
        listed = (models.get("data") or [None])[0] if isinstance(models, dict) else None
        listed = listed if isinstance(listed, dict) else {}
        found = await detect(self._get_json, self._get)
        meta = listed.get("meta")
        memory, context, size = found.memory, found.context_length, meta.get("size") if isinstance(meta, dict) else None
        if memory.weight_bytes is None and isinstance(size, (int, float)) and size > 0:  # llama.cpp: its weights
            memory = msgspec.structs.replace(memory, weight_bytes=float(size), weight_from="/v1/models meta.size")
        if context is None and isinstance(model_len := listed.get("max_model_len"), int) and model_len > 0:
            context = model_len  # vLLM and SGLang list the context here
        return msgspec.structs.replace(found, model=listed.get("id"), context_length=context, memory=memory)

    async def metrics(self) -> Metrics | None:
        with contextlib.suppress(ServerUnavailable):
            status, body = await self._get("/metrics", timeout=3.0)
            return metrics_from_text(body.decode("utf-8", "replace")) if status == 200 else None
        return None

    async def generate(self, endpoint: str, body: dict[str, Any], progress: Progress) -> Completion | Failure:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        model = body.get("model", "")
        stream = StreamSink(model, progress) if body.get("stream") else None
        try:
            status, raw, retry_after = await self.pool.post(path, _json_encode(body), stream)
        except OSError as exc:  # refused, reset, cut short, the connect timeout, no answer
            if stream is not None and stream.done:  # cut after [DONE]: the answer is whole
                return stream.outcome()
            return Failure("connection", f"{type(exc).__name__}: {exc}".rstrip(": "))
        except ValueError as exc:  # a status line, length or chunk size that is not HTTP's
            return Failure("protocol", f"malformed HTTP response: {exc}")
        if status != 200:
            return http_failure(status, raw, retry_after)
        if stream is not None:
            return stream.outcome()
        progress.first_byte = progress.last_activity = time.monotonic()
        return parse_completion_bytes(raw, model)


class WireUsage(msgspec.Struct):  # typed views decode several times faster than dicts
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
    logprobs: dict[str, Any] | None = None
    matched_stop: int | str | None = None  # SGLang
    stop_reason: int | str | None = None  # vLLM's name

    @property
    def stop(self) -> int | str | None:
        return self.matched_stop if self.matched_stop is not None else self.stop_reason


class _WireAnswer(msgspec.Struct):
    """A response, one stream chunk, or an error body."""

    id: str | None = None
    model: str | None = None
    object: str | None = None
    choices: list[_WireChoice] | None = None
    usage: WireUsage | None = None
    error: Any = None  # nested error bodies (vLLM, llama.cpp, SGLang's stream events)
    message: Any = None  # flat error bodies (SGLang): {"object": "error", "message", "code", ...}
    code: Any = None


_answer_decode = msgspec.json.Decoder(_WireAnswer).decode
_PATH_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def decode_answer(raw: bytes) -> _WireAnswer | Failure:
    """A response or stream event (a flat error body read as a nested one); a protocol Failure if it is
    not a JSON object. A field of another type is taken as absent, a list item of another type left out."""
    try:
        try:
            answer = _answer_decode(raw)
        except msgspec.ValidationError:
            body = _json_decode(raw)
            while True:
                try:
                    answer = msgspec.convert(body, _WireAnswer)
                    break
                except msgspec.ValidationError as exc:  # drop what it names, and try again
                    where = str(exc).rpartition(" - at `$")[2]
                    steps: list[Any] = [int(i) if i else k for k, i in _PATH_STEP.findall(where)]
                    if not steps:
                        return Failure("protocol", f"answer is not a JSON object: {raw[:200]!r}")
                    parent = body
                    for step in steps[:-1]:
                        parent = parent[step]
                    del parent[steps[-1]]
    except msgspec.DecodeError as exc:
        return Failure("protocol", f"unparsable answer: {exc} ({raw[:200]!r})")
    if answer.error is None and answer.object == "error":
        answer.error = {"message": answer.message, "code": answer.code}
    return answer


def http_failure(status: int, raw: bytes, retry_after: bytes | None = None) -> Failure:
    """A non-200 answer: judged by its HTTP status, told by its error's message; with the wait its
    Retry-After asks, in seconds or as an HTTP date (RFC 9110), if it is either."""
    error = answer.error if isinstance(answer := decode_answer(raw), _WireAnswer) else None
    message = error.get("message") if isinstance(error, dict) else error if isinstance(error, str) else None
    page = " ".join(raw[:500].decode("utf-8", "replace").split())  # a proxy's HTML page, in one line
    failure = event_failure({"code": status, "message": message or page or "(empty body)"})
    wait = (retry_after or b"").decode("latin-1").strip()
    with contextlib.suppress(TypeError, ValueError):
        failure.retry_after = float(wait) if wait.isdigit() else \
            max(0.0, email.utils.parsedate_to_datetime(wait).timestamp() - time.time())
    return failure


def event_failure(err: Any, mid_stream: bool = False) -> Failure:
    """The failure an error body names. Mid-stream (the request ran) it is a server_error to retry
    whatever its code: SGLang sends any exception in a running stream with its blanket code 400."""
    code = err.get("code") if isinstance(err, dict) else None
    status = code if isinstance(code, int) else None
    message = " ".join((str(err.get("message") or err) if isinstance(err, dict) else str(err)).split())  # one line
    if status in (400, 413, 422) and not mid_stream:
        return Failure("bad_request", message, status, retryable=False)
    return Failure("server_error", message, status)


def usage_of(raw: WireUsage | None) -> Usage:
    if raw is None:
        return Usage()
    reasoning = raw.reasoning_tokens
    if reasoning is None and raw.completion_tokens_details:
        reasoning = raw.completion_tokens_details.get("reasoning_tokens")
    return Usage(prompt_tokens=raw.prompt_tokens or 0, completion_tokens=raw.completion_tokens or 0,
                 reasoning_tokens=reasoning if isinstance(reasoning, int) and reasoning else None)


def parse_completion_bytes(raw: bytes, model: str) -> Completion | Failure:  # a non-streamed answer
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
    if len(choices) == 1:  # a whole answer's usage is the request's: one choice has it all
        choices[0].completion_tokens = usage.completion_tokens
    return Completion(choices=choices, usage=usage, model=answer.model or model, response_id=answer.id)


@dataclass(slots=True)
class _ChoiceState:
    """One choice of a stream: n > 1 come interleaved by `index`, a chunk's usage counting its own
    choice's tokens; the last chunk (no choices) has the request's total (docs/fidelity.md)."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    tokens: int | None = None  # the last per-choice usage seen
    logprobs: dict[str, Any] | None = None
    matched_stop: int | str | None = None
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)  # by the call's index

    def add(self, wire: _WireChoice) -> None:
        delta = wire.delta
        if delta is not None:
            if delta.content:
                self.text.append(delta.content)
            if piece := delta.reasoning_content or delta.reasoning:
                self.reasoning.append(piece)
            # A call comes in pieces by index: the first names id, type and function, the rest carry
            # more of its arguments (OpenAI's shape; SGLang and vLLM send it).
            for part in delta.tool_calls or ():
                index = part.get("index", len(self.tool_calls))
                call = self.tool_calls.setdefault(index if isinstance(index, int) else 0, {
                    "id": None, "type": "function", "function": {"name": None, "arguments": ""}})
                call.update({key: part[key] for key in ("id", "type") if part.get(key)})
                function = part.get("function")
                if isinstance(function, dict):
                    if function.get("name"):
                        call["function"]["name"] = function["name"]
                    if isinstance(function.get("arguments"), str):
                        call["function"]["arguments"] += function["arguments"]
        elif wire.text:
            self.text.append(wire.text)
        if wire.finish_reason:
            self.finish_reason, self.matched_stop = wire.finish_reason, wire.stop
        if wire.logprobs:  # a chunk's lists extend what came before
            have = self.logprobs = self.logprobs or {}
            for key, value in wire.logprobs.items():
                if isinstance(value, list) and isinstance(have.get(key), list):
                    have[key].extend(value)
                elif value is not None or key not in have:
                    have[key] = list(value) if isinstance(value, list) else value

    def choice(self, index: int) -> Choice:
        return Choice(index=index, completion="".join(self.text), finish_reason=self.finish_reason,
                      completion_tokens=self.tokens, reasoning_content="".join(self.reasoning) or None,
                      logprobs=self.logprobs, matched_stop=self.matched_stop,
                      tool_calls=[self.tool_calls[i] for i in sorted(self.tool_calls)] or None)


@dataclass(slots=True)
class StreamSink:
    """A stream's body as it comes, in pieces of any size: split into `data:` events, each fed to the
    answer so far. Called with each piece; True once a failure ends the reading."""

    model: str
    progress: Progress
    rest: bytes = b""  # the unfinished last line
    failure: Failure | None = None
    choices: dict[int, _ChoiceState] = field(default_factory=dict)
    usage: WireUsage | None = None
    total_seen: bool = False  # usage came on a chunk without choices: the request's total
    response_id: str | None = None
    done: bool = False
    events: int = 0
    head: bytes = b""  # the body's start, until its first event: one that is not SSE is read whole

    def __call__(self, chunk: bytes) -> bool:
        progress = self.progress
        now = progress.last_activity = time.monotonic()
        if progress.first_byte is None:
            progress.first_byte = now
        if self.done:  # read on to the body's end: a body left unread costs the connection
            return False
        if not self.events and len(self.head) < HEAD_MAX:
            self.head += chunk
        lines = (self.rest + chunk if self.rest else chunk).split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                if (failure := self.feed(line[5:].strip())) is not None:
                    self.failure = failure
                    return True
                if self.done:
                    break
        return False

    def outcome(self) -> Completion | Failure:  # once the body has ended or a failure stopped the reading
        if self.failure is None and not self.done and self.rest.startswith(b"data:"):
            self.failure = self.feed(self.rest[5:].strip())
        if self.failure is None and not self.done and not self.events and self.head.strip() \
                and not self.head.lstrip().startswith((b"data:", b":")):  # not SSE: a JSON error, a page
            return parse_completion_bytes(self.head, self.model)
        return self.failure or (self.completion() if self.done else Failure("connection", "stream ended before [DONE]"))

    def feed(self, payload: bytes) -> Failure | None:
        progress = self.progress
        if payload == b"[DONE]":
            self.done, progress.whole = True, self
            return None
        event = decode_answer(payload)
        if isinstance(event, Failure):
            return Failure("protocol", f"stream event is not a JSON object: {payload[:200]!r}")
        if event.error is not None:  # the engines report errors in a running stream this way, on HTTP 200
            return event_failure(event.error, mid_stream=self.events > 0)
        self.events += 1
        self.response_id = self.response_id or event.id
        self.model = event.model or self.model
        usage = event.usage
        for wire in event.choices or ():
            state = self.choices.get(wire.index) or self.choices.setdefault(wire.index, _ChoiceState())
            state.add(wire)
            if usage is not None and usage.completion_tokens is not None:
                state.tokens = usage.completion_tokens
        if usage is not None:
            self.total_seen = self.total_seen or not event.choices
            whole = self.total_seen or len(self.choices) <= 1  # the request's count, not one choice's
            if whole:
                self.usage = usage
            elif self.usage is None:  # per-choice usage: the prompt's tokens for the total
                self.usage = WireUsage(prompt_tokens=usage.prompt_tokens)
            progress.advance((usage.completion_tokens or 0) if whole
                             else sum(s.tokens or 0 for s in self.choices.values()))
        elif self.usage is None:
            progress.advance(progress.tokens + 1)  # no usage stats: count events
        return None

    def completion(self) -> Completion:
        choices = [self.choices.get(i, _ChoiceState()).choice(i) for i in sorted(self.choices) or [0]]
        usage = usage_of(self.usage)
        if not self.total_seen and len(choices) > 1:  # no total from the server: the choices' sum
            usage.completion_tokens = sum(c.completion_tokens or 0 for c in choices)
        elif len(choices) > 1:
            # SGLang's chat stream sends no chunk for a choice's end-of-sequence token, which its
            # total counts: a total above the choices' counts by the number that stopped is theirs.
            stopped = [c for c in choices if c.finish_reason in ("stop", "tool_calls")]
            if stopped and usage.completion_tokens - sum(c.completion_tokens or 0 for c in choices) == len(stopped):
                for c in stopped:
                    c.completion_tokens = (c.completion_tokens or 0) + 1
        if len(choices) == 1 and (choices[0].completion_tokens is None or self.total_seen):
            choices[0].completion_tokens = usage.completion_tokens
        return Completion(choices=choices, usage=usage, model=self.model, response_id=self.response_id)


def result_of(body: dict[str, Any], c: Completion, *, prompt: Prompt, job: str, batch: str, worker: str,
              attempts: int, latency_s: float, settings_version: int = 0) -> Result | Failure:
    """The record of an answer; a non-retryable Failure when it lacks a choice or logprobs asked for
    (a record with fewer samples than asked would pass unnoticed into training data)."""
    n = body.get("n", 1)
    n = n if isinstance(n, int) and n > 1 else 1
    indexes = [choice.index for choice in c.choices]
    # An aborted request's text is what was made before it ended, not an answer: the server's failure, retried.
    if aborted := next((x.finish_reason for x in c.choices if x.finish_reason in ("abort", "error")), None):
        return Failure("server_error", f"the server ended the request with finish_reason {aborted}")
    if indexes != list(range(n)):
        return Failure("protocol", f"the request asked for n={n} choices; the server answered with "
                       f"indexes {indexes}", retryable=False)
    asked_stop = body.get("stop") or body.get("stop_token_ids")  # else no Result.matched_stop
    # Chat asks with true; completions with a count of alternatives, 0 included.
    asked_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
    for choice in c.choices:
        if not asked_stop:
            choice.matched_stop = msgspec.UNSET  # absent: not asked; null: asked, the server named none
        if not asked_logprobs:
            choice.logprobs = None
            continue
        tokens = choice.completion_tokens if choice.completion_tokens is not None else \
            c.usage.completion_tokens if n == 1 else None
        logprobs = one_per_token(choice.logprobs, tokens, choice.finish_reason, chat="messages" in body)
        if logprobs is None:
            return Failure("protocol", f"the request asked for logprobs; the server's choice {choice.index} has none",
                           retryable=False)
        choice.logprobs = logprobs
    first = c.choices[0]
    return Result(
        id=prompt.id, job=job, batch=batch, index=prompt.index,
        completion=first.completion, reasoning_content=first.reasoning_content, finish_reason=first.finish_reason,
        usage=c.usage, model=c.model, worker=worker, attempts=attempts, latency_s=round(latency_s, 3),
        # Without its prompt, as Redis keeps it (records.without_prompt): the shard joins them again.
        response_id=c.response_id, finished_at=time.time(),
        choices=c.choices if n > 1 else None, logprobs=first.logprobs, matched_stop=first.matched_stop,
        tool_calls=first.tool_calls, settings_version=settings_version,
    )


def one_per_token(logprobs: dict[str, Any] | None, tokens: int | None, finish_reason: str | None, *,
                  chat: bool) -> dict[str, Any] | None:
    """A choice's logprobs with one entry per generated token (docs/engines.md, "Logprobs"): the up
    to UNSENT_MAX trailing tokens SGLang's chat stream counts and never sends are null entries (no
    figure made up). None: the server sent none where more were needed (it ignored the request)."""
    have = 0 if logprobs is None else len(logprobs.get("content" if chat else "token_logprobs") or ())
    unsent = 0 if tokens is None else tokens - have
    if not 0 < unsent <= UNSENT_MAX or (logprobs is None and finish_reason not in ("stop", "tool_calls")):
        return logprobs
    if chat:
        entry = {"token": None, "logprob": None, "bytes": None, "top_logprobs": None}
        return {**(logprobs or {}), "content": [*((logprobs or {}).get("content") or ()), *[entry] * unsent]}
    if logprobs is None:
        return {k: [None] * unsent for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    # Each per-token list grows (top_logprobs is null, not a list, when no alternatives were asked).
    return {k: [*v, *[None] * unsent] if isinstance(v, list) and len(v) == have else v for k, v in logprobs.items()}
