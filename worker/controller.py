"""How many requests one worker keeps in flight against its server.

Start from the server's own capacity (max running requests) plus a small
waiting queue, so slots are full from the first second; then follow the
server's /metrics: raise when slots sit idle while we hold work back, lower
when the KV cache is full (retractions) or the waiting queue runs away.
"""

from __future__ import annotations

import math

from worker.server import Metrics

UNKNOWN_CAPACITY_START = 64  # vLLM has no capacity endpoint: start here, then follow /metrics
MAX_TARGET = 100_000


def headroom(capacity: int) -> int:
    """Requests waiting in the server's queue so a freed slot is refilled in the same step."""
    return max(2, math.ceil(capacity * 0.1))


class ConcurrencyController:
    def __init__(self, capacity: int | None, cap: int | None = None) -> None:
        self.capacity = capacity
        self.cap = cap
        self._auto = capacity + headroom(capacity) if capacity else UNKNOWN_CAPACITY_START
        self._last_retracted: float | None = None
        self._queue_high_streak = 0
        self.reason = "from server capacity" if capacity else "capacity unknown: starting value"

    @property
    def target(self) -> int:
        return max(1, min(self._auto, self.cap or MAX_TARGET))

    def set_cap(self, cap: int | None) -> None:
        """A live limit from the command line; None goes back to automatic."""
        self.cap = cap if cap and cap > 0 else None

    def set_capacity(self, capacity: int | None) -> None:
        if capacity and capacity != self.capacity:
            self.capacity = capacity
            self._auto = capacity + headroom(capacity)
            self.reason = "from server capacity"

    def observe(self, m: Metrics, in_flight: int, backlog: int) -> None:
        """One look at the server's metrics; in_flight is ours, backlog the prompts we hold unsent."""
        if m.running is None:
            return
        waiting = m.waiting or 0.0
        retracted_more = (
            m.retracted is not None and self._last_retracted is not None and m.retracted > self._last_retracted
        )
        if m.retracted is not None:
            self._last_retracted = m.retracted
        limited = backlog > 0 and in_flight >= self.target
        capacity = self.capacity
        if retracted_more or (m.kv_usage is not None and m.kv_usage >= 0.99 and waiting > 0):
            # The KV cache cannot hold what is running: more requests only add retractions.
            self._auto = max(1, min(self._auto, int(m.running + waiting)) - max(1, self._auto // 10))
            self.reason = "lowered: KV cache full"
            return
        if waiting == 0 and limited and (capacity is None or m.running < capacity):
            # Slots idle while we hold work back: feed the server more.
            step = (capacity - int(m.running)) if capacity else max(1, self._auto // 4)
            self._auto = min(MAX_TARGET, self._auto + max(1, step))
            self.reason = "raised: server slots idle"
            return
        ceiling = (capacity or m.running) + 4 * headroom(int(capacity or max(m.running, 1)))
        if waiting > 4 * headroom(int(capacity or max(m.running, 1))) and self._auto > ceiling:
            self._queue_high_streak += 1
            if self._queue_high_streak >= 3:
                self._auto = max(1, int(ceiling))
                self.reason = "lowered: server queue growing"
                self._queue_high_streak = 0
        else:
            self._queue_high_streak = 0
