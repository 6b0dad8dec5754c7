"""How many requests one worker keeps in flight against its server.

Start from the server's own capacity (SGLang's max running requests) plus a small
waiting queue, so every slot is busy from the first second and a freed slot is
refilled in the server's next step. Then follow the server's /metrics, once a
second:

- raise when slots sit idle (running below capacity, nothing waiting) while the
  worker holds prompts back;
- lower when the KV cache is what limits (the server retracts or preempts
  running requests), multiplicatively, and raise only gently for a while after;
- lower when the server's waiting queue keeps growing past what refilling needs.

A server without a capacity endpoint (vLLM, or one genq does not recognise)
starts at a guess and grows while its slots sit idle. Once requests wait in its
queue while the running count holds still (PLATEAU_CHECKS looks in a row, KV cache
not full), that running count is its capacity ("learned"), and the target drops
at once to it plus the small refill headroom: no more than that waits in the
server. `slots` is the one notion of server capacity (told or learned) that the
worker publishes (WorkerStatus.server_capacity) and the monitor shows.
A number from the command line caps the target; `genq concurrency` sets a live
cap (Control.concurrency) that replaces it until set back to auto.
"""

from __future__ import annotations

import math

from genq.worker.server import Metrics

UNKNOWN_CAPACITY_START = 64  # vLLM has no capacity endpoint: start here, then follow /metrics
MAX_TARGET = 100_000
KV_PRESSURE = 0.9  # token usage above which idle slots are the KV cache's doing, not ours
QUEUE_RUNAWAY_CHECKS = 3  # observations in a row with too long a queue before lowering
GENTLE_CHECKS = 30  # observations after a KV-pressure cut during which raises are small
# Looks in a row with requests waiting and the same running count before that count
# is taken as the capacity: while a server ramps up (vLLM admits by a token budget
# per step) requests wait although slots are free, but the running count still moves.
PLATEAU_CHECKS = 3


def headroom(capacity: int) -> int:
    """Requests waiting in the server's queue so a freed slot is refilled in the same step."""
    return max(2, math.ceil(capacity * 0.1))


class ConcurrencyController:
    def __init__(self, capacity: int | None, cap: int | None = None) -> None:
        self.capacity = capacity  # from the server (None: unknown)
        self.learned: int | None = None  # capacity read off /metrics when the server does not tell
        self.start_cap = cap if cap and cap > 0 else None  # --concurrency N
        self.live_cap: int | None = None  # genq concurrency N (None: none set)
        self._auto = capacity + headroom(capacity) if capacity else UNKNOWN_CAPACITY_START
        self._last_retractions: float | None = None
        self._queue_high = 0
        self._last_waiting = 0.0
        self._last_running = 0.0
        self._gentle = 0
        self._plateau_value = -1.0
        self._plateau_count = 0
        self.reason = "from server capacity" if capacity else "capacity unknown: starting value"
        self.target = 1
        self._update()

    # ---------------------------------------------------------------- settings

    @property
    def cap(self) -> int | None:
        """The cap in force: the live one, else the command line's."""
        return self.live_cap or self.start_cap

    @property
    def slots(self) -> int | None:
        """The server's capacity: as it tells (SGLang, llama.cpp), else as learned (vLLM)."""
        return self.capacity or self.learned

    @property
    def auto(self) -> int:
        """The automatic target, before any cap."""
        return self._auto

    def set_cap(self, cap: int | None) -> None:
        """A live limit from `genq concurrency`; None or 0 removes it (back to auto,
        or to the --concurrency the worker was started with)."""
        self.live_cap = cap if cap and cap > 0 else None
        self._update()

    def set_capacity(self, capacity: int | None) -> None:
        if capacity and capacity != self.capacity:
            self.capacity = capacity
            self._auto = capacity + headroom(capacity)
            self.reason = "from server capacity"
            self._update()

    def _update(self) -> None:
        # A plain attribute, not a property: the dispatcher reads it per request.
        self._auto = max(1, min(self._auto, MAX_TARGET))
        self.target = max(1, min(self._auto, self.cap or MAX_TARGET))

    # ---------------------------------------------------------------- metrics

    def observe(self, m: Metrics, in_flight: int, backlog: int) -> None:
        """One look at the server's metrics; in_flight is ours, backlog the prompts we hold unsent."""
        if m.running is None:
            return
        running = m.running
        waiting = m.waiting or 0.0
        growing = waiting > self._last_waiting
        self._last_waiting = waiting
        # Running still rising: the server is admitting (ramping up), not full.
        ramping = running > self._last_running
        self._last_running = running
        retracting = self._retracting(m)
        kv_pressure = m.kv_usage is not None and m.kv_usage >= KV_PRESSURE
        if self.capacity is None and waiting > 0 and not kv_pressure and not retracting:
            # Requests wait although memory is free: a slot limit. What runs, once it
            # holds still, is the capacity.
            self._learn(int(running))
        else:
            self._plateau_count = 0
        capacity = self.capacity or self.learned
        if self._gentle:
            self._gentle -= 1

        if retracting:
            # The KV cache cannot hold what runs: more requests in flight only means
            # more retracted work. Cut to what the server holds, less a tenth.
            self._auto = max(1, min(self._auto, int(running + waiting)) - max(1, self._auto // 10))
            self.reason = "lowered: KV cache full (server retracting requests)"
            self._gentle = GENTLE_CHECKS
            self._queue_high = 0
            self._update()
            return

        limited = backlog > 0 and in_flight >= self.target and (self.cap is None or self._auto < self.cap)
        if waiting == 0 and limited and not kv_pressure and (capacity is None or running < capacity):
            # Slots idle while we hold prompts back: feed the server more.
            if self._gentle:
                step = max(1, self._auto // 20)
            elif capacity:
                step = max(1, int(capacity - running))
            else:
                step = max(1, self._auto // 2)  # unknown capacity: grow fast to find it
            ceiling = 2 * capacity + headroom(capacity) if capacity else MAX_TARGET
            if self._auto < ceiling:
                self._auto = min(ceiling, self._auto + step)
                self.reason = "raised: server slots idle"
                self._update()
            self._queue_high = 0
            return

        base = capacity or int(running)
        queue_limit = 2 * headroom(max(base, 1))
        settling = capacity is None and ramping  # what runs is no capacity yet
        if (waiting > queue_limit and (growing or self._queue_high) and not settling
                and self._auto > base + headroom(max(base, 1))):
            self._queue_high += 1
            if self._queue_high >= QUEUE_RUNAWAY_CHECKS:
                # The queue grows past what refilling slots needs: hold less.
                self._auto = max(1, base + headroom(max(base, 1)))
                self.reason = "lowered: server queue growing"
                self._queue_high = 0
                self._update()
        else:
            self._queue_high = 0

    def _learn(self, running: int) -> None:
        if running != self._plateau_value:
            self._plateau_value, self._plateau_count = running, 0
        self._plateau_count += 1
        if running <= 0 or self._plateau_count < PLATEAU_CHECKS:
            return
        if self.learned is None or running > self.learned:
            self.learned = running
            limit = running + headroom(running)
            if self._auto > limit:
                # Known now: more than the refill headroom would only wait in the server.
                self._auto = limit
                self.reason = f"lowered: learned server capacity {running}"
            else:
                self.reason = f"learned server capacity {running}"
            self._queue_high = 0
            self._update()

    def _retracting(self, m: Metrics) -> bool:
        """Whether the server retracted (SGLang) or preempted (vLLM) requests since last time."""
        more = False
        if m.retractions_total is not None:
            last = self._last_retractions
            self._last_retractions = m.retractions_total
            more = last is not None and m.retractions_total > last
        elif m.retracted is not None:
            more = m.retracted > 0
        return more
