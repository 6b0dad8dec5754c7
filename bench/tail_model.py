"""What any scheduler can gain at the end of a job on bench/fleet_tail.py's fleet: a model.

bench/fleet_tail.py measures genq's makespan against a FIFO shared queue (every free slot takes
the next prompt). This script replays the same fleet in a discrete-event model, step by step as
`genq sim` runs it (16 running slots; a decode step of step_ms_base + step_ms_per_req x running,
twice as long on the half-speed server; 16 tokens a step), on the exact output lengths the
simulator gives the bench's prompts (genq.sim.lengths over bench/common.write_prompts), and on
other prompt sets drawn the same way. No timing noise, no worker or network costs: only the order
in which slots take prompts.

Policies, each as makespan / FIFO's on the same prompts:
  hold back k   the half-speed server takes no new prompt once the unsent prompts are at most
                k x the fast servers' slots (worker/tail.py's rule, for every k): the best a
                scheduler that does not know output lengths can do here, since a prompt's
                length is known only once it has finished.
  longest first FIFO on the prompts sorted longest first (it needs every output length in
                advance, which no engine gives): the bound with perfect foresight.

    .venv/bin/python bench/tail_model.py                  # the `half` scenario, 30 prompt sets
    .venv/bin/python bench/tail_model.py --sets 100 --prompts 10000 --servers 8

Pure Python, no server, a few seconds. Results in docs/scheduling.md.
"""

from __future__ import annotations

import argparse
import heapq
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import read_messages, write_prompts

from genq.sim.lengths import output_length, prompt_key

SLOTS = 16
TOKENS_PER_STEP = 16
STEP_PER_REQ_S = 0.00005  # bench/fleet_tail.py's step_ms_per_req, 0.05 ms
Accept = Callable[[int, int], bool]  # (server, prompts unsent) -> may it take one now?


def bench_lengths(n: int, seed: int, mean: float, sigma: float, max_tokens: int) -> list[int]:
    """The simulator's output length of each prompt bench/common.write_prompts writes, in order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "p.jsonl"
        write_prompts(path, n, seed=seed)
        return [output_length(prompt_key(m), 0, mean, sigma, max_tokens) for m in read_messages(path)]


def makespan(lengths: list[int], speeds: list[float], accept: Accept, step_s: float) -> float:
    """Continuous batching per server: each step advances every running request by 16 tokens."""
    unsent = list(reversed(lengths))
    running: list[list[int]] = [[] for _ in speeds]
    steps: list[tuple[float, int]] = []  # (end of a server's current step, server)
    last_finish = 0.0

    def admit(s: int, now: float) -> None:
        while len(running[s]) < SLOTS and unsent and accept(s, len(unsent)):
            running[s].append(unsent.pop())
        if running[s] and all(server != s for _, server in steps):
            heapq.heappush(steps, (now + (step_s + STEP_PER_REQ_S * len(running[s])) * speeds[s], s))

    for s in range(len(speeds)):
        admit(s, 0.0)
    while steps:
        now, s = heapq.heappop(steps)
        left = [r - TOKENS_PER_STEP for r in running[s]]
        if len(left) != sum(r > 0 for r in left) or not left:
            last_finish = now
        running[s] = [r for r in left if r > 0]
        for server in [s, *(i for i in range(len(speeds)) if i != s and not running[i])]:
            admit(server, now)
    if unsent:
        raise RuntimeError("every server held back with prompts unsent")
    return last_finish


def hold_back(speeds: list[float], k: float) -> Accept:
    fastest = min(speeds)
    fast_slots = SLOTS * sum(1 for x in speeds if x == fastest)
    return lambda s, unsent: speeds[s] == fastest or unsent > k * fast_slots


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1600)
    p.add_argument("--servers", type=int, default=4, help="one of them at half speed")
    p.add_argument("--sets", type=int, default=30, help="prompt sets: write_prompts seeds 0 (the bench's) to N-1")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--mean-tokens", type=float, default=256)
    p.add_argument("--output-sigma", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--target", type=float, default=0.93)
    args = p.parse_args()
    speeds = [1.0] * (args.servers - 1) + [2.0]
    step_s = args.step_ms / 1000
    ks = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0)
    ratios: dict[str, list[float]] = {f"hold back k={k}": [] for k in ks}
    ratios["longest first"] = []
    for seed in range(args.sets):
        lengths = bench_lengths(args.prompts, seed, args.mean_tokens, args.output_sigma, args.max_tokens)
        fifo = makespan(lengths, speeds, lambda s, unsent: True, step_s)
        for k in ks:
            ratios[f"hold back k={k}"].append(makespan(lengths, speeds, hold_back(speeds, k), step_s) / fifo)
        ratios["longest first"].append(makespan(sorted(lengths, reverse=True), speeds, lambda s, u: True, step_s)
                                       / fifo)
        if seed == 0:
            print(f"the bench's prompts (seed 0): FIFO makespan {fifo:.2f} s")
    summary = {}
    for name, values in ratios.items():
        summary[name] = {"bench_prompts": round(values[0], 3), "mean": round(statistics.mean(values), 3),
                         "min": round(min(values), 3), "max": round(max(values), 3),
                         f"at_most_{args.target}": f"{sum(v <= args.target for v in values)}/{len(values)}"}
        print(f"{name:>16}: the bench's prompts {values[0]:.3f}; over {len(values)} sets mean "
              f"{statistics.mean(values):.3f}, min {min(values):.3f}, max {max(values):.3f}, "
              f"<= {args.target} in {sum(v <= args.target for v in values)}/{len(values)}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
