"""The end of the queue (docs/scheduling.md): once RQ's queue is empty, free slots borrow unsent prompts from the
back of other engines' batches, and a slow engine holds back while the fleet's unsent prompts end sooner on faster
ones: U <= SPREAD x sum_v slots_v / L_v x (L_me - L_v), L the mean request time (token_s x mean_tokens)."""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import OrderedDict

import msgspec
import redis

from genq.core.ledger import fleet, leasing
from genq.core.ledger import jobs as ledger_jobs
from genq.core.records import BatchRef, BatchSource, JobConfig, Prompt, WorkerStatus, unpack
from genq.core.timings import BEAT_S, LEASE_TIMEOUT_S
from genq.core.words import plural
from genq.ops.recover import adopt_if_written
from genq.producer.sources import load_prompts
from genq.worker.batches import Batches
from genq.worker.dispatch import Dispatcher
from genq.worker.heartbeat import IdlePace
from genq.worker.held import HeldBatch

log = logging.getLogger("genq.worker")

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


def unsent_now(w: WorkerStatus, now: float) -> float:
    """w's unsent prompts now: its beat's count less what it sent since, at slots / L_w."""
    if w.state != "busy" or not w.token_s or not w.mean_tokens or not w.concurrency_target or not w.in_flight:
        return w.queued
    age = min(max(0.0, now - w.heartbeat_at), 2 * BEAT_S)  # clocks of other hosts: a beat or two at most
    return max(0.0, w.queued - age * w.concurrency_target / (w.mean_tokens * w.token_s))


def tail_line(me: WorkerStatus, others: list[WorkerStatus], now: float | None = None) -> tuple[float, float]:
    """(the fleet's unsent prompts now, the line at or under which `me` holds back; 0: never)."""
    tokens = [w.mean_tokens for w in (me, *others) if w.mean_tokens]
    now = time.time() if now is None else now
    unsent = me.queued + sum(unsent_now(w, now) for w in others)
    if not me.token_s or not tokens:
        return unsent, 0.0  # nothing measured yet
    mean = sum(tokens) / len(tokens)
    mine = mean * me.token_s
    faster = 0.0
    for w in others:
        if w.state in ("busy", "idle") and w.token_s and w.concurrency_target and w.token_s <= me.token_s * (1 - MARGIN):
            theirs = mean * w.token_s
            faster += w.concurrency_target / theirs * (mine - theirs)
    return unsent, faster * SPREAD


def hold_back(me: WorkerStatus, others: list[WorkerStatus], now: float | None = None) -> bool:
    """Whether `me` should start nothing new (`me.queued` taken as of now)."""
    unsent, line = tail_line(me, others, now)
    return 0 < unsent <= line


class Stealer:
    def __init__(self, queue_key: str, batches: Batches, dispatcher: Dispatcher, pace: IdlePace) -> None:
        self.conn, self.name, self.instance, self.queue_key = batches.conn, batches.worker, batches.instance, queue_key
        self.batches, self.held, self.dispatcher, self.gate = batches, batches.held, dispatcher, dispatcher.gate
        self.pace = pace  # an idle stealer naps (worker/heartbeat.py)
        # Prompts of batches looked at, by batch, job incarnation and settings version.
        self._batches: OrderedDict[tuple[BatchRef, str, int], list[Prompt] | None] = OrderedDict()
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
            ids = await self.batches.claims.steal(ref, config.incarnation, holder, [p.id for p in reversed(prompts)],
                                                  free)
            if not ids or await adopt_if_written(self.conn, config, ref):  # written already: Redis lost that
                continue
            if ref in self.held:  # leased to this engine meanwhile: its own lease sends them
                await self.batches.claims.unclaim(self.held[ref], ids)
                continue
            took += len(ids)
            free -= len(ids)
            self._borrow(ref, config, prompts, ids)
            if free <= 0:
                break
        return took

    def _borrow(self, ref: BatchRef, config: JobConfig, prompts: list[Prompt], ids: dict[str, int]) -> None:
        borrowed = self.held.borrowed.get(ref)
        if borrowed is not None and borrowed.config.incarnation != config.incarnation:
            self.batches.drop(borrowed, cancel=True)  # of a deleted job: nothing of it is recorded
        if borrowed is None or borrowed.dropped:
            borrowed = self.held.borrowed[ref] = HeldBatch(ref, token="", config=config, unfinished=set(), borrowed=True)
        borrowed.unfinished |= set(ids)
        log.info("took %s of batch %s from another worker", plural(len(ids), "unsent prompt"), ref)
        self.batches.todo.add_claimed(borrowed, [p for p in prompts if p.id in ids], ids)

    async def _leased_elsewhere(self) -> list[tuple[BatchRef, str, JobConfig]]:
        """Batches other engines hold with their job's settings now, the highest priority first, holders mixed
        (idle engines spread over them), paused jobs left out."""
        names = [j for j in await ledger_jobs.job_names(self.conn) if j not in self.gate.paused_jobs]
        found = [(now.schedule.priority, BatchRef(job, batch), holder, now.config)
                 for job, now in zip(names, await ledger_jobs.jobs_now(self.conn, names, leases=True))
                 if now.config is not None and not now.paused
                 for batch, holder in now.leases.items()
                 if holder and holder != self.instance and BatchRef(job, batch) not in self.held]
        random.shuffle(found)
        found.sort(key=lambda f: -f[0])
        return [(ref, holder, config) for _, ref, holder, config in found]

    async def _batch(self, ref: BatchRef, config: JobConfig) -> list[Prompt] | None:
        cached = (ref, config.incarnation, config.settings_version)  # new settings: read again
        if cached not in self._batches:
            raw, loaded = await leasing.batch_record(self.conn, ref), None
            try:
                loaded = None if raw is None else await load_prompts(unpack(raw, BatchSource), config)
            except Exception as exc:  # unreadable or changed input: its holder deals with it
                log.debug("not taking from batch %s: its input cannot be read (%s)", ref, exc)
            self._batches[cached] = loaded
            while len(self._batches) > BATCHES_CACHED:
                self._batches.popitem(last=False)
        return self._batches[cached]

    async def tail(self) -> None:
        """Decide the hold (see the module docstring) and act on it."""
        d, active = self.dispatcher, self.held.active()
        self._near = self._near and active and not self._given_up
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
        self._near = False
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
