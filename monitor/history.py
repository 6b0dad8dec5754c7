"""Time series the monitor keeps of each job, for the web page: a ring buffer per job.

Monitor.refresh() hands every set of reports to History.record(); the page
asks for a job's series as columns (one list per field, aligned on `t`), the
form uPlot draws directly. Nothing is written anywhere: a restarted monitor
starts its plots afresh (Prometheus keeps the long history).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

from genq.monitor.progress import JobReport

JOB_FIELDS = ("completed", "failed", "percent", "percent_completed", "eta_s", "eta_low_s", "eta_high_s",
              "rate_per_sec", "output_tokens_per_sec", "in_flight")
WORKER_FIELDS = ("tok_per_s", "req_per_s", "slot_utilization")


class History:
    def __init__(self, maxlen: int = 3600) -> None:
        self.maxlen = maxlen
        self.points: dict[str, deque[dict[str, Any]]] = {}
        self.lock = threading.Lock()

    def record(self, reports: list[JobReport]) -> None:
        with self.lock:
            for r in reports:
                p = r.progress
                point: dict[str, Any] = {"t": p.updated_at}
                for name in JOB_FIELDS:
                    point[name] = getattr(p, name)
                point["workers"] = {
                    w.name: {f: getattr(w, f) for f in WORKER_FIELDS}
                    for w in p.worker_details if w.state not in ("lost", "gone", "stopped")
                }
                ring = self.points.setdefault(p.job, deque(maxlen=self.maxlen))
                if ring and ring[-1]["t"] >= point["t"]:
                    continue  # a second reader of the same refresh
                ring.append(point)

    def columns(self, job: str) -> dict[str, Any]:
        """{"t": [...], field: [...], "workers": {name: {field: [...]}}}, aligned on t (None where absent)."""
        with self.lock:
            pts = list(self.points.get(job, ()))
        out: dict[str, Any] = {"t": [p["t"] for p in pts]}
        for name in JOB_FIELDS:
            out[name] = [p[name] for p in pts]
        names = sorted({n for p in pts for n in p["workers"]})
        out["workers"] = {n: {f: [p["workers"].get(n, {}).get(f) for p in pts] for f in WORKER_FIELDS}
                          for n in names}
        return out
