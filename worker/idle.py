"""An idle worker waits instead of polling: under one Redis command a second (0.60, 2026-12-06).

Idle (nothing held, running or borrowed for IDLE_AFTER_S, no open work in the ledger), it beats every
IDLE_BEAT_S, looks for prompts to steal every IDLE_LOOK_S and reconciles every IDLE_MAINTENANCE_S. A
WAKE message (genq:wake: an enqueue, a busy worker's unsent prompts, a control change) ends its waits.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING

import redis
import redis.asyncio as aioredis

from genq.core.ledger import fleet
from genq.core.redisconn import connect
from genq.core.waits import wait_event

if TYPE_CHECKING:
    from genq.worker.dispatch import Dispatcher
    from genq.worker.gate import Gate
    from genq.worker.held import Holdings

log = logging.getLogger("genq.worker")

IDLE_AFTER_S = 5.0  # nothing held, running or borrowed this long: the idle pace
IDLE_BEAT_S = 20.0  # an idle worker's heartbeat and control read
IDLE_TTL_S = 60  # its liveness and status keys live this long (3 beats)
IDLE_LOOK_S = 30.0  # its look for prompts to steal, when nothing woke it
IDLE_MAINTENANCE_S = 60.0  # its turn at RQ's and the ledger's cleanup
WORKERS_SET_EVERY_S = 60.0  # re-adding the worker to genq:workers (kept once added)
WOKEN_LOOK_S = 1.0  # an idle stealer woken looks at most this often
ANNOUNCE_EVERY_S = 2.0  # a busy engine holding unsent prompts says so (WAKE) this often


class IdlePace:
    """Whether the worker is idle, and the pace of its loops accordingly (heartbeat, stealer, maintenance)."""

    def __init__(self, held: Holdings, dispatcher: Dispatcher, queue_key: str = "",
                 queued: asyncio.Event | None = None) -> None:
        self.queue_key, self.held, self.dispatcher = queue_key, held, dispatcher  # queue_key: RQ's queue list
        self.busy_at = time.monotonic()
        self.last_beat = 0.0
        self.idle_keys = False  # the last beat wrote every key with IDLE_TTL_S (ttl() while idle)
        self.workers_set_at = -WORKERS_SET_EVERY_S
        self.woken = asyncio.Event()  # a WAKE message
        # A WAKE message that says batches were queued, or a shard written after failing (worker/intake.py).
        self.queued = queued or asyncio.Event()
        self.open_work = False  # some job has a batch not done (the reconciler's last pass): not idle
        self.announced_at = 0.0
        self.beat_now = asyncio.Event()  # the heartbeat beats at once (a woken stealer wants a fresh lease check)

    def idle(self) -> bool:
        d = self.dispatcher
        now = time.monotonic()
        if self.open_work or self.held.active() or d.running or d.unsent:
            self.busy_at = now
            return False
        return now - self.busy_at >= IDLE_AFTER_S

    async def tick(self, seconds: float) -> None:
        await wait_event(self.beat_now, seconds)

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

    def workers_set_due(self) -> bool:
        now = time.monotonic()
        if now - self.workers_set_at < WORKERS_SET_EVERY_S:
            return False
        self.workers_set_at = now
        return True

    def maintenance_every(self, busy_s: float) -> float:
        return IDLE_MAINTENANCE_S if self.idle() else busy_s

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
            if self.woken.is_set():
                # Woken too soon after the last look: sleep (waiting on the set event would spin).
                await asyncio.sleep(min(left, looked + WOKEN_LOOK_S - now))
            else:
                await wait_event(self.woken, min(left, 1.0))

    async def fresh_beat(self, controls: Gate, within: float = 3.0) -> None:
        """Asks the heartbeat for a beat now (its lease check included) and waits for it."""
        before = controls.last_beat
        self.beat_now.set()
        deadline = time.monotonic() + within
        while controls.last_beat == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def announce(self, conn: aioredis.Redis) -> None:
        """From a busy worker's heartbeat: WAKE every ANNOUNCE_EVERY_S while it holds unsent prompts and
        RQ's queue is empty (else idle workers take batches)."""
        now = time.monotonic()
        if self.dispatcher.unsent and now - self.announced_at >= ANNOUNCE_EVERY_S:
            self.announced_at = now
            if not await conn.llen(self.queue_key):
                await wake_fleet(conn)


class WakeListener:
    """Sets the pace's `queued`, `beat_now` (a control changed) or `woken` on each WAKE message, from a
    thread reading a second at a time: an asyncio read cancelled at exit once hung a --burst worker."""

    def __init__(self, redis_url: str, pace: IdlePace, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = connect(redis_url)  # a client of its own (Sentinel too): its pool makes connections lazily
        self._conn.connection_pool.connection_kwargs["health_check_interval"] = 0
        self.pace, self.loop = pace, loop
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="genq-wake", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._conn.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            pubsub = self._conn.pubsub(ignore_subscribe_messages=True)
            try:
                says = fleet.listen_for_wakes(pubsub)
                while not self._stop.is_set():
                    message = pubsub.get_message(timeout=1.0)
                    if message and message.get("type") == "message":
                        event = {"control": self.pace.beat_now, "queued": self.pace.queued,
                                 "work": self.pace.woken}[says(message.get("data"))]
                        self.loop.call_soon_threadsafe(event.set)
            except (redis.RedisError, OSError) as exc:
                log.debug("wake-up channel: %s", exc)
                self._stop.wait(1.0)
            except RuntimeError:  # the engine's loop is closed: it has exited
                return
            finally:
                pubsub.close()


async def wake_fleet(conn: aioredis.Redis) -> None:
    """Tell idle workers there may be prompts to take (one PUBLISH)."""
    try:
        await fleet.wake_for_work(conn)
    except (redis.RedisError, OSError) as exc:
        log.debug("wake-up not sent: %s", exc)
