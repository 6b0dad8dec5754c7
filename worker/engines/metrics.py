"""The figures the concurrency controller reads off a server's /metrics page (Prometheus text).

Each engine names its metrics (worker/engines/*.py); a page is read for every engine's names, in
ENGINES' order, the first found winning: a page has one engine's names, and a server genq does not
recognise may still publish a known engine's (its capacity is then learned like vLLM's).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from genq.worker.engines import ENGINES

RUNNING = tuple(n for e in ENGINES for n in e.running)
WAITING = tuple(n for e in ENGINES for n in e.waiting)
WAITING_FOR_SLOT = tuple(e.waiting_for_slot for e in ENGINES if e.waiting_for_slot)
KV_USAGE = tuple(n for e in ENGINES for n in e.kv_usage)
RETRACTED = tuple(n for e in ENGINES for n in e.retracted)
RETRACTIONS_TOTAL = tuple(n for e in ENGINES for n in e.retractions_total)
GENERATED_TOTAL = tuple(n for e in ENGINES for n in e.generated_total)


@dataclass
class Metrics:
    running: float | None = None
    waiting: float | None = None
    waiting_capacity: float | None = None  # of those waiting, how many wait for a slot (vLLM)
    kv_usage: float | None = None
    retracted: float | None = None  # gauge: requests retracted lately
    retractions_total: float | None = None  # counter: requests retracted/preempted since start
    generated_total: float | None = None  # counter: output tokens the server made since it started
    at: float = 0.0  # when the page was read (time.monotonic())


def metrics_from_text(text: str) -> Metrics:
    """The figures the concurrency controller reads, from a Prometheus text page."""
    sums = parse_metrics(text, RUNNING + WAITING + RETRACTED + RETRACTIONS_TOTAL + GENERATED_TOTAL)
    # Usage is a fraction per rank: the fullest rank is the one that retracts.
    kv = _first(parse_metrics(text, KV_USAGE, combine=max), KV_USAGE)
    return Metrics(
        running=_first(sums, RUNNING),
        waiting=_first(sums, WAITING),
        waiting_capacity=_first(parse_metrics(text, WAITING_FOR_SLOT, label='reason="capacity"'), WAITING_FOR_SLOT),
        kv_usage=kv,
        retracted=_first(sums, RETRACTED),
        retractions_total=_first(sums, RETRACTIONS_TOTAL),
        generated_total=_first(sums, GENERATED_TOTAL),
    )


def _first(sums: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in sums:
            return sums[name]
    return None


def parse_metrics(text: str, wanted: tuple[str, ...], combine: Callable[[float, float], float] | None = None,
                  label: str | None = None) -> dict[str, float]:
    """Each wanted Prometheus sample over its labels (one series per DP/TP rank):
    summed, or combined by `combine` (e.g. max); with `label` (`key="value"`), only
    the series that carry it."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line[0] == "#" or (label is not None and label not in line):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in wanted:
            try:
                # `name{labels} value [timestamp]` or `name value [timestamp]`
                rest = line.rsplit("}", 1)[1] if "{" in line else line[len(name):]
                value = float(rest.split()[0])
            except (IndexError, ValueError):
                continue
            if name not in out:
                out[name] = value
            else:
                out[name] = combine(out[name], value) if combine else out[name] + value
    return out
