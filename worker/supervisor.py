"""The fleet's children, kept alive: a GPU's `genq worker` engine and (with --launch) its server.

One restart loop serves both (Supervisor.run): exponential backoff, a limit on restarts in a
row. Every child leads its own session: a terminal's Ctrl-C reaches only the fleet, which stops
engines first and servers last, and signalling a server's group also stops what it spawned
(SGLang's scheduler and detokenizer). PR_SET_PDEATHSIG on each child and a guard on each
server's group (worker/launchguard.py) end them when the fleet dies, even by SIGKILL.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import aiohttp

from genq.core.waits import wait_event
from genq.core.words import plural
from genq.worker.server import HEALTH_TIMEOUT_S

log = logging.getLogger("genq.fleet")


def _term_on_parent_death() -> None:
    """In the child: SIGTERM when the thread that forked it dies (Linux's PR_SET_PDEATHSIG = 1)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass  # not Linux: no such signal there


def signal_group(pid: int, sig: int) -> None:
    """Signal a child's whole process group (it leads its own session)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# A child that stayed up STABLE_AFTER seconds has its restart count reset: the limit is for
# crash loops, not for a server that fails once a day.
FIRST_DELAY = 1.0
MAX_DELAY = 60.0
STABLE_AFTER = 600.0


@dataclass
class HealthTimeouts:
    start: float = 1800.0  # a big model can take many minutes to load
    unhealthy: float = 60.0  # /health failing this long (after having answered) -> restart
    interval: float = 5.0  # between health checks while healthy
    probe: float = HEALTH_TIMEOUT_S  # one /health request: the engine's own verdict (worker/server.py)
    stop: float = 30.0  # SIGTERM -> SIGKILL


class Supervisor:
    """Starts a child, waits for its end, starts it again; subclasses say how one run goes."""

    def __init__(self, label: str, argv: list[str], env: dict[str, str], log_path: Path, pid_path: Path,
                 max_restarts: int) -> None:
        self.label = label
        self.argv = argv
        self.env = env
        self.log_path = log_path
        self.pid_path = pid_path
        self.max_restarts = max_restarts
        self.restarts = 0  # in a row
        self.proc: asyncio.subprocess.Process | None = None
        self.failure: str | None = None  # why it gave up
        self.starts = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Start, watch, restart; returns once stopped, ended for good or given up (self.failure says why)."""
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                self.starts += 1
                why = await self._run_once()
                if why is None or self._stop.is_set():
                    return
                if time.monotonic() - started >= STABLE_AFTER:
                    self.restarts = 0
                self.restarts += 1
                if self.restarts > self.max_restarts:
                    self.failure = f"{why}; gave up after {plural(self.max_restarts, 'restart')} (log: {self.log_path})"
                    log.error("%s: %s", self.label, self.failure)
                    return
                delay = min(MAX_DELAY, FIRST_DELAY * 2 ** (self.restarts - 1))
                log.warning("%s: %s; restart %d/%d in %.0fs (log: %s)", self.label, why, self.restarts,
                            self.max_restarts, delay, self.log_path)
                if await wait_event(self._stop, delay):
                    return
        finally:
            await self._cleanup()

    async def _run_once(self) -> str | None:
        """Run the child once; why it must be restarted, or None: it ended for good."""
        raise NotImplementedError

    async def _cleanup(self) -> None:
        """What run() leaves behind it."""

    async def _spawn(self, stdout: int | IO[bytes]) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            *self.argv, stdin=asyncio.subprocess.DEVNULL, stdout=stdout, stderr=asyncio.subprocess.STDOUT,
            env={**os.environ, **self.env}, start_new_session=True, limit=1 << 20,
            # The fleet killed outright: the child gets SIGTERM (an engine still drains).
            preexec_fn=_term_on_parent_death,
        )
        self.pid_path.parent.mkdir(parents=True, exist_ok=True)
        self.pid_path.write_text(f"{proc.pid}\n")
        return proc

    def _remove_pid_file(self, pid: int) -> None:
        """Only if it still names our process (another fleet may share the directory)."""
        try:
            if self.pid_path.read_text().strip() == str(pid):
                self.pid_path.unlink()
        except (FileNotFoundError, ValueError):
            pass


class EngineSupervisor(Supervisor):
    """One `genq worker --server ... --gpu N` child; restarted when it fails, not when it exits 0
    (drained, --burst, stopped)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, pid_path: Path,
                 max_restarts: int) -> None:
        super().__init__(f"worker {name}", argv, env, log_path, pid_path, max_restarts)
        self.name = name
        self.rc = 0  # the child's last exit status (0 also when our own stop signal ended it)

    @property
    def ok(self) -> bool:
        return self.rc == 0 and self.failure is None

    def stop(self, level: int = 1) -> None:
        """1: drain (SIGTERM); 2: stop now (a second SIGTERM); 3+: SIGKILL."""
        self._stop.set()
        if self.proc is None or self.proc.returncode is not None:
            return
        if level >= 3:
            signal_group(self.proc.pid, signal.SIGKILL)
        else:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    async def _run_once(self) -> str | None:
        self.proc = proc = await self._spawn(asyncio.subprocess.PIPE)
        log.info("%s: started pid %d%s", self.label, proc.pid, f" (start #{self.starts})" if self.starts > 1 else "")
        if self._stop.is_set():  # stop() came while it was being spawned
            proc.send_signal(signal.SIGTERM)
        assert proc.stdout is not None  # started with stdout=PIPE
        pump = asyncio.create_task(self._pump(proc.stdout))
        self.rc = await proc.wait()
        await pump
        self._remove_pid_file(proc.pid)
        if self.rc == 0:
            log.info("%s: exited normally (drained, burst or stopped); not restarted", self.label)
        elif not self._stop.is_set():
            return f"exited with status {self.rc}"
        elif self.rc in (-signal.SIGTERM, -signal.SIGKILL):
            # Our signal arrived before it installed its handlers: it held nothing.
            log.info("%s: stopped (it had not started work)", self.label)
            self.rc = 0
        else:
            log.info("%s: exited with status %s while stopping", self.label, self.rc)
        return None

    async def _pump(self, stream: asyncio.StreamReader) -> None:
        """Copy the child's output to its log file and, prefixed with its name, to our stderr."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            while True:
                try:
                    line = await stream.readline()
                except ValueError:  # a line over the limit: pass it on in pieces
                    line = await stream.read(1 << 16)
                if not line:
                    return
                logf.write(line)
                logf.flush()
                try:
                    sys.stderr.write(f"{self.name} | {line.decode(errors='replace')}")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass  # our terminal went away: the log file still has it


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


class ServerSupervisor(Supervisor):
    """Keeps one GPU's inference server running: restarted when it exits, never answers /health
    within timeouts.start, or stops answering it for timeouts.unhealthy. Its output goes to its log."""

    def __init__(self, gpu: int, port: int, url: str, argv: list[str], env: dict[str, str], log_path: Path,
                 pid_path: Path, max_restarts: int, timeouts: HealthTimeouts) -> None:
        super().__init__(f"server gpu{gpu} (port {port})", argv, env, log_path, pid_path, max_restarts)
        self.gpu = gpu
        self.port = port
        self.url = url  # the server's base URL, for /health
        self.timeouts = timeouts
        self.guard: asyncio.subprocess.Process | None = None  # ends proc's group if the fleet dies
        self._last_pid: int | None = None

    def stop(self, level: int = 1) -> None:
        """Stop it (SIGTERM to its group, SIGKILL after timeouts.stop); 3+: with no more patience."""
        if level >= 3:
            self.timeouts.stop = 0.1
        self._stop.set()

    async def _run_once(self) -> str | None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as logf:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logf.write(f"\n=== genq: start #{self.starts} of the server for GPU {self.gpu} at {stamp}: "
                       f"{' '.join(self.argv)}\n".encode())
            logf.flush()
            try:
                self.proc = await self._spawn(logf)
            except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
                # Not worth retrying: the command cannot be run at all.
                self.failure = f"cannot run {self.argv[0]!r}: {exc.strerror or exc}"
                log.error("%s: %s", self.label, self.failure)
                return None
            self.guard = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "genq.worker.launchguard", str(self.proc.pid), str(self.timeouts.stop),
                stdin=asyncio.subprocess.PIPE, stdout=logf, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        self._last_pid = self.proc.pid
        log.info("%s: started pid %d (log %s)", self.label, self.proc.pid, self.log_path)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeouts.probe)) as session:
            why = await self._watch(self.proc, session)
        await self._kill()
        return why

    async def _cleanup(self) -> None:
        await self._kill()
        if self._last_pid is not None:
            self._remove_pid_file(self._last_pid)

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.url.rstrip("/") + "/health") as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _exit_or_stop(self, proc: asyncio.subprocess.Process, seconds: float) -> bool:
        """Wait up to `seconds`; True if the process exited or a stop was asked."""
        waiters = [asyncio.ensure_future(proc.wait()), asyncio.ensure_future(self._stop.wait())]
        done, pending = await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        return bool(done)

    async def _watch(self, proc: asyncio.subprocess.Process, session: aiohttp.ClientSession) -> str:
        """Why the server must be restarted (or "stop requested")."""
        t = self.timeouts
        started = time.monotonic()
        healthy = ever_healthy = False
        bad_since: float | None = None
        while True:
            if await self._exit_or_stop(proc, t.interval if healthy else min(1.0, t.interval)):
                if self._stop.is_set():
                    return "stop requested"
                rc = proc.returncode
                said = last_words(self.log_path) if rc and rc > 0 else ""  # killed by a signal: it said nothing
                return f"exited with status {rc}" + (f" (its log ends: {said})" if said else "")
            now = time.monotonic()
            if await self._healthy(session):
                if not healthy:
                    log.info("%s: healthy%s", self.label, " again" if ever_healthy else f" after {now - started:.1f}s")
                healthy = ever_healthy = True
                bad_since = None
            elif not ever_healthy:
                if now - started > t.start:
                    return f"no healthy answer on /health within {t.start:.0f}s of start"
            elif bad_since is None:
                bad_since, healthy = now, False
                log.warning("%s: /health is failing", self.label)
            elif now - bad_since >= t.unhealthy:
                return f"/health failing for {now - bad_since:.0f}s"

    async def _kill(self) -> None:
        """SIGTERM to the group, SIGKILL to what is left after timeouts.stop; then release the guard."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.timeouts.stop)
        except TimeoutError:
            log.warning("%s: did not stop within %.0fs of SIGTERM; killing it", self.label, self.timeouts.stop)
        # SIGKILL what is left of the group (the leader, or children it left behind holding the GPU).
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        # The group is gone: its guard leaves without signalling (its number may be another's soon).
        guard, self.guard = self.guard, None
        if guard is None or guard.stdin is None:
            return
        try:
            guard.stdin.write(b"done\n")
            await guard.stdin.drain()
            guard.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass
        await guard.wait()
