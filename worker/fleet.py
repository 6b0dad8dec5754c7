"""`genq worker --gpus`: one worker per GPU (GPU i of the list on port base_port + i) and (--launch) its
server, each leading a session of its own, restarted after 1 s doubling to 60 s, given up after --max-restarts
in a row. PR_SET_PDEATHSIG and a guard beside each server's group end them when the fleet dies, even by SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO
from urllib.parse import urlsplit

import redis

from genq import PYTHON
from genq.core.ledger import fleet as ledger_fleet
from genq.core.redisconn import ENV_VAR, connect, mask_url
from genq.core.waits import wait_event
from genq.core.words import plural
from genq.worker.server import ServerClient

log = logging.getLogger("genq.fleet")

FIELDS = ("port", "gpu")  # the only substitutions in --launch and --server-url
HAS_MODULE = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"
STAND_IN = "without the server installed here, `--launch \"genq sim --port {port}\"` stands in for one (docs/fleet.md)"
STABLE_AFTER = 600.0  # the restart limit is for crash loops, not for a server that fails once a day
SIGNALLED = ("%s: each worker finishes its held batches (up to its --grace-period) and exits; servers stop after "
             "their worker. Send again to stop the workers now, a third time to kill everything.",
             "%s again: workers stop now, handing unfinished batches back",
             "%s a third time: killing workers and servers")


class FleetError(Exception):
    """A setting that cannot work: the message names it and says what to do."""


@dataclass
class HealthTimeouts:
    start: float = 1800.0  # a big model can take many minutes to load
    unhealthy: float = 60.0  # /health failing this long, after it answered once: restarted
    interval: float = 5.0  # between health checks while healthy
    stop: float = 30.0  # SIGTERM -> SIGKILL


@dataclass
class FleetOptions:
    redis_url: str
    gpus: list[int]
    host: str
    base_port: int = 30000
    server_url: str = "http://127.0.0.1:{port}"
    launch: str | None = None
    log_dir: Path = Path("genq-logs")
    name_prefix: str | None = None  # default: the host name
    engine_args: list[str] = field(default_factory=list)  # shared `genq worker` options, forwarded
    max_restarts: int = 10
    health: HealthTimeouts = field(default_factory=HealthTimeouts)


def check_template(text: str, option: str) -> None:
    """Allow only {port} and {gpu}; literal braces are written {{ and }}."""
    rule = "only {port} and {gpu} are substituted (write a literal brace as {{ or }})"
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as exc:
        raise FleetError(f"{option}: {exc} in {text!r}; {rule}") from None
    for _, name, spec, conversion in parsed:
        if name is not None and (name not in FIELDS or spec or conversion):
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise FleetError(f"{option}: {shown} is not a substitution genq knows; {rule}, in {text!r}")


def launch_argv(command: str, *, port: int, gpu: int) -> list[str]:
    """Split like a POSIX shell (no shell runs it), then substitute in each word."""
    try:
        words = shlex.split(command)
    except ValueError as exc:
        raise FleetError(f"--launch: cannot split {command!r}: {exc}") from None
    if not words:
        raise FleetError("--launch is empty")
    for word in words:
        check_template(word, "--launch")
    return [w.format(port=port, gpu=gpu) for w in words]


def launch_problem(argv: list[str]) -> str | None:
    """Why argv cannot run here (said once, not after --max-restarts per GPU): a program not on PATH, or
    `python -m PACKAGE` where that python has no PACKAGE (found without importing it: no CUDA touched)."""
    if (found := shutil.which(argv[0])) is None:  # a path is only checked: its launch says what is wrong
        return (None if os.sep in argv[0]
                else f"--launch: {argv[0]!r} is not a command on this machine's PATH; {STAND_IN}")
    if not os.path.basename(found).startswith("python") or len(argv) < 3 or argv[1] != "-m":
        return None
    package = argv[2].split(".")[0]
    try:
        if subprocess.run([found, "-c", HAS_MODULE, package], capture_output=True, timeout=60).returncode != 3:
            return None
    except (OSError, subprocess.TimeoutExpired):
        return None  # the launch itself will say what is wrong
    return (f"--launch: {found} has no module {package!r} (`{' '.join(argv[:3])}` cannot start): install it into "
            f"that python, or name the python that has it (--launch \"/path/to/venv/bin/python -m {argv[2]} ...\"); "
            f"{STAND_IN}")


def parse_gpus(spec: str) -> list[int]:
    """`all` (every GPU NVML sees) or a comma-separated list of GPU indices (any, where NVML sees no driver).
    ValueError for a list that is not one (bad usage); FleetError for what NVML says of this machine."""
    spec, count = spec.strip(), None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            count = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ImportError
        why = f"{type(exc).__name__}: {exc}"
    if spec.lower() == "all":
        if count is None:
            raise FleetError(f"--gpus all: cannot list this machine's GPUs through NVML ({why}); pass an explicit "
                             "list such as --gpus 0,1")
        if count == 0:
            raise FleetError("--gpus all: NVML sees no GPU on this machine; pass an explicit list such as --gpus 0")
        return list(range(count))
    gpus: list[int] = []
    for part in (p.strip() for p in spec.split(",")):
        if not part.isdigit():
            raise ValueError(f"--gpus {spec!r}: {part!r} is not a GPU index; use 'all' or a list such as 0,1,5")
        if int(part) in gpus:
            raise ValueError(f"--gpus {spec!r}: GPU {part} is listed twice")
        gpus.append(int(part))
    if count is not None and (missing := [g for g in gpus if g >= count]):
        raise FleetError(f"--gpus {spec!r}: NVML sees {count} GPU(s) (0-{count - 1}); no GPU {missing[0]}")
    return gpus


def _term_on_parent_death() -> None:
    with contextlib.suppress(OSError):  # not Linux; PR_SET_PDEATHSIG = 1: SIGTERM when the forking thread dies
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


class Child:
    """A GPU's `genq worker`, restarted unless it exits 0; or, with `health`, its server (output to its log only),
    restarted when it exits, never answers /health within health.start, or fails it for health.unhealthy."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], files: Path, max_restarts: int,
                 health: HealthTimeouts | None = None, url: str = "") -> None:
        self.label, self.argv, self.env, self.log_path = label, argv, env, files.with_suffix(".log")
        self.pid_path = files.with_suffix(".pid")
        self.name, self.starts = label.removeprefix("worker "), 0
        self.max_restarts, self.health, self.url = max_restarts, health, url
        self.rc = 0  # a worker's last exit status (0 also when our own stop signal ended it)
        self.failure: str | None = None  # why it was given up
        self.proc: asyncio.subprocess.Process | None = None
        self.guard: asyncio.subprocess.Process | None = None  # ends a server's group if the fleet dies
        self._stop = asyncio.Event()

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.failure is None

    async def run(self) -> None:
        """Start, watch, restart; returns once stopped, ended for good or given up (self.failure says why)."""
        restarts = 0
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.starts += 1
                self.log_path.parent.mkdir(parents=True, exist_ok=True)  # its log and pid file, each start
                why = await (self._server_once() if self.health else self._worker_once())
                if why is None or self._stop.is_set():
                    return
                if self.health is None and await asyncio.to_thread(self._draining):
                    log.warning("%s: %s while draining; not restarted (the drain asked it to go)", self.label, why)
                    return
                restarts = 1 if time.monotonic() - started >= STABLE_AFTER else restarts + 1
                if restarts > self.max_restarts:
                    self.failure = f"{why}; gave up after {plural(self.max_restarts, 'restart')} (log: {self.log_path})"
                    log.error("%s: %s", self.label, self.failure)
                    return
                delay = min(60.0, 2.0 ** (restarts - 1))
                log.warning("%s: %s; restart %d/%d in %.0fs (log: %s)", self.label, why, restarts,
                            self.max_restarts, delay, self.log_path)
                if await wait_event(self._stop, delay):
                    return
        finally:
            await self._kill()

    def _draining(self) -> bool:
        """Whether the worker that died was asked to drain (no when Redis cannot say)."""
        try:
            with connect(self.env[ENV_VAR]) as conn:
                return ledger_fleet.control_of(conn, self.name).drain
        except (redis.RedisError, OSError):
            return False

    def stop(self, level: int = 1) -> None:
        """1: drain (a worker gets SIGTERM; a server's group SIGTERM, SIGKILL after health.stop);
        2: a worker stops now (a second SIGTERM); 3+: SIGKILL, no more patience."""
        self._stop.set()
        if self.health is not None and level >= 3:
            self.health.stop = 0.1
        elif self.health is None and self.proc is not None and self.proc.returncode is None:
            if level >= 3:
                signal_group(self.proc.pid, signal.SIGKILL)
            else:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(signal.SIGTERM)

    async def _spawn(self, stdout: int | IO[bytes]) -> asyncio.subprocess.Process:
        self.proc = proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **self.env}, start_new_session=True, limit=1 << 20, preexec_fn=_term_on_parent_death)
        self.pid_path.write_text(f"{proc.pid}\n")
        return proc

    def _forget_pid(self, pid: int) -> None:
        """Its pid file goes, if it still names ours (another fleet may share the directory)."""
        with contextlib.suppress(FileNotFoundError, ValueError):
            if self.pid_path.read_text().strip() == str(pid):
                self.pid_path.unlink()

    async def _worker_once(self) -> str | None:
        """Why it must be started again, or None: it ended for good."""
        proc = await self._spawn(asyncio.subprocess.PIPE)
        log.info("%s: started pid %d%s", self.label, proc.pid, f" (start #{self.starts})" if self.starts > 1 else "")
        if self._stop.is_set():  # stop() came while it was being spawned
            proc.send_signal(signal.SIGTERM)
        assert proc.stdout is not None
        pump = asyncio.create_task(self._pump(proc.stdout))
        self.rc = await proc.wait()
        await pump
        self.proc = None
        self._forget_pid(proc.pid)
        if self.rc == 0:
            log.info("%s: exited normally (drained, burst or stopped); not restarted", self.label)
        elif not self._stop.is_set():
            return f"exited with status {self.rc}"
        elif self.rc in (-signal.SIGTERM, -signal.SIGKILL):  # our signal came before its handlers: it held nothing
            log.info("%s: stopped (it had not started work)", self.label)
            self.rc = 0
        else:
            log.info("%s: exited with status %s while stopping", self.label, self.rc)
        return None

    async def _pump(self, stream: asyncio.StreamReader) -> None:  # to its log and, named, to our stderr
        with open(self.log_path, "ab") as logf:
            while True:
                try:
                    line = await stream.readline()
                except ValueError:  # a line over the limit: passed on in pieces
                    line = await stream.read(1 << 16)
                if not line:
                    return
                logf.write(line)
                logf.flush()
                with contextlib.suppress(OSError, ValueError):  # our terminal went away: the log still has it
                    sys.stderr.write(f"{self.name} | {line.decode(errors='replace')}")
                    sys.stderr.flush()

    async def _server_once(self) -> str | None:
        assert self.health is not None
        with open(self.log_path, "ab") as logf:
            logf.write(f"\n=== genq: start #{self.starts} of the {self.label} at {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                       f"{' '.join(self.argv)}\n".encode())
            logf.flush()
            try:
                proc = await self._spawn(logf)
            except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:  # not worth retrying
                self.failure = f"cannot run {self.argv[0]!r}: {exc.strerror or exc}"
                log.error("%s: %s", self.label, self.failure)
                return None
            self.guard = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "genq.worker.fleet", str(proc.pid), str(self.health.stop),
                stdin=asyncio.subprocess.PIPE, stdout=logf, stderr=asyncio.subprocess.STDOUT, start_new_session=True)
        log.info("%s: started pid %d (log %s)", self.label, proc.pid, self.log_path)
        client, t, started = ServerClient(self.url), self.health, time.monotonic()
        ended, stopped = asyncio.ensure_future(proc.wait()), asyncio.ensure_future(self._stop.wait())
        ever_healthy = False
        bad_since: float | None = None
        try:  # until it must be started again (or stopped)
            while True:
                healthy = ever_healthy and bad_since is None
                await asyncio.wait([ended, stopped], timeout=t.interval if healthy else min(1.0, t.interval),
                                   return_when=asyncio.FIRST_COMPLETED)
                if stopped.done():
                    return "stop requested"
                if ended.done():
                    said = last_words(self.log_path) if ended.result() > 0 else ""  # a signal says nothing
                    return f"exited with status {ended.result()}" + (f" (its log ends: {said})" if said else "")
                now = time.monotonic()
                if await client.healthy():
                    if not healthy:
                        log.info("%s: healthy%s", self.label,
                                 " again" if ever_healthy else f" after {now - started:.1f}s")
                    ever_healthy, bad_since = True, None
                elif not ever_healthy:
                    if now - started > t.start:
                        return f"no healthy answer on /health within {t.start:.0f}s of start"
                elif bad_since is None:
                    bad_since = now
                    log.warning("%s: /health is failing", self.label)
                elif now - bad_since >= t.unhealthy:
                    return f"/health failing for {now - bad_since:.0f}s"
        finally:
            ended.cancel()
            stopped.cancel()
            await client.close()
            await self._kill()

    async def _kill(self) -> None:
        """SIGTERM to a server's group, SIGKILL to what is left after health.stop (the leader, or
        children it left holding the GPU); then its guard leaves without signalling."""
        proc, self.proc = self.proc, None
        if proc is None or self.health is None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.health.stop)
        except TimeoutError:
            log.warning("%s: did not stop within %.0fs of SIGTERM; killing it", self.label, self.health.stop)
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        self._forget_pid(proc.pid)
        guard, self.guard = self.guard, None
        if guard is not None and guard.stdin is not None:
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                guard.stdin.write(b"done\n")
                await guard.stdin.drain()
                guard.stdin.close()
            await guard.wait()


def last_words(log_path: Path, limit: int = 240) -> str:
    """The last line a server wrote in its log since its latest start (why it exited, mostly)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    lines = [line.strip() for line in tail.rsplit("=== genq: start", 1)[-1].splitlines()[1:]]
    said = next((line for line in reversed(lines) if line), "")
    return said if len(said) <= limit else said[:limit] + "..."


def guard(pgid: int, stop_s: float) -> None:
    """Beside a server, reading a pipe from the fleet: "done", the group is gone; the pipe ending without it, the
    fleet died (PR_SET_PDEATHSIG misses a server under a shell): SIGTERM to the group, SIGKILL after stop_s."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # only the pipe ends the guard
        signal.signal(sig, signal.SIG_IGN)
    if sys.stdin.buffer.read() == b"done\n":
        return
    print(f"genq: the fleet is gone; stopping the server's process group {pgid}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + stop_s
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
        while time.monotonic() < deadline:
            time.sleep(0.1)
            os.killpg(pgid, 0)  # ProcessLookupError once the group is gone
        os.killpg(pgid, signal.SIGKILL)


def plan(opts: FleetOptions) -> list[tuple[int, str, Child, Child | None]]:
    """One (gpu, server URL, worker, launched server) per GPU, every setting checked before anything starts."""
    check_template(opts.server_url, "--server-url")
    if opts.launch and (problem := launch_problem(launch_argv(opts.launch, port=opts.base_port, gpu=opts.gpus[0]))):
        raise FleetError(problem)
    last = opts.base_port + len(opts.gpus) - 1
    if not 1 <= opts.base_port or last > 65535:
        raise FleetError(f"--base-port {opts.base_port} with {len(opts.gpus)} GPU(s) needs ports up to {last}")
    slots = []
    for port, gpu in enumerate(opts.gpus, opts.base_port):
        url, logs = opts.server_url.format(port=port, gpu=gpu), opts.log_dir
        name = f"{opts.name_prefix or opts.host}.gpu{gpu}"
        argv = [*PYTHON, "-m", "genq", "worker", "--server", url, "--gpu", str(gpu), "--name", name,
                "--host", opts.host, *opts.engine_args]
        # The Redis URL travels in the environment, not argv: `ps` must not show a password.
        worker = Child(f"worker {name}", argv, {ENV_VAR: opts.redis_url, "PYTHONUNBUFFERED": "1"},
                       logs / f"worker-gpu{gpu}", opts.max_restarts)
        server = None
        if opts.launch is not None:
            # CUDA's default order (fastest first) may differ from nvidia-smi/NVML's; make them agree.
            env = {"CUDA_VISIBLE_DEVICES": str(gpu),
                   "CUDA_DEVICE_ORDER": os.environ.get("CUDA_DEVICE_ORDER", "PCI_BUS_ID")}
            server = Child(f"server gpu{gpu} (port {port})", launch_argv(opts.launch, port=port, gpu=gpu), env,
                           logs / f"server-gpu{gpu}", opts.max_restarts, opts.health, url)
            host = urlsplit(url).hostname or "127.0.0.1"
            with contextlib.suppress(OSError):  # a port already answering would answer /health for a stranger
                socket.create_connection((host, port), timeout=0.5).close()
                raise FleetError(f"port {port} (GPU {gpu}) already accepts connections at {host}; "
                                 "stop what listens there or pick another --base-port")
        slots.append((gpu, url, worker, server))
    return slots


async def run_fleet(opts: FleetOptions) -> int:
    slots = plan(opts)
    opts.log_dir.mkdir(parents=True, exist_ok=True)
    log.info("fleet on %s: %d GPU(s), redis %s, logs in %s", opts.host, len(slots), mask_url(opts.redis_url),
             opts.log_dir)
    for gpu, url, worker, server in slots:
        log.info("  gpu%d -> %s, server %s%s", gpu, worker.label, url,
                 f"; launched: {' '.join(server.argv)}" if server else "")
    signals = 0

    def on_signal(sig: int) -> None:
        nonlocal signals
        signals += 1
        log.info(SIGNALLED[min(signals, 3) - 1], signal.Signals(sig).name)
        for _, _, worker, server in slots:
            worker.stop(signals)
            if signals >= 3 and server is not None:
                server.stop(signals)

    async def run_slot(gpu: int, worker: Child, server: Child | None) -> bool:
        running = asyncio.create_task(worker.run())
        if server is None:
            await running
            return worker.ok
        serving = asyncio.create_task(server.run())
        await asyncio.wait({running, serving}, return_when=asyncio.FIRST_COMPLETED)
        if serving.done() and not running.done():
            log.error("gpu%d: its server cannot be kept running (%s); stopping %s (held batches go back to the "
                      "queue after its --server-down-timeout/--grace-period)", gpu, server.failure, worker.label)
            worker.stop(1)
        await running
        server.stop()  # its worker is gone: free the GPU
        await serving
        return worker.ok and server.ok

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    results = await asyncio.gather(*(run_slot(gpu, worker, server) for gpu, _, worker, server in slots))
    if failed := [worker.name for (_, _, worker, _), ok in zip(slots, results, strict=True) if not ok]:
        log.error("fleet: %d of %d worker(s) ended in failure: %s", len(failed), len(slots), ", ".join(failed))
        return 1
    log.info("fleet: all %d worker(s) have exited", len(slots))
    return 0


if __name__ == "__main__":  # the guard: python -m genq.worker.fleet PGID STOP_SECONDS
    guard(int(sys.argv[1]), float(sys.argv[2]))
