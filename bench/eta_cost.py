"""CPU of the monitor's ETA a refresh at a million prompts (issue #29).

No Redis: the estimator is pure, and this times it on the states a live
monitor sees (synthetic, from a lognormal job: mean 512 tokens, sigma 1.2,
max_tokens 8192), early (2,000 done), mid-job and near the end, for a fleet of
8 and of 64 workers with 37 slots each. For each state:

- one-shot: estimate() with no pool, all the work at once (what `genq monitor
  --once` does, and what every live refresh did before the EtaPool);
- pooled: the live monitor's way (monitor/etapool.py), refreshed twice a
  second for --refreshes refreshes while the job moves on (each running
  request gains 15 tokens a refresh, the finished count grows); CPU a refresh
  (median, 95th percentile, max), refreshes until the first ETA, and at the end
  the pooled ETA next to the one-shot ETA of the same final state.

    .venv/bin/python bench/eta_cost.py                 # ~1 minute on 2 loaded cores
    .venv/bin/python bench/eta_cost.py --refreshes 400
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import conditions, table  # noqa: E402

from genq.monitor.eta import Estimate, LengthData, Speed, WorkerState, estimate, length_bucket  # noqa: E402
from genq.monitor.etapool import EtaPool  # noqa: E402

MEAN, SIGMA, CAP = 512.0, 1.2, 8192
MU = math.log(MEAN) - SIGMA**2 / 2
TOTAL = 1_000_000
SPEED = Speed(per_request=30.0, rel_se=0.05, span_s=100.0, samples=100)
STATES = (("early", 2_000, 8), ("early", 2_000, 64), ("mid", 500_000, 64), ("end", 995_000, 8))


def state(done: int, workers: int, batch: int, step: int, seed: int = 1) -> dict:
    """Estimate inputs `step` refreshes (0.5 s each) into the state."""
    rng = random.Random(seed)
    sample = [max(1, min(CAP, round(rng.lognormvariate(MU, SIGMA)))) for _ in range(20_000)]
    done += step * workers // 4  # a prompt per worker every 2 s
    scale = done / len(sample)
    hist = {k: max(1, round(v * scale)) for k, v in Counter(length_bucket(v) for v in sample).items()}
    fleet = [WorkerState(slots=37, leases=2, max_leases=16, reserve=batch,
                         running=tuple(rng.randint(0, 3000) + 15 * step for _ in range(37)), ready=batch,
                         held=3, held_unfinished=(batch // 4, batch // 2, batch)) for _ in range(workers)]
    return dict(total=TOTAL, completed=done, failed=0, lengths=LengthData(hist=hist, running=[], cap=CAP),
                fleet=fleet, batch_size=batch, speed=SPEED)


def timed(inputs: dict, **pooled) -> tuple[float, Estimate]:
    """CPU ms of one estimate, and the estimate."""
    t = time.process_time()
    est = estimate(**inputs, **pooled)
    return (time.process_time() - t) * 1000, est


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refreshes", type=int, default=240, help="Pooled refreshes per state [%(default)s].")
    p.add_argument("--batch-size", type=int, default=64)
    a = p.parse_args(argv)
    print(conditions())
    rows = []
    for name, done, workers in STATES:
        one_ms, _ = timed(state(done, workers, a.batch_size, 0))
        pool, costs, first = EtaPool(), [], None
        for step in range(a.refreshes):
            ms, est = timed(state(done, workers, a.batch_size, step), pool=pool, now=step * 0.5)
            costs.append(ms)
            if first is None and est.eta_s is not None:
                first = step + 1
        final = estimate(**state(done, workers, a.batch_size, a.refreshes - 1))
        costs.sort()
        rows.append([f"{name} {done:,} done, {workers} workers", f"{one_ms:.0f}",
                     f"{statistics.median(costs):.1f}", f"{costs[int(0.95 * (len(costs) - 1))]:.1f}",
                     f"{costs[-1]:.1f}", str(first), _eta(est), _eta(final)])
    print(table(["state (1,000,000 prompts)", "one-shot ms", "pooled median ms", "p95", "max",
                 "refreshes to 1st ETA", "pooled ETA at end", "one-shot ETA at end"], rows))
    return 0


def _eta(e: Estimate) -> str:
    if e.eta_s is None:
        return e.note
    return f"{e.eta_s:,.0f} s [{e.eta_low_s:,.0f}, {e.eta_high_s:,.0f}]"


if __name__ == "__main__":
    sys.exit(main())
