"""How many sequences one worker keeps in flight: the server's capacity (told, or learned from its
/metrics) plus a headroom waiting in its queue, so a freed slot is refilled in its next step.

Each look at /metrics: raise while slots idle and prompts are held back; cut by a tenth when the server
retracts or preempts (then raise gently); lower when its queue keeps growing. An untold capacity (vLLM)
is learned (docs/engines.md, "Capacity"). --concurrency caps the target; `genq concurrency` live.
"""

from __future__ import annotations

import math

from genq.worker.engines import CAPACITY_START as UNKNOWN_CAPACITY_START
from genq.worker.engines import Metrics

MAX_TARGET = 100_000
KV_PRESSURE = 0.9  # token usage above which idle slots are the KV cache's doing, not ours
QUEUE_RUNAWAY_CHECKS = 3  # observations in a row with too long a queue before lowering
GENTLE_CHECKS = 30  # observations after a KV-pressure cut during which raises are small
# Looks with requests waiting and no higher running count before the highest is the capacity:
# while a server ramps up (vLLM admits by a token budget per step) the count still rises.
LEARN_LOOKS = 3
LOOK_S = 1.0  # between looks at /metrics
LEARN_LOOK_S = 0.25  # while the capacity is being learned: a step with no finish is soon seen
SETTLE_LOOKS = 40  # looks at LEARN_LOOK_S after the learned capacity rose (most counts are a bit below)


def headroom(capacity: int) -> int:
    """Requests waiting in the server's queue so a freed slot is refilled in the same step."""
    return max(2, math.ceil(capacity * 0.1))


class ConcurrencyController:
    def __init__(self, capacity: int | None, cap: int | None = None) -> None:
        self.capacity = capacity  # from the server (None: unknown)
        self.learned: int | None = None  # capacity read off /metrics when the server does not tell
        self.start_cap = cap if cap and cap > 0 else None  # --concurrency N
        self.live_cap: int | None = None  # genq concurrency N (None: none set)
        self.auto = capacity + headroom(capacity) if capacity else UNKNOWN_CAPACITY_START  # before any cap
        self._last_retractions: float | None = None
        self._last_waiting = self._last_running = 0.0
        self._queue_high = self._gentle = self._backlog = 0  # _backlog: prompts held back at the last look
        # The highest running count seen while requests waited for a slot; looks since it rose; looks
        # since the learned capacity rose.
        self._seen_max = self._since_rise = self._since_learned = 0
        self.reason = "from server capacity" if capacity else "capacity unknown: starting value"
        self.target = 1
        self._update()

    @property
    def cap(self) -> int | None:
        return self.live_cap or self.start_cap

    @property
    def slots(self) -> int | None:
        """The server's capacity: as it tells (SGLang, llama.cpp), else as learned (vLLM)."""
        return self.capacity or self.learned

    def set_cap(self, cap: int | None) -> None:
        """A live limit from `genq concurrency`; None or 0 removes it (back to --concurrency, or auto)."""
        self.live_cap = cap if cap and cap > 0 else None
        self._update()

    @property
    def look_interval_s(self) -> float:
        """Until the next look: shorter while an untold capacity is learned (while prompts are held back)
        and SETTLE_LOOKS after it rose (a step in which nothing finished shows the exact count)."""
        if self.capacity is not None:
            return LOOK_S
        learning = self._backlog > 0 if self.learned is None else self._since_learned < SETTLE_LOOKS
        return LEARN_LOOK_S if learning else LOOK_S

    def set_capacity(self, capacity: int | None) -> None:
        """What the server tells after (re)discovery; one that tells nothing is learned again."""
        if capacity is None and self.learned is not None:
            self.learned = None
            self._seen_max = self._since_rise = 0
            self.reason = "server rediscovered: learning its capacity again"
        elif capacity and capacity != self.capacity:
            self.capacity = capacity
            self._set(capacity + headroom(capacity), "from server capacity")

    def _set(self, auto: int, reason: str) -> None:
        self.auto, self.reason, self._queue_high = auto, reason, 0
        self._update()

    def _update(self) -> None:
        # A plain attribute, not a property: the dispatcher reads it per request.
        self.auto = max(1, min(self.auto, MAX_TARGET))
        self.target = max(1, min(self.auto, self.cap or MAX_TARGET))

    def observe(self, m: Metrics, in_flight: int, backlog: int) -> None:
        """One look at the server's metrics; in_flight is ours, backlog the prompts we hold unsent."""
        if m.running is None:
            return
        running, waiting, self._backlog = m.running, m.waiting or 0.0, backlog
        self._since_learned += 1
        # Waiting for a slot (vLLM tells it apart from requests deferred for other reasons).
        queued = waiting if m.waiting_capacity is None else m.waiting_capacity
        growing, self._last_waiting = waiting > self._last_waiting, waiting
        ramping, self._last_running = running > self._last_running, running  # admitting, not full
        retracting = self._retracting(m)
        kv_pressure = m.kv_usage is not None and m.kv_usage >= KV_PRESSURE
        if self.capacity is None and not kv_pressure and not retracting:
            if queued > 0:  # requests wait with memory free: a slot limit, the most that runs
                if int(running) > self._seen_max:
                    self._seen_max, self._since_rise = int(running), 0
                self._since_rise += 1
                if self._since_rise >= LEARN_LOOKS and self._seen_max > (self.learned or 0):
                    self._commit(self._seen_max)
            elif self.learned is not None and running > self.learned:  # whatever runs fits
                self._seen_max = int(running)
                self._commit(self._seen_max)
        capacity = self.capacity or self.learned
        self._gentle = max(0, self._gentle - 1)
        if retracting:  # the KV cache cannot hold what runs: cut to what the server holds, less a tenth
            self._gentle = GENTLE_CHECKS
            self._set(max(1, min(self.auto, int(running + waiting)) - max(1, self.auto // 10)),
                      "lowered: KV cache full (server retracting requests)")
            return

        limited = backlog > 0 and in_flight >= self.target and (self.cap is None or self.auto < self.cap)
        if waiting == 0 and limited and not kv_pressure and (capacity is None or running < capacity):
            # Slots idle while we hold prompts back: feed the server more.
            if self._gentle:
                step = max(1, self.auto // 20)
            elif capacity:
                step = max(1, int(capacity - running))
            elif running + waiting >= 0.9 * self.target:
                step = max(1, self.auto // 2)  # unknown capacity: grow fast to find it
            else:  # what was sent has not all reached the server yet: look again before sending more
                return
            ceiling = 2 * capacity + headroom(capacity) if capacity else MAX_TARGET
            if self.auto < ceiling:
                self._set(min(ceiling, self.auto + step), "raised: server slots idle")
            self._queue_high = 0
            return

        base = capacity or int(running)
        room = headroom(max(base, 1))
        # Ours (once the capacity is known: before, what runs is no base for it) and a headroom more.
        queue_limit = (max(self.auto - base, room) if capacity else room) + room
        settling = capacity is None and ramping  # what runs is no capacity yet
        if (waiting > queue_limit and (growing or self._queue_high) and not settling
                and self.auto > base + room):
            self._queue_high += 1
            if self._queue_high >= QUEUE_RUNAWAY_CHECKS:  # past what refilling slots needs: hold less
                self._set(max(1, base + room), "lowered: server queue growing")
        else:
            self._queue_high = 0

    def _commit(self, capacity: int) -> None:
        # The refill headroom waits in the server: more would only wait, less would idle a freed slot.
        self.learned, self._since_learned, limit = capacity, 0, capacity + headroom(capacity)
        verb = "lowered" if self.auto > limit else "raised" if self.auto < limit else "kept"
        self._set(limit, f"{verb}: learned server capacity {capacity}")

    def _retracting(self, m: Metrics) -> bool:
        """Whether the server retracted (SGLang) or preempted (vLLM) requests since last time."""
        if m.retractions_total is None:
            return m.retracted is not None and m.retracted > 0
        last, self._last_retractions = self._last_retractions, m.retractions_total
        return last is not None and m.retractions_total > last
