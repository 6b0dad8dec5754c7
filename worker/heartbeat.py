"""The engine's heartbeat (alive, what it holds, how fast it goes), then the controls and the lease check.
Idle (nothing held, running or borrowed for IDLE_AFTER_S, no open work) it beats every IDLE_BEAT_S and steals
every IDLE_LOOK_S: under one Redis command a second (0.72, 2026-12-07); a WAKE message ends its waits."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import Counter

import redis
import redis.asyncio as aioredis

from genq.core import decodebound
from genq.core.ledger import fleet
from genq.core.records import BatchRef, GpuSample, InFlight, WorkerState, WorkerStatus
from genq.core.redisconn import connect, in_words, redis_note, refusal
from genq.core.timings import BEAT_S, IDLE_BEAT_S, LEASE_TIMEOUT_S, STATUS_TTL_S
from genq.core.waits import wait_event
from genq.worker import controller as decoding
from genq.worker.batches import Batches
from genq.worker.controller import GpuProbe, hardware
from genq.worker.dispatch import Dispatcher
from genq.worker.gate import Gate
from genq.worker.held import Holdings
from genq.worker.options import WorkerOptions

log = logging.getLogger("genq.worker")

REDIS_NOTE_EVERY_S = 10.0  # while Redis is unreachable or refuses writes, say so this often
GPU_EVERY_S = 5.0
INFLIGHT_TTL_S = 5  # a job's InFlight record of this worker: the requests it runs now

IDLE_AFTER_S = 5.0  # nothing held, running or borrowed this long: the idle pace
IDLE_TTL_S = 60  # its liveness and status keys live this long (3 beats)
IDLE_LOOK_S = 30.0  # its look for prompts to steal, when nothing woke it
IDLE_MAINTENANCE_S = 60.0  # its turn at RQ's and the ledger's cleanup
WORKERS_SET_EVERY_S = 60.0  # re-adding the worker to genq:workers (kept once added)
WOKEN_LOOK_S = 1.0  # an idle stealer woken looks at most this often
WAKE_READ_S = 0.2  # the WAKE listener's read (a select, no Redis command)
ANNOUNCE_EVERY_S = 2.0  # a busy engine holding unsent prompts says so (WAKE) this often


class IdlePace:
    """Whether the worker is idle, and the pace of its loops accordingly (heartbeat, stealer, maintenance)."""

    def __init__(self, held: Holdings, dispatcher: Dispatcher, queue_key: str = "",
                 queued: asyncio.Event | None = None) -> None:
        self.queue_key, self.held, self.dispatcher = queue_key, held, dispatcher  # queue_key: RQ's queue list
        self.busy_at = time.monotonic()
        self.last_beat = 0.0
        self.idle_keys = False  # the last beat wrote every key with IDLE_TTL_S (ttl() while idle)
        self.woken = asyncio.Event()  # a WAKE message
        self.queued = queued or asyncio.Event()  # a WAKE: batches queued; or a shard written after failing
        self.open_work = False  # some job has a batch not done (the reconciler's last pass): not idle
        self.announced_at = 0.0
        self.beat_now = asyncio.Event()  # the heartbeat beats at once (a woken stealer wants a fresh lease check)

    def idle(self) -> bool:
        if self.open_work or self.held.active() or self.dispatcher.running or self.dispatcher.unsent:
            self.busy_at = time.monotonic()
            return False
        return time.monotonic() - self.busy_at >= IDLE_AFTER_S

    def beat_due(self) -> bool:
        """Asked every second by the heartbeat: beat now? Beats are spaced out only after one whose keys
        all outlive the gap (a busy beat's expire in LEASE_TIMEOUT_S)."""
        now, asked = time.monotonic(), self.beat_now.is_set()
        self.beat_now.clear()
        if not asked and self.idle() and self.idle_keys and now - self.last_beat < IDLE_BEAT_S:
            return False
        self.last_beat = now
        self.idle_keys = True  # until a ttl() of this beat is a busy one
        return True

    def ttl(self, busy_ttl: int) -> int:
        idle = self.idle()
        self.idle_keys = self.idle_keys and idle
        return IDLE_TTL_S if idle else busy_ttl

    async def nap(self, seconds: float, looked: float | None = None) -> bool:
        """The stealer's wait: `seconds`, or while idle IDLE_LOOK_S after its last look (`looked`, monotonic);
        True when a WAKE message ends it, WOKEN_LOOK_S after the look at the soonest."""
        start = time.monotonic()
        looked = start if looked is None else looked
        while True:
            now = time.monotonic()
            if self.woken.is_set() and now - looked >= WOKEN_LOOK_S:
                self.woken.clear()  # many holders may call: one look a WOKEN_LOOK_S at most
                return True
            left = (looked + IDLE_LOOK_S if self.idle() else start + seconds) - now
            if left <= 0:
                return False
            if self.woken.is_set():  # too soon after the last look: sleep (a wait on the set event would spin)
                await asyncio.sleep(min(left, looked + WOKEN_LOOK_S - now))
            else:
                await wait_event(self.woken, min(left, 1.0))

    async def fresh_beat(self, controls: Gate) -> None:
        """Asks the heartbeat for a beat now (its lease check included) and waits for it, 3 s at most."""
        before, deadline = controls.last_beat, time.monotonic() + 3.0
        self.beat_now.set()
        while controls.last_beat == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def announce(self, conn: aioredis.Redis) -> None:
        """From a busy worker's heartbeat: WAKE every ANNOUNCE_EVERY_S while it holds unsent prompts and
        RQ's queue is empty (else idle workers take batches)."""
        now = time.monotonic()
        if self.dispatcher.unsent and now - self.announced_at >= ANNOUNCE_EVERY_S:
            self.announced_at = now
            try:
                if not await conn.llen(self.queue_key):
                    await fleet.wake_for_work(conn)  # one PUBLISH
            except (redis.RedisError, OSError) as exc:
                log.debug("wake-up not sent: %s", exc)


class WakeListener(threading.Thread):
    """Sets the pace's `queued`, `beat_now` (a control changed) or `woken` on each WAKE message, reading
    WAKE_READ_S at a time (an asyncio read cancelled at exit can hang): a stopping worker waits that long at most."""

    def __init__(self, redis_url: str, pace: IdlePace, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(name="genq-wake", daemon=True)
        self._conn = connect(redis_url)  # a client of its own (Sentinel too): its pool makes connections lazily
        self._conn.connection_pool.connection_kwargs["health_check_interval"] = 0
        self.pace, self.loop = pace, loop
        self._done = threading.Event()

    def stop(self) -> None:
        self._done.set()
        if self.is_alive():
            self.join(timeout=5)
        self._conn.close()

    def run(self) -> None:
        while not self._done.is_set():
            pubsub = self._conn.pubsub(ignore_subscribe_messages=True)
            try:
                says = fleet.listen_for_wakes(pubsub)
                while not self._done.is_set():
                    message = pubsub.get_message(timeout=WAKE_READ_S)
                    if message and message.get("type") == "message":
                        event = {"control": self.pace.beat_now, "queued": self.pace.queued,
                                 "work": self.pace.woken}[says(message.get("data"))]
                        self.loop.call_soon_threadsafe(event.set)
            except (redis.RedisError, OSError) as exc:
                log.debug("wake-up channel: %s", exc)
                self._done.wait(1.0)
            except RuntimeError:  # the engine's loop is closed: it has exited
                return
            finally:
                pubsub.close()


class Heartbeat:
    def __init__(self, opts: WorkerOptions, host: str, batches: Batches, dispatcher: Dispatcher,
                 pace: IdlePace) -> None:
        self.opts, self.name, self.host, self.instance = opts, batches.worker, host, batches.instance
        self.conn, self.batches, self.held = batches.conn, batches, batches.held  # after each beat, its lease check
        self.dispatcher, self.gate = dispatcher, dispatcher.gate  # the gate's controls are written here only
        self.stopping, self.watch, self.rates = dispatcher.stopping, dispatcher.watch, dispatcher.rates
        self.controller = dispatcher.controller
        self.pace = pace  # an idle engine beats every IDLE_BEAT_S
        self.gpu = GpuProbe(opts.gpu)
        self.gpu_sample: GpuSample | None = None
        self._gpu_stop = threading.Event()
        if self.gpu.note is None:
            threading.Thread(target=self._sample_gpu, name="genq-gpu", daemon=True).start()
        self.started_at = time.time()
        self.outage_since: float | None = None  # monotonic: the first beat that failed, while they fail
        self.run_id: str | None = None  # Redis's (INFO): another one is a restart or a failover
        self._next_note = 0.0  # seconds into the outage when the next warning is due
        self._inflight_jobs: set[str] = set()  # jobs whose InFlight record the last beat wrote
        self._workers_set_at = -WORKERS_SET_EVERY_S  # when it was last added to genq:workers
        self._figures_of: tuple[str, str] | None = None  # (server, model) whose decode figures it keeps
        self.tallies: dict[str, decodebound.Tally] = {}  # per job: its decode against the bound (WorkerStatus)
        self._tallied_at = time.monotonic()
        self._writing = asyncio.Lock()  # one beat at a time, none after "stopped" (its TTLs would read as lost)
        self._stopped = self._beaten = False  # _beaten: a beat of this life has landed

    def _sample_gpu(self) -> None:  # a thread: NVML can block
        while not self._gpu_stop.is_set():
            self.gpu_sample = self.gpu.sample()
            self._gpu_stop.wait(GPU_EVERY_S)

    async def first_beat(self) -> None:
        """The start's beat, waited for (Redis full or restarting), after what Redis's settings mean for genq."""
        try:
            info = await self.conn.info()
            self.run_id = info.get("run_id")
            if note := redis_note(info):
                log.warning("%s", note.text)
        except (redis.RedisError, OSError):
            pass  # INFO not allowed (renamed in some managed Redis), or Redis away: the beat below waits
        while not self.stopping.requested:
            try:
                await self.beat()
                self._answered()
                return
            except (redis.RedisError, OSError) as exc:
                self._failed(exc)
                await asyncio.sleep(BEAT_S)

    async def run(self) -> None:
        tick = time.monotonic()
        while True:
            await wait_event(self.pace.beat_now, BEAT_S)
            last_tick, tick = tick, time.monotonic()
            if tick - last_tick > LEASE_TIMEOUT_S:  # the loop itself did not run (SIGSTOP, a stalled host)
                log.warning("this engine was frozen for %.0fs: checking its leases before sending more",
                            tick - last_tick)
            if not self.pace.beat_due():
                continue
            try:
                await self.beat()
                if await self.gate.read(sorted(self.held.jobs() | set(self.dispatcher.todo.parked))):
                    self.pace.beat_now.set()  # a control changed: the status just written is stale
                try:
                    run_id = (await self.conn.info("server")).get("run_id")
                except redis.ResponseError:  # INFO not allowed (renamed in some managed Redis): no restart seen
                    run_id = self.run_id
                # Redis restarted or failed over: it may hold a lease of ours that another engine's written shard
                # superseded. Nothing is sent until the check looked in the output.
                if restarted := run_id != self.run_id:
                    self.gate.last_beat = float("-inf")
                await self.batches.check_leases(restarted)
                self.run_id = run_id
                await self.pace.announce(self.conn)  # unsent prompts: idle workers may take some
                self.gate.last_beat = time.monotonic()
                self.dispatcher.wake.set()
                self._answered()
            except (redis.RedisError, OSError) as exc:
                self._failed(exc)

    def _failed(self, exc: BaseException) -> None:
        """A beat failed (Redis away or refusing writes): said at once, then every REDIS_NOTE_EVERY_S."""
        if self.outage_since is None:
            self.outage_since, self._next_note = time.monotonic(), 0.0
        down_for = time.monotonic() - self.outage_since
        if down_for >= self._next_note:
            why = "" if refusal(exc) else f" ({exc})"  # a refusal quotes the refused command: said already
            log.warning("heartbeat: %s for %.0fs%s; results kept in memory, nothing new sent until it "
                        "answers", in_words(exc, "Redis unreachable"), down_for, why)
            self._next_note = down_for + REDIS_NOTE_EVERY_S

    def _answered(self) -> None:
        if self.outage_since is not None:
            log.info("Redis answers again after %.0fs; leases checked, sending again",
                     time.monotonic() - self.outage_since)
            self.outage_since = None

    def state(self) -> WorkerState:
        c = self.gate
        if self.watch.down:
            return "server_down"
        if c.draining or self.stopping.requested:
            return "draining"
        if c.paused_all or (self.held and self.held.jobs() <= c.paused_jobs):
            return "paused"
        return "busy" if self.held or self.dispatcher.running else "idle"

    def status(self, state: WorkerState | None = None, note: str | None = None) -> WorkerStatus:
        req_s, tok_s = self.rates.rates()
        # nothing running generates nothing now (the window is 30 s: a pause read stale)
        if not self.dispatcher.running:
            req_s = tok_s = 0.0
        m = self.watch.metrics
        now = time.monotonic()
        if m is not None and m.generated_total is not None:
            self.rates.counted(m.at, m.generated_total, m.running, m.kv_usage, m.waiting)
        window = self.rates.server_window()
        # Nothing of this worker's running: its row says 0 at once, not the window's last tokens.
        server_tok_s = None if window is None else window[0] if self.dispatcher.running else 0.0
        status = WorkerStatus(
            name=self.name, host=self.host, pid=os.getpid(), server=self.opts.server_url,
            state=state or self.state(), started_at=self.started_at, heartbeat_at=time.time(),
            gpu=None if self.opts.gpu is None else str(self.opts.gpu),
            concurrency_target=self.controller.target, concurrency_limit=self.controller.cap,
            server_capacity=self.controller.slots,
            in_flight=len(self.dispatcher.running), sequences=self.dispatcher.running.sequences,
            queued=self.dispatcher.unsent,
            batches=sorted(BatchRef(r.job, r.batch) for r in self.held), prefetch=self.opts.loops,
            tok_per_s=round(tok_s if server_tok_s is None else server_tok_s, 1),
            tok_per_s_from="answers" if server_tok_s is None else "server",
            window_running=None if window is None else window[1],
            window_token_usage=None if window is None else window[2],
            req_per_s=round(req_s, 2), done=self.rates.done, errors=self.rates.errors,
            job_errors=dict(self.rates.job_errors),
            server_running=m.running if m else None, server_waiting=m.waiting if m else None,
            server_token_usage=m.kv_usage if m else None,
            gpu_sample=self.gpu_sample, gpu_note=self.gpu.note,
            note=note or self.watch.note or self.batches.unwritten_note(),
            model=self.watch.info.model if self.watch.info else None,
            decode=self.dispatcher.running.meter.figures(),
            token_s=self.rates.token_s, mean_tokens=self.rates.mean_tokens,
            hardware=hardware(self.opts, self.gpu, self.watch.info),
        )
        in_flight = Counter(task.batch.ref.job for task in self.dispatcher.running)
        decodebound.add_tally(self.tallies, in_flight, status, now - self._tallied_at)
        self._tallied_at = now
        status.bound_tally = self.tallies
        return status

    async def beat(self, state: WorkerState | None = None, note: str | None = None) -> None:
        async with self._writing:
            if not self._stopped:
                await self._beat(state, note)

    async def _beat(self, state: WorkerState | None, note: str | None) -> None:
        info, meter = self.watch.info, self.dispatcher.running.meter
        if info is not None and self._figures_of is None:  # once its server is known: what was measured on it
            self._figures_of = (self.opts.server_url, info.model or "")
            await decoding.load(self.conn, meter, *self._figures_of)
        status = self.status(state, note)
        by_job: dict[str, list[int]] = {}
        for task in self.dispatcher.running:
            by_job.setdefault(task.batch.ref.job, []).append(task.progress.tokens)
        queued = self.dispatcher.todo.by_job()
        now, pace = time.time(), self.pace
        if member := time.monotonic() - self._workers_set_at >= WORKERS_SET_EVERY_S:
            self._workers_set_at = time.monotonic()
        async with self.conn.pipeline(transaction=False) as pipe:
            jobs = set(by_job) | set(queued) | self.held.jobs()
            fleet.stage_beat(pipe, status, self.instance, pace.ttl(LEASE_TIMEOUT_S), pace.ttl(STATUS_TTL_S),
                             member=member, gone=self._inflight_jobs - jobs,
                             inflight=[InFlight(worker=self.name, job=job, at=now, tokens=by_job.get(job, []),
                                                queued=queued.get(job, 0)) for job in jobs],
                             inflight_ttl=INFLIGHT_TTL_S, first=not self._beaten)
            if self._figures_of is not None:
                decoding.store(pipe, meter, status.decode, *self._figures_of, self.name)
            # Raised as Redis said it (redis-py's pipeline rewrites the words that tell a full Redis).
            for answer in await pipe.execute(raise_on_error=False):
                if isinstance(answer, Exception):
                    raise answer
        self._beaten = True
        self._inflight_jobs = jobs

    async def check_name_free(self) -> None:
        """Refuse to run twice under one name; a crashed predecessor's record is fine."""
        found = (await fleet.statuses(self.conn, [self.name]))[self.name]
        if found is None or found.state == "stopped":
            return
        first = found.heartbeat_at
        await fleet.tell_idle_workers(self.conn)  # an idle one beats every 20 s, a busy one every second
        await asyncio.sleep(2.5)
        other = (await fleet.statuses(self.conn, [self.name]))[self.name]
        if other is not None and other.heartbeat_at > first and other.state != "stopped":
            raise SystemExit(f"a worker named {self.name} is already running (host {other.host}, pid {other.pid}); "
                             "give this one another --name")

    async def stopped(self) -> None:
        """The last write, after any beat under way: that beat's alive key would outlive the stop."""
        self._gpu_stop.set()
        async with self._writing:
            self._stopped = True
            await fleet.stopped(self.conn, self.instance, self.name)
            await self._beat("stopped", None)

