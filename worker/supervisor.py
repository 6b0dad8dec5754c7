"""Child processes the fleet keeps alive: restart policy, process groups, and the
supervised inference server of one GPU (start, wait for /health, restart when it
exits or stops answering).

Every child runs in its own session (process group) so that (1) a terminal's Ctrl-C
reaches only the fleet, which decides the order of shutdown (engines drain first,
servers stop last), and (2) stopping a server also stops the processes it spawned
(SGLang's scheduler and detokenizer) by signalling the whole group. Each child also
gets PR_SET_PDEATHSIG, and each server's group a guard (worker/launchguard.py) that
ends it when the fleet dies, so a fleet killed with SIGKILL leaves no server holding
its port or GPU memory, even one started through a shell.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from genq.core.parentdeath import ask_for_signal_on_parent_death
from genq.core.waits import wait_event
from genq.core.words import plural
from genq.worker.server import HEALTH_TIMEOUT_S

log = logging.getLogger("genq.fleet")

def preexec_die_with_parent(sig: int) -> Callable[[], None]:
    """A preexec_fn: the child gets `sig` when the fleet process dies (Linux; no-op elsewhere)."""
    return lambda: ask_for_signal_on_parent_death(sig)


def remove_pid_file(path: Path, pid: int | None) -> None:
    """Remove a pid file only if it still names our process (another fleet may share the directory)."""
    try:
        if pid is not None and path.read_text().strip() == str(pid):
            path.unlink()
    except (FileNotFoundError, ValueError):
        pass


def signal_group(pid: int, sig: int) -> None:
    """Signal a child's whole process group (it leads its own session)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@dataclass
class RestartPolicy:
    """Exponential backoff between restarts and a limit on restarts in a row.

    A process that stayed up (and, for a server, healthy) for `stable_after`
    seconds has its count reset: the limit is for crash loops, not for a
    server that fails once a day.
    """

    max_restarts: int = 10
    first_delay: float = 1.0
    max_delay: float = 60.0
    stable_after: float = 600.0
    restarts: int = 0

    def next_delay(self, ran_for: float) -> float | None:
        """Seconds to wait before the next start, or None when the limit is reached."""
        if ran_for >= self.stable_after:
            self.restarts = 0
        self.restarts += 1
        if self.restarts > self.max_restarts:
            return None
        return min(self.max_delay, self.first_delay * 2 ** (self.restarts - 1))


async def sleep_unless(event: asyncio.Event, seconds: float) -> bool:
    """Sleep, waking early when `event` is set; True when it was set (core/waits.py: a stop is not swallowed)."""
    return await wait_event(event, seconds)


class LaunchError(Exception):
    """The server command cannot be run at all (not found, not executable): not worth retrying."""


@dataclass
class ServerSpec:
    gpu: int
    port: int
    argv: list[str]  # already split and substituted
    url: str  # the server's base URL, for /health
    log_path: Path
    pid_path: Path
    env: dict[str, str] = field(default_factory=dict)


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


@dataclass
class HealthTimeouts:
    start: float = 1800.0  # a big model can take many minutes to load
    unhealthy: float = 60.0  # /health failing this long (after having answered) -> restart
    interval: float = 5.0  # between health checks while healthy
    probe: float = HEALTH_TIMEOUT_S  # one /health request: the engine's own verdict (worker/server.py)
    stop: float = 30.0  # SIGTERM -> SIGKILL


class ServerSupervisor:
    """Keeps one GPU's inference server running; its output goes to spec.log_path."""

    def __init__(self, spec: ServerSpec, policy: RestartPolicy, timeouts: HealthTimeouts) -> None:
        self.spec = spec
        self.policy = policy
        self.timeouts = timeouts
        self.proc: asyncio.subprocess.Process | None = None
        self.guard: asyncio.subprocess.Process | None = None  # ends proc's group if the fleet dies
        self.state = "stopped"  # starting | healthy | unhealthy | stopped | failed
        self.starts = 0
        self.failure: str | None = None  # why it gave up
        self._last_pid: int | None = None
        self._stop = asyncio.Event()
        self.healthy_event = asyncio.Event()

    @property
    def label(self) -> str:
        return f"server gpu{self.spec.gpu} (port {self.spec.port})"

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Start, watch, restart; returns once stopped or given up (self.failure says why)."""
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeouts.probe))
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    await self._start()
                except LaunchError as exc:
                    self.failure = str(exc)
                    log.error("%s: %s", self.label, exc)
                    break
                why = await self._watch(session)
                await self._kill()
                if self._stop.is_set():
                    break
                delay = self.policy.next_delay(time.monotonic() - started)
                if delay is None:
                    self.failure = (f"{why}; gave up after {plural(self.policy.max_restarts, 'restart')} "
                                    f"(log: {self.spec.log_path})")
                    log.error("%s: %s", self.label, self.failure)
                    break
                log.warning("%s: %s; restart %d/%d in %.0fs (log: %s)", self.label, why,
                            self.policy.restarts, self.policy.max_restarts, delay, self.spec.log_path)
                if await sleep_unless(self._stop, delay):
                    break
        finally:
            await self._kill()
            await session.close()
            self.state = "failed" if self.failure else "stopped"
            remove_pid_file(self.spec.pid_path, self._last_pid)

    async def _start(self) -> None:
        self.starts += 1
        self.state = "starting"
        self.healthy_event.clear()
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.spec.log_path, "ab") as logf:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            logf.write(f"\n=== genq: start #{self.starts} of the server for GPU {self.spec.gpu} at {stamp}: "
                       f"{' '.join(self.spec.argv)}\n".encode())
            logf.flush()
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *self.spec.argv, stdin=asyncio.subprocess.DEVNULL, stdout=logf, stderr=asyncio.subprocess.STDOUT,
                    env={**os.environ, **self.spec.env}, start_new_session=True,
                    preexec_fn=preexec_die_with_parent(signal.SIGTERM),
                )
            except (FileNotFoundError, PermissionError, NotADirectoryError) as exc:
                raise LaunchError(f"cannot run {self.spec.argv[0]!r}: {exc.strerror or exc}") from None
            self.guard = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "genq.worker.launchguard", str(self.proc.pid), str(self.timeouts.stop),
                stdin=asyncio.subprocess.PIPE, stdout=logf, stderr=asyncio.subprocess.STDOUT, start_new_session=True,
            )
        self.spec.pid_path.parent.mkdir(parents=True, exist_ok=True)
        self.spec.pid_path.write_text(f"{self.proc.pid}\n")
        self._last_pid = self.proc.pid
        log.info("%s: started pid %d (log %s)", self.label, self.proc.pid, self.spec.log_path)

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.spec.url.rstrip("/") + "/health") as resp:
                await resp.read()
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _wait_exit_or_stop(self, seconds: float) -> bool:
        """Wait up to `seconds`; True if the process exited or a stop was asked."""
        assert self.proc is not None
        waiters = [asyncio.ensure_future(self.proc.wait()), asyncio.ensure_future(self._stop.wait())]
        done, pending = await asyncio.wait(waiters, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        for w in pending:
            w.cancel()
        return bool(done)

    async def _watch(self, session: aiohttp.ClientSession) -> str:
        """Return why the server must be restarted (or "stop requested")."""
        assert self.proc is not None
        t = self.timeouts
        started = time.monotonic()
        bad_since: float | None = None
        ever_healthy = False
        while True:
            interval = t.interval if self.state == "healthy" else min(1.0, t.interval)
            if await self._wait_exit_or_stop(interval):
                if self._stop.is_set():
                    return "stop requested"
                rc = self.proc.returncode
                said = last_words(self.spec.log_path) if rc and rc > 0 else ""  # killed by a signal: it said nothing
                return f"exited with status {rc}" + (f" (its log ends: {said})" if said else "")
            ok = await self._healthy(session)
            now = time.monotonic()
            if ok:
                if self.state != "healthy":
                    log.info("%s: healthy%s", self.label,
                             f" after {now - started:.1f}s" if not ever_healthy else " again")
                self.state, bad_since, ever_healthy = "healthy", None, True
                self.healthy_event.set()
                continue
            if not ever_healthy:
                if now - started > t.start:
                    return f"no healthy answer on /health within {t.start:.0f}s of start"
                continue
            if bad_since is None:
                bad_since = now
                self.state = "unhealthy"
                self.healthy_event.clear()
                log.warning("%s: /health is failing", self.label)
            elif now - bad_since >= t.unhealthy:
                return f"/health failing for {now - bad_since:.0f}s"

    async def _kill(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        self.healthy_event.clear()
        signal_group(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.wait(), self.timeouts.stop)
        except TimeoutError:
            log.warning("%s: did not stop within %.0fs of SIGTERM; killing it", self.label, self.timeouts.stop)
        # SIGKILL what is left of the group (the leader, or children it left behind holding the GPU).
        signal_group(proc.pid, signal.SIGKILL)
        await proc.wait()
        await self._release_guard()

    async def _release_guard(self) -> None:
        """The group is gone: its guard leaves without signalling (its number may be another's soon)."""
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
