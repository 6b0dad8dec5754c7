"""CPU of the monitor's ETA a refresh at a million prompts.

No Redis: the estimator is pure, and this times it on the states a live monitor sees
(synthetic, from a lognormal job: mean 512 tokens, sigma 1.2, max_tokens 8192), early
(2,000 done), mid-job and near the end, for a fleet of 8 and of 64 workers with 37 slots each:
the median, 95th percentile and max CPU of --refreshes estimates, each a refresh later (every
running request 15 tokens further, the finished count grown).

    .venv/bin/python bench/eta_cost.py                 # a few seconds
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

from genq.monitor.eta import Estimate, LengthData, Speed, estimate, length_bucket  # noqa: E402

MEAN, SIGMA, CAP = 512.0, 1.2, 8192
MU = math.log(MEAN) - SIGMA**2 / 2
TOTAL = 1_000_000
STATES = (("early", 2_000, 8), ("early", 2_000, 64), ("mid", 500_000, 64), ("end", 995_000, 8))


def state(done: int, workers: int, step: int, seed: int = 1) -> dict:
    """Estimate inputs `step` refreshes (0.5 s each) into the state."""
    rng = random.Random(seed)
    sample = [max(1, min(CAP, round(rng.lognormvariate(MU, SIGMA)))) for _ in range(20_000)]
    done += step * workers // 4  # a prompt per worker every 2 s
    scale = done / len(sample)
    hist = {k: max(1, round(v * scale)) for k, v in Counter(length_bucket(v) for v in sample).items()}
    running = [rng.randint(0, 3000) + 15 * step for _ in range(37 * workers)]
    speed = Speed(per_request=30.0, rel_se=0.05, span_s=100.0, samples=100, running=37.0 * workers)
    return dict(total=TOTAL, completed=done, failed=0, lengths=LengthData(hist=hist, running=running, cap=CAP),
                speed=speed, workers=workers, unsent=64 * workers)


def timed(inputs: dict) -> tuple[float, Estimate]:
    """CPU ms of one estimate, and the estimate."""
    t = time.process_time()
    est = estimate(**inputs)
    return (time.process_time() - t) * 1000, est


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refreshes", type=int, default=40, help="Refreshes per state [%(default)s].")
    a = p.parse_args(argv)
    print(conditions())
    rows = []
    for name, done, workers in STATES:
        costs, est = [], None
        for step in range(a.refreshes):
            ms, est = timed(state(done, workers, step))
            costs.append(ms)
        costs.sort()
        rows.append([f"{name} {done:,} done, {workers} workers", f"{statistics.median(costs):.1f}",
                     f"{costs[int(0.95 * (len(costs) - 1))]:.1f}", f"{costs[-1]:.1f}", _eta(est)])
    print(table(["state (1,000,000 prompts)", "median ms", "p95", "max", "ETA at the end"], rows))
    return 0


def _eta(e: Estimate | None) -> str:
    if e is None or e.eta_s is None:
        return "-" if e is None else e.note
    return f"{e.eta_s:,.0f} s [{e.eta_low_s:,.0f}, {e.eta_high_s:,.0f}]"


if __name__ == "__main__":
    sys.exit(main())
