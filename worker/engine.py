"""The worker engine: one process per GPU, one in-flight window over every batch it holds, its parts' loops in
one TaskGroup. Shutdown: take nothing more, finish held batches for up to --grace-period, hand the rest back;
told to stop now, it goes on only while Redis answers a PING (docs/exactly-once.md)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Coroutine
from typing import Any

import redis
import redis.asyncio as aioredis

from genq.core.ledger import Reconciler
from genq.core.queueing import rq_queue
from genq.core.redisconn import connect, connect_async, describe_error, mask_url, refusal
from genq.core.timings import RECONCILE_EVERY_S
from genq.core.words import plural
from genq.ops.control import blocked_jobs
from genq.ops.recover import OutputWatch
from genq.producer.enqueue import queue_lost
from genq.worker.batches import Batches
from genq.worker.controller import ConcurrencyController, Running
from genq.worker.dispatch import Dispatcher
from genq.worker.gate import Gate, ServerStartTimeout, ServerWatch
from genq.worker.heartbeat import IDLE_MAINTENANCE_S, Heartbeat, IdlePace, WakeListener
from genq.worker.held import Holdings
from genq.worker.intake import Intake, Shares, Stealer
from genq.worker.options import WorkerOptions, default_worker_name
from genq.worker.results import ResultWriter
from genq.worker.server import ServerClient, ServerInfo

log = logging.getLogger("genq.worker")

STOP_NOW_S = 5.0  # told to stop now, it goes on while Redis answers a PING (within PING_S) asked this often...
STOP_NOW_MAX_S = 30.0  # ...for up to this (a Redis that answers pings but never takes the hand-back)
PING_S = 1.0
EXIT_BY_S = 10.0  # then the process ends itself: a thread blocked on a frozen Redis would hold its exit
LOOK_S = 0.5  # how often the shutdown is looked at


class StopNow:
    def __init__(self, conn: aioredis.Redis, worker: str, held: Holdings, writer: ResultWriter) -> None:
        self.conn, self.worker, self.held, self.writer = conn, worker, held, writer
        self.requested = 0  # 1: finish what is held, then exit; 2: stop now (a second signal, the grace over)
        self.since: float | None = None  # monotonic: when the worker was told to stop now
        self.without_redis = False  # the shutdown was given up: Redis did not answer, or took too long

    def start(self) -> None:
        self.requested = 2
        if self.since is None:
            self.since = time.monotonic()

    async def run(self, finish: Coroutine[Any, Any, None]) -> None:
        """Run the shutdown `finish`; told to stop now, only while Redis answers (STOP_NOW_S): else leases lapse."""
        finishing = asyncio.create_task(finish)
        ask_at = 0.0  # monotonic: when to ask Redis again
        try:
            while True:
                await asyncio.wait({finishing}, timeout=LOOK_S)
                if finishing.done():
                    finishing.result()  # its error, if it failed
                    return
                now = time.monotonic()
                if self.since is None or now < max(ask_at, self.since + STOP_NOW_S):
                    continue
                if now - self.since >= STOP_NOW_MAX_S or not await self._redis_answers():
                    break
                ask_at = now + STOP_NOW_S
        finally:
            finishing.cancel()  # nothing once it is done; it goes with the caller if that is cancelled
        with contextlib.suppress(asyncio.CancelledError, redis.RedisError, OSError):
            await finishing
        self.without_redis = True
        log.warning("stopping now, Redis away: %s not handed back, %s not recorded; their leases lapse and "
                    "other workers take them once Redis is back", plural(len(self.held), "batch", "batches"),
                    plural(self.writer.pending, "result"))
        backstop = threading.Timer(EXIT_BY_S, self._exit_now)
        backstop.daemon = True
        backstop.start()

    async def _redis_answers(self) -> bool:
        try:
            async with asyncio.timeout(PING_S):
                return bool(await self.conn.ping())
        except (TimeoutError, redis.RedisError, OSError):
            return False

    def _exit_now(self) -> None:
        log.warning("worker %s: not exited %.0fs after stopping without Redis (a thread waits on it): exiting now",
                    self.worker, EXIT_BY_S)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(0)


class Engine:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.host = opts.host or socket.gethostname()
        self.name = opts.name or default_worker_name(self.host, opts.gpu, opts.server_url)
        self.instance = f"{self.name}.{uuid.uuid4().hex[:8]}"
        self.redis = connect_async(opts.redis_url)
        self.sync_redis = connect(opts.redis_url)
        self.held = Holdings()
        self.client = ServerClient(opts.server_url)
        self.controller = ConcurrencyController(None, opts.concurrency)
        queue_key = rq_queue(self.sync_redis).key
        self.batches = Batches(self.redis, self.sync_redis, self.name, self.instance, self.held, Running(),
                               backoff=(opts.retry_backoff, opts.retry_backoff_max))
        self.writer = self.batches.writer
        self.stopping = StopNow(self.redis, self.name, self.held, self.writer)
        self.watch = ServerWatch(opts, self.client, self.controller, self.stopping, self.batches)
        self.shares = Shares(self.redis, queue_key, self.instance, self.batches)
        self.gate = Gate(self.batches, self.controller, self.watch)
        self.dispatcher = Dispatcher(opts, self.client, self.batches, self.watch, self.gate, self.shares.plan)
        self.pace = IdlePace(self.held, self.dispatcher, queue_key, self.batches.written_again)
        self.intake = Intake(opts, self.batches, self.dispatcher, self.shares)
        self.stealer = Stealer(queue_key, self.batches, self.dispatcher, self.pace)
        self.heartbeat = Heartbeat(opts, self.host, self.batches, self.dispatcher, self.pace)
        self.reconciler = Reconciler(self.sync_redis, self.instance)
        self.outputs = OutputWatch(self.sync_redis, queue_lost)  # the ledger checked against the written output
        self.wake_listener = WakeListener(opts.redis_url, self.pace, asyncio.get_running_loop())

    async def run(self) -> int:
        try:
            await self.redis.ping()
        except (redis.RedisError, OSError) as exc:  # one refusing writes (MISCONF): the first beat waits for it
            if not refusal(exc):
                await self.client.close()
                raise SystemExit(describe_error(self.opts.redis_url, exc)) from None
        await self.heartbeat.check_name_free()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        waiting = functools.partial(self.heartbeat.beat, "server_down")
        try:
            server: ServerInfo | ServerStartTimeout | None = await self.watch.wait_for_server(waiting)
        except ServerStartTimeout as exc:
            server = exc
        if not isinstance(server, ServerInfo):  # stopped while waiting: nothing was taken, nothing to hand back
            await self.heartbeat.stopped()
            await self._close()
            if server is not None:
                raise SystemExit(str(server)) from None
            log.info("worker %s exited (stopped while waiting for its server)", self.name)
            return 0
        self.controller.set_capacity(server.capacity)
        log.info("worker %s: server %s (%s, model %s, capacity %s) -> %s in flight (%s); redis %s", self.name,
                 self.opts.server_url, server.flavor, server.model, server.capacity or "unknown",
                 self.controller.target,
                 f"capped at {self.opts.concurrency}" if self.opts.concurrency else "auto",
                 mask_url(self.opts.redis_url))
        await self.heartbeat.first_beat()
        await asyncio.to_thread(self.reconciler.drop_legacy_jobs)
        self.wake_listener.start()  # WAKE messages end an idle stealer's nap (worker/heartbeat.py)
        try:
            async with asyncio.TaskGroup() as group:
                loops = [group.create_task(coro) for coro in (
                    self.writer.run(), self.intake.run(), self.dispatcher.run(), self.watch.watchdog(),
                    self.watch.recovery_loop(self.batches.hand_back_all), self.watch.metrics_loop(),
                    self.heartbeat.run(), self.maintain(), self.stealer.run(), self.gate.run(), self.gate.admit(),
                    self.shares.run())]
                await self.stopping.run(self._finish())
                for task in loops:
                    task.cancel()
        finally:
            await self._close()
        log.info("worker %s exited: %s completed, %d handed back", self.name,
                 plural(self.batches.completed, "batch", "batches"), self.batches.handed_back)
        return 0

    async def _finish(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            quiet = not self.dispatcher.running and self.writer.pending == 0  # nothing in flight, all recorded
            idle = quiet and not self.held.active()
            if self.stopping.requested >= 2:
                await self.batches.hand_back_all("stopping now")
                break
            # Paused fleet-wide, what it holds cannot finish: once quiet it goes back to the queue (below).
            if (self.gate.draining or self.stopping.requested) and (idle or quiet and self.gate.paused_all):
                break
            if self.opts.burst and self.intake.exhausted and idle and await self._burst_done():
                break
        if self.held or self.held.borrowed:
            await self.batches.hand_back_all("stopping")
        if self.batches.completions:  # shards being written: their release answers their leases
            await asyncio.wait(self.batches.completions, timeout=60)
        try:
            await asyncio.wait_for(self.writer.wait_idle(), timeout=30)
        except TimeoutError:
            log.error("could not flush %s to Redis; their batches will be redone",
                      plural(self.writer.pending, "result"))
        with contextlib.suppress(redis.RedisError, OSError):
            await self.heartbeat.stopped()

    async def maintain(self) -> None:
        """Each worker takes its turn at the ledger's reconciler: stranded batches requeued (by TTLs, not clocks)."""
        while True:
            await asyncio.sleep(IDLE_MAINTENANCE_S if self.pace.idle() else RECONCILE_EVERY_S)
            try:
                await asyncio.to_thread(self.outputs.pass_once)
                outlook = await asyncio.to_thread(self.reconciler.pass_once)
                self.pace.open_work = bool(outlook.unfinished or outlook.finishing)
            except (redis.RedisError, OSError) as exc:
                log.debug("maintenance skipped: %s", exc)

    async def _burst_done(self) -> bool:
        """--burst leaves once the ledger says every batch of every job is done (none queued again)."""
        await asyncio.to_thread(self.outputs.pass_once)
        outlook = await asyncio.to_thread(self.reconciler.pass_once, force=True)
        if outlook.unfinished or outlook.finishing:
            await asyncio.sleep(1.0)
            return False
        blocked = await asyncio.to_thread(blocked_jobs, self.sync_redis)  # they wait: docs/settings.md
        log.info("burst: every batch of every job is done%s; exiting",
                 f" but those of blocked jobs ({', '.join(blocked)}: genq jobs show JOB)" if blocked else "")
        return True

    def _on_signal(self, sig: int) -> None:
        if not self.stopping.requested:
            self.stopping.requested = 1
            log.info("%s: finishing held batches (up to %.0fs), then exiting; send again to stop now",
                     signal.Signals(sig).name, self.opts.grace_period)
            asyncio.get_running_loop().call_later(self.opts.grace_period, self._grace_expired)
        else:
            self.stopping.start()
        self.dispatcher.wake.set()

    def _grace_expired(self) -> None:
        """Still here: stop as a second signal would."""
        if self.stopping.requested < 2:
            log.info("grace period over: %s", "handing back unfinished batches" if self.held else "stopping now")
        self.stopping.start()

    async def _close(self) -> None:
        await asyncio.to_thread(self.wake_listener.stop)
        self.batches.close()
        await self.client.close()
        await self.redis.aclose()
        self.sync_redis.close()


async def run_engine(opts: WorkerOptions) -> int:
    """Built inside the running loop (aiohttp and redis clients bind to it)."""
    return await Engine(opts).run()

