"""The worker's HTTP/1.1 client (llhttp; aiohttp costs 80-100 % more CPU a request, docs/performance.md).
A request with no response byte on a reused keep-alive connection never reached the server (llama.cpp closes
after each stream): it is sent once more on a new one; after a byte, never.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable

import httptools
from yarl import URL

CONNECT_TIMEOUT_S = 10.0  # TCP and TLS handshakes: a server that takes longer is down
_FRAMING = (b"content-length", b"transfer-encoding")

# Fed a 200 answer's body as it comes; True: enough read (the connection is not reused).
Sink = Callable[[bytes], bool | None]


class NoResponse(ConnectionError):
    """The connection ended before any byte of the response."""


class _Conn(asyncio.Protocol):
    transport: asyncio.Transport | None

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop, self.transport, self.parser = loop, None, httptools.HttpResponseParser(self)
        self.answer: asyncio.Future[tuple[int, bool]] | None = None  # the request in flight's
        self.stream: Sink | None = None  # where a 200 answer's body goes; others are kept in `body`
        self.sink: Sink | None = None
        self.body: list[bytes] = []
        self.status, self.closed, self.keep = 0, False, False
        self.got = False  # a byte of this answer came
        self.framed = False  # by Content-Length or chunked; else the body runs to the close
        self.retry_after: bytes | None = None  # the answer's Retry-After header

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, stream: Sink | None) -> asyncio.Future[tuple[int, bool]]:
        """(status, whether the connection can carry another) once the answer is read."""
        assert self.transport is not None
        self.answer, self.stream, self.sink, self.got, self.body = self.loop.create_future(), stream, None, False, []
        self.retry_after = None
        self.transport.write(request)
        return self.answer

    def data_received(self, data: bytes) -> None:
        if self.answer is None or self.answer.done():  # bytes nobody asked for: not to be reused
            self.close()
            return
        self.got = True
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a sink's own error goes up as it was; llhttp's as a ValueError
            cause = exc.__context__ if isinstance(exc, httptools.HttpParserCallbackError) else None
            self._end(exc=cause if cause is not None else ValueError(f"{exc} ({bytes(data[:40])!r})"))

    def on_message_begin(self) -> None:
        if self.answer is None or self.answer.done():  # a second answer after the one asked for
            self.close()
        self.framed = False

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() in _FRAMING:
            self.framed = True
        elif name.lower() == b"retry-after":
            self.retry_after = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        if self.status >= 200:  # not 100 Continue and the like: the answer's own
            self.keep = self.parser.should_keep_alive()
            self.sink = self.stream if self.status == 200 and self.stream is not None else self.body.append

    def on_body(self, body: bytes) -> None:
        if self.sink is not None and self.sink(body):
            self._end(False)

    def on_message_complete(self) -> None:
        if self.sink is not None:
            self._end(self.keep)

    def connection_lost(self, exc: Exception | None) -> None:  # also after the server's EOF
        self.closed = True
        if not self.got:
            self._end(exc=NoResponse("the server closed the connection before answering"))
        elif self.sink is not None and not self.framed:  # a body to the close: this was its end
            self._end(False)
        else:
            self._end(exc=exc if isinstance(exc, OSError) else ConnectionResetError("the server closed the connection"))

    def _end(self, keep: bool = False, exc: BaseException | None = None) -> None:
        self.sink = None  # the sink gets no more
        if self.answer is not None and not self.answer.done():
            if exc is None:
                self.answer.set_result((self.status, keep))
            else:
                self.answer.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Keep-alive connections to one server, each carrying one request at a time."""

    def __init__(self, base: URL, limit: int) -> None:
        self.host, self.port = base.host or "127.0.0.1", base.port or 80  # yarl: 443 for https:// without one
        # https: the certificate checked against the system's trust store (or SSL_CERT_FILE) and the host.
        self.tls = ssl.create_default_context() if base.scheme == "https" else None
        if self.tls is not None:
            self.tls.set_alpn_protocols(["http/1.1"])
        self.prefix = base.path.rstrip("/")
        self.limit = limit  # idle connections kept
        self.idle: list[_Conn] = []
        self.reconnects = 0  # requests sent again after their reused connection was dead
        host = base.host_port_subcomponent  # the URI's authority: "[::1]:30000", no ":80"
        self._head = f"\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: */*\r\nContent-Length: ".encode()
        self._get_head = f"\r\nHost: {host}\r\nAccept: */*\r\nConnection: close\r\n\r\n".encode()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            _, conn = await loop.create_connection(lambda: _Conn(loop), self.host, self.port, ssl=self.tls)
        return conn

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of a GET on a connection of its own, closed after: a pooled one may be one
        the server is about to close, and a health check lost that way reads a live server as down."""
        async with asyncio.timeout(timeout):
            conn = await self._connect()
            try:
                status, _ = await conn.send(b"GET " + (self.prefix + path).encode() + b" HTTP/1.1" + self._get_head,
                                            None)
            finally:
                conn.close()
        return status, b"".join(conn.body)

    async def post(self, path: str, data: bytes, stream: Sink | None = None) -> tuple[int, bytes, bytes | None]:
        """(status, body, Retry-After); a 200 answer's body goes to `stream` instead, when there is one. Raises
        NoResponse, or OSError, before the response; once it has begun, ConnectionError if the body
        is cut short."""
        request = b"POST " + (self.prefix + path).encode() + b" HTTP/1.1" + self._head + str(len(data)).encode() \
            + b"\r\n\r\n" + data
        while self.idle:
            if not (conn := self.idle.pop()).closed:
                try:
                    return await self._send(conn, request, stream)
                except NoResponse:
                    self.reconnects += 1
                    break
        return await self._send(await self._connect(), request, stream)

    async def _send(self, conn: _Conn, request: bytes, stream: Sink | None) -> tuple[int, bytes, bytes | None]:
        try:
            status, keep = await conn.send(request, stream)
        except BaseException:  # cut short, cancelled: the connection is in an unknown state
            conn.close()
            raise
        if keep and not conn.closed and len(self.idle) < self.limit:
            self.idle.append(conn)
        else:
            conn.close()
        return status, b"".join(conn.body), conn.retry_after
