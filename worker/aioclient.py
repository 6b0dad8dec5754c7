"""The generation POSTs to an https:// server, on aiohttp (an http:// server's go through
worker/http1.py). Imported only for such a server: aiohttp's import is a quarter of a second
of every worker's start otherwise."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import msgspec
from yarl import URL

from genq.worker.stream import StreamSink
from genq.worker.wire import Completion, Failure, Progress, _connection_failure, _http_failure, parse_completion_bytes

_JSON_HEADERS = {"Content-Type": "application/json"}

# Errors of a request that never got a response byte: on a reused keep-alive
# connection these mean the server had closed it (llama.cpp does after every stream).
_BEFORE_RESPONSE = (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError)


class AioClient:
    def __init__(self, connections: int) -> None:
        self._connections = connections
        connector = aiohttp.TCPConnector(limit=connections, limit_per_host=connections, ttl_dns_cache=300)
        # Tells a request whether it went out on a pooled (reused) connection.
        tracing = aiohttp.TraceConfig()
        tracing.on_connection_reuseconn.append(_mark_reused)
        # No total timeout: the worker's watchdog enforces stall and request timeouts,
        # which a per-request aiohttp timer would only duplicate.
        self.session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), trace_configs=[tracing])
        # Never reuses a connection: for GETs, and for a generation request whose
        # pooled connection turned out dead.
        self._fresh: aiohttp.ClientSession | None = None
        self.reconnects = 0  # requests sent again after their reused connection was dead

    async def close(self) -> None:
        await self.session.close()
        if self._fresh is not None:
            await self._fresh.close()

    def _fresh_session(self) -> aiohttp.ClientSession:
        if self._fresh is None:
            self._fresh = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._connections, force_close=True),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            )
        return self._fresh

    async def get(self, url: str, timeout: float) -> tuple[int, bytes]:
        try:
            async with self._fresh_session().get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except aiohttp.ClientError as exc:  # as the lean client's: an OSError
            raise OSError(f"{type(exc).__name__}: {exc}") from None

    async def generate(self, url: URL, data: bytes, body: dict[str, Any], progress: Progress) -> Completion | Failure:
        trace = SimpleNamespace(reused=False)
        try:
            return await _post(self.session, url, data, body, progress, trace)
        except _BEFORE_RESPONSE as exc:
            if not trace.reused:
                return _connection_failure(exc)
            # The pooled connection was dead before the server said anything: the
            # request never reached a live server. Send it again at once on a new
            # connection; the server's behaviour, not the prompt's, so no attempt counts.
            self.reconnects += 1
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            return _connection_failure(exc)
        try:
            return await _post(self._fresh_session(), url, data, body, progress, None)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            return _connection_failure(exc)


async def _post(session: aiohttp.ClientSession, url: URL, data: bytes, body: dict[str, Any],
                progress: Progress, trace: SimpleNamespace | None) -> Completion | Failure:
    """One try. Errors before the response escape as exceptions; once the response
    has begun, every outcome (failures after response bytes included) is returned,
    so the caller never sends it again."""
    async with session.post(url, data=data, headers=_JSON_HEADERS, trace_request_ctx=trace) as resp:
        try:
            if resp.status != 200:
                outcome: Completion | Failure = _http_failure(resp.status, await resp.read())
            elif body.get("stream"):
                outcome = await _read_stream(resp, progress, body.get("model", ""))
            else:
                raw = await resp.read()
                progress.first_byte = progress.last_activity = time.monotonic()
                outcome = parse_completion_bytes(raw, body.get("model", ""))
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as exc:
            outcome = _connection_failure(exc)
        except msgspec.DecodeError as exc:
            outcome = Failure("protocol", f"unparsable response: {exc}")
        return outcome


async def _mark_reused(session: Any, ctx: SimpleNamespace, params: Any) -> None:
    if ctx.trace_request_ctx is not None:
        ctx.trace_request_ctx.reused = True




async def _read_stream(resp: aiohttp.ClientResponse, progress: Progress, model: str) -> Completion | Failure:
    # Whatever arrives, not a readline per line (two per event): a short answer comes in one
    # piece. No async generator here: leaving one early costs a task for its aclose().
    sink = StreamSink(model, progress)
    async for chunk in resp.content.iter_any():
        if sink(chunk):
            break
    return sink.outcome()
