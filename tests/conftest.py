"""Shared fixtures: a private real Redis, real `genq sim` servers, real genq processes.

The suite starts its own redis-server on a free port (nothing kept on disk) when this
module is imported, and stops it at the end: it never connects to a Redis it did not
start (a Redis on 6379 may be production). Each test starts from an empty database.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import redis

from genq.core.redisconn import LocalRedis, free_port
from tests import zygote

ROOT = Path(__file__).resolve().parent.parent
pytest_plugins = ["tests.tiers"]  # the fast and end-to-end tiers

# Every command a test starts gets Ctrl-C's default action, as a terminal's foreground command has it: a run
# started in the background (`make test &`) ignores SIGINT, and a child would inherit that and ignore a test's
# Ctrl-C. An exec resets a handled signal to its default; the zygote's children set it themselves.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

_PRIVATE = LocalRedis()
atexit.register(_PRIVATE.stop)
REDIS_URL = _PRIVATE.url


def restart_port() -> int:
    """A free loopback port for a server a test stops and starts again on it (an outage): below Linux's
    ephemeral range (32768-60999 by default), where free_port() (bind to port 0) and outgoing
    connections take theirs, so no other test's server or connection takes it while it is down."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(100):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 20000-32767")


def wait_http(url: str, timeout: float = 15.0, want: int | None = 200) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if want is None or resp.status == want:
                    return
        except urllib.error.HTTPError as exc:
            if want is None or exc.code == want:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def wait_until(predicate, timeout: float = 30.0, what: str = "condition", *, interval: float = 0.1):
    """Poll predicate until it returns something truthy; return that, or fail naming what."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def nvml_count() -> int | None:
    """GPUs NVML sees on this machine, or None where there is no driver (then indices are only labels)."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        return None
    try:
        return int(pynvml.nvmlDeviceGetCount())
    finally:
        pynvml.nvmlShutdown()


class NvmlGpu(NamedTuple):
    name: str
    memory_total_mib: float
    power_limit_w: float  # the board's top power limit (W), or a bound where it says none
    max_sm_clock_mhz: float  # likewise


def nvml_gpu(index: int) -> NvmlGpu:
    """NVML's own fixed figures of one GPU (a GPU host only), to check what a worker reports."""
    import pynvml

    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        name = pynvml.nvmlDeviceGetName(h)  # bytes in older nvidia-ml-py, str in newer
        try:  # [min, max] in milliwatts; not every board says (then a bound no board exceeds)
            power_limit_w = pynvml.nvmlDeviceGetPowerManagementLimitConstraints(h)[1] / 1000.0
        except pynvml.NVMLError:
            power_limit_w = 2000.0
        try:
            max_sm_clock = float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM))
        except pynvml.NVMLError:
            max_sm_clock = 5000.0
        return NvmlGpu(
            name=name.decode() if isinstance(name, bytes) else str(name),
            memory_total_mib=pynvml.nvmlDeviceGetMemoryInfo(h).total / 2**20,  # bytes
            power_limit_w=power_limit_w,
            max_sm_clock_mhz=max_sm_clock,
        )
    finally:
        pynvml.nvmlShutdown()


def sim_stats(url: str) -> dict:
    """The simulator's /sim/stats (time-weighted running mean, generated_by_key, ...)."""
    import urllib.request

    with urllib.request.urlopen(url + "/sim/stats", timeout=5) as resp:
        return json.loads(resp.read())


def post_json(url: str, body: dict) -> dict:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


# The folder genq's processes run in unless a test says otherwise: what they write by default
# (./out, ./genq-rejects, ./genq-logs) stays out of the repository, so a second `make test` does not
# find the first one's shards and rebuild its jobs from them (the output is the durable truth).
WORKDIR = Path(tempfile.mkdtemp(prefix="genq-test-cwd-"))
atexit.register(shutil.rmtree, WORKDIR, ignore_errors=True)


def genq_cmd(*args: str, redis_url: str = REDIS_URL) -> list[str]:
    return [sys.executable, "-m", "genq", "--redis", redis_url, *args]


def run_genq(*args: str, redis_url: str = REDIS_URL, timeout: float = 120, check: bool = True,
             cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    proc = zygote.run(genq_cmd(*args, redis_url=redis_url), timeout=timeout, cwd=cwd or WORKDIR)
    if check and proc.returncode != 0:
        raise AssertionError(f"genq {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def run_genq_on_a_tty(*args: str, timeout: float = 300) -> tuple[int, str, str]:
    """Run genq with stderr on a terminal (progress is drawn for one only): (exit code, stdout,
    what the terminal got)."""
    import pty

    main, child = pty.openpty()
    proc = subprocess.Popen(genq_cmd(*args), stdout=subprocess.PIPE, stderr=child, text=True, cwd=WORKDIR)
    os.close(child)
    seen = b""
    while True:
        try:
            chunk = os.read(main, 4096)
        except OSError:  # the child closed its end
            break
        if not chunk:
            break
        seen += chunk
    out = proc.communicate(timeout=timeout)[0]
    os.close(main)
    return proc.returncode, out, seen.decode(errors="replace")


def write_prompts(path: Path, n: int, *, start: int = 0, extra: dict | None = None, text: str = "") -> list[str]:
    ids = []
    with open(path, "w") as f:
        for i in range(start, start + n):
            pid = f"p{i:05d}"
            ids.append(pid)
            row = {"id": pid, "messages": [{"role": "user", "content": f"prompt number {i}{text}"}], **(extra or {})}
            f.write(json.dumps(row) + "\n")
    return ids


def enqueue(tmp_path: Path, redis_url: str, job: str, n: int, *args: str) -> tuple[list[str], Path]:
    """`genq enqueue` of n generated prompts into job, its output under tmp_path/out: (ids, out)."""
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), *args, redis_url=redis_url)
    return ids, out


def read_results(out_dir: Path, job: str) -> list[dict]:
    rows = []
    for shard in sorted((out_dir / job / "shards").glob("*.jsonl")):
        with open(shard) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    return rows


def descendants(pid: int) -> list[int]:
    """All processes below pid, found through /proc (children may start new sessions)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _stat_field(pid: int, index: int) -> str | None:
    """Field `index` of /proc/PID/stat after the command name; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[index]
    except (OSError, IndexError):
        return None


def process_state(pid: int) -> str | None:
    """The state letter ('T' once a SIGSTOP has taken effect)."""
    return _stat_field(pid, 0)


def _started_at(pid: int) -> str | None:
    """The process's start time (clock ticks after boot): with the pid, it names one process.
    Not its command line: RQ renames its processes where setproctitle is installed."""
    return _stat_field(pid, 19)


class Proc:
    """A child process that is always stopped at the end of the test."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None, cwd: Path = WORKDIR) -> None:
        self.args = args
        self.log_path = log_path
        self._log = open(log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if zygote.wanted(args):
            self.popen = zygote.Forked(args, cwd=cwd, env=env, stdout=str(log_path), session=True)
        else:
            self.popen = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                          start_new_session=True)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)  # nothing if it has exited

    def kill_tree(self) -> None:
        """SIGKILL the process and every descendant (as a machine crash would), at once."""
        for pid in [self.popen.pid, *descendants(self.popen.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.popen.wait(timeout=10)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # say what it was doing
            raise AssertionError(f"{self.log_path.stem} did not exit within {timeout:.0f}s; its log ends:\n"
                                 f"{self.log()[-6000:]}") from None

    def stop(self) -> None:
        # Children that started sessions of their own (a fleet's servers) are outside the
        # process group: collect them before the parent goes.
        children = {pid: _started_at(pid) for pid in descendants(self.popen.pid)}
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid, started in children.items():
            if started and _started_at(pid) == started:  # still that process, not a reused pid
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        self._log.close()


@pytest.fixture
def redis_url() -> Iterator[str]:
    conn = redis.Redis.from_url(REDIS_URL)
    conn.flushall()
    yield REDIS_URL
    conn.close()


@pytest.fixture
def rconn(redis_url: str) -> Iterator[redis.Redis]:
    conn = redis.Redis.from_url(redis_url)
    yield conn
    conn.close()


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[callable]:
    """procs(args, name=..., env=..., cwd=...) starts a Proc that is stopped after the test."""
    started: list[Proc] = []

    def start(args: list[str], name: str = "proc", env: dict | None = None, cwd: Path = WORKDIR) -> Proc:
        proc = Proc(args, tmp_path / f"{name}-{len(started)}.log", env, cwd)
        started.append(proc)
        return proc

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def sim(procs) -> callable:
    """sim(**options) starts `genq sim` on a free port and returns its base URL."""

    def start(**options) -> str:
        port = options.pop("port", None) or free_port()
        args = [sys.executable, "-m", "genq", "sim", "--port", str(port)]
        for key, value in options.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        proc = procs(args, name=f"sim-{port}")
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/v1/models", want=None)
        start.procs[url] = proc
        return url

    start.procs = {}
    return start


@pytest.fixture
def worker(procs, redis_url: str) -> callable:
    """worker(server_url, *extra_args) starts `genq worker` and returns its Proc."""

    def start(server_url: str, *extra: str, name: str = "worker", env: dict | None = None) -> Proc:
        args = genq_cmd("worker", "--server", server_url, *extra, redis_url=redis_url)
        return procs(args, name=name, env=env)

    return start


def batch_prompts(conn, job: str, batch_id: str) -> list:
    """The prompts of a queued batch, read as a worker reads them (inline or by reference)."""
    from genq.core.queueing import load_batch, load_config
    from genq.producer.sources import read_prompts

    return read_prompts(load_batch(conn, job, batch_id), load_config(conn, job))

