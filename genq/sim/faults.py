"""Fault injection: which request fails how, and when the server is "crashed".

Decisions are deterministic for a given seed: the n-th request for a prompt key
always draws the same fault, whatever the arrival order of other prompts, while a
retry of the same prompt (n+1) draws afresh, so a retrying client can get through.
"""

from __future__ import annotations

import enum
import random
import time

import msgspec

from genq.sim.config import SimConfig


class Fault(enum.Enum):
    NONE = "none"
    ERROR = "error"  # answered 500
    RESET = "reset"  # connection dropped mid-generation
    HANG = "hang"  # output stops forever
    # Some output, then the engine's SSE error event and [DONE] on the HTTP 200 stream
    # (a whole answer: 500), as SGLang and vLLM report an internal error mid-stream.
    STREAM_ERROR = "stream_error"


_RATES = ("error_rate", "reset_rate", "hang_rate", "stream_error_rate")


class FaultUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of POST /sim/faults; fields left out keep their value."""

    error_rate: float | None = None
    reset_rate: float | None = None
    hang_rate: float | None = None
    stream_error_rate: float | None = None
    # Start an outage now lasting this many seconds (0 ends a running one).
    outage_for: float | None = None
    # True: stop listening as llama-server does on SIGTERM (its listening socket
    # closes, open requests hang, no answer, no close). One way: nothing undoes it.
    stop_listening: bool | None = None


class FaultInjector:
    def __init__(self, config: SimConfig) -> None:
        self.error_rate = config.error_rate
        self.reset_rate = config.reset_rate
        self.hang_rate = config.hang_rate
        self.stream_error_rate = config.stream_error_rate
        self._seed = config.seed
        self._attempts: dict[str, int] = {}
        self._outage_until = 0.0

    def draw(self, key: str) -> tuple[Fault, float]:
        """The fault for the next request of this prompt, and where in the output
        (fraction in [0, 1)) it strikes."""
        if not (self.error_rate or self.reset_rate or self.hang_rate or self.stream_error_rate):
            return Fault.NONE, 0.0
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
        rng = random.Random(f"{key}:{self._seed}:{attempt}")
        u, where = rng.random(), rng.random()
        if u < self.error_rate:
            return Fault.ERROR, where
        if u < self.error_rate + self.reset_rate:
            return Fault.RESET, where
        if u < self.error_rate + self.reset_rate + self.hang_rate:
            return Fault.HANG, where
        if u < self.error_rate + self.reset_rate + self.hang_rate + self.stream_error_rate:
            return Fault.STREAM_ERROR, where
        return Fault.NONE, where

    def apply(self, update: FaultUpdate) -> None:
        """Change the rate switches (all or none); the caller handles outage_for and
        stop_listening."""
        rates = {
            name: value
            for name in _RATES
            if (value := getattr(update, name)) is not None
        }
        for name, value in rates.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if update.outage_for is not None and update.outage_for < 0:
            raise ValueError(f"outage_for must be >= 0, got {update.outage_for}")
        for name, value in rates.items():
            setattr(self, name, value)

    def start_outage(self, duration: float) -> None:
        self._outage_until = time.monotonic() + duration

    def outage_remaining(self) -> float:
        return max(self._outage_until - time.monotonic(), 0.0)

    def in_outage(self) -> bool:
        return self._outage_until > time.monotonic()

    def snapshot(self) -> dict[str, float | bool]:
        remaining = self.outage_remaining()
        return {
            "error_rate": self.error_rate,
            "reset_rate": self.reset_rate,
            "hang_rate": self.hang_rate,
            "stream_error_rate": self.stream_error_rate,
            "outage": remaining > 0,
            "outage_remaining_s": remaining,
        }
