"""genq's HTTP/1.1 client (worker/http1.py, under worker/server.py) against a server that answers
scripted bytes, a byte at a time: every way a body can end, which connections may carry the next
request, TLS."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess

import pytest
from yarl import URL

from genq.worker.engines import ServerInfo
from genq.worker.http1 import Http1Pool, NoResponse
from genq.worker.server import Completion, Failure, Progress, ServerClient

OK_JSON = b'{"a": 1}'


class Scripted:
    """Answers each request on a connection with the next of its answers; then, if told, closes."""

    def __init__(self, answers: list[bytes], close_after: bool = False, step: int = 1) -> None:
        self.answers = answers
        self.close_after = close_after
        self.step = step
        self.connections = 0
        self.requests: list[bytes] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)  # a GET has none
                self.requests.append(head + await reader.readexactly(length))
                answer = self.answers.pop(0)
                if not answer:
                    break
                for i in range(0, len(answer), self.step):  # a byte at a time: every split the parser can meet
                    writer.write(answer[i:i + self.step])
                    await writer.drain()
                if self.close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


async def post(pool: Http1Pool) -> tuple[int, bytes]:
    return (await pool.post("/v1/chat/completions", b'{"x": 1}'))[:2]


def run(answers: list[bytes], go, close_after: bool = False, step: int = 1) -> Scripted:
    scripted = Scripted(answers, close_after, step)

    async def main() -> None:
        server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(URL(f"http://127.0.0.1:{port}/prefix"), 8)
        try:
            await go(pool)
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    return scripted


def generate(answers: list[bytes], close_after: bool = False, step: int = 1) -> Completion | Failure:
    """A streamed chat request of ServerClient against a server answering `answers`: its outcome."""
    async def main() -> Completion | Failure:
        server = await asyncio.start_server(Scripted(answers, close_after, step).handle, "127.0.0.1", 0)
        client = ServerClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            return await client.generate("chat", {"model": "m", "stream": True}, Progress())
        finally:
            await client.close()
            server.close()

    return asyncio.run(main())


def test_bodies_by_length_chunks_and_close_and_keep_alive_reuse():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"3;ext=1\r\ndat\r\n5\r\na: [D\r\n0\r\nX-Trailer: t\r\n\r\n")
    answers = [
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n" + OK_JSON,
        chunked,
        b"HTTP/1.1 400 Bad Request\r\ncontent-length: 2\r\n\r\nno",
        b"HTTP/1.0 200 OK\r\n\r\n" + OK_JSON,  # no length: to the close
    ]

    async def go(pool: Http1Pool) -> None:
        assert await post(pool) == (200, OK_JSON)
        assert await post(pool) == (200, b"data: [D")
        assert await post(pool) == (400, b"no")
        assert await post(pool) == (200, OK_JSON)
        assert not pool.idle  # HTTP/1.0 without keep-alive: not kept

    scripted = run(answers, go)
    assert scripted.connections == 1, "keep-alive: one connection carried all four"
    assert all(r.startswith(b"POST /prefix/v1/chat/completions HTTP/1.1\r\n") for r in scripted.requests)


def test_connection_close_is_not_reused_and_a_dead_pooled_one_is_sent_again_on_a_new_one():
    answers = [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 8\r\n\r\n" + OK_JSON,
               b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n" + OK_JSON,
               b"",  # the server takes the request and closes without a byte (llama.cpp after a stream)
               b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n" + OK_JSON]

    async def go(pool: Http1Pool) -> None:
        assert await post(pool) == (200, OK_JSON)
        assert not pool.idle
        assert await post(pool) == (200, OK_JSON)  # on a new connection, kept
        assert len(pool.idle) == 1
        # It went out on the pooled connection and no byte came: sent again on a new one.
        assert await post(pool) == (200, OK_JSON)
        assert pool.reconnects == 1

    scripted = run(answers, go)
    assert scripted.connections == 3

def test_a_body_cut_short_is_a_connection_error_not_a_lost_request():
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + OK_JSON]

    async def go(pool: Http1Pool) -> None:
        with pytest.raises(ConnectionError) as cut:
            await post(pool)
        assert not isinstance(cut.value, NoResponse), "response bytes came: not to be sent again"
        assert not pool.idle

    run(answers, go, close_after=True)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 2x0 OK\r\nContent-Length: 8\r\n\r\n" + OK_JSON,  # a status that is not a number
    b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\nTransfer-Encoding: chunked\r\n\r\n8\r\n" + OK_JSON,  # both framings
    b"SSH-2.0-OpenSSH_9.6\r\n",  # not HTTP, on a connection the server keeps open
])
def test_a_malformed_answer_is_a_value_error_at_once_not_a_hang_or_a_lost_request(answer):
    async def go(pool: Http1Pool) -> None:
        async with asyncio.timeout(5):
            with pytest.raises(ValueError):
                await post(pool)
        assert not pool.idle

    run([answer, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"], go)  # a second answer: the server keeps it open


@pytest.mark.parametrize("step", [1, 1000])  # a byte at a time, and the whole answer in one piece
def test_a_sink_that_has_enough_gets_no_more_and_the_connection_is_not_reused(step):
    answer = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n4\r\nSTOP\r\n1\r\nb\r\n0\r\n\r\n"
    parts: list[bytes] = []

    def sink(piece: bytes) -> bool:
        parts.append(piece)
        return b"".join(parts).endswith(b"STOP")

    async def go(pool: Http1Pool) -> None:
        assert await pool.post("/v1/completions", b"{}", sink) == (200, b"", None)
        assert b"".join(parts) == b"aSTOP", "nothing after the sink said enough"
        assert not pool.idle

    run([answer], go, step=step)


def test_a_server_on_an_ipv6_address_gets_a_bracketed_host_header():
    # `--server http://[::1]:30000`: the Host header is "[::1]:30000" (RFC 9110 uses the URI's
    # authority), not "::1:30000", which a strict server refuses as a bad request.
    scripted = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 8\r\n\r\n" + OK_JSON])

    async def main() -> None:
        server = await asyncio.start_server(scripted.handle, "::1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = Http1Pool(URL(f"http://[::1]:{port}"), 8)
        try:
            assert await post(pool) == (200, OK_JSON)
        finally:
            pool.close()
            server.close()

    asyncio.run(main())
    host = next(line for line in scripted.requests[0].split(b"\r\n") if line.lower().startswith(b"host:"))
    assert host.split(b":", 1)[1].strip().startswith(b"[::1]:"), host


@pytest.mark.e2e  # openssl makes the certificate
def test_an_https_server_is_spoken_to_over_tls_verified_against_the_trust_store(tmp_path, monkeypatch):
    # The same client for `https://`: the certificate checked against the default trust store
    # (SSL_CERT_FILE names it here), the name against the URL's host; one that is not trusted is a
    # connection failure, not a request sent in clear.
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls.load_cert_chain(cert, key)
    body = b'{"choices": [{"index": 0, "message": {"content": "hi"}}], "usage": {"completion_tokens": 1}}'
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    scripted = Scripted([b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n", answer, answer], step=1000)

    async def main() -> None:
        server = await asyncio.start_server(scripted.handle, "127.0.0.1", 0, ssl=tls)
        url = f"https://localhost:{server.sockets[0].getsockname()[1]}"
        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "nothing.pem"))
        untrusted = ServerClient(url)
        try:
            assert not await untrusted.healthy(), "a certificate nobody trusts: no answer read"
            outcome = await untrusted.generate("chat", {"model": "m", "stream": False}, Progress())
            assert isinstance(outcome, Failure) and outcome.kind == "connection", outcome
        finally:
            await untrusted.close()
        monkeypatch.setenv("SSL_CERT_FILE", str(cert))
        client = ServerClient(url)
        try:
            assert await client.healthy()
            for _ in range(2):
                outcome = await client.generate("chat", {"model": "m", "stream": False}, Progress())
                assert isinstance(outcome, Completion) and outcome.choices[0].completion == "hi", outcome
        finally:
            await client.close()
            server.close()

    asyncio.run(main())
    assert scripted.requests[0].startswith(b"GET /health HTTP/1.1\r\n")
    assert scripted.connections == 2, "the GET on a connection of its own, both POSTs on one kept alive"


def test_a_stream_event_that_is_not_json_is_a_protocol_failure_not_an_exception():
    sse = b"data: {not json\n\n"
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(sse), sse)]

    outcome = generate(answers)
    assert isinstance(outcome, Failure) and outcome.kind == "protocol", outcome


def test_a_busy_sglang_whose_server_info_answers_late_is_not_read_as_down():
    """SGLang's /server_info asks its scheduler for internal_states, as /health's generation does: on a
    busy scheduler both answer late. The check after a failed request read /server_info with 5 s where
    /health had 30: a busy server was down, every request in flight cancelled and counted a crash."""
    info = json.dumps({"context_length": 4096, "max_running_requests": 48}).encode()
    models = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        path = (await reader.readuntil(b"\r\n\r\n")).split(b" ")[1]
        if path == b"/server_info":
            await asyncio.sleep(6)
        body = {b"/health": b"", b"/v1/models": models, b"/server_info": info}.get(path)
        head = b"HTTP/1.1 200 OK" if body is not None else b"HTTP/1.1 404 Not Found"
        writer.write(b"%s\r\nContent-Length: %d\r\n\r\n%s" % (head, len(body or b""), body or b""))
        await writer.drain()
        writer.close()

    async def main() -> ServerInfo:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        client = ServerClient(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}")
        try:
            return await client.discover()
        finally:
            await client.close()
            server.close()

    found = asyncio.run(main())
    assert (found.flavor, found.model, found.capacity, found.context_length) == ("sglang", "m", 48, 4096), found


def test_an_error_page_that_is_not_json_is_told_in_one_line():
    """A proxy's 502 page (nginx's, HTML over lines) is the failure's message, the dead letter's and the
    worker's log line: in one line, so that a log line is one event. Its lines went into the log as they came."""
    page = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n"
            b"<center><h1>502 Bad Gateway</h1></center>\r\n<hr><center>nginx</center>\r\n</body>\r\n</html>\r\n")
    answers = [b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s"
               % (len(page), page)]

    outcome = generate(answers)
    assert isinstance(outcome, Failure) and (outcome.kind, outcome.status) == ("server_error", 502), outcome
    assert outcome.message.startswith("<html> <head><title>502 Bad Gateway</title></head> <body>"), outcome
    assert "\n" not in outcome.message and "\r" not in outcome.message, outcome


@pytest.mark.parametrize("header, seconds", [(b"7", 7.0), (b"Wed, 21 Oct 2015 07:28:00 GMT", 0.0), (b"soon", None)])
def test_a_busy_answers_retry_after_is_kept_in_its_failure(header, seconds):
    """A 429 or 503 may say when to come back (Retry-After: seconds or an HTTP date, RFC 9110); the
    failure keeps it for the dispatcher's retry (a date past is 0, a value that is neither is ignored).
    It was dropped with the headers: the retry came at the backoff, however long the server had asked."""
    body = b'{"object": "error", "message": "The request queue is full.", "code": 503}'
    answers = [b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %s\r\nContent-Length: %d\r\n\r\n%s"
               % (header, len(body), body)]

    outcome = generate(answers)
    assert isinstance(outcome, Failure) and (outcome.status, outcome.message) == (503, "The request queue is full.")
    assert outcome.retry_after == seconds, outcome


@pytest.mark.parametrize("body, kind, status, retryable", [
    (b'{"error": {"message": "This model\'s maximum context length is 2048 tokens.", "code": 400}}',
     "bad_request", 400, False),
    (b'{"object": "error", "message": "Internal server error", "type": "InternalServerError", "code": 500}',
     "server_error", 500, True),
])
def test_a_streams_200_answer_that_is_a_json_error_is_that_error(body, kind, status, retryable):
    """A proxy or an older engine may answer a streamed request with HTTP 200 and a plain JSON error
    body, no SSE: the failure is the server's own message, judged by its code (a 400 is the prompt's,
    not retried). It was a connection failure, "stream ended before [DONE]", the message lost."""
    answers = [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
               % (len(body), body)]

    outcome = generate(answers)
    message = json.loads(body).get("error", json.loads(body))["message"]
    assert isinstance(outcome, Failure), outcome
    assert (outcome.kind, outcome.status, outcome.message, outcome.retryable) == (kind, status, message, retryable)


def test_a_streams_200_answer_that_is_an_html_page_is_told_as_such():
    """A proxy's page on HTTP 200 (a login or maintenance page) to a streamed request: a protocol failure
    quoting the page, in one line. It was "stream ended before [DONE]", a connection failure."""
    page = b"<html>\r\n<head><title>Maintenance</title></head>\r\n<body>Back soon</body>\r\n</html>\r\n"
    answers = [b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n%s" % (len(page), page)]

    outcome = generate(answers)
    assert isinstance(outcome, Failure) and outcome.kind == "protocol", outcome
    assert "<title>Maintenance</title>" in outcome.message and "\n" not in outcome.message, outcome


def test_a_stream_cut_after_its_done_event_is_the_answer_it_was():
    """Every event and [DONE] came, then the connection closed before the chunked body's last chunk (the
    server killed, a proxy's reset): the answer is whole and is recorded. It was a connection failure:
    the prompt generated again, its GPU time spent twice."""
    events = (b'data: {"id": "r", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}\n\n'
              b'data: {"id": "r", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}\n\n'
              b'data: {"id": "r", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\n'
              b"data: [DONE]\n\n")
    answers = [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"%x\r\n%s\r\n" % (len(events), events)]  # no last chunk: the connection closes

    outcome = generate(answers, close_after=True, step=1000)
    assert isinstance(outcome, Completion), outcome
    assert (outcome.choices[0].completion, outcome.choices[0].finish_reason, outcome.usage.completion_tokens) == \
        ("Hi", "stop", 1), outcome


def test_a_servers_error_message_over_lines_is_told_in_one_line():
    """SGLang sends str(exception) as the message: a CUDA error is several lines. The failure's message (the
    dead letter's, the worker's log line) is one line, so that a log line is one event. Its lines went into
    the log as they came."""
    message = "CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be reported later.\n"
    body = json.dumps({"object": "error", "message": message, "type": "InternalServerError", "code": 500}).encode()
    answers = [b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]

    outcome = generate(answers)
    assert isinstance(outcome, Failure) and outcome.message == (
        "CUDA error: an illegal memory access was encountered CUDA kernel errors might be reported later."), outcome
