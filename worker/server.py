"""HTTP client for one inference server (SGLang, vLLM, or `genq sim`).

Speaks only the public API: /health, /v1/models, /get_server_info (SGLang),
/metrics, and the OpenAI-compatible generation endpoints, streamed so the
worker sees tokens as they come (stall detection, in-flight lengths for the ETA).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from genq.records import JobConfig, Prompt, Usage

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode

# Metric names genq reads; SGLang's first, vLLM's second.
RUNNING = ("sglang:num_running_reqs", "vllm:num_requests_running")
WAITING = ("sglang:num_queue_reqs", "vllm:num_requests_waiting")
KV_USAGE = ("sglang:token_usage", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RETRACTED = ("sglang:num_retracted_reqs",)


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
    retracted: float | None = None


@dataclass
class Failure:
    kind: str  # see genq.records.ErrorKind
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
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
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
        sums = parse_metrics(body.decode("utf-8", "replace"), RUNNING + WAITING + KV_USAGE + RETRACTED)
        return Metrics(
            running=_first(sums, RUNNING),
            waiting=_first(sums, WAITING),
            kv_usage=_first(sums, KV_USAGE),
            retracted=_first(sums, RETRACTED),
        )

    async def generate(
        self, endpoint: str, body: dict[str, Any], progress: Progress
    ) -> Completion | Failure:
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        try:
            async with self.session.post(self.base_url + path, data=_json_encode(body),
                                         headers={"Content-Type": "application/json"}) as resp:
                if resp.status != 200:
                    return _http_failure(resp.status, await resp.read())
                if body.get("stream"):
                    return await _read_stream(resp, progress, body.get("model", ""))
                return _parse_completion(_json_decode(await resp.read()), body.get("model", ""))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            return Failure("connection", f"{type(exc).__name__}: {exc}".rstrip(": "))
        except msgspec.DecodeError as exc:
            return Failure("protocol", f"unparsable response: {exc}")


def _capacity(info: dict[str, Any]) -> int | None:
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(isinstance(v, int) and v > 0 for v in effective):
        return sum(effective)
    value = info.get("max_running_requests")
    return value if isinstance(value, int) and value > 0 else None


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in sums:
            return sums[name]
    return None


def parse_metrics(text: str, wanted: tuple[str, ...]) -> dict[str, float]:
    """Sum each wanted Prometheus sample over its labels (one series per DP/TP rank)."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                sums[name] = sums.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
            except (IndexError, ValueError):
                continue
    return sums


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
    text: list[str] = []
    reasoning: list[str] = []
    finish_reason = None
    usage: Any = None
    response_id = None
    served_model = model
    done = False
    async for line in resp.content:
        progress.last_activity = time.monotonic()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        event = _json_decode(payload)
        if "error" in event:  # SGLang and vLLM report mid-stream errors this way, on HTTP 200
            return _event_failure(event["error"])
        if event.get("usage"):
            usage = event["usage"]
            progress.tokens = int(usage.get("completion_tokens") or progress.tokens)
        response_id = response_id or event.get("id")
        served_model = event.get("model") or served_model
        for choice in event.get("choices") or ():
            delta = choice.get("delta")
            if delta is not None:
                if delta.get("content"):
                    text.append(delta["content"])
                piece = delta.get("reasoning_content") or delta.get("reasoning")
                if piece:
                    reasoning.append(piece)
            elif choice.get("text"):
                text.append(choice["text"])
            if choice.get("finish_reason"):
                finish_reason = choice["finish_reason"]
        if usage is None:
            progress.tokens += 1
    if not done:
        return Failure("connection", "stream ended before [DONE]")
    return Completion(
        text="".join(text),
        reasoning="".join(reasoning) if reasoning else None,
        finish_reason=finish_reason,
        usage=_usage(usage),
        model=served_model,
        response_id=response_id,
    )
