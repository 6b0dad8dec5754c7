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


# Each rate switch and its fault, in the order a draw tries them.
_RATES = {"error_rate": Fault.ERROR, "reset_rate": Fault.RESET, "hang_rate": Fault.HANG,
          "stream_error_rate": Fault.STREAM_ERROR}


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
        self.rates = {name: float(getattr(config, name)) for name in _RATES}
        self._seed = config.seed
        self._attempts: dict[str, int] = {}
        self._outage_until = 0.0

    def draw(self, key: str) -> tuple[Fault, float]:
        """The fault for the next request of this prompt, and where in the output
        (fraction in [0, 1)) it strikes."""
        if not any(self.rates.values()):
            return Fault.NONE, 0.0
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
        rng = random.Random(f"{key}:{self._seed}:{attempt}")
        u, where = rng.random(), rng.random()
        bound = 0.0
        for name, fault in _RATES.items():
            bound += self.rates[name]
            if u < bound:
                return fault, where
        return Fault.NONE, where

    def apply(self, update: FaultUpdate) -> None:
        """Change the rate switches (all or none); the caller handles outage_for and stop_listening."""
        rates = {name: value for name in _RATES if (value := getattr(update, name)) is not None}
        for name, value in rates.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if update.outage_for is not None and update.outage_for < 0:
            raise ValueError(f"outage_for must be >= 0, got {update.outage_for}")
        self.rates.update(rates)

    def start_outage(self, duration: float) -> None:
        self._outage_until = time.monotonic() + duration

    def in_outage(self) -> bool:
        return self._outage_until > time.monotonic()

    def snapshot(self) -> dict[str, float | bool]:
        remaining = max(self._outage_until - time.monotonic(), 0.0)
        return {**self.rates, "outage": remaining > 0, "outage_remaining_s": remaining}
