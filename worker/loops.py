"""The engine's RQ work loops: child processes that take batches off the queue.

Each loop is a stock `rq.SimpleWorker` running `run_batch` (genq.worker.rqjob), which
hands the batch to the engine and waits, and keeps `rq info` truthful. How many run:
--prefetch, plus one for each held batch that has nothing left to send (its long tail),
so slots never run dry at batch boundaries.

Loops get exactly one SIGTERM (RQ's warm shutdown: an idle loop exits, a busy one
finishes its job, which returns once the engine has answered its lease; a loop
popping a batch when it comes first starts it: see rqjob.EngineWorker). A second
signal would be RQ's cold shutdown: never sent.

A loop that exits because Redis is unreachable (rqjob.EXIT_REDIS_UNREACHABLE) is no crash:
it is not counted toward LoopsFailing, and loops that exit are started again with a
backoff (up to RESPAWN_MAX_S), not every pass: a Redis outage of any length stops no worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from collections import deque
from dataclasses import dataclass

from genq import PYTHON
from genq.core.prefetch import max_loops, reserve
from genq.core.redisconn import ENV_VAR as REDIS_ENV
from genq.worker.dispatch import Dispatcher
from genq.worker.held import Flags, Holdings
from genq.worker.options import WorkerOptions
from genq.worker.rqjob import ENGINE_ENV, EXIT_REDIS_UNREACHABLE
from genq.worker.shares import Shares

log = logging.getLogger("genq.worker")

FAILURE_WINDOW_S = 600.0  # loop crashes counted over this window...
MAX_FAILURES = 20  # ...and this many in it stop the worker (loudly, exit 1) rather than idle silently
RESPAWN_FIRST_S = 0.5  # after a loop exits unasked, the next start waits this long, doubling...
RESPAWN_MAX_S = 30.0  # ...up to this; a loop that ran a while (HEALTHY_S) resets it
HEALTHY_S = 60.0


class LoopsFailing(RuntimeError):
    """RQ work loops keep crashing: the worker stops instead of holding nothing forever."""


@dataclass
class RqLoop:
    proc: asyncio.subprocess.Process
    name: str
    started: float  # monotonic
    stopping: bool = False


class RqLoops:
    def __init__(self, opts: WorkerOptions, instance: str, flags: Flags, held: Holdings,
                 dispatcher: Dispatcher) -> None:
        self.opts = opts
        self.instance = instance
        self.flags = flags
        self.held = held
        self.dispatcher = dispatcher
        self.loops: list[RqLoop] = []
        self.exhausted = False  # --burst: a loop found the queue empty
        self._failures: deque[float] = deque()
        self._respawn_delay = 0.0  # grows while loops exit unasked (see RESPAWN_FIRST_S)
        self._respawn_at = 0.0  # monotonic: no loop is started before this
        self.shares: Shares | None = None  # priorities and fair share (worker/shares.py)

    @property
    def any_alive(self) -> bool:
        return any(loop.proc.returncode is None for loop in self.loops)

    async def run(self) -> None:
        while True:
            self._reap()
            active = [loop for loop in self.loops if not loop.stopping]
            desired = self.desired(len(active)) if self.flags.accepting and not self.exhausted else 0
            # Loops told to stop may still hold a batch until it is done; count them, or a
            # pause/resume cycle would leave more batches held than --prefetch asks for.
            if len(self.loops) < desired and time.monotonic() >= self._respawn_at:
                for _ in range(desired - len(self.loops)):
                    self.loops.append(await self._spawn())
            elif len(active) > desired and not self.exhausted:  # burst loops leave by themselves
                for loop in active[desired:]:
                    self._stop(loop)
            await asyncio.sleep(0.3)

    def _reap(self) -> None:
        now = time.monotonic()
        for loop in [lp for lp in self.loops if lp.proc.returncode is not None]:
            self.loops.remove(loop)
            if loop.stopping:
                continue
            if loop.proc.returncode == 0 and self.opts.burst:
                self.exhausted = True
                continue
            self._back_off(now - loop.started)
            if loop.proc.returncode == EXIT_REDIS_UNREACHABLE:
                log.info("RQ loop %s: Redis away or full; starting another in %.1fs", loop.name, self._respawn_delay)
            elif loop.proc.returncode != 0:
                self._failures.append(now)
                log.warning("RQ loop %s exited with %s", loop.name, loop.proc.returncode)
        while self._failures and now - self._failures[0] > FAILURE_WINDOW_S:
            self._failures.popleft()
        if len(self._failures) >= MAX_FAILURES:
            raise LoopsFailing(f"{len(self._failures)} RQ work loops crashed in the last "
                               f"{FAILURE_WINDOW_S / 60:.0f} minutes; see the log above")

    def _back_off(self, ran_s: float) -> None:
        """A loop exited unasked after running ran_s: the next start waits (see RESPAWN_FIRST_S)."""
        if ran_s >= HEALTHY_S:
            self._respawn_delay = 0.0
        self._respawn_delay = min(RESPAWN_MAX_S, max(RESPAWN_FIRST_S, self._respawn_delay * 2))
        self._respawn_at = time.monotonic() + self._respawn_delay

    def desired(self, active: int) -> int:
        """--prefetch loops, plus one for each held batch that has nothing left to send.

        A batch whose prompts are all sent holds only its long tail. With heavy-tailed
        lengths several batches can be in their tails at once, so the reserve of
        unsent prompts is counted in prompts, not batches: keep (prefetch - 1)
        batches' worth unsent, or slots run dry at batch boundaries.
        """
        base = self.opts.loops
        if self.flags.paused_all:
            return base  # parked prompts are not work: do not take more batches for them
        size = max((h.config.batch_size for h in self.held.values()), default=0)
        keep = reserve(base, size)
        unsent = self.dispatcher.unsent
        # A job's next batch is fetched while half an in-flight window of it is still waiting here.
        low = max(1, self.dispatcher.controller.target // 2)
        if self.shares is not None and self.shares.wants_head(self.dispatcher.todo.by_job(), low):
            # The queue's next batch is of higher priority, or a job with nothing waiting here
            # (worker/shares.py): take it now, not after a held batch's long tail.
            return min(active + 1, max_loops(base)) if len(self.held) >= active else max(base, active)
        if unsent < keep and len(self.held) >= active:
            return min(active + 1, max_loops(base))  # every loop holds a batch: take one more
        if unsent > keep + 2 * size and active > base and not any(lp.stopping for lp in self.loops):
            return active - 1  # plenty in hand: one loop leaves after its batch (hysteresis: 2 batches)
        return max(base, active)

    async def _spawn(self) -> RqLoop:
        name = f"{self.instance}.{uuid.uuid4().hex[:4]}"
        env = dict(os.environ, **{ENGINE_ENV: self.instance, REDIS_ENV: self.opts.redis_url})
        args = [*PYTHON, "-m", "genq.worker.rqjob", "--name", name,
                "--parent", str(os.getpid()), "--monitoring-interval", str(self.opts.job_monitoring_interval)]
        if self.opts.burst:
            args.append("--burst")
        # Own session: a terminal's Ctrl-C reaches the engine, which decides what the loops do.
        proc = await asyncio.create_subprocess_exec(*args, env=env, start_new_session=True)
        return RqLoop(proc, name, started=time.monotonic())

    def _stop(self, loop: RqLoop) -> None:
        if loop.stopping:
            return  # one SIGTERM only: a second is RQ's cold shutdown
        loop.stopping = True
        try:
            loop.proc.send_signal(signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop_all(self) -> None:
        for loop in self.loops:
            if loop.proc.returncode is None:
                self._stop(loop)

    def kill_all(self) -> None:
        """SIGKILL what is left of the loops (each leads its own process group), so none hands a
        batch over after the engine's last look (the reconciler takes such a batch)."""
        for loop in self.loops:
            if loop.proc.returncode is None:
                try:
                    os.killpg(loop.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    async def wait_all(self) -> None:
        for loop in self.loops:
            await loop.proc.wait()
