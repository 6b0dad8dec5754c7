"""A worker's per-job figures once the job has ended: nothing of it is left "in flight".

Real Redis, a real `genq sim`, a real (long-running, not --burst) `genq worker`: the
worker stays alive after the job, as a fleet's workers do, and the monitor reads it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from genq.core import keys
from genq.core.records import InFlight, WorkerStatus, pack, unpack
from tests.conftest import run_genq, wait_until, write_prompts

N = 40
# All N requests run at once and end in the same step (no length spread): every heartbeat
# before the end sees N of them running, and the job ends with them.
# About 3 s a request: several one-second beats land while they run (at 0.6 s a request the
# whole job could fall between two beats once the worker got faster, #29).
EVEN_SIM = dict(max_running_requests=N, step_ms_base=20, step_ms_per_req=0, tokens_per_step=2,
                mean_output_tokens=300, output_sigma=0)


def test_job_in_flight_is_zero_once_the_job_is_done(tmp_path: Path, redis_url, rconn, sim, worker) -> None:
    url = sim(**EVEN_SIM)
    write_prompts(tmp_path / "p.jsonl", N)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "fig", "--output", str(tmp_path / "out"),
             "--batch-size", str(N), redis_url=redis_url)
    proc = worker(url, "--name", "fig-w", "--grace-period", "0")
    # The worker heartbeats with all N requests of the job running...
    wait_until(lambda: (raw := rconn.get(keys.worker_status("fig-w"))) and unpack(raw, WorkerStatus).in_flight == N,
               60, "N requests in flight")

    def done_and_idle() -> dict | None:
        doc = json.loads(run_genq("monitor", "--once", "--json", "--job", "fig", redis_url=redis_url).stdout)
        status = unpack(rconn.get(keys.worker_status("fig-w")), WorkerStatus)
        return doc if doc["status"] == "done" and status.in_flight == 0 and status.state == "idle" else None

    # ... then finishes it and says so in a later heartbeat (it stays up, idle).
    doc = wait_until(done_and_idle, 60, "the job done and the worker idle")
    assert proc.alive()
    (w,) = doc["worker_details"]
    assert w["job_completed"] == N
    assert doc["in_flight"] == 0
    assert w["job_in_flight"] == 0, f"the worker's figures still show {w['job_in_flight']} of the job in flight"
    # A heartbeat a moment older than the job's last result (its requests still listed running):
    # the full suite once read the monitor between the last result and the beat after it (40 of 40).
    stale = InFlight(worker="fig-w", job="fig", at=time.time(), tokens=[300] * N, queued=0)
    rconn.set(keys.job_inflight("fig", "fig-w"), pack(stale), ex=60)
    doc = json.loads(run_genq("monitor", "--once", "--json", "--job", "fig", redis_url=redis_url).stdout)
    (w,) = doc["worker_details"]
    assert doc["status"] == "done" and w["job_in_flight"] == 0, w
