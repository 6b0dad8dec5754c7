"""Timelines of a fleet run for bench/fleet_tail.py --trace: where a scheduler loses to the ideal.

A thread reads every server's /metrics (running, waiting, finished: small, unlike /sim/stats)
every INTERVAL_S. From the samples, per run:

  sent_s        when the servers had received every prompt (the end of the queue: nothing unsent)
  last_in_s     per server, when it received its last prompt (the slow server's hold shows here)
  unsent_at_s   when the prompts not yet received fell to k x the fast servers' slots (k = 3, 1):
                worker/intake.py's hold with SPREAD = 3 is due at k = 3 on the half-speed fleet
  running       per server, the mean running count until sent_s, and after it
  waiting       per server, the mean waiting count until sent_s (a refill queue, if any)

Times are seconds from the first sample with anything received. Sampled means, not integrals:
the bench's own figures (busy_mean_running) remain the exact ones.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any

INTERVAL_S = 0.1
GAUGES = {"sglang:num_running_reqs": 0, "sglang:num_queue_reqs": 1, "sglang:num_requests_total": 2}
LINE = re.compile(r"^(sglang:[a-z_]+)\{[^}]*\} ([0-9.eE+-]+)$", re.M)


def read_metrics(url: str) -> tuple[int, int, int]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = [0, 0, 0]
    for name, value in LINE.findall(text):
        if name in GAUGES:
            out[GAUGES[name]] = int(float(value))
    return out[0], out[1], out[2]


@dataclass
class Trace:
    urls: list[str]
    samples: list[tuple[float, list[tuple[int, int, int]]]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Trace:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                row = [read_metrics(u) for u in self.urls]
            except OSError:
                row = None
            if row is not None:
                self.samples.append((time.time(), row))
            self._stop.wait(INTERVAL_S)


def summary(trace: Trace, prompts: int, slots: int, fast: list[int]) -> dict[str, Any]:
    """The figures in the module docstring; `fast` are the indexes of the full-speed servers."""
    base = [s[2] for s in trace.samples[0][1]] if trace.samples else []  # finished before this run: none after a reset
    rows = [(t, [(r, w, f - b) for (r, w, f), b in zip(row, base)]) for t, row in trace.samples]
    started = [t for t, row in rows if any(r + w + f for r, w, f in row)]
    if not started:
        return {}
    t0 = started[0]

    def received(row: list[tuple[int, int, int]]) -> int:
        return sum(r + w + f for r, w, f in row)

    sent = next((t for t, row in rows if received(row) >= prompts), rows[-1][0])
    last_in = []
    for i in range(len(trace.urls)):
        got = [(t, row[i][0] + row[i][1] + row[i][2]) for t, row in rows]
        final = got[-1][1]
        last_in.append(round(next(t for t, n in got if n >= final) - t0, 2))
    unsent_at = {}
    for k in (3, 1):
        limit = k * slots * len(fast)
        unsent_at[k] = round(next((t for t, row in rows if prompts - received(row) <= limit), sent) - t0, 2)

    def mean(values: list[int]) -> float:
        return round(sum(values) / len(values), 2) if values else float("nan")

    before = [row for t, row in rows if t0 <= t < sent]
    after = [row for t, row in rows if t >= sent and any(r + w for r, w, _ in row)]
    return {
        "sent_s": round(sent - t0, 2),
        "last_in_s": last_in,
        "unsent_at_s": unsent_at,
        "running_until_sent": [mean([row[i][0] for row in before]) for i in range(len(trace.urls))],
        "waiting_until_sent": [mean([row[i][1] for row in before]) for i in range(len(trace.urls))],
        "running_after_sent": [mean([row[i][0] for row in after]) for i in range(len(trace.urls))],
        "timeline": [[round(t - t0, 2), [list(x) for x in row]] for t, row in rows],
    }
