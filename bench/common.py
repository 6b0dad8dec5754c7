"""Shared pieces of the benchmarks: a `genq sim` process, its /sim/stats poller,
synthetic prompts, genq command lines, the machine's conditions, markdown tables.

Benchmarks run on a private redis-server they start on a free loopback port (nothing kept on disk,
stopped when the benchmark exits): a Redis they did not start is never touched. GENQ_BENCH_REDIS_URL
names another one instead; it is flushed before each run, so never point it at real jobs.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


@functools.cache
def bench_redis_url() -> str:
    """GENQ_BENCH_REDIS_URL, else a redis-server of the benchmark's own, started on first use (a
    benchmark that runs its own Redis, or none, starts nothing); its URL goes into the environment
    so that the benchmark's child processes (which import this module too) use the same one."""
    if os.environ.get("GENQ_BENCH_REDIS_URL"):
        return os.environ["GENQ_BENCH_REDIS_URL"]
    import atexit

    try:
        server = LocalRedis(db=8)
    except RuntimeError as e:
        raise SystemExit(f"the benchmarks run a redis-server of their own: {e}") from None
    atexit.register(server.stop)
    os.environ["GENQ_BENCH_REDIS_URL"] = server.url
    return server.url



# A SIGTERMed benchmark unwinds as on Ctrl-C: its `finally` blocks and atexit stop the servers and
# workers it started (the default action would leave them running, in sessions of their own).
signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

if str(ROOT) not in sys.path:  # run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(ROOT))

from genq.core.redisconn import LocalRedis, free_port, mask_url  # noqa: E402,F401  (free_port: for the benchmarks)


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL after 10 s: a benchmark's child process at its end."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: Any = None, timeout: float = 5.0) -> Any:
    data = json.dumps(body or {}).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_http(url: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def sim_args(port: int, options: dict[str, Any]) -> list[str]:
    args = [PY, "-m", "genq", "sim", "--port", str(port)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    return args


class Sim:
    """A `genq sim` child process on a free port; use as a context manager."""

    def __init__(self, log_path: Path, **options: Any) -> None:
        self.options = options
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(sim_args(self.port, options), stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        try:
            wait_http(self.url + "/v1/models")
        except TimeoutError:
            self.stop()
            raise

    def stats(self) -> dict[str, Any]:
        return get_json(self.url + "/sim/stats")

    def reset(self) -> None:
        post_json(self.url + "/sim/reset")

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()

    def __enter__(self) -> Sim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class Sample:
    t: float  # local monotonic time of the answer
    elapsed: float  # sim seconds since reset
    integral: float  # running requests x seconds since reset
    finished: int
    running: int
    waiting: int


@dataclass
class Poller:
    """Polls /sim/stats in a thread; the samples give the time-weighted mean of the
    server's running requests over any window (the sim integrates exactly; the
    poll only chooses the window's end)."""

    url: str
    interval: float = 0.05
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Poller:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                s = get_json(self.url + "/sim/stats", timeout=5)
            except (OSError, ValueError):
                time.sleep(self.interval)
                continue
            self.samples.append(Sample(time.monotonic(), s["elapsed_s"], s["mean_running"] * s["elapsed_s"],
                                       s["finished_requests"], s["num_running"], s["num_waiting"]))
            self._stop.wait(self.interval)


@dataclass
class RunFigures:
    name: str
    n: int
    capacity: int
    makespan_s: float  # server busy window: first admission to last finish
    wall_s: float  # client process start to exit (genq: worker start to exit)
    generated_tokens: int
    finished: int
    util_busy: float  # mean running / capacity over the busy window (tail included)
    util_until_empty: float | None  # same, until the last prompt was admitted
    first_admit_s: float | None  # client start -> first request running
    full_s: float | None  # client start -> running == capacity for the first time
    queue_empty_s: float | None = None  # first admission -> every request admitted (within a poll)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.generated_tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def figures(name: str, n: int, capacity: int, final: dict[str, Any], samples: list[Sample],
            started: float, ended: float) -> RunFigures:
    """Turn a run's final /sim/stats and its samples into figures.

    started/ended: local monotonic times of the client's start and end; the sim
    was reset just before `started`.
    """
    first = final["first_admit_s"] or 0.0
    last = final["last_finish_s"] or 0.0
    busy = max(last - first, 1e-9)
    integral = final["mean_running"] * final["elapsed_s"]
    # Until the queue is empty: the last sample at which some prompt was still not
    # admitted (finished + running < n). The sim's integral is exact at that point.
    util_q = None
    empty_at = None
    for s in samples:
        if s.finished + s.running >= n:
            empty_at = s.elapsed - first
            break
        window = s.elapsed - first
        if window > 0.5 and s.finished + s.running > 0:
            util_q = s.integral / (window * capacity)
    # Offsets from the client's start. The sim's clock starts at reset, just before.
    reset_at = final_reset_local(samples)
    first_admit = None if reset_at is None else reset_at + first - started
    full = next((s.t - started for s in samples if s.running >= capacity), None)
    return RunFigures(
        name=name, n=n, capacity=capacity, makespan_s=busy, wall_s=ended - started,
        generated_tokens=final["generated_tokens"], finished=final["finished_requests"],
        util_busy=integral / (busy * capacity), util_until_empty=util_q,
        first_admit_s=first_admit, full_s=full, queue_empty_s=empty_at,
    )


def final_reset_local(samples: list[Sample]) -> float | None:
    """Local monotonic time of the sim's reset, from the first sample (t - elapsed)."""
    if not samples:
        return None
    return min(s.t - s.elapsed for s in samples[:5])


def write_prompts(path: Path, n: int, *, seed: int = 0, words: int = 12) -> None:
    """n chat prompts with ids q000000...; content varies so every prompt has its own
    output length in the sim (lengths are a hash of the messages)."""
    rng = random.Random(seed)
    vocab = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river stone cloud "
             "engine market garden theory signal protein orbit harbor language memory").split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(vocab) for _ in range(words))
            f.write(json.dumps({"id": f"q{i:06d}", "messages": [
                {"role": "user", "content": f"Question {i}: write about {text}."}]}) + "\n")


def read_messages(path: Path) -> list[list[dict[str, Any]]]:
    with open(path) as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def genq(*args: str, redis_url: str | None = None) -> list[str]:
    return [PY, "-m", "genq", "--redis", redis_url or bench_redis_url(), *args]


def flush_bench_db(redis_url: str | None = None) -> None:
    import redis

    redis_url = redis_url or bench_redis_url()
    conn = redis.Redis.from_url(redis_url)
    db = conn.connection_pool.connection_kwargs.get("db", 0)
    if db == 0 and not os.environ.get("GENQ_BENCH_ALLOW_DB0"):
        raise SystemExit(f"refusing to flush database 0 of {mask_url(redis_url)}: "
                         "set GENQ_BENCH_REDIS_URL to a spare database, or leave it unset for a private redis-server")
    conn.flushdb()
    conn.close()


def conditions() -> str:
    """One line on the machine the figures came from (they depend on it)."""
    load = os.getloadavg()
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()} cores ({cpu}), load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, "
            f"Python {platform.python_version()}")


def busy_processes(threshold: float = 20.0) -> list[str]:
    """Other processes using CPU now (from ps), to report noisy neighbours."""
    try:
        out = subprocess.run(["ps", "-eo", "pid,pcpu,args", "--sort=-pcpu"], capture_output=True,
                             text=True, timeout=5).stdout.splitlines()[1:]
    except (OSError, subprocess.SubprocessError):
        return []
    mine = os.getpid()
    busy = []
    for line in out:
        pid, pcpu, args = line.split(None, 2)
        if int(pid) != mine and float(pcpu) >= threshold:
            busy.append(f"{pcpu}% {args[:80]}")
    return busy


def table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)
