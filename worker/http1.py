"""A lean HTTP/1.1 client for the generation POSTs (issue #29: a worker's CPU per request).

aiohttp's client session cost about what a whole bare request loop costs (tracing, timers,
cookie jar, payload registry, a StreamReader per response): against a fast server it was
more than half of a worker's CPU. The POSTs need little of it: keep-alive connections to one
`http://` server, a body of known length, and an answer by Content-Length, chunked, or to
the connection's close. GETs (health, models, /metrics) go each on a connection of its own.
`https://` servers stay on aiohttp (worker/aioclient.py).

Only a request that got no response byte on a reused connection may be sent again (the
caller does: a server that closed an idle keep-alive connection, llama.cpp after each
stream); once a response byte came, every outcome is the request's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from yarl import URL

CONNECT_TIMEOUT_S = 10.0  # the aiohttp session's sock_connect, kept

# Feeds the body's bytes as they come; True: enough read (the connection is not reused).
Sink = Callable[[bytes], bool]


class NoResponse(ConnectionError):
    """The connection ended before any byte of the response; `reused`: it came from the pool."""

    reused = False


class _Conn(asyncio.Protocol):
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.waiter: asyncio.Future[None] | None = None
        self.closed = False
        self.error: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def eof_received(self) -> bool:
        self._ended(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended(exc)

    def _ended(self, exc: BaseException | None) -> None:
        self.closed = True
        self.error = self.error or exc
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def more(self) -> None:
        """Until more bytes come; raises once the connection has ended."""
        if self.closed:
            raise self.error if isinstance(self.error, OSError) else ConnectionResetError("the server closed the connection")
        self.waiter = self.loop.create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Http1Pool:
    """Keep-alive connections to one http:// server, each carrying one request at a time."""

    def __init__(self, base: URL, limit: int) -> None:
        self.host, self.port = base.host or "127.0.0.1", base.port or 80
        self.prefix = base.path.rstrip("/")
        self.limit = limit  # idle connections kept
        self.idle: list[_Conn] = []
        host = self.host if self.port == 80 else f"{self.host}:{self.port}"
        self._head = (f"\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: */*\r\n"
                      "Content-Length: ").encode()
        self._get_head = f"\r\nHost: {host}\r\nAccept: */*\r\nConnection: close\r\n\r\n".encode()

    def close(self) -> None:
        for conn in self.idle:
            conn.close()
        self.idle.clear()

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            _, conn = await loop.create_connection(lambda: _Conn(loop), self.host, self.port)
        return conn

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of a GET on a connection of its own, closed after (see ServerClient._get)."""
        parts: list[bytes] = []

        def keep(piece: bytes) -> bool:
            parts.append(piece)
            return False

        async with asyncio.timeout(timeout):
            conn = await self._connect()
            try:
                assert conn.transport is not None
                conn.transport.write(b"GET " + (self.prefix + path).encode() + b" HTTP/1.1" + self._get_head)
                status, _ = await _response(conn, lambda status: keep)
            finally:
                conn.close()
        return status, b"".join(parts)

    async def post(self, path: str, data: bytes, sink_for: Callable[[int], Sink], *, reuse: bool = True) -> int:
        """The status; the body went to sink_for(status). Raises NoResponse, or OSError, before
        the response; once it has begun, ConnectionError if the body is cut short."""
        conn = None
        while reuse and self.idle:
            if not (pooled := self.idle.pop()).closed:
                conn = pooled
                break
        reused = conn is not None
        if conn is None:
            conn = await self._connect()
        assert conn.transport is not None
        conn.transport.write(b"POST " + (self.prefix + path).encode() + b" HTTP/1.1" + self._head
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
        try:
            status, keep = await _response(conn, sink_for)
        except BaseException as exc:  # cut short, cancelled: the connection is in an unknown state
            conn.close()
            if isinstance(exc, NoResponse):
                exc.reused = reused
            raise
        if keep and not conn.closed and len(self.idle) < self.limit:
            self.idle.append(conn)
        else:
            conn.close()
        return status


async def _response(conn: _Conn, sink_for: Callable[[int], Sink]) -> tuple[int, bool]:
    """Reads one response, its body into sink: (status, whether the connection can carry another)."""
    buf = conn.buf
    while True:
        while (end := buf.find(b"\r\n\r\n")) < 0:
            if conn.closed and not buf:
                raise NoResponse("the server closed the connection before answering")
            await conn.more()
        lines = bytes(buf[:end]).split(b"\r\n")
        del buf[:end + 4]
        version, status = lines[0][:8], int(lines[0][9:12])
        if not 100 <= status < 200:
            break
    length, chunked, connection = -1, False, b""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            connection = value.strip().lower()
    keep = connection != b"close" if version == b"HTTP/1.1" else connection == b"keep-alive"
    sink = sink_for(status)
    if status in (204, 304):
        return status, keep
    if chunked:
        return status, keep and await _chunked(conn, sink)
    if length < 0:  # to the connection's close
        while True:
            if buf:
                stop = sink(bytes(buf))
                buf.clear()
                if stop:
                    return status, False
            if conn.closed:
                return status, False
            await conn.more()
    while length > 0:
        if not buf:
            await conn.more()
            continue
        piece = bytes(buf[:length])
        del buf[:length]
        length -= len(piece)
        if sink(piece):
            return status, False
    return status, keep


async def _chunked(conn: _Conn, sink: Sink) -> bool:
    """A chunked body into sink; whether it was read to its end."""
    buf = conn.buf
    while True:
        while (eol := buf.find(b"\r\n")) < 0:
            await conn.more()
        size = int(bytes(buf[:eol]).split(b";")[0], 16)
        del buf[:eol + 2]
        if size == 0:
            while (eol := buf.find(b"\r\n")) != 0:  # trailers, up to the empty line
                if eol > 0:
                    del buf[:eol + 2]
                else:
                    await conn.more()
            del buf[:2]
            return True
        while len(buf) < size + 2:
            await conn.more()
        piece = bytes(buf[:size])
        del buf[:size + 2]
        if sink(piece):
            return False
