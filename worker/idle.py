"""An idle worker waits instead of polling: under one Redis command a second (0.60, 2026-12-06).

Idle (nothing held, running or borrowed for IDLE_AFTER_S, and no open work in the ledger), a
worker beats every IDLE_BEAT_S with keys that live IDLE_TTL_S, looks for prompts to steal every
IDLE_LOOK_S, and takes its turn at the reconciler every IDLE_MAINTENANCE_S. A WAKE message
(genq:wake) ends its waits: every enqueue publishes one (the intake takes a batch then), busy
engines holding unsent prompts at the end of the queue every ANNOUNCE_EVERY_S, an operator's
control change (the next beat then reads it). The first sign of work ends the idle pace.
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
    """Whether the engine is idle, and the pace of its loops accordingly (heartbeat, stealer, maintenance)."""

    def __init__(self, held: Holdings, dispatcher: Dispatcher, queue_key: str = "",
                 queued: asyncio.Event | None = None) -> None:
        self.queue_key = queue_key  # RQ's queue list: announce() speaks once it is empty
        self.held = held
        self.dispatcher = dispatcher
        self.busy_at = time.monotonic()
        self.last_beat = 0.0
        self.idle_keys = False  # the last beat wrote every key with IDLE_TTL_S (ttl() while idle)
        self.workers_set_at = -WORKERS_SET_EVERY_S
        self.woken = asyncio.Event()  # a WAKE message
        # A WAKE message that says batches were queued, or a shard written after failing (worker/intake.py).
        self.queued = queued or asyncio.Event()
        # Some job has a batch not done (the reconciler's last pass): no idle pace, so stranded
        # batches and a frozen holder's prompts are found within seconds.
        self.open_work = False
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
        """The heartbeat's wait between its looks: `seconds`, or less when a beat is asked for."""
        await wait_event(self.beat_now, seconds)

    def beat_due(self) -> bool:
        """Called every second by the heartbeat: beat now? (always, unless idle)."""
        now = time.monotonic()
        asked = self.beat_now.is_set()
        self.beat_now.clear()
        # Beats are spaced out only after one whose keys all outlive the gap: the last busy beat's
        # expire in LEASE_TIMEOUT_S, and waiting IDLE_BEAT_S from it left an engine going idle
        # shown lost for seconds.
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
        """The stealer's wait: `seconds`, or while idle until IDLE_LOOK_S after its last look (`looked`,
        monotonic); a WAKE message (also one that came during that look) ends it early, WOKEN_LOOK_S
        after the look at the soonest (None: now): then True. Checks once a second whether still idle."""
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
                # Woken too soon after the last look: sleep out the rest (waiting on the set event
                # would return without yielding, and spin).
                await asyncio.sleep(min(left, looked + WOKEN_LOOK_S - now))
            else:
                await wait_event(self.woken, min(left, 1.0))

    async def fresh_beat(self, controls: Gate, within: float = 3.0) -> None:
        """Asks the heartbeat for a beat now (its lease check included) and waits for it: an idle
        engine beats every IDLE_BEAT_S, and sends nothing on a lease check older than LEASE_CHECK_STALE_S."""
        before = controls.last_beat
        self.beat_now.set()
        deadline = time.monotonic() + within
        while controls.last_beat == before and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    async def announce(self, conn: aioredis.Redis) -> None:
        """From a busy engine's heartbeat: while it holds prompts not yet sent and the queue
        is empty (idle workers take those then), WAKE every ANNOUNCE_EVERY_S. While the queue
        has batches, idle workers take those: no need, and no fan-out to pay."""
        now = time.monotonic()
        if self.dispatcher.unsent and now - self.announced_at >= ANNOUNCE_EVERY_S:
            self.announced_at = now
            if not await conn.llen(self.queue_key):
                await wake_fleet(conn)


class WakeListener:
    """Sets the pace's `queued`, `beat_now` (an operator's control changed) or `woken` on each WAKE
    message, from a thread of its own reading at most a second at a time, so a stop never waits on a
    read. No health-check PINGs: a lost connection shows on the next read, and it subscribes again."""

    def __init__(self, redis_url: str, pace: IdlePace, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = connect(redis_url)  # a client of its own (Sentinel too): its pool makes connections lazily
        self._conn.connection_pool.connection_kwargs["health_check_interval"] = 0
        self.pace = pace
        self.loop = loop
        self.subscribed = threading.Event()
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
                self.subscribed.set()
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
                self.subscribed.clear()
                pubsub.close()


async def wake_fleet(conn: aioredis.Redis) -> None:
    """Tell idle workers there may be prompts to take (one PUBLISH; nobody listening is fine)."""
    try:
        await fleet.wake_for_work(conn)
    except (redis.RedisError, OSError) as exc:
        log.debug("wake-up not sent: %s", exc)
