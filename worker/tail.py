"""The tail on the fastest GPUs: at the end of the queue, a prompt starts where it finishes first.

Once RQ's queue is empty, the fleet's unsent prompts U are the last to start. Started here, one
ends after L_me (mean output tokens x this worker's seconds per token per request); a worker v
faster by at least MARGIN frees slots_v / L_v slots a second and finishes a prompt before L_me
for L_me - L_v. While U <= SPREAD x sum_v slots_v / L_v x (L_me - L_v), every unsent prompt ends
sooner elsewhere: this worker holds back (Dispatcher.hold_back), claims nothing and steals nothing,
gives back the prompts it claimed ahead (Todo.give_back_ready), and the faster workers take them
(worker/stealing.py). The fastest worker never holds back; a hold lasts a few request times at
most. A server down past DOWN_GRACE_S makes its worker the slowest: it gives back every claim.

Speeds come from the heartbeats (WorkerStatus.token_s, mean_tokens), read once a second (every
NEAR_EVERY_S near the line); another worker's `queued` is taken less what it sent since its beat.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import msgspec
import redis
import redis.asyncio as aioredis

from genq.core.ledger import fleet
from genq.core.records import WorkerStatus
from genq.core.timings import BEAT_S, LEASE_TIMEOUT_S
from genq.worker.dispatch import Dispatcher
from genq.worker.watch import ServerWatch

log = logging.getLogger("genq.worker")

EVERY_S = 1.0
NEAR_EVERY_S = 0.2  # while the unsent prompts are within NEAR x the line and this engine does not hold back
NEAR = 2.0
MARGIN = 0.15  # a worker is faster when its requests take at most 85% of this one's
WORKING = ("busy", "idle")
# Output lengths are heavy-tailed: what ends a job is a long request started on a slow GPU, not
# an average one. The expected gap (L_me - L_v) is widened by this much.
SPREAD = 3.0
HOLD_MIN_S = 5.0  # a hold lasts at most this, or HOLD_REQUESTS of this worker's mean request time
HOLD_REQUESTS = 3.0
# A server down this long holds back as the slowest of workers: its prompts go to the others, as
# soon as a lost worker's would (its leases lapse after LEASE_TIMEOUT_S).
DOWN_GRACE_S = LEASE_TIMEOUT_S


def unsent_now(w: WorkerStatus, now: float) -> float:
    """w's unsent prompts now: its beat's count less what it sent since, at r_w = slots / L_w
    (a busy worker's requests end, and it sends the next, at that rate)."""
    if w.state != "busy" or not w.token_s or not w.mean_tokens or not w.concurrency_target or not w.in_flight:
        return w.queued
    age = min(max(0.0, now - w.heartbeat_at), 2 * BEAT_S)  # clocks of other hosts: a beat or two at most
    return max(0.0, w.queued - age * w.concurrency_target / (w.mean_tokens * w.token_s))


def tail_line(me: WorkerStatus, others: list[WorkerStatus], now: float | None = None) -> tuple[float, float]:
    """(the fleet's unsent prompts now, the line under which `me` holds back; 0: never)."""
    fleet = [me, *others]
    tokens = [w.mean_tokens for w in fleet if w.mean_tokens]
    now = time.time() if now is None else now
    unsent = me.queued + sum(unsent_now(w, now) for w in others)
    if not me.token_s or not tokens:
        return unsent, 0.0  # nothing measured yet
    mean = sum(tokens) / len(tokens)
    mine = mean * me.token_s
    faster = 0.0
    for w in others:
        if w.state in WORKING and w.token_s and w.concurrency_target and w.token_s <= me.token_s * (1 - MARGIN):
            theirs = mean * w.token_s
            faster += w.concurrency_target / theirs * (mine - theirs)
    return unsent, faster * SPREAD


def hold_back(me: WorkerStatus, others: list[WorkerStatus], now: float | None = None) -> bool:
    """Whether `me` should start nothing new: the unsent prompts of the fleet all finish sooner
    on faster workers (see the module docstring). `me.queued` is taken as of now."""
    unsent, line = tail_line(me, others, now)
    return 0 < unsent <= line


class TailWatch:
    def __init__(self, conn: aioredis.Redis, name: str, queue_key: str, watch: ServerWatch, dispatcher: Dispatcher,
                 active: Callable[[], bool]) -> None:
        self.conn = conn
        self.name = name
        self.queue_key = queue_key
        self.watch = watch
        self.dispatcher = dispatcher
        self.active = active  # whether this engine holds or borrows anything (idle: nothing is read)
        self.held_back = 0  # times this engine began holding back
        self._since: float | None = None  # monotonic: when this hold began
        self._limit_s = HOLD_MIN_S
        self._given_up = False  # held back past its limit: not again while this engine holds anything
        self._near = False  # the unsent prompts near the line at the last look: look again soon

    async def run(self) -> None:
        while True:
            await asyncio.sleep(NEAR_EVERY_S if self._near and not self.dispatcher.hold_back else EVERY_S)
            active = self.active()
            self._near = self._near and active and not self._given_up
            down = self._server_gone()
            try:
                hold = down or (active and not self._given_up and await self.decide())
            except (redis.RedisError, OSError) as exc:
                log.debug("tail check skipped: %s", exc)
                hold = False
            hold = down or self._bounded(hold, active)
            if hold:
                try:
                    await self.dispatcher.todo.prune()
                except (redis.RedisError, OSError) as exc:
                    log.debug("tail prune skipped: %s", exc)
            if hold != self.dispatcher.hold_back:
                if not down:
                    log.info("end of the queue: %s", "faster workers finish the unsent prompts sooner; starting "
                             "none here" if hold else "starting prompts here again")
                self.held_back += hold
                self.dispatcher.hold_back = hold
                self.dispatcher.wake.set()
                if hold and not down:
                    await self.give_back_ready()
            if down:  # every round: what was in flight when it went down comes back claimed
                await self.give_back_ready(server_down=True)

    def _server_gone(self) -> bool:
        """The server is down past DOWN_GRACE_S: its prompts are better sent anywhere else."""
        since = self.watch.down_since
        return since is not None and time.monotonic() - since > DOWN_GRACE_S

    async def give_back_ready(self, server_down: bool = False) -> None:
        try:
            back = await self.dispatcher.todo.give_back_ready(server_down)
        except (redis.RedisError, OSError) as exc:  # still claimed here: sent here once the hold ends
            log.debug("claimed prompts not given back: %s", exc)
            return
        if back and server_down:
            log.info("server down: %d claimed prompts left to other workers (they take them once the queue is "
                     "empty; claimed again here if it comes back first)", back)
        elif back:
            log.info("end of the queue: %d claimed prompts not sent here, left to the faster workers", back)

    def _bounded(self, hold: bool, active: bool) -> bool:
        """A hold lasts at most a few of this worker's request times: if the faster workers have
        not taken the prompts by then (another model's, paused, gone), this one sends them."""
        if not active:
            self._given_up = False
        if not hold:
            self._since = None
            return False
        now = time.monotonic()
        if self._since is None:
            self._since = now
        if now - self._since > self._limit_s:
            log.info("end of the queue: held back %.0fs and the faster workers took nothing; sending here",
                     now - self._since)
            self._given_up, self._since = True, None
            return False
        return True

    async def decide(self) -> bool:
        self._near = False
        if await self.conn.llen(self.queue_key):
            return False
        found = await fleet.statuses(self.conn)
        if len(found) < 2:
            return False
        statuses = [s for s in found.values() if s is not None]
        mine = [s for s in statuses if s.name == self.name]
        if not mine:
            return False
        me = mine[0]
        if me.token_s and me.mean_tokens:
            self._limit_s = max(HOLD_MIN_S, HOLD_REQUESTS * me.token_s * me.mean_tokens)
        me = msgspec.structs.replace(me, queued=self.dispatcher.unsent)  # its own count, live
        unsent, line = tail_line(me, [s for s in statuses if s.name != self.name])
        self._near = 0 < unsent <= NEAR * line  # nothing unsent, or no faster worker (line 0): not near
        return 0 < unsent <= line
