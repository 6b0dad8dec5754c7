"""The ETA when a request's speed depends on how many decode at once.

On a CPU (vLLM's CPU build, llama.cpp) a server's step costs about the same per sequence, so
its tokens/s hardly depends on the batch and the last requests of a job run many times
faster than the first ones: a monitor that keeps a request's speed constant overestimates the
drain (real vLLM: +47/+72/+136 % at 25/50/75 % done). Here `genq sim` plays such a server
(step time 1 ms + 1.5 ms per running request), real workers run two jobs on it one after the
other, and the monitor's own estimator (the code behind `genq monitor --json`) is read at 25,
50 and 75 % of the second: its ETA must be within TOLERANCE of the true time left. The first
job's drain is what the workers measured and stored for the server (worker/controller.py): the
second job's ETA knows how this server drains before the second job does.

The prompts are ~30 tokens for answers of ~40, and the sim prefills a prompt in the step that
admits it (genq sim --prefill-cost, as vLLM on CPU does): while the server admits, its requests
decode about a third slower than in the drain, when nothing is left to admit (PREFILL_COST,
monitor/eta.py; the clean bins, monitor/rates.py).
"""

from __future__ import annotations

import time

from genq.core import keys
from genq.core.records import ServerDecode, unpack
from genq.monitor.progress import Monitor
from tests.audit import audit
from tests.conftest import run_genq, write_prompts

# A compute-bound server: a step costs 1 ms + 1.5 ms per running request, so one request alone
# runs 40 times faster than 48 together, while the server's tokens/s varies by a few %.
CPU_LIKE = dict(max_running_requests=48, step_ms_base=1, step_ms_per_req=1.5, tokens_per_step=1,
                mean_output_tokens=40, output_sigma=0.6)
PADDING = ": some context" * 9  # ~30 tokens a prompt at the sim's four characters a token
TOLERANCE = 0.15
AT = (0.25, 0.50, 0.75)


def run_job(redis_url, tmp_path, worker, url, job: str, n: int, rconn=None) -> list[tuple[float, float, float]]:
    """One job through a burst worker; with rconn, the monitor's (done fraction, ETA, time) at AT."""
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n, text=PADDING)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "24", "--max-tokens", "96",
             redis_url=redis_url)
    proc = worker(url, "--burst", name=f"w-{job}")
    points: list[tuple[float, float, float]] = []
    if rconn is not None:
        mon = Monitor(rconn, job, window_s=120.0)
        pending = list(AT)
        while proc.alive() and pending:
            (report,) = mon.refresh()
            p = report.progress
            done = (p.completed + p.failed) / n
            while pending and done >= pending[0]:
                points.append((pending.pop(0), p.eta_s, report.snapshot.at))
            time.sleep(0.25)
    assert proc.wait(timeout=180) == 0, proc.log()
    if rconn is None:
        return points
    found = audit(rconn, job, out, ids)
    end = max(r["finished_at"] for r in found.rows)
    return [(at, eta, end - t) for at, eta, t in points]


def test_the_eta_knows_the_drain_of_a_compute_bound_server(redis_url, rconn, sim, worker, tmp_path):
    url = sim(**CPU_LIKE)
    run_job(redis_url, tmp_path, worker, url, "first", 150)  # its drain is what the workers learn
    stored = rconn.get(keys.server_decode(url, "genq-sim/Sim-8B"))
    assert stored and len(unpack(stored, ServerDecode).bins) > 3, "the first worker left no figures of the server"
    points = run_job(redis_url, tmp_path, worker, url, "second", 480, rconn)
    assert [at for at, _, _ in points] == list(AT), points
    errors = [None if eta is None else eta / left - 1 for _, eta, left in points]
    shown = ", ".join(f"{at:.0%}: {eta if eta is None else round(eta, 1)} s for {left:.1f} s"
                      for at, eta, left in points)
    print(f"ETA on a compute-bound sim: {shown}")
    assert all(e is not None and abs(e) <= TOLERANCE for e in errors), f"ETA (want within {TOLERANCE:.0%}): {shown}"
