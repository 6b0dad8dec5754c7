"""The worker engine: one process per GPU, one in-flight window over every batch it holds.

    RQ loops (child processes) --lease--> inbox --> ready prompts --> server
                                                         |
                           shard + "done" <-- results <--+

RQ loops take batches from the queue and hand them to this engine; the engine
keeps `target` requests in flight across all held batches, so the next batch
fills slots while the current one's long tail drains. Results are committed to
Redis as they finish; a batch's shard is written once every prompt has a
result or a dead letter, and only then is its RQ job allowed to finish.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import os
import random
import signal
import socket
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import redis
from rq.registry import StartedJobRegistry

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.records import (
    Batch,
    BatchRef,
    Control,
    DeadLetter,
    InFlight,
    JobConfig,
    Prompt,
    Result,
    ShardInfo,
    WorkerStatus,
    pack,
    unpack,
)
from genq.core.redisconn import ENV_VAR as REDIS_ENV
from genq.core.redisconn import connect, connect_async, describe_error, mask_url
from genq.output.sink import open_sink, shard_bytes
from genq.worker.controller import ConcurrencyController
from genq.worker.results import ResultWriter
from genq.worker.rqjob import ENGINE_ENV
from genq.worker.server import Completion, Failure, Progress, ServerClient, ServerInfo, ServerUnavailable, build_body
from genq.worker.telemetry import GpuProbe

log = logging.getLogger("genq.worker")

ALIVE_TTL_S = 10  # a holding RQ job gives up on this engine after this long without a heartbeat
STATUS_TTL_S = 15  # the fleet view shows a worker as lost after this long
CLEANUP_EVERY_S = 10  # recover batches of dead workers (RQ abandoned-job handling); cheap
MAX_EXTRA_LOOPS = 14  # RQ loops beyond --prefetch for batches in their tails (each loop is a process)


@dataclass
class WorkerOptions:
    redis_url: str
    server_url: str
    name: str | None = None
    host: str | None = None
    gpu: int | None = None
    concurrency: int | None = None  # None: auto, from the server's capacity
    burst: bool = False
    loops: int = 2  # RQ work loops: batches held at once (the current one and the next)
    stream: bool = True
    request_timeout: float = 3600.0
    stall_timeout: float = 300.0
    server_down_timeout: float = 300.0
    grace_period: float = 60.0
    retry_backoff: float = 1.0
    retry_backoff_max: float = 60.0
    max_attempts: int | None = None  # overrides the job's setting
    job_monitoring_interval: int = 10


@dataclass
class BatchState:
    job: str
    id: str
    rq_job_id: str
    config: JobConfig
    unfinished: set[str]
    results: list[Result]
    dead: int = 0
    completing: bool = False


@dataclass(eq=False)
class Task:
    prompt: Prompt
    batch: BatchState
    attempts: int = 0
    progress: Progress = field(default_factory=Progress)
    cancel_reason: str | None = None


@dataclass
class RqLoop:
    proc: asyncio.subprocess.Process
    name: str
    stopping: bool = False


class Engine:
    def __init__(self, opts: WorkerOptions) -> None:
        self.opts = opts
        self.host = opts.host or socket.gethostname()
        self.name = opts.name or default_worker_name(self.host, opts.gpu, opts.server_url)
        self.instance = f"{self.name}.{uuid.uuid4().hex[:8]}"
        self.redis = connect_async(opts.redis_url)
        self.client = ServerClient(opts.server_url)
        self.controller = ConcurrencyController(None, opts.concurrency)
        self.server: ServerInfo | None = None
        self.writer = ResultWriter(self.redis, self.name, self._on_written)
        self.gpu = GpuProbe(opts.gpu)
        self.started_at = time.time()

        self.batches: dict[str, BatchState] = {}  # by batch id
        self.ready: deque[Task] = deque()
        self.parked: dict[str, list[Task]] = {}  # tasks of paused jobs, by job
        self.delayed: list[tuple[float, int, Task]] = []  # retries: (due, seq, task)
        self.running: dict[Task, asyncio.Task] = {}
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._configs: dict[str, JobConfig] = {}
        self._models: dict[str, str] = {}

        self.paused_all = False
        self.paused_jobs: set[str] = set()
        self.draining = False
        self.stop_requested = 0  # signals received
        self.server_down_since: float | None = None
        self.server_note: str | None = None
        self._health_check: asyncio.Future | None = None
        self._handed_back_for_outage = False
        self.loops: list[RqLoop] = []
        self._burst_exhausted = False
        self._done_events: deque[tuple[float, int]] = deque()  # (time, completion tokens)
        self.done = 0
        self.errors = 0
        self.last_metrics = None
        self._tasks: list[asyncio.Task] = []
        self._gpu_sample = None
        self._writer_task: asyncio.Task | None = None
        self._sync_redis = connect(opts.redis_url)
        self._waiting_for_orphans = False

    # ---------------------------------------------------------------- run

    async def run(self) -> int:
        try:
            await self.redis.ping()
        except (redis.RedisError, OSError) as exc:
            await self.client.close()
            raise SystemExit(describe_error(self.opts.redis_url, exc)) from None
        await self._check_name_free()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_signal, sig)
        server = await self._wait_for_server()
        if server is None:  # stopped while waiting: nothing was taken, nothing to hand back
            await self._heartbeat(state="stopped")
            await self.client.close()
            return 0
        self.server = server
        self.controller.set_capacity(self.server.capacity)
        log.info(
            "worker %s: server %s (%s, model %s, capacity %s) -> %s in flight (%s); redis %s",
            self.name, self.opts.server_url, self.server.kind, self.server.model,
            self.server.capacity or "unknown", self.controller.target,
            f"capped at {self.opts.concurrency}" if self.opts.concurrency else "auto",
            mask_url(self.opts.redis_url),
        )
        await self._heartbeat()
        self._writer_task = asyncio.create_task(self.writer.run())
        self._tasks = [self._writer_task] + [
            asyncio.create_task(coro)
            for coro in (
                self._intake(), self._dispatch(), self._watchdog(),
                self._heartbeat_loop(), self._metrics_loop(), self._loop_manager(), self._cleanup_loop(),
            )
        ]
        try:
            await self._until_finished()
        finally:
            await self._shutdown()
        return 0

    async def _until_finished(self) -> None:
        while True:
            await asyncio.sleep(0.2)
            for t in self._tasks:
                if t.done() and not t.cancelled() and t.exception() is not None:
                    raise t.exception()  # a bug: fail loudly rather than hang
            nothing_held = not self.batches and not self.running and self.writer.pending == 0
            loops_gone = not any(l.proc.returncode is None for l in self.loops)
            if self.stop_requested >= 2 and not self.running:
                await self._hand_back_all("stopping now (second signal)")
                return
            if (self.draining or self.stop_requested) and nothing_held and loops_gone:
                return
            if self.opts.burst and self._burst_exhausted and nothing_held and loops_gone:
                queued, orphaned = await asyncio.to_thread(_queue_outlook, self._sync_redis)
                if queued:
                    self._burst_exhausted = False  # work came back (recovered or requeued): take it
                elif not orphaned:
                    log.info("burst: queue empty and nothing in flight; exiting")
                    return
                elif not self._waiting_for_orphans:
                    self._waiting_for_orphans = True
                    log.info("burst: queue empty, but %d batch(es) held by stopped workers will come back; "
                             "waiting for them", orphaned)
                await asyncio.sleep(1.0)

    def _on_signal(self, sig: int) -> None:
        self.stop_requested += 1
        if self.stop_requested == 1:
            log.info("%s: finishing held batches (up to %.0fs), then exiting; send again to stop now",
                     signal.Signals(sig).name, self.opts.grace_period)
            asyncio.get_running_loop().call_later(self.opts.grace_period, self._grace_expired)
        else:
            for task in list(self.running.values()):
                task.cancel()
        self._wake.set()

    def _grace_expired(self) -> None:
        if self.batches:
            log.info("grace period over: handing back unfinished batches")
            self.stop_requested = max(self.stop_requested, 2)
            for task in list(self.running.values()):
                task.cancel()

    @property
    def accepting(self) -> bool:
        """Whether RQ loops should take new batches."""
        return not (
            self.draining or self.stop_requested or self.paused_all or self.server_down_since is not None
        )

    # ---------------------------------------------------------------- server

    async def _wait_for_server(self) -> ServerInfo | None:
        delay = 0.5
        waited = 0.0
        while not self.stop_requested:
            try:
                return await self.client.discover()
            except ServerUnavailable as exc:
                if waited == 0:
                    log.info("waiting for server %s: %s", self.opts.server_url, exc)
                await self._heartbeat(state="server_down", note=str(exc))
                await asyncio.sleep(delay)
                waited += delay
                delay = min(delay * 2, 5.0)
        return None

    async def _server_is_down(self) -> bool:
        """Single-flight health check after a failure: many failures, one probe."""
        if self.server_down_since is not None:
            return True
        if self._health_check is None:
            self._health_check = asyncio.ensure_future(self.client.healthy())
        try:
            healthy = await asyncio.shield(self._health_check)
        finally:
            if self._health_check is not None and self._health_check.done():
                self._health_check = None
        if not healthy and self.server_down_since is None:
            self.server_down_since = time.monotonic()
            self.server_note = "health check failed"
            log.warning("server %s is down: holding prompts (no attempts counted) until it answers",
                        self.opts.server_url)
            asyncio.create_task(self._await_recovery())
        return not healthy

    async def _await_recovery(self) -> None:
        delay = 0.5
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, 5.0)
            down_for = time.monotonic() - (self.server_down_since or time.monotonic())
            if down_for > self.opts.server_down_timeout and self.batches and not self._handed_back_for_outage:
                self._handed_back_for_outage = True
                await self._hand_back_all(f"server down for {down_for:.0f}s")
            try:
                info = await self.client.discover()
            except ServerUnavailable as exc:
                self.server_note = str(exc)
                continue
            self.server = info
            self.controller.set_capacity(info.capacity)
            log.info("server %s is back after %.1fs", self.opts.server_url, down_for)
            self.server_down_since = None
            self.server_note = None
            self._handed_back_for_outage = False
            self._wake.set()
            return

    # ---------------------------------------------------------------- leases

    async def _intake(self) -> None:
        conn = connect_async(self.opts.redis_url)  # BLPOP blocks its connection
        inbox = keys.engine_inbox(self.instance)
        while True:
            item = await self._retrying(lambda: conn.blpop([inbox], timeout=1), "inbox")
            if item is None:
                continue
            rq_job_id, job, batch_id = unpack(item[1], list)
            await self._retrying(lambda: self._lease(rq_job_id, job, batch_id))

    async def _retrying(self, action, what: str = "redis"):
        backoff = 0.5
        while True:
            try:
                return await action()
            except (redis.RedisError, OSError) as exc:
                log.warning("%s: %s; retrying in %.1fs", what, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10)

    async def _lease(self, rq_job_id: str, job: str, batch_id: str) -> None:
        if batch_id in self.batches or await self.redis.sismember(keys.job_done(job), batch_id):
            await self._reply(rq_job_id, b"done")
            return
        config = await self._config(job)
        raw = await self.redis.get(keys.batch(job, batch_id))
        if config is None or raw is None:
            log.warning("batch %s/%s has no record (job deleted?); releasing it", job, batch_id)
            await self._reply(rq_job_id, b"done")
            return
        batch = unpack(raw, Batch)
        stored = await self.redis.hgetall(keys.batch_results(job, batch_id))
        results = [unpack(v, Result) for v in stored.values()]
        ids = [p.id for p in batch.prompts]
        dead = await self.redis.hmget(keys.job_dlq(job), ids)
        finished = {r.id for r in results} | {i for i, d in zip(ids, dead) if d is not None}
        state = BatchState(job, batch_id, rq_job_id, config,
                           unfinished={i for i in ids if i not in finished}, results=results)
        self.batches[batch_id] = state
        if results:
            log.info("batch %s/%s: %d of %d prompts already done, not regenerating them",
                     job, batch_id, len(finished), len(ids))
        todo = [Task(p, state) for p in batch.prompts if p.id in state.unfinished]
        self.ready.extend(todo)
        if not state.unfinished:
            asyncio.create_task(self._complete(state))
        self._wake.set()

    async def _config(self, job: str) -> JobConfig | None:
        if job not in self._configs:
            raw = await self.redis.get(keys.job_config(job))
            if raw is None:
                return None
            self._configs[job] = unpack(raw, JobConfig)
        return self._configs[job]

    async def _reply(self, rq_job_id: str, word: bytes) -> None:
        key = keys.lease_reply(rq_job_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.rpush(key, word)
            pipe.expire(key, 24 * 3600)
            await pipe.execute()

    def _on_written(self, job: str, batch_id: str, ids: list[str]) -> None:
        state = self.batches.get(batch_id)
        if state is None:
            return
        state.unfinished.difference_update(ids)
        if not state.unfinished and not state.completing:
            asyncio.create_task(self._complete(state))

    async def _complete(self, state: BatchState) -> None:
        """All prompts have a result or a dead letter: write the shard, then release the batch."""
        if state.completing:
            return
        state.completing = True
        sink = open_sink(state.config)
        data = shard_bytes(state.results, state.config.compression)
        backoff = 1.0
        while True:
            try:
                info: ShardInfo = await asyncio.to_thread(
                    sink.write_shard, state.job, state.id, data, len(state.results))
                break
            except Exception as exc:  # the sink's own errors (disk full, S3 down): keep trying
                log.warning("batch %s/%s: writing shard failed (%s: %s); results stay in Redis, retrying in %.0fs",
                            state.job, state.id, type(exc).__name__, exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 60)

        async def release() -> None:
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.sadd(keys.job_done(state.job), state.id)
                pipe.hset(keys.job_shards(state.job), state.id, pack(info))
                pipe.delete(keys.batch_results(state.job, state.id))
                pipe.delete(keys.batch(state.job, state.id))
                pipe.rpush(keys.lease_reply(state.rq_job_id), b"done")
                pipe.expire(keys.lease_reply(state.rq_job_id), 24 * 3600)
                await pipe.execute()

        await self._retrying(release, f"releasing batch {state.id}")
        self.batches.pop(state.id, None)
        self._wake.set()

    async def _hand_back_all(self, why: str) -> None:
        """Give every held batch back to the queue; what finished stays finished."""
        for task in list(self.running.values()):
            task.cancel()
        while self.running:
            await asyncio.sleep(0.05)
        await self.writer.wait_idle()
        held = [s for s in self.batches.values() if not s.completing]
        for state in held:
            await self._retrying(lambda: self._reply(state.rq_job_id, b"handback"))
            self.batches.pop(state.id, None)
        if held:
            log.info("%s: handed back %d batches (%s)", why, len(held), ", ".join(s.id for s in held))
        dropped = {s.id for s in held}
        self.ready = deque(t for t in self.ready if t.batch.id not in dropped)
        self.delayed = [d for d in self.delayed if d[2].batch.id not in dropped]
        heapq.heapify(self.delayed)
        for job, tasks in self.parked.items():
            self.parked[job] = [t for t in tasks if t.batch.id not in dropped]

    # ---------------------------------------------------------------- dispatch

    def _can_dispatch(self) -> bool:
        return (
            self.server_down_since is None
            and not self.paused_all
            and self.stop_requested < 2
            and len(self.running) < self.controller.target
        )

    async def _dispatch(self) -> None:
        while True:
            timeout = None
            if self.delayed:
                timeout = max(0.0, self.delayed[0][0] - time.monotonic())
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                pass
            self._wake.clear()
            now = time.monotonic()
            while self.delayed and self.delayed[0][0] <= now:
                self.ready.appendleft(heapq.heappop(self.delayed)[2])
            for job in [j for j in self.parked if j not in self.paused_jobs]:
                self.ready.extendleft(reversed(self.parked.pop(job)))
            while (task := self._take_ready()) is not None:
                self.running[task] = asyncio.create_task(self._run(task))

    def _take_ready(self) -> Task | None:
        """The next prompt to send, if the in-flight window has room."""
        while self.ready and self._can_dispatch():
            task = self.ready.popleft()
            if task.batch.id not in self.batches:
                continue  # handed back
            if task.batch.job in self.paused_jobs:
                self.parked.setdefault(task.batch.job, []).append(task)
                continue
            task.progress = Progress()
            task.cancel_reason = None
            return task
        return None

    async def _run(self, task: Task | None) -> None:
        # One asyncio task sends prompt after prompt while there are prompts ready: a
        # task per request and a round trip through the dispatcher would cost about
        # half of what the HTTP request itself costs against a fast server.
        me = asyncio.current_task()
        while task is not None:
            state = task.batch
            config = state.config
            model = self._model_for(config)
            body = build_body(config, task.prompt, model, self.opts.stream)
            try:
                try:
                    outcome: Completion | Failure = await self.client.generate(config.endpoint, body, task.progress)
                except asyncio.CancelledError:
                    if task.cancel_reason is None:
                        raise  # shutdown or hand-back: the prompt stays unfinished, nothing is counted
                    me.uncancel()  # the watchdog's cancel was for this request only
                    outcome = Failure("timeout", task.cancel_reason)
                # No longer in flight: the watchdog must not cancel the bookkeeping below
                # (a health check can take seconds), or the prompt would be dropped.
                self.running.pop(task, None)
                if isinstance(outcome, Completion):
                    self._record(task, outcome)
                else:
                    await self._failed(task, outcome)
                    self._wake.set()  # a retry may now be due: the dispatcher times it
            finally:
                self.running.pop(task, None)
            task = self._take_ready()
            if task is not None:
                self.running[task] = me
        self._wake.set()

    def _model_for(self, config: JobConfig) -> str:
        if config.model != "auto":
            return config.model
        return (self.server.model if self.server else None) or "default"

    def _record(self, task: Task, c: Completion) -> None:
        p = task.prompt
        state = task.batch
        result = Result(
            id=p.id, job=state.job, batch=state.id, index=p.index,
            completion=c.text, reasoning_content=c.reasoning, finish_reason=c.finish_reason,
            usage=c.usage, model=c.model, worker=self.name, attempts=task.attempts + 1,
            latency_s=round(time.monotonic() - task.progress.started, 3),
            messages=p.messages, prompt=p.prompt, metadata=p.metadata, custom_id=p.custom_id,
            response_id=c.response_id, finished_at=time.time(),
        )
        state.results.append(result)
        self.writer.add_result(result)
        self.done += 1
        self._done_events.append((time.monotonic(), c.usage.completion_tokens))

    async def _failed(self, task: Task, failure: Failure) -> None:
        state = task.batch
        if failure.kind in ("connection", "timeout", "server_error") and await self._server_is_down():
            # The server is down, not the prompt: keep it, count nothing.
            self.ready.appendleft(task)
            return
        task.attempts += 1
        self.errors += 1
        max_attempts = self.opts.max_attempts or state.config.max_attempts
        if failure.retryable and task.attempts < max_attempts:
            delay = min(self.opts.retry_backoff_max, self.opts.retry_backoff * 2 ** (task.attempts - 1))
            delay *= random.uniform(0.5, 1.5)
            heapq.heappush(self.delayed, (time.monotonic() + delay, next(self._seq), task))
            log.debug("prompt %s attempt %d failed (%s: %s); retry in %.1fs",
                      task.prompt.id, task.attempts, failure.kind, failure.message, delay)
            return
        log.warning("prompt %s/%s to the dead-letter queue after %d attempt(s): %s%s: %s",
                    state.job, task.prompt.id, task.attempts, failure.kind,
                    f" {failure.status}" if failure.status else "", failure.message)
        state.dead += 1
        self.writer.add_dead(DeadLetter(
            id=task.prompt.id, job=state.job, batch=state.id, attempts=task.attempts, kind=failure.kind,
            message=failure.message, worker=self.name, at=time.time(), status=failure.status,
            prompt=task.prompt,
        ))

    async def _watchdog(self) -> None:
        """Cancel requests that stalled or ran too long (one timer for all, not one each)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for task, aio_task in list(self.running.items()):
                p = task.progress
                if now - p.last_activity > self.opts.stall_timeout:
                    task.cancel_reason = f"no output for {self.opts.stall_timeout:.0f}s (stall timeout)"
                elif now - p.started > self.opts.request_timeout:
                    task.cancel_reason = f"request exceeded {self.opts.request_timeout:.0f}s (request timeout)"
                else:
                    continue
                aio_task.cancel()

    # ---------------------------------------------------------------- loops (RQ)

    async def _loop_manager(self) -> None:
        failures = 0
        while True:
            for loop in [l for l in self.loops if l.proc.returncode is not None]:
                self.loops.remove(loop)
                if not loop.stopping:
                    if loop.proc.returncode == 0 and self.opts.burst:
                        self._burst_exhausted = True
                    elif loop.proc.returncode != 0:
                        failures += 1
                        log.warning("RQ loop %s exited with %s", loop.name, loop.proc.returncode)
            active = [l for l in self.loops if not l.stopping]
            desired = self._desired_loops(len(active)) if self.accepting and not self._burst_exhausted else 0
            # Loops told to stop may still hold a batch until it is done; count them, or a
            # pause/resume cycle would leave more batches held than --prefetch asks for.
            if len(self.loops) < desired and failures < 20:
                for _ in range(desired - len(self.loops)):
                    self.loops.append(await self._spawn_loop())
            elif len(active) > desired and not self._burst_exhausted:  # burst loops leave by themselves
                for loop in active[desired:]:
                    loop.stopping = True
                    try:
                        loop.proc.send_signal(signal.SIGTERM)  # RQ warm shutdown: idle loops exit now
                    except ProcessLookupError:
                        pass
            await asyncio.sleep(0.3)

    def _desired_loops(self, active: int) -> int:
        """--prefetch loops, plus one for each held batch that has nothing left to send.

        A batch whose prompts are all sent holds only its long tail. With heavy-tailed
        lengths several batches can be in their tails at once, so the reserve of
        unsent prompts must be counted in prompts, not batches: keep (prefetch - 1)
        batches' worth unsent, or slots run dry at batch boundaries.
        """
        base = self.opts.loops
        if self.paused_all or self.paused_jobs:
            return base  # parked prompts are not work: do not take more batches for them
        size = max((s.config.batch_size for s in self.batches.values()), default=0)
        reserve = (base - 1) * size
        unsent = len(self.ready) + len(self.delayed)
        if unsent < reserve and len(self.batches) >= active:
            return min(active + 1, base + MAX_EXTRA_LOOPS)  # every loop holds a batch: take one more
        if unsent > reserve + 2 * size and active > base and not any(l.stopping for l in self.loops):
            return active - 1  # plenty in hand: one loop leaves after its batch (hysteresis: 2 batches)
        return max(base, active)

    async def _spawn_loop(self) -> RqLoop:
        name = f"{self.instance}.{uuid.uuid4().hex[:4]}"
        env = dict(os.environ, **{ENGINE_ENV: self.instance, REDIS_ENV: self.opts.redis_url})
        args = [sys.executable, "-m", "genq.worker.rqloop", "--name", name,
                "--parent", str(os.getpid()), "--monitoring-interval", str(self.opts.job_monitoring_interval)]
        if self.opts.burst:
            args.append("--burst")
        # Own session: a terminal's Ctrl-C reaches the engine, which decides what the loops do.
        proc = await asyncio.create_subprocess_exec(*args, env=env, start_new_session=True)
        return RqLoop(proc, name)

    async def _cleanup_loop(self) -> None:
        while True:
            try:
                # Moves batches of dead workers back to the queue (RQ's Retry) once their heartbeat expired.
                await asyncio.to_thread(lambda: StartedJobRegistry(queue=rq_queue(self._sync_redis)).cleanup())
            except (redis.RedisError, OSError) as exc:
                log.debug("registry cleanup skipped: %s", exc)
            await asyncio.sleep(CLEANUP_EVERY_S)

    # ---------------------------------------------------------------- heartbeat & control

    async def _heartbeat_loop(self) -> None:
        tick = 0
        while True:
            await asyncio.sleep(1.0)
            tick += 1
            if tick % 5 == 1:
                self._gpu_sample = await asyncio.to_thread(self.gpu.sample)
            try:
                await self._heartbeat()
                await self._read_control()
            except (redis.RedisError, OSError) as exc:
                log.warning("heartbeat: %s", exc)

    async def _read_control(self) -> None:
        jobs = sorted({s.job for s in self.batches.values()} | set(self.parked))
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.get(keys.worker_control(self.name))
            pipe.exists(keys.PAUSED)
            for job in jobs:
                pipe.exists(keys.job_paused(job))
            raw, paused, *job_flags = await pipe.execute()
        control = unpack(raw, Control) if raw else Control()
        if control.drain and not self.draining:
            log.info("drain requested: finishing held batches, taking no new ones")
            self.draining = True
        if (control.concurrency or None) != self.controller.live_cap:
            self.controller.set_cap(control.concurrency)
            log.info("concurrency cap now %s (target %d)", control.concurrency or "auto", self.controller.target)
        paused_jobs = {job for job, flag in zip(jobs, job_flags) if flag}
        if bool(paused) != self.paused_all or paused_jobs != self.paused_jobs:
            self.paused_all, self.paused_jobs = bool(paused), paused_jobs
            log.info("paused: %s", "all jobs" if self.paused_all else (", ".join(sorted(paused_jobs)) or "none"))
        self._wake.set()

    def _state(self) -> str:
        if self.server_down_since is not None:
            return "server_down"
        if self.draining or self.stop_requested:
            return "draining"
        if self.paused_all or (self.batches and {s.job for s in self.batches.values()} <= self.paused_jobs):
            return "paused"
        return "busy" if self.batches or self.running else "idle"

    def _rates(self) -> tuple[float, float]:
        """Requests/s and completion tokens/s over the last 30 s (or since start)."""
        now = time.monotonic()
        while self._done_events and now - self._done_events[0][0] > 30:
            self._done_events.popleft()
        span = max(1.0, min(30.0, time.time() - self.started_at))
        return len(self._done_events) / span, sum(t for _, t in self._done_events) / span

    async def _heartbeat(self, state: str | None = None, note: str | None = None) -> None:
        req_s, tok_s = self._rates()
        m = self.last_metrics
        status = WorkerStatus(
            name=self.name, host=self.host, pid=os.getpid(), server=self.opts.server_url,
            state=state or self._state(), started_at=self.started_at, heartbeat_at=time.time(),
            gpu=None if self.opts.gpu is None else str(self.opts.gpu),
            concurrency_target=self.controller.target, concurrency_limit=self.controller.cap,
            server_capacity=self.server.capacity if self.server else None,
            in_flight=len(self.running), queued=len(self.ready) + len(self.delayed),
            batches=sorted(BatchRef(s.job, s.id) for s in self.batches.values()), prefetch=self.opts.loops, tok_per_s=round(tok_s, 1), req_per_s=round(req_s, 2),
            done=self.done, errors=self.errors,
            server_running=m.running if m else None, server_waiting=m.waiting if m else None,
            server_token_usage=m.kv_usage if m else None,
            gpu_sample=self._gpu_sample, gpu_note=self.gpu.note,
            note=note or self.server_note,
        )
        by_job: dict[str, list[int]] = {}
        for task in self.running:
            by_job.setdefault(task.batch.job, []).append(task.progress.tokens)
        queued: dict[str, int] = {}
        for task in self.ready:
            queued[task.batch.job] = queued.get(task.batch.job, 0) + 1
        now = time.time()
        async with self.redis.pipeline(transaction=False) as pipe:
            if status.state != "stopped":
                pipe.set(keys.engine_alive(self.instance), self.name, ex=ALIVE_TTL_S)
            # A clean exit's record is kept (no TTL) so the fleet view tells stopped from lost.
            pipe.set(keys.worker_status(self.name), pack(status),
                     ex=None if status.state == "stopped" else STATUS_TTL_S)
            pipe.sadd(keys.WORKERS, self.name)
            for job in set(by_job) | set(queued) | {s.job for s in self.batches.values()}:
                record = InFlight(worker=self.name, job=job, at=now, tokens=by_job.get(job, []),
                                  queued=queued.get(job, 0))
                pipe.set(keys.job_inflight(job, self.name), pack(record), ex=5)
            await pipe.execute()

    async def _metrics_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.server_down_since is not None or self.server is None or not self.server.has_metrics:
                continue
            m = await self.client.metrics()
            if m is None:
                continue
            self.last_metrics = m
            before = self.controller.target
            self.controller.observe(m, len(self.running), len(self.ready))
            if self.controller.target != before:
                log.info("in-flight target %d -> %d (%s)", before, self.controller.target, self.controller.reason)
                self._wake.set()

    async def _check_name_free(self) -> None:
        """Refuse to run twice under one name; a crashed predecessor's record is fine."""
        raw = await self.redis.get(keys.worker_status(self.name))
        if not raw or unpack(raw, WorkerStatus).state == "stopped":
            return
        first = unpack(raw, WorkerStatus).heartbeat_at
        await asyncio.sleep(2.5)  # a live worker heartbeats every second
        raw = await self.redis.get(keys.worker_status(self.name))
        if raw and (other := unpack(raw, WorkerStatus)).heartbeat_at > first and other.state != "stopped":
            raise SystemExit(
                f"a worker named {self.name} is already running (host {other.host}, pid {other.pid}); "
                "give this one another --name"
            )

    # ---------------------------------------------------------------- shutdown

    async def _shutdown(self) -> None:
        for loop in self.loops:
            if loop.proc.returncode is None:
                loop.stopping = True
                try:
                    loop.proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for t in self._tasks:
            if t is not self._writer_task:
                t.cancel()
        for task in list(self.running.values()):
            task.cancel()
        try:
            await asyncio.wait_for(self.writer.wait_idle(), timeout=30)
        except TimeoutError:
            log.error("could not flush %d results to Redis; their batches will be redone", self.writer.pending)
        self._writer_task.cancel()
        await self._release_late_leases()
        for loop in self.loops:
            try:
                await asyncio.wait_for(loop.proc.wait(), timeout=10)
            except TimeoutError:
                loop.proc.kill()
        await self._release_late_leases()
        try:
            async with self.redis.pipeline(transaction=False) as pipe:
                pipe.delete(keys.engine_alive(self.instance))
                pipe.delete(keys.worker_control(self.name))
                await pipe.execute()
            await self._heartbeat(state="stopped")
        except (redis.RedisError, OSError):
            pass
        await self.client.close()
        await self.redis.aclose()

    async def _release_late_leases(self) -> None:
        """Batches a loop took just before it was told to stop go straight back."""
        try:
            while raw := await self.redis.lpop(keys.engine_inbox(self.instance)):
                rq_job_id, _job, _batch = unpack(raw, list)
                await self._reply(rq_job_id, b"handback")
        except (redis.RedisError, OSError):
            pass


def _queue_outlook(conn: redis.Redis) -> tuple[int, int]:
    """(batches queued, batches held by RQ loops whose engine stopped heartbeating).

    Our RQ loops are named ENGINE_INSTANCE.xxxx, so a started job's worker name
    tells whose lease it is; a dead engine's batches return once RQ sees their
    heartbeat expire (a minute or so) and the registry cleanup requeues them.
    """
    queue = rq_queue(conn)
    orphaned = 0
    for job in queue.job_class.fetch_many(StartedJobRegistry(queue=queue).get_job_ids(), connection=conn):
        if job is None or not job.worker_name:
            continue
        instance = job.worker_name.rsplit(".", 1)[0]
        # A live engine refreshes its key every second; two missed beats mean it is gone.
        if conn.pttl(keys.engine_alive(instance)) < (ALIVE_TTL_S - 2.5) * 1000:
            orphaned += 1
    return queue.count, orphaned


async def run_engine(opts: WorkerOptions) -> int:
    """Build the engine inside the running loop (aiohttp and redis clients bind to it)."""
    return await Engine(opts).run()


def default_worker_name(host: str, gpu: int | None, server_url: str) -> str:
    if gpu is not None:
        return f"{host}.gpu{gpu}"
    port = server_url.rstrip("/").rsplit(":", 1)[-1]
    return f"{host}.{port}" if port.isdigit() else host

