"""HTTP client for one inference server: SGLang, vLLM, llama.cpp's llama-server, or `genq sim`.

Speaks only the public API: /health, /v1/models, what each engine serves of its own
(worker/engines.py), /metrics, and the OpenAI-compatible generation endpoints, streamed so the
worker sees tokens as they come (stall detection, in-flight lengths for the ETA).
"""

from __future__ import annotations

import time
from typing import Any

import msgspec
from yarl import URL

from genq.core.records import JobConfig, Prompt
from genq.worker.engines import Metrics, ServerInfo, detect, metrics_from_text
from genq.worker.http1 import Http1Pool, NoResponse
from genq.worker.stream import StreamSink
from genq.worker.wire import Completion, Failure, Progress, connection_failure, http_failure, parse_completion_bytes

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode

# How long a health check waits: SGLang's /health runs a one-token generation and answers 503
# itself after 20 s (SGLANG_HEALTH_CHECK_TIMEOUT); giving up sooner reads a busy server as down.
HEALTH_TIMEOUT_S = 30.0


class ServerUnavailable(Exception):
    """The server is not answering (refused, reset, 503 from /health)."""


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
    body["stream"] = stream
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


class ServerClient:
    def __init__(self, base_url: str, *, connections: int = 4096) -> None:
        self.base_url = base_url.rstrip("/")
        self._pool = Http1Pool(URL(self.base_url), connections)
        self.reconnects = 0  # requests sent again after their reused connection was dead

    async def close(self) -> None:
        self._pool.close()

    async def _get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        try:
            return await self._pool.get(path, timeout)
        except (OSError, ValueError) as exc:  # refused, reset, timed out, not HTTP
            raise ServerUnavailable(f"{self.base_url}{path}: {type(exc).__name__}: {exc}") from None

    async def _get_json(self, path: str) -> Any:
        """The JSON answer of a GET, or None if the server has no such endpoint."""
        status, body = await self._get(path)
        if status != 200:
            return None
        try:
            return _json_decode(body)
        except msgspec.DecodeError:
            return None

    async def healthy(self) -> bool:
        try:
            status, _ = await self._get("/health", HEALTH_TIMEOUT_S)
        except ServerUnavailable:
            return False
        return status == 200

    async def discover(self) -> ServerInfo:
        """Which server it is and what it tells. Raises ServerUnavailable if it is not up."""
        status, _ = await self._get("/health", HEALTH_TIMEOUT_S)
        if status != 200:
            raise ServerUnavailable(f"{self.base_url}/health answered {status}")
        model = model_len = size = None
        models = await self._get_json("/v1/models")
        if isinstance(models, dict):
            data = models.get("data") or []
            if data and isinstance(data[0], dict):
                model = data[0].get("id")
                model_len = data[0].get("max_model_len")  # vLLM and SGLang list the context here
                meta = data[0].get("meta")  # llama.cpp: the model file's bytes, its weights
                size = meta.get("size") if isinstance(meta, dict) else None
        found = await detect(self._get_json, self._get)
        memory = found.memory
        if memory.weight_bytes is None and isinstance(size, (int, float)) and size > 0:
            memory = msgspec.structs.replace(memory, weight_bytes=float(size), weight_from="/v1/models meta.size")
        context = found.context_length
        if context is None and isinstance(model_len, int) and model_len > 0:
            context = model_len
        return msgspec.structs.replace(found, model=model, context_length=context, memory=memory)

    async def metrics(self) -> Metrics | None:
        try:
            status, body = await self._get("/metrics", timeout=3.0)
        except ServerUnavailable:
            return None
        if status != 200:
            return None
        m = metrics_from_text(body.decode("utf-8", "replace"))
        m.at = time.monotonic()
        return m

    async def generate(self, endpoint: str, body: dict[str, Any], progress: Progress) -> Completion | Failure:
        """The request's outcome. Sent again once, on a new connection, only if a pooled one ended
        before any response byte: the server had closed it (llama.cpp does after every stream), so
        the request never reached it, and no attempt counts."""
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        data = _json_encode(body)
        try:
            return await self._post(path, data, body, progress, reuse=True)
        except NoResponse:
            self.reconnects += 1
            return await self._post(path, data, body, progress, reuse=False)

    async def _post(self, path: str, data: bytes, body: dict[str, Any], progress: Progress, *,
                    reuse: bool) -> Completion | Failure:
        """One try. Raises NoResponse only when a pooled connection ended before any response byte."""
        model = body.get("model", "")
        stream = StreamSink(model, progress) if body.get("stream") else None
        try:
            status, raw = await self._pool.post(path, data, stream, reuse=reuse)
        except NoResponse as exc:
            if exc.reused:
                raise
            return connection_failure(exc)
        except OSError as exc:  # refused, reset, cut short, the connect timeout
            return connection_failure(exc)
        except ValueError as exc:  # a status line, length or chunk size that is not HTTP's
            return Failure("protocol", f"malformed HTTP response: {exc}")
        if status != 200:
            return http_failure(status, raw)
        if stream is not None:
            return stream.outcome()
        progress.first_byte = progress.last_activity = time.monotonic()
        return parse_completion_bytes(raw, model)
