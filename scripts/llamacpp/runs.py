"""The parts of scripts/llamacpp/bench.py: a private redis-server and llama-server, one
genq run or one bare-client run against them, with llama-server's own figures for each
(its /metrics counters before and after, busy slots sampled), and the monitor's ETA."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

from genq.core.redisconn import LocalRedis, free_port

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CACHE = Path(os.environ.get("GENQ_LLAMACPP_CACHE", Path.home() / ".cache" / "genq-llamacpp"))
TREE = CACHE / f"llama_cpp_python-{os.environ.get('GENQ_LLAMACPP_PY_VERSION', '0.3.36')}" / "vendor" / "llama.cpp"
SLOTS, CTX = 8, 16384
ETA_AT = (0.25, 0.50, 0.75)


def load() -> float:
    """The 1-minute load average: how busy the shared machine was."""
    return os.getloadavg()[0]


def wait_ok(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout}s")


def prompts(n: int, long: int, tag: str = "p") -> list[dict]:
    rows = [{"id": f"{tag}{i:04d}", "messages": [{"role": "user", "content": f"Tell me about item {i}, please."}]}
            for i in range(n - long)]
    # ~3,000 tokens each: more than a slot's 2,048.
    rows += [{"id": f"long{i}", "messages": [{"role": "user", "content": "word " * 3000 + str(i)}]}
             for i in range(long)]
    return rows


class Stack:
    """A private redis-server and llama-server, stopped at the end."""

    def __init__(self, work: Path, model: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        with open(work / "redis.log", "wb") as log:
            self.local_redis = LocalRedis(log=log)
        self.redis = self.local_redis.url
        lport = free_port()
        self.server = f"http://127.0.0.1:{lport}"
        self._start([str(CACHE / "build" / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                     "--port", str(lport), "-np", str(SLOTS), "-c", str(CTX), "--metrics", "--slots"],
                    work / "llama-server.log")
        wait_ok(self.server + "/health", 120, self.procs[-1])

    def cpu_s(self) -> float:
        """CPU seconds llama-server has used: the work, whatever else the machine runs."""
        fields = Path(f"/proc/{self.procs[-1].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def work_done(self) -> float:
        """Prompt and generated tokens llama-server has processed: any request it ran moves it
        (it counts no requests as such)."""
        m = self.metrics()
        return m.get("llamacpp:prompt_tokens_total", 0.0) + m.get("llamacpp:tokens_predicted_total", 0.0)

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.server + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return {name: float(value) for name, value in
                (line.split(" ", 1) for line in text.splitlines() if line.startswith("llamacpp:"))}

    def _start(self, args: list[str], log: Path) -> None:
        self.procs.append(subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.local_redis.stop()


def cpu_s(who: int) -> float:
    """CPU seconds of this process (RUSAGE_SELF) or of its waited-for children (RUSAGE_CHILDREN)."""
    use = resource.getrusage(who)
    return use.ru_utime + use.ru_stime


class Sampler:
    """llama-server's own view of one run: busy slots and deferred requests from /metrics
    twice a second, its counters before and after (generation slot-seconds, tokens), its
    CPU time."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.busy, self.deferred = stack, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.load0, self.m0 = load(), self.stack.metrics()
        self.cpu0 = self.stack.cpu_s()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu = self.stack.cpu_s() - self.cpu0
        m1 = self.stack.metrics()
        self.delta = {k: m1[k] - self.m0.get(k, 0.0) for k in m1 if k.endswith("_total")}
        self.load1 = load()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                values = self.stack.metrics()
            except OSError:
                continue
            self.busy.append(values.get("llamacpp:requests_processing", float("nan")))
            self.deferred.append(values.get("llamacpp:requests_deferred", float("nan")))

    def figures(self, run: dict) -> dict:
        # Samples while work was in flight; the first and last seconds ramp.
        busy = [b for b in self.busy if b > 0] or [0.0]
        gen_s = self.delta.get("llamacpp:tokens_predicted_seconds_total", 0.0)
        return {"busy_slots": sum(busy) / len(busy), "max_deferred": max(self.deferred or [0.0]),
                "server_cpu_s": self.cpu, "server_cpu_ms_per_tok": 1000 * self.cpu / max(run["tokens"], 1),
                # Slot-seconds llama-server spent generating, over the slot-seconds the run had:
                # its tokens per second normalised by the server's own generation speed.
                "server_gen_s": gen_s, "occupancy": gen_s / (SLOTS * run["span_s"]),
                "client_cpu_ms_per_req": 1000 * run["client_cpu_s"] / max(run["requests"], 1),
                "load": (self.load0 + self.load1) / 2}


def flush(stack: Stack) -> None:
    """Empties the private Redis for the next run, all but what genq keeps of the server
    (keys.SERVERS: its decode figures, worker/controller.py), as a fleet's Redis keeps them
    from job to job: a run's ETA then knows how this server drains (docs/real-engines.md)."""
    from genq.core import keys
    from genq.core.redisconn import connect

    conn = connect(stack.redis)
    try:
        drop = [k for k in conn.scan_iter(count=1000) if not k.startswith(keys.SERVERS.encode())]
        for i in range(0, len(drop), 500):
            conn.delete(*drop[i:i + 500])
    finally:
        conn.close()


def genq(stack: Stack, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genq", "--redis", stack.redis, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _worker(stack: Stack, args: tuple[str, ...], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "genq", "--redis", stack.redis, "worker", "--server",
                             stack.server, "--burst", *args], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)


def watch_eta(stack: Stack, job: str, proc: subprocess.Popen, total: int) -> list[dict]:
    """The monitor's ETA (genq.monitor.progress.Monitor, the code behind `genq monitor
    --json`, refreshed every second as the live monitor does) when 25, 50 and 75 % of the
    prompts are done; after the end, the true time left at each (to the last commit)."""
    from genq.core.redisconn import connect
    from genq.monitor.progress import Monitor

    conn = connect(stack.redis)
    mon = Monitor(conn, job, window_s=120.0)
    points: list[dict] = []
    pending = list(ETA_AT)
    # On this machine llama-server needs the same two cores as the monitor, and a monitor at normal
    # priority slows the server it measures. On a fleet the monitor runs beside GPUs, not on their
    # cores: here it yields the CPU to the server (nice 19) while it watches; what it spent is reported.
    old_nice = os.getpriority(os.PRIO_PROCESS, 0)
    os.setpriority(os.PRIO_PROCESS, 0, 19)
    refresh_cpu: list[float] = []
    # GENQ_ETA_TRACE=PATH: every refresh's ETA and its inputs, as JSON lines with the true time
    # left (for finding why an estimate misses, not only whether).
    trace: list[dict] = []
    while True:
        tick = time.monotonic()
        cpu = time.process_time()
        (report,) = mon.refresh()
        refresh_cpu.append(time.process_time() - cpu)
        p = report.progress
        done = (p.completed + p.failed) / total
        sp, model = report.speed, report.estimate.model
        trace.append({"t": report.snapshot.at, "done": done, "eta_s": p.eta_s, "load": load(),
                      "tok_s": sp.tokens_per_s if sp else None, "per_request_tok_s": sp.per_request if sp else None,
                      "overhead": sp.overhead if sp else None, "decoding": sp.decoding if sp else None,
                      "fit_mean": model.mean() if model else None, "in_flight": report.snapshot.decoding,
                      "remaining_tokens": report.estimate.remaining_tokens, "finished": p.completed + p.failed,
                      "state": p.eta_state, "note": report.estimate.note,
                      # What the estimate's running part stood on: the requests' tokens so far.
                      "running_tokens": report.snapshot.running_tokens, "hist": report.snapshot.hist,
                      "fit_sigma": model.sigma if model else None,
                      "queued": report.snapshot.queued, "speed": dataclasses.asdict(sp) if sp else None})
        while pending and done >= pending[0]:
            points.append({"at": pending.pop(0), "done": done, "t": report.snapshot.at, "eta_s": p.eta_s,
                           "eta_low_s": p.eta_low_s, "eta_high_s": p.eta_high_s, "state": p.eta_state,
                           "load": load(), "tok_s": p.output_tokens_per_sec,
                           # The estimator's inputs: one decoding request's speed, the fitted mean length.
                           "per_request_tok_s": report.speed.per_request if report.speed else None,
                           # How a request's speed depends on the count decoding (monitor/rates.py).
                           "overhead": report.speed.overhead if report.speed else None,
                           "decoding": report.speed.decoding if report.speed else None,
                           "fit_mean": report.estimate.model.mean() if report.estimate.model else None,
                           # The job's own tokens so far, for its rate before and after the point.
                           "generated": report.snapshot.generated_tokens, "first_at": report.snapshot.first_at})
        if p.status == "done" or proc.poll() is not None:
            break
        time.sleep(max(0.0, 1.0 - (time.monotonic() - tick)))
    proc.wait()
    os.setpriority(os.PRIO_PROCESS, 0, old_nice)
    (report,) = mon.refresh()
    end = report.snapshot.last_at or report.snapshot.at  # the last result's commit
    print(f"monitor: {len(refresh_cpu)} refreshes, "
          f"CPU per refresh median {statistics.median(refresh_cpu) * 1000:.0f} ms, "
          f"max {max(refresh_cpu) * 1000:.0f} ms (at nice 19)")
    out_tokens = report.snapshot.out_tokens  # the job's, all done (`total` counts its prompts)
    for pt in points:
        pt["true_s"] = end - pt["t"]
        # What no estimate made at the point could know: how much faster (or slower) the job's
        # tokens came after it than before it (the server's speed, which a shared CPU moves).
        ran_s = pt["t"] - pt["first_at"] if pt["first_at"] else 0.0
        known = ran_s > 0 and pt["generated"] > 0 and pt["true_s"] > 0
        pt["rate_change"] = (((out_tokens - pt["generated"]) / pt["true_s"]) / (pt["generated"] / ran_s)
                             if known else None)
        pt["error"] = None if pt["eta_s"] is None else (pt["eta_s"] - pt["true_s"]) / pt["true_s"]
    if os.environ.get("GENQ_ETA_TRACE"):
        with open(os.environ["GENQ_ETA_TRACE"], "w") as f:
            f.writelines(json.dumps(dict(row, true_s=end - row["t"])) + "\n" for row in trace)
    conn.close()
    return points


def genq_run(stack: Stack, work: Path, src: Path, name: str, max_tokens: int, *worker_args: str,
             eta: bool = False) -> dict:
    flush(stack)
    out = work / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    p = genq(stack, "enqueue", str(src), "--job", name, "--batch-size", "50", "--max-tokens", str(max_tokens),
             "--output", str(out))
    assert p.returncode == 0, p.stderr
    log = work / f"worker-{name}.log"
    total = sum(1 for line in open(src) if line.strip())
    cpu0 = cpu_s(resource.RUSAGE_CHILDREN)
    proc = _worker(stack, worker_args, log)
    points = watch_eta(stack, name, proc, total) if eta else []
    proc.wait(timeout=1800)
    worker_cpu = cpu_s(resource.RUSAGE_CHILDREN) - cpu0  # the worker
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    rows = [json.loads(line) for shard in sorted((out / name / "shards").glob("*.jsonl"))
            for line in open(shard) if line.strip()]
    letters = json.loads(genq(stack, "dlq", "list", "--json").stdout or "[]")
    start = min(r["finished_at"] - r["latency_s"] for r in rows)
    span = max(r["finished_at"] for r in rows) - start
    tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    capacity_line = next((line for line in text.splitlines() if "in flight" in line), "")
    return {"name": name, "args": " ".join(worker_args) or "(defaults)", "rows": rows, "letters": letters,
            "span_s": span, "tokens": tokens, "tok_s": tokens / span, "capacity_line": capacity_line,
            "requests": len(rows) + len(letters), "client_cpu_s": worker_cpu, "eta": points}


async def bare(server: str, rows: list[dict], max_tokens: int, stream: bool, concurrency: int) -> dict:
    """A plain aiohttp client, 8 in flight, no retries: the floor genq is held to."""
    queue = list(rows)
    starts, ends, tokens, errors = [], [], 0, 0
    # A new connection per request (force_close): llama-server closes it after a stream anyway.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as http:
        async def one(row: dict) -> None:
            nonlocal tokens, errors
            body = {"messages": row["messages"], "max_tokens": max_tokens, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            starts.append(time.time())
            try:
                async with http.post(server + "/v1/chat/completions", json=body) as resp:
                    raw = await resp.read()
            except aiohttp.ClientError as exc:
                errors += 1
                print(f"bare client: {type(exc).__name__}: {exc}", file=sys.stderr)
                return
            ends.append(time.time())
            if resp.status != 200:
                errors += 1
                return
            if stream:
                for line in raw.split(b"\n"):
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens += event["usage"]["completion_tokens"]
            else:
                tokens += json.loads(raw)["usage"]["completion_tokens"]

        async def lane() -> None:
            while queue:
                await one(queue.pop(0))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    span = max(ends) - min(starts)
    return {"name": f"bare-{'stream' if stream else 'nostream'}", "tokens": tokens, "span_s": span,
            "tok_s": tokens / span, "errors": errors, "requests": len(rows)}


def bare_run(server: str, rows: list[dict], max_tokens: int, stream: bool) -> dict:
    cpu0 = cpu_s(resource.RUSAGE_SELF)  # with the sampler's thread: a few ms a second
    run = asyncio.run(bare(server, rows, max_tokens, stream, SLOTS))
    run["client_cpu_s"] = cpu_s(resource.RUSAGE_SELF) - cpu0
    return run
