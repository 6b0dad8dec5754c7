"""HTTP client for one inference server (SGLang, vLLM, or `genq sim`).

Speaks only the public API: /health, /v1/models, /get_server_info (SGLang),
/metrics, and the OpenAI-compatible generation endpoints, streamed so the
worker sees tokens as they come (stall detection, in-flight lengths for the ETA).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from genq.core.records import JobConfig, Prompt, Usage

_json_decode = msgspec.json.Decoder().decode
_JSON_HEADERS = {"Content-Type": "application/json"}
_json_encode = msgspec.json.Encoder().encode

# Metric names genq reads; SGLang's first, vLLM's second.
RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running")
WAITING = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
KV_USAGE = ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RETRACTED = ("sglang:num_retracted_reqs",)  # gauge (older SGLang)
# Counters of requests pushed back out of the running batch for lack of KV cache.
RETRACTIONS_TOTAL = ("sglang:num_retracted_requests_total", "vllm:num_preemptions_total")


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


class ServerUnavailable(Exception):
    """The server is not answering (refused, reset, 503 from /health)."""


@dataclass
class ServerInfo:
    model: str | None
    capacity: int | None  # max running requests, when the server tells
    context_length: int | None
    kind: str  # "sglang" or "openai-compatible"
    has_metrics: bool


@dataclass
class Metrics:
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    retracted: float | None = None  # gauge: requests retracted lately
    retractions_total: float | None = None  # counter: requests retracted/preempted since start


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


@dataclass
class Progress:
    """Live state of one request, read by the watchdog and the in-flight report."""

    started: float = field(default_factory=time.monotonic)
    last_activity: float = field(default_factory=time.monotonic)
    tokens: int = 0


def build_body(config: JobConfig, prompt: Prompt, model: str, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": config.max_tokens}
    if config.temperature is not None:
        body["temperature"] = config.temperature
    if config.top_p is not None:
        body["top_p"] = config.top_p
    body.update(config.extra_body)
    if prompt.sampling:
        body.update(prompt.sampling)
        # OpenAI Batch bodies may say max_completion_tokens; SGLang honours both,
        # but the row's value must win over the job's max_tokens.
        if "max_completion_tokens" in prompt.sampling and "max_tokens" not in prompt.sampling:
            body.pop("max_tokens", None)
    if prompt.messages is not None:
        body["messages"] = prompt.messages
    else:
        body["prompt"] = prompt.prompt
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    else:
        body["stream"] = False
    return body


class ServerClient:
    def __init__(self, base_url: str, *, connections: int = 4096) -> None:
        self.base_url = base_url.rstrip("/")
        # Parsed once: a URL string is parsed again on every request otherwise.
        self._generate_urls = {
            "chat": URL(self.base_url + "/v1/chat/completions"),
            "completions": URL(self.base_url + "/v1/completions"),
        }
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, ttl_dns_cache=300)
        # No total timeout: the worker's watchdog enforces stall and request timeouts,
        # which a per-request aiohttp timer would only duplicate.
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            json_serialize=lambda obj: _json_encode(obj).decode(),
        )

    async def close(self) -> None:
        await self.session.close()

    async def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            async with self.session.get(self.base_url + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise ServerUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from None

    async def healthy(self) -> bool:
        try:
            status, _ = await self._get("/health")
        except ServerUnavailable:
            return False
        return status == 200

    async def discover(self) -> ServerInfo:
        """Model name and capacity. Raises ServerUnavailable if the server is not up."""
        status, _ = await self._get("/health")
        if status != 200:
            raise ServerUnavailable(f"{self.base_url}/health answered {status}")
        model = None
        status, body = await self._get("/v1/models")
        if status == 200:
            data = _json_decode(body).get("data") or []
            if data:
                model = data[0].get("id")
        capacity = context = None
        kind = "openai-compatible"
        for path in ("/get_server_info", "/server_info"):
            status, body = await self._get(path)
            if status == 200:
                kind = "sglang"
                info = _json_decode(body)
                capacity = _capacity(info)
                context = info.get("context_length")
                break
        status, body = await self._get("/metrics")
        has_metrics = status == 200 and (b"sglang:" in body or b"vllm:" in body)
        return ServerInfo(model=model, capacity=capacity, context_length=context, kind=kind, has_metrics=has_metrics)

    async def metrics(self) -> Metrics | None:
        try:
            status, body = await self._get("/metrics", timeout=3.0)
        except ServerUnavailable:
            return None
        if status != 200:
            return None
        return metrics_from_text(body.decode("utf-8", "replace"))

    async def generate(
        self, endpoint: str, body: dict[str, Any], progress: Progress
    ) -> Completion | Failure:
        url = self._generate_urls["chat" if endpoint == "chat" else "completions"]
        try:
            async with self.session.post(url, data=_json_encode(body), headers=_JSON_HEADERS) as resp:
                if resp.status != 200:
                    return _http_failure(resp.status, await resp.read())
                if body.get("stream"):
                    return await _read_stream(resp, progress, body.get("model", ""))
                return parse_completion_bytes(await resp.read(), body.get("model", ""))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            return Failure("connection", f"{type(exc).__name__}: {exc}".rstrip(": "))
        except msgspec.DecodeError as exc:
            return Failure("protocol", f"unparsable response: {exc}")


def metrics_from_text(text: str) -> Metrics:
    """The figures the concurrency controller reads, from a Prometheus text page."""
    sums = parse_metrics(text, RUNNING + WAITING + RETRACTED + RETRACTIONS_TOTAL)
    # Usage is a fraction per rank: the fullest rank is the one that retracts.
    kv = _first(parse_metrics(text, KV_USAGE, combine=max), KV_USAGE)
    return Metrics(
        running=_first(sums, RUNNING),
        waiting=_first(sums, WAITING),
        kv_usage=kv,
        retracted=_first(sums, RETRACTED),
        retractions_total=_first(sums, RETRACTIONS_TOTAL),
    )


def _capacity(info: dict[str, Any]) -> int | None:
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(isinstance(v, int) and v > 0 for v in effective):
        return sum(int(v) for v in effective if v)
    value = info.get("max_running_requests")
    return value if isinstance(value, int) and value > 0 else None


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in sums:
            return sums[name]
    return None


def parse_metrics(text: str, wanted: tuple[str, ...], combine=None) -> dict[str, float]:
    """Each wanted Prometheus sample over its labels (one series per DP/TP rank):
    summed, or combined by `combine` (e.g. max)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                # `name{labels} value [timestamp]` or `name value [timestamp]`
                rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name):]
                value = float(rest.split()[0])
            except (IndexError, ValueError):
                continue
            if name not in out:
                out[name] = value
            else:
                out[name] = combine(out[name], value) if combine else out[name] + value
    return out


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


def _event_failure(err: Any) -> Failure:
    if isinstance(err, dict):
        code = err.get("code")
        status = code if isinstance(code, int) else None
        message = str(err.get("message") or err)
    else:
        status, message = None, str(err)
    if status in (400, 413, 422):
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


async def _read_stream(resp: aiohttp.ClientResponse, progress: Progress, model: str) -> Completion | Failure:
    state = _StreamState(model)
    # Read whatever arrives rather than a readline per line (two per event): a short
    # answer comes in one piece. No async generator here: leaving one early costs a
    # task for its aclose(). Read on to the end of the body after [DONE]: a body left
    # unread makes aiohttp close the connection instead of reusing it.
    rest = b""
    async for chunk in resp.content.iter_any():
        progress.last_activity = time.monotonic()
        if state.done:
            continue
        if rest:
            chunk = rest + chunk
        lines = chunk.split(b"\n")
        rest = lines.pop()  # the unfinished last line (b"" when the chunk ends a line)
        for line in lines:
            if line.startswith(b"data:"):
                failure = state.feed(line[5:].strip(), progress)
                if failure is not None:
                    return failure
                if state.done:
                    break
    if not state.done and rest.startswith(b"data:"):
        failure = state.feed(rest[5:].strip(), progress)
        if failure is not None:
            return failure
    if not state.done:
        return Failure("connection", "stream ended before [DONE]")
    return state.completion()


class _StreamState:
    """What the events of one stream have said so far."""

    __slots__ = ("text", "reasoning", "finish_reason", "usage", "response_id", "model", "done")

    def __init__(self, model: str) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.usage: _WireUsage | None = None
        self.response_id: str | None = None
        self.model = model
        self.done = False

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
        if event.error is not None:  # SGLang and vLLM report mid-stream errors this way, on HTTP 200
            return _event_failure(event.error)
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
