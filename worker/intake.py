"""Where an engine's work comes from (docs/scheduling.md). Intake: batches off RQ's queue (TAKE: RQ job started and
batch leased in one script) while fewer than --prefetch are held, or (prefetch - 1) batches' worth is not left
unsent, or the queue's next batch outranks what waits here. Shares: which held prompts are claimed next, the highest
priority first, then the job with the fewest claimed or in flight on the fleet over its weight (FLEET_SHARE).
Stealer, the end of the queue: once RQ's queue is empty, free slots borrow unsent prompts from the back of other
engines' batches, and a slow engine holds back while the fleet's unsent prompts end sooner on faster ones:
U <= SPREAD x sum_v slots_v / L_v x (L_me - L_v), L the mean request time (token_s x mean_tokens)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import time
import uuid
from collections import Counter

import msgspec
import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import fleet, leasing
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import batch_of_description, rq_worker
from genq.core.records import BatchRef, BatchSource, JobConfig, JobSchedule, Prompt, WorkerStatus, unpack
from genq.core.timings import BEAT_S, LEASE_TIMEOUT_S
from genq.core.waits import retrying, wait_event
from genq.core.words import plural
from genq.ops.recover import adopt_if_written
from genq.producer.sources import read_prompts
from genq.worker.batches import Batches
from genq.worker.dispatch import Dispatcher
from genq.worker.heartbeat import IdlePace
from genq.worker.held import HeldBatch
from genq.worker.options import WorkerOptions

log = logging.getLogger("genq.worker")

BUSY_POLL_S = 0.3  # wanting a batch and the last TAKE found none: look again this often,
IDLE_POLL_S = 30.0  # or this often after a while: every queueing publishes a WAKE that ends the wait
FULL_POLL_S = 0.05  # holding enough: whether that changed is a look at this engine's own state, no Redis
CLOSED_POLL_S = 1.0  # taking nothing (paused, draining, stopping, server down): what ends it sets the wake
FOREIGN_EVERY_S = 2.0  # the skip list's view of other models' jobs is this fresh
RQ_BEAT_S = 20.0  # the RQ worker key's heartbeat...
RQ_TTL_S = 60  # ...and its life: a killed engine leaves `rq info` within this
MAX_EXTRA = 14  # batches taken beyond --prefetch while held ones drain their long tails

REFRESH_EVERY_S = 1.0
FRESH_S = 3  # another engine's count stops counting this long after its last refresh


class Shares:
    def __init__(self, conn: aioredis.Redis, queue_key: str, instance: str, batches: Batches) -> None:
        self.conn, self.queue_key, self.instance = conn, queue_key, instance
        self.batches = batches  # what this engine holds, claimed and runs
        self.sched: dict[str, JobSchedule] = {}
        self.head: str | None = None  # the job of the queue's next batch (None: empty, or not read)
        self.others: dict[str, int] = {}  # prompts per job claimed or in flight on the fleet's other engines
        self._published: set[str] = set()  # jobs this engine's count is published for
        self._head = conn.register_script(scripts.QUEUE_HEAD)
        self._share = conn.register_script(scripts.FLEET_SHARE)

    def _mine(self) -> dict[str, int]:
        """This engine's prompts claimed or in flight, per job."""
        return Counter(t.batch.ref.job for t in itertools.chain(self.batches.running, self.batches.todo.ready))

    def priority(self, job: str) -> int:
        return self.sched.get(job, JobSchedule()).priority

    async def run(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_EVERY_S)
            jobs = sorted(self.batches.held.all_jobs())
            if not jobs and not self._published:
                self.head = None
                continue  # idle: nothing read (worker/heartbeat.py)
            try:
                await self.refresh(jobs)
            except (redis.RedisError, OSError) as exc:
                log.debug("schedules not read: %s", exc)

    async def refresh(self, jobs: list[str]) -> None:
        counts = self._mine()
        # Jobs left since the last refresh publish 0: their entries go now, not FRESH_S later.
        mine = {job: counts.get(job, 0) for job in sorted(set(jobs) | self._published)}
        async with self.conn.pipeline(transaction=False) as pipe:
            script_keys, args = scripts.fleet_share_call(self.instance, FRESH_S, mine)
            await self._share(keys=script_keys, args=args, client=pipe)
            if jobs:
                ledger_jobs.stage_schedules(pipe, jobs)
                script_keys, args = scripts.queue_head_call(self.queue_key)
                await self._head(keys=script_keys, args=args, client=pipe)
            shared, *rest = await pipe.execute()
        self._published = {job for job, n in mine.items() if n}
        self.others = dict(zip(mine, shared))
        if not rest:
            self.head = None
            return
        raws, head = rest
        self.sched.update({job: ledger_jobs.schedule_of(raw) for job, raw in zip(jobs, raws)})
        found = batch_of_description(head)
        self.head = found[0] if found else None
        if self.head is not None and self.head not in self.sched:
            self.sched[self.head] = (await ledger_jobs.jobs_now(self.conn, [self.head]))[0].schedule

    def wants_head(self, low: int) -> bool:
        """Whether the queue's next batch is taken now although --prefetch are held: it outranks what waits here, or
        ties it with fewer than `low` waiting (taken only once dry, the second of two equal jobs got 38%)."""
        if self.head is None or not (waiting := self.batches.todo.by_job()):
            return False
        best = max(self.priority(j) for j in waiting)
        head = self.priority(self.head)
        return head > best or (head == best and waiting.get(self.head, 0) < low)

    def plan(self, waiting: dict[str, int], n: int) -> list[tuple[str, int]]:
        """How many of n claims go to each job with prompts waiting, in the order to claim them."""
        out: Counter[str] = Counter()
        load = Counter(self._mine()) + Counter(self.others)
        for priority in sorted({self.priority(j) for j in waiting}, reverse=True):
            left = {j: k for j, k in waiting.items() if self.priority(j) == priority and k > 0}
            while n > 0 and left:
                job = min(left, key=lambda j: (load[j] / self.sched.get(j, JobSchedule()).weight, j))
                out[job] += 1
                load[job] += 1
                n -= 1
                left[job] -= 1
                if not left[job]:
                    del left[job]
        return list(out.items())


def run_batch(job: str, batch_id: str) -> None:
    """What a stock RQ worker runs for a genq batch: genq's engine takes batches itself (TAKE)."""
    raise RuntimeError(f"batch {job}/{batch_id}: genq batches are run by `genq worker`, not by a stock RQ worker")


class Intake:
    def __init__(self, opts: WorkerOptions, batches: Batches, dispatcher: Dispatcher, shares: Shares) -> None:
        self.conn, self.opts, self.instance = batches.conn, opts, batches.instance
        self.batches, self.held = batches, batches.held  # loads what is taken
        self.dispatcher, self.shares = dispatcher, shares  # whether the engine takes new work; priorities
        self.queued = batches.written_again  # set too by the wake listener when batches are queued
        self.exhausted = False  # the last look at the queue found nothing for this engine (--burst: leave?)
        self.foreign: set[str] = set()  # jobs of a model this engine's server does not serve
        self._foreign_at = float("-inf")  # when the skip list was read,
        self._foreign_model: str | None = None  # and under which model the server served
        self._take = self.conn.register_script(scripts.TAKE)
        self._rq = rq_worker(batches.sync_conn, self.instance)

    def wants_batch(self) -> bool:
        base, held = self.opts.loops, len(self.held)
        if held < base:
            return True
        if held >= base + MAX_EXTRA:
            return False  # parked prompts are not work: no more batches for them
        low = max(1, self.dispatcher.controller.target // 2)
        if self.shares.head not in self.foreign and self.shares.wants_head(low):
            return True  # the queue's next batch outranks what waits here; another model's is not ours to take
        # (prefetch - 1) batches' worth unsent, counted in prompts without an outcome and not in flight
        # (several held batches can be in their heavy tails at once).
        size = max((h.config.batch_size for h in self.held.values()), default=0)
        unsent = sum(len(h.unfinished) for h in self.held.values() if not h.dropped) - len(self.dispatcher.running)
        return unsent < (base - 1) * size

    async def run(self) -> None:
        # Redis away or refusing writes (full, a replica) at the start: waited out, as every write is.
        await retrying(lambda: asyncio.to_thread(self._rq_birth), "registering in rq info")
        beat_at = quiet_since = time.monotonic()
        try:
            while True:
                if time.monotonic() - beat_at >= RQ_BEAT_S:
                    try:
                        await asyncio.to_thread(self._rq_beat)
                        beat_at = time.monotonic()
                    except (redis.RedisError, OSError) as exc:
                        log.debug("rq info heartbeat: %s", exc)
                if not self.dispatcher.accepting():
                    wake = self.dispatcher.wake  # set, it is the dispatcher's to clear: a wait on it would spin
                    await (asyncio.sleep(FULL_POLL_S) if wake.is_set() else wait_event(wake, CLOSED_POLL_S))
                    continue
                if not self.wants_batch():
                    await asyncio.sleep(FULL_POLL_S)
                    continue
                taken = await self.take()
                self.exhausted = not taken
                if taken:
                    quiet_since = time.monotonic()
                    continue
                idle = time.monotonic() - quiet_since > 10 * BUSY_POLL_S
                await wait_event(self.queued, IDLE_POLL_S if idle else BUSY_POLL_S)
                self.queued.clear()
        finally:
            with contextlib.suppress(redis.RedisError, OSError):  # else its key lapses within RQ_TTL_S
                await asyncio.to_thread(self._rq.register_death)

    async def take(self) -> bool:
        """TAKE one batch this engine may run, and load it; False if the queue has none. A TAKE whose answer was
        lost is sent again with the same token and answers the batch the first one took."""
        await retrying(self._refresh_foreign, "reading the jobs")
        token = uuid.uuid4().hex
        skip = sorted(self.foreign | self.batches.unwritten_jobs())
        rq_now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())  # as RQ writes it (rq.utils.utcformat)
        script_keys, args = scripts.take_call(self.instance, token, rq_now, skip)
        got = await retrying(lambda: self._take(keys=script_keys, args=args), "taking a batch")
        if not got:
            return False
        ref = BatchRef(got[0].decode(), got[1].decode())
        # Leased to this live engine now: no one else takes it, so its load is waited through (Redis away).
        await retrying(lambda: self._load(token, ref), f"loading batch {ref}")
        return True

    async def _load(self, token: str, ref: BatchRef) -> None:
        config = (await ledger_jobs.jobs_now(self.conn, [ref.job]))[0].config
        if await self.batches.renewed(ref, token, config):
            return
        if config is not None and (config := await self.dispatcher.watch.admit(config)) is None:  # `auto` pinned
            self.foreign.add(ref.job)  # another model's job: back to the queue, and skipped from now on
            await self.batches.hand_back(ref, token)
            return
        await self.batches.load(token, ref, config)

    async def _refresh_foreign(self) -> None:
        """Jobs whose model is pinned to one this server does not serve; read again at once when the server
        serves another model: else a batch the watch just handed back is taken again and handed back twice."""
        model = self.dispatcher.watch.model
        if model == self._foreign_model and time.monotonic() - self._foreign_at < FOREIGN_EVERY_S:
            return
        jobs = sorted(await ledger_jobs.job_names(self.conn))
        self.foreign = {job for job, now in zip(jobs, await ledger_jobs.jobs_now(self.conn, jobs))
                        if now.config is not None and not self.dispatcher.watch.takes(now.config)}
        self._foreign_at, self._foreign_model = time.monotonic(), model

    def _rq_birth(self) -> None:
        with contextlib.suppress(ValueError):  # "an active worker named ...": a try before this one got that far
            self._rq.register_birth()
        self._rq_beat()

    def _rq_beat(self) -> None:
        self._rq.set_state("busy" if self.held else "idle")
        self._rq.heartbeat(RQ_TTL_S)


STEAL_EVERY_S = 0.5  # while the queue has batches: a look at its length (one LLEN)
STEAL_AGAIN_S = 0.1  # after a take, or while every slot is busy
STEAL_IDLE_MAX_S = 2.0  # the longest wait between looks while there is nothing to take
BATCHES_CACHED = 64
TAIL_EVERY_S = 1.0  # the hold decided this often, or every TAIL_NEAR_EVERY_S within NEAR x the line
TAIL_NEAR_EVERY_S = 0.2
NEAR = 2.0
MARGIN = 0.15  # a worker is faster when its requests take at most 85% of this one's
SPREAD = 3.0  # output lengths are heavy-tailed: the expected gap (L_me - L_v) widened this much
HOLD_MIN_S = 5.0  # a hold lasts at most this, or HOLD_REQUESTS of this worker's mean request time
HOLD_REQUESTS = 3.0
DOWN_GRACE_S = LEASE_TIMEOUT_S  # a server down this long: its prompts go as a lost worker's would


def unsent_now(w: WorkerStatus) -> float:
    """w's unsent prompts now: its beat's count less what it sent since, at slots / L_w."""
    if w.state != "busy" or not w.token_s or not w.mean_tokens or not w.concurrency_target or not w.in_flight:
        return w.queued
    age = min(max(0.0, time.time() - w.heartbeat_at), 2 * BEAT_S)  # clocks of other hosts: a beat or two at most
    return max(0.0, w.queued - age * w.concurrency_target / (w.mean_tokens * w.token_s))


def tail_line(me: WorkerStatus, others: list[WorkerStatus]) -> tuple[float, float]:
    """(the fleet's unsent prompts now, the line at or under which `me` holds back; 0: never)."""
    tokens = [w.mean_tokens for w in (me, *others) if w.mean_tokens]
    unsent = me.queued + sum(unsent_now(w) for w in others)
    if not me.token_s or not tokens:
        return unsent, 0.0  # nothing measured yet
    mean = sum(tokens) / len(tokens)
    mine = mean * me.token_s
    faster = 0.0
    for w in others:
        if (w.state in ("busy", "idle") and w.token_s and w.concurrency_target
            and w.token_s <= me.token_s * (1 - MARGIN)):
            theirs = mean * w.token_s
            faster += w.concurrency_target / theirs * (mine - theirs)
    return unsent, faster * SPREAD


def hold_back(me: WorkerStatus, others: list[WorkerStatus]) -> bool:
    """Whether `me` should start nothing new (`me.queued` taken as of now)."""
    unsent, line = tail_line(me, others)
    return 0 < unsent <= line


class Stealer:
    def __init__(self, queue_key: str, batches: Batches, dispatcher: Dispatcher, pace: IdlePace) -> None:
        self.conn, self.name, self.instance, self.queue_key = batches.conn, batches.worker, batches.instance, queue_key
        self.batches, self.held, self.dispatcher, self.gate = batches, batches.held, dispatcher, dispatcher.gate
        self.pace = pace  # an idle stealer naps (worker/heartbeat.py)
        self._batches: dict[tuple[BatchRef, str, int], list[Prompt] | None] = {}  # by batch, incarnation, settings
        self._hold_since: float | None = None  # monotonic: when this hold began
        self._hold_limit_s = HOLD_MIN_S
        self._given_up = False  # held back past its limit: not again while this engine holds anything
        self._near = False  # the unsent prompts near the line at the last look: look again soon

    async def run(self) -> None:
        wait, looked, tail_at = STEAL_EVERY_S, 0.0, 0.0
        while True:
            woken = await self.pace.nap(max(0.0, min(looked + wait, tail_at) - time.monotonic()), looked)
            if woken and not self.gate.leases_fresh():
                await self.pace.fresh_beat(self.gate)  # idle: its last lease check is old
            if time.monotonic() >= tail_at:
                await self.tail()
                tail_at = time.monotonic() + (TAIL_NEAR_EVERY_S if self._near and not self.dispatcher.hold_back
                                              else TAIL_EVERY_S)
            if not woken and time.monotonic() < looked + wait:
                continue
            try:
                took = await self.pass_once()
            except (redis.RedisError, OSError) as exc:
                log.debug("stealing skipped: %s", exc)
                took = 0
            # Soon again after a take or while the slots are full; while nothing is found, less often.
            wait = (STEAL_AGAIN_S if took or self.free_slots() <= 0 else STEAL_EVERY_S if took is None
                    else min(wait * 2, STEAL_IDLE_MAX_S))
            looked = time.monotonic()

    def free_slots(self) -> int:
        d = self.dispatcher
        return d.controller.target - d.running.sequences - d.unsent

    async def pass_once(self) -> int | None:
        """Take up to the free slots' worth of prompts; how many (None: the queue has batches)."""
        for ref in [r for r, b in self.held.borrowed.items() if not b.unfinished or b.dropped]:
            self.held.borrowed.pop(ref)
        if self.dispatcher.watch.down and self.held.borrowed:
            await self.batches.give_back_borrowed("this worker's server is down")  # the holders need not wait for it
            return 0
        free = self.free_slots()
        if free <= 0 or not self.dispatcher.accepting() or self.dispatcher.hold_back or not self.gate.leases_fresh():
            return 0
        if await self.conn.llen(self.queue_key):
            return None  # RQ hands the queue's batches out: the end of the job is not here yet
        took = 0
        unwritten = self.batches.unwritten_jobs()
        for ref, holder, config in await self._leased_elsewhere():
            # Its shards cannot be written here now, or another model's job, or its input unreadable: skipped.
            if (ref.job in unwritten or not self.dispatcher.watch.takes(config)
                    or (prompts := await self._batch(ref, config)) is None):
                continue
            ids, lease = await self.batches.claims.steal(ref, config.incarnation, holder,
                                                         [p.id for p in reversed(prompts)], free)
            if not ids or await adopt_if_written(self.conn, config, ref):  # written already: Redis lost that
                continue
            if ref in self.held:  # leased to this engine meanwhile: its own lease sends them
                await self.batches.claims.unclaim(self.held[ref], ids, lease)
                continue
            took += len(ids)
            free -= len(ids)
            self._borrow(ref, config, prompts, ids, lease)
            if free <= 0:
                break
        return took

    def _borrow(self, ref: BatchRef, config: JobConfig, prompts: list[Prompt], ids: dict[str, int], lease: str) -> None:
        borrowed = self.held.borrowed.get(ref)
        if borrowed is not None and borrowed.config.incarnation != config.incarnation:
            self.batches.drop(borrowed, cancel=True)  # of a deleted job: nothing of it is recorded
        if borrowed is None or borrowed.dropped:
            borrowed = self.held.borrowed[ref] = HeldBatch(ref, token=lease, config=config, unfinished=set(),
                                                           borrowed=True)
        borrowed.unfinished |= set(ids)
        borrowed.token = lease  # the holder's lease now: claims under an older one are void
        log.info("took %s of batch %s from another worker", plural(len(ids), "unsent prompt"), ref)
        self.batches.todo.add_claimed(borrowed, [p for p in prompts if p.id in ids], ids)

    async def _leased_elsewhere(self) -> list[tuple[BatchRef, str, JobConfig]]:
        """Batches other engines hold, with their job's settings now: highest priority first, holders mixed."""
        names = [j for j in await ledger_jobs.job_names(self.conn) if j not in self.gate.paused_jobs]
        found = [(now.schedule.priority, BatchRef(job, batch), holder, now.config)
                 for job, now in zip(names, await ledger_jobs.jobs_now(self.conn, names, leases=True))
                 if now.config is not None and not now.paused
                 for batch, holder in now.leases.items()
                 if holder and holder != self.instance and BatchRef(job, batch) not in self.held]
        found.sort(key=lambda f: (-f[0], random.random()))
        return [(ref, holder, config) for _, ref, holder, config in found]

    async def _batch(self, ref: BatchRef, config: JobConfig) -> list[Prompt] | None:
        cached = (ref, config.incarnation, config.settings_version)  # new settings: read again
        if cached not in self._batches:
            raw, loaded = await leasing.batch_record(self.conn, ref), None
            try:
                loaded = None if raw is None else await asyncio.to_thread(read_prompts, unpack(raw, BatchSource),
                                                                          config)
            except Exception as exc:  # unreadable or changed input: its holder deals with it
                log.debug("not taking from batch %s: its input cannot be read (%s)", ref, exc)
            self._batches[cached] = loaded
            if len(self._batches) > BATCHES_CACHED:  # the oldest read goes
                del self._batches[next(iter(self._batches))]
        return self._batches[cached]

    async def tail(self) -> None:
        """Decide the hold (see the module docstring) and act on it."""
        d, active = self.dispatcher, self.held.active()
        self._near = False  # _decide says
        since = d.watch.down_since  # down past DOWN_GRACE_S: its prompts are better sent anywhere else
        down = since is not None and time.monotonic() - since > DOWN_GRACE_S
        try:
            hold = down or (active and not self._given_up and await self._decide())
        except (redis.RedisError, OSError) as exc:
            log.debug("tail check skipped: %s", exc)
            hold = False
        hold = down or self._bounded(hold, active)
        if hold:  # claiming nothing, it hears of no backlog prompt faster engines finished: it looks
            with contextlib.suppress(redis.RedisError, OSError):
                await d.todo.prune()
        began = hold and not d.hold_back
        if hold != d.hold_back:
            if not down:
                log.info("end of the queue: %s", "faster workers finish the unsent prompts sooner; starting "
                         "none here" if hold else "starting prompts here again")
            d.hold_back = hold
            d.wake.set()
        if down or began:  # down: every round, what was in flight when it went down comes back claimed
            try:
                back = await d.todo.give_back_ready(server_down=down)
            except (redis.RedisError, OSError) as exc:  # still claimed here: sent here once the hold ends
                log.debug("claimed prompts not given back: %s", exc)
                return
            if back and down:
                log.info("server down: %d claimed prompts left to other workers (they take them once the "
                         "queue is empty; claimed again here if it comes back first)", back)
            elif back:
                log.info("end of the queue: %d claimed prompts not sent here, left to the faster workers", back)

    def _bounded(self, hold: bool, active: bool) -> bool:
        """A hold lasts a few of this worker's request times at most: then this one sends them."""
        self._given_up = self._given_up and active
        if not hold:
            self._hold_since = None
            return False
        now = time.monotonic()
        self._hold_since = now if self._hold_since is None else self._hold_since
        if now - self._hold_since > self._hold_limit_s:
            log.info("end of the queue: held back %.0fs and the faster workers took nothing; sending here",
                     now - self._hold_since)
            self._given_up, self._hold_since = True, None
            return False
        return True

    async def _decide(self) -> bool:
        if await self.conn.llen(self.queue_key):
            return False
        statuses = [s for s in (await fleet.statuses(self.conn)).values() if s is not None]
        me = next((s for s in statuses if s.name == self.name), None)
        if me is None or len(statuses) < 2:
            return False
        if me.token_s and me.mean_tokens:
            self._hold_limit_s = max(HOLD_MIN_S, HOLD_REQUESTS * me.token_s * me.mean_tokens)
        me = msgspec.structs.replace(me, queued=self.dispatcher.unsent)  # its own count, live
        unsent, line = tail_line(me, [s for s in statuses if s.name != self.name])
        self._near = 0 < unsent <= NEAR * line  # nothing unsent, or no faster worker (line 0): not near
        return 0 < unsent <= line
