"""Overhead benchmark: how many requests/s one `genq worker` drives against a server
that costs nothing, next to a bare aiohttp loop at the same concurrency.

Two servers, each pinned to its own core (the clients get the other one):
  sim   `genq sim --step-ms-base 0 --step-ms-per-req 0` with short outputs: the
        real simulator in its instant mode (pure Python, so on 2 cores it may be
        the bottleneck itself; the bare loop shows where that ceiling is)
  raw   a minimal asyncio HTTP server in this file that answers every request
        with a canned completion (stream or not): far less CPU per request

For each server and mode (stream, no-stream) it runs
  bare  an asyncio + aiohttp loop: C coroutines posting the same requests, nothing else
  genq  `genq enqueue` (not timed) + one `genq worker --burst`, auto concurrency
and reports requests/s (server side first request to last answer; the worker's
process start is excluded and shown apart) and the ratio genq / bare. `--client http` puts
genq's HTTP client alone (worker/server.py ServerClient.generate, no Redis, no records) in
the worker's place: what the request path's HTTP costs next to a bare aiohttp loop.

    .venv/bin/python bench/overhead.py                  # ~2 minutes
    .venv/bin/python bench/overhead.py --servers raw --modes no-stream
    .venv/bin/python bench/overhead.py --servers raw --client http --rounds 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    PY,
    ROOT,
    bench_redis_url,
    busy_processes,
    conditions,
    flush_bench_db,
    free_port,
    genq,
    get_json,
    mask_url,
    read_messages,
    sim_args,
    stop_process,
    table,
    wait_http,
    write_prompts,
)

CAPACITY = 64  # server slots; genq's auto target is this plus its headroom


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=40000)
    p.add_argument("--servers", default="sim,raw", help="Comma-separated: sim, raw.")
    p.add_argument("--modes", default="no-stream,stream", help="Comma-separated: no-stream, stream.")
    p.add_argument("--capacity", type=int, default=CAPACITY, help="The server's max running requests.")
    p.add_argument("--output-tokens", type=int, default=8, help="Completion length of every request.")
    p.add_argument("--batch-size", type=int, default=256, help="genq's batch size.")
    p.add_argument("--worker-args", default="", help="Extra arguments for `genq worker`.")
    p.add_argument("--client", choices=("worker", "http"), default="worker",
                   help="What runs beside the bare loop: a whole `genq worker`, or genq's HTTP client alone.")
    p.add_argument("--rounds", type=int, default=1,
                   help="Paired rounds per server and mode, the order alternating (bare first, then genq "
                        "first): each round's ratio, and their median, are reported.")
    p.add_argument("--no-pin", action="store_true", help="Do not pin the server and the client to separate cores.")
    p.add_argument("--redis", default=None, help="A spare Redis database: it is flushed.")
    p.add_argument("--workdir", default=None)
    return p.parse_args(argv)


# ---------------------------------------------------------------- raw server

class _RawProtocol(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length bodies only: just enough for genq and aiohttp."""

    def __init__(self, server: RawServer) -> None:
        self.s = server
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            head_end = self.buf.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = self.buf[:head_end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                if line[:15].lower() == b"content-length:":
                    length = int(line[15:])
            if len(self.buf) < head_end + 4 + length:
                return
            body = self.buf[head_end + 4:head_end + 4 + length]
            self.buf = self.buf[head_end + 4 + length:]
            method, path = head.split(b" ", 2)[:2]
            self.transport.write(self.s.answer(method, path, body))


class RawServer:
    def __init__(self, capacity: int, tokens: int) -> None:
        self.capacity = capacity
        text = "lorem " * tokens
        usage = {"prompt_tokens": 12, "completion_tokens": tokens, "total_tokens": 12 + tokens}
        full = {"id": "raw", "object": "chat.completion", "created": 0, "model": "raw",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": "length"}], "usage": usage}
        chunk = {"id": "raw", "object": "chat.completion.chunk", "created": 0, "model": "raw"}
        events = [
            {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
            {**chunk, "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}], "usage": usage},
            {**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}], "usage": usage},
            {**chunk, "choices": [], "usage": usage},
        ]
        sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        self.full = self._response(json.dumps(full).encode(), b"application/json")
        self.sse = self._response(sse, b"text/event-stream")
        self.requests = 0
        self.first: float | None = None
        self.last: float | None = None
        info = {"max_running_requests": capacity, "context_length": 32768,
                "internal_states": [{"effective_max_running_requests_per_dp": capacity}]}
        self.gets = {
            b"/health": self._response(b"", b"text/plain"),
            b"/v1/models": self._response(json.dumps({"object": "list", "data": [{"id": "raw"}]}).encode(),
                                          b"application/json"),
            b"/get_server_info": self._response(json.dumps(info).encode(), b"application/json"),
        }

    @staticmethod
    def _response(body: bytes, ctype: bytes, status: bytes = b"200 OK") -> bytes:
        return (b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype + b"\r\nContent-Length: "
                + str(len(body)).encode() + b"\r\n\r\n" + body)

    def answer(self, method: bytes, path: bytes, body: bytes) -> bytes:
        if method == b"POST" and path.startswith(b"/v1/"):
            now = time.monotonic()
            if self.first is None:
                self.first = now
            self.last = now
            self.requests += 1
            return self.sse if b'"stream":true' in body else self.full
        if path == b"/raw/stats":
            stats = {"requests": self.requests, "busy_s": (self.last or 0) - (self.first or 0)}
            return self._response(json.dumps(stats).encode(), b"application/json")
        if method == b"POST" and path == b"/raw/reset":
            self.requests, self.first, self.last = 0, None, None
            return self._response(b"{}", b"application/json")
        return self.gets.get(path.split(b"?")[0], self._response(b"not found", b"text/plain", b"404 Not Found"))


async def serve_raw(port: int, capacity: int, tokens: int) -> None:
    server = RawServer(capacity, tokens)
    loop = asyncio.get_running_loop()
    srv = await loop.create_server(lambda: _RawProtocol(server), "127.0.0.1", port, backlog=1024)
    async with srv:
        await srv.serve_forever()


# ---------------------------------------------------------------- bare client

async def bare_client(url: str, prompts: Path, concurrency: int, stream: bool, max_tokens: int) -> None:
    """The least a Python client can do: C coroutines, each posting and reading, nothing recorded."""
    import aiohttp

    messages = read_messages(prompts)
    it = iter(messages)
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector) as http:
        async def runner() -> None:
            for m in it:
                body = {"model": "default", "messages": m, "max_tokens": max_tokens, **extra}
                async with http.post("/v1/chat/completions", json=body) as resp:
                    if stream:
                        async for _line in resp.content:
                            pass
                    else:
                        await resp.read()

        await asyncio.gather(*(runner() for _ in range(concurrency)))


async def http_client(url: str, prompts: Path, concurrency: int, stream: bool, max_tokens: int) -> None:
    """The bare loop's requests through genq's own client: what the worker's request path pays for HTTP."""
    from genq.worker.server import Completion, Progress, ServerClient

    messages = read_messages(prompts)
    it = iter(messages)
    extra = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}} if stream else {}
    client = ServerClient(url)

    async def runner() -> None:
        for m in it:
            body = {"model": "default", "messages": m, "max_tokens": max_tokens, "stream": stream, **extra}
            outcome = await client.generate("chat", body, Progress())
            if not isinstance(outcome, Completion):
                raise SystemExit(f"http client: {outcome}")

    try:
        await asyncio.gather(*(runner() for _ in range(concurrency)))
    finally:
        await client.close()


# ---------------------------------------------------------------- runs

def pin(core: int | None) -> list[str]:
    return ["taskset", "-c", str(core)] if core is not None else []


class Server:
    def __init__(self, kind: str, args: argparse.Namespace, log: Path, core: int | None) -> None:
        self.kind = kind
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if kind == "sim":
            cmd = sim_args(self.port, {"max_running_requests": args.capacity, "step_ms_base": 0, "step_ms_per_req": 0,
                                       "mean_output_tokens": args.output_tokens, "output_sigma": 0,
                                       "tokens_per_step": max(16, args.output_tokens)})
        else:
            cmd = [PY, str(Path(__file__).resolve()), "raw-server", str(self.port), str(args.capacity),
                   str(args.output_tokens)]
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(pin(core) + cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        wait_http(self.url + "/v1/models")

    def reset(self) -> None:
        path = "/sim/reset" if self.kind == "sim" else "/raw/reset"
        subprocess.run(["curl", "-s", "-XPOST", self.url + path], capture_output=True, check=True)

    def served(self) -> tuple[int, float]:
        """(requests answered, seconds from the first to the last) since the reset."""
        if self.kind == "sim":
            s = get_json(self.url + "/sim/stats")
            return s["finished_requests"], (s["last_finish_s"] or 0) - (s["first_admit_s"] or 0)
        s = get_json(self.url + "/raw/stats")
        return s["requests"], s["busy_s"]

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def target_concurrency(capacity: int) -> int:
    sys.path.insert(0, str(ROOT))
    from genq.worker.controller import ConcurrencyController

    return ConcurrencyController(capacity).target


def run_pair(server: Server, mode: str, args: argparse.Namespace, work: Path, prompts: Path,
             client_core: int | None, round_no: int = 0) -> list[list[object]]:
    """One paired round: bare then genq (even rounds) or genq then bare (odd rounds)."""
    stream = mode == "stream"
    conc = target_concurrency(args.capacity)
    rows = []
    for client in ("bare", "genq") if round_no % 2 == 0 else ("genq", "bare"):
        tag = f"{server.kind}-{mode}-{client}-r{round_no}"
        if client == "genq" and args.client == "http":
            cmd = [PY, str(Path(__file__).resolve()), "http-client", server.url, str(prompts), str(conc),
                   "1" if stream else "0", str(args.output_tokens)]
        elif client == "genq":
            flush_bench_db(args.redis)
            subprocess.run(genq("enqueue", str(prompts), "--job", "ovh", "--output", str(work / f"out-{tag}"),
                                "--batch-size", str(args.batch_size), "--max-tokens", str(args.output_tokens),
                                redis_url=args.redis), check=True, capture_output=True, cwd=ROOT)
            cmd = genq("worker", "--server", server.url, "--burst", "--name", f"ovh-{tag}",
                       "--stream" if stream else "--no-stream", *args.worker_args.split(), redis_url=args.redis)
        else:
            cmd = [PY, str(Path(__file__).resolve()), "bare-client", server.url, str(prompts), str(conc),
                   "1" if stream else "0", str(args.output_tokens)]
        server.reset()
        cpu0 = _children_cpu()
        t0 = time.monotonic()
        with open(work / f"client-{tag}.log", "wb") as log:
            rc = subprocess.run(pin(client_core) + cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        wall = time.monotonic() - t0
        # The client's CPU, with every process it started and reaped (genq: its RQ
        # loops), start-up included: robust to other load on the machine.
        cpu = _children_cpu() - cpu0
        if rc != 0:
            raise SystemExit(f"{tag}: client exited {rc}; see {work / f'client-{tag}.log'}")
        served, busy = server.served()
        if served != args.prompts:
            print(f"MISSED: {tag}: server answered {served} requests, expected {args.prompts}", file=sys.stderr)
            MISMATCHES.append(f"{tag}: the server answered {served} of {args.prompts} requests")
        rate = served / busy if busy > 0 else 0.0
        rows.append([server.kind, mode, client, round_no, conc, served, busy, rate, wall, cpu, served / cpu])
        print(f"  {tag}: {rate:,.0f} req/s ({served} in {busy:.2f}s; wall {wall:.1f}s; client cpu {cpu:.2f}s, "
              f"{1e6 * cpu / max(served, 1):.0f} us/request)", flush=True)
    return rows


# Targets (docs/performance.md "Worker overhead"): one worker drives >= 2,000 req/s on one core, >= 0.8 of a bare loop.
RATE_TARGET = 2000.0
RATIO_TARGET = 0.8
MISMATCHES: list[str] = []


def missed_targets(out: list[list]) -> list[str]:
    misses = list(MISMATCHES)
    for row in out:
        server, mode, client, rate, ratio = row[0], row[1], row[2], row[7], row[11]
        if client == "bare":
            continue
        if rate < RATE_TARGET:
            misses.append(f"{server}/{mode}: {rate:,.0f} req/s < {RATE_TARGET:,.0f}")
        if ratio is None or ratio < RATIO_TARGET:
            misses.append(f"{server}/{mode}: {ratio if ratio is None else round(ratio, 2)} of bare < {RATIO_TARGET}")
    return misses


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.redis = args.redis or bench_redis_url()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="genq-overhead-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, args.prompts)
    cores = os.cpu_count() or 1
    server_core, client_core = (None, None) if args.no_pin or cores < 2 else (1, 0)
    print(f"overhead: {args.prompts} prompts of {args.output_tokens} output tokens, server capacity {args.capacity}, "
          f"concurrency {target_concurrency(args.capacity)} (genq auto), batch size {args.batch_size}, "
          f"genq = {args.client}; "
          f"server on core {server_core}, client on core {client_core}; redis {mask_url(args.redis)}; work dir {work}")
    print(f"machine: {conditions()}")
    for p in busy_processes():
        print(f"  busy before start: {p}")
    rows: list[list[object]] = []
    for kind in [k.strip() for k in args.servers.split(",") if k.strip()]:
        server = Server(kind, args, work / f"server-{kind}.log", server_core)
        try:
            for mode in [m.strip() for m in args.modes.split(",") if m.strip()]:
                for round_no in range(args.rounds):
                    rows += run_pair(server, mode, args, work, prompts, client_core, round_no)
        finally:
            server.stop()
    out = []
    for row in rows:  # each against the bare run of its own round
        bare = next((r for r in rows if r[:2] == row[:2] and r[3] == row[3] and r[2] == "bare"), None)
        out.append(row + [row[7] / bare[7] if bare and bare[7] else None, row[10] / bare[10] if bare else None])
    print()
    print(table(["server", "mode", "client", "round", "in flight", "requests", "busy s", "req/s", "wall s",
                 "client cpu s", "req per cpu-s", "req/s genq/bare", "req per cpu-s genq/bare"], out))
    medians = []
    for key in dict.fromkeys((r[0], r[1]) for r in out):
        genq_rows = [r for r in out if (r[0], r[1]) == key and r[2] == "genq" and r[11] is not None]
        if genq_rows:
            medians.append([*key, len(genq_rows), statistics.median(r[11] for r in genq_rows),
                            min(r[11] for r in genq_rows), max(r[11] for r in genq_rows),
                            statistics.median(r[12] for r in genq_rows)])
    print()
    print(table(["server", "mode", "rounds", "median req/s genq/bare", "min", "max",
                 "median req per cpu-s genq/bare"], medians))
    print(f"machine after: {conditions()}")
    misses = missed_targets(out if args.rounds == 1 else [
        [m[0], m[1], "genq", None, None, None, None, RATE_TARGET, None, None, None, m[3]] for m in medians])
    print(f"targets (>= {RATE_TARGET:,.0f} req/s, >= {RATIO_TARGET} of bare): "
          + ("met" if not misses else "NOT met: " + "; ".join(misses)))
    if misses:
        raise SystemExit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "raw-server":
        asyncio.run(serve_raw(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    elif len(sys.argv) > 1 and sys.argv[1] in ("bare-client", "http-client"):
        run_client = bare_client if sys.argv[1] == "bare-client" else http_client
        asyncio.run(run_client(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6])))
    else:
        main()
