"""What any scheduler can gain at the end of a job on bench/fleet_tail.py's fleet: a model.

bench/fleet_tail.py measures genq's makespan against a FIFO shared queue (every free slot takes
the next prompt). This script replays the same fleet in a discrete-event model, step by step as
`genq sim` runs it (16 running slots; a decode step of step_ms_base + step_ms_per_req x running,
twice as long on the half-speed server; 16 tokens a step), on the exact output lengths the
simulator gives the bench's prompts (genq.sim.lengths over bench/common.write_prompts with the
bench's seed, fleet_tail.PROMPT_SEED), and on other prompt sets drawn the same way. No timing
noise, no worker or network costs: only the order in which slots take prompts.

The baseline is the bench's ideal as it runs: its client holds exactly 16 requests per server,
and the simulator admits at the start of a step, so a freed slot takes its next request one
step later (the reply goes out after the step, the next request arrives during the following
one): each request holds its slot one step longer. genq keeps a couple of requests waiting in
each server (worker/controller.py headroom), so its slots refill in the same step: the policies
below run without that gap. Each is makespan / the baseline's on the same prompts:

  FIFO          every free slot takes the next prompt, no refill gap.
  hold back k   the same, but the half-speed server takes no new prompt once the unsent prompts
                are at most k x the fast servers' slots (worker/intake.py's rule, for every k):
                the best a scheduler that does not know output lengths can do here, since a
                prompt's length is known only once it has finished.
  longest first FIFO on the prompts sorted longest first (it needs every output length in
                advance, which no engine gives): about the best with perfect foresight.
  bound         the fleet's whole work at full slots (no order does better).

genq takes whole batches in turn, not the file's order: "shuffled" replays the bench's prompts
in --shuffles random orders against the ideal in the file's order, as the bench compares them:
their spread is what the order alone can do to one run.

    .venv/bin/python bench/tail_model.py                  # the `half` scenario, 30 prompt sets
    .venv/bin/python bench/tail_model.py --sets 100 --prompts 10000 --servers 8

Pure Python, no server, a few seconds. Results in docs/scheduling.md.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

from common import read_messages, write_prompts
from fleet_tail import PROMPT_SEED

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


def bound(lengths: list[int], speeds: list[float], step_s: float) -> float:
    """No schedule ends sooner: the whole work at every slot busy, or the longest request alone."""
    steps = [math.ceil(n / TOKENS_PER_STEP) for n in lengths]
    full = step_s + STEP_PER_REQ_S * SLOTS
    return max(sum(steps) / sum(SLOTS / (full * x) for x in speeds), max(steps) * full * min(speeds))


def ideal_of(lengths: list[int], speeds: list[float], step_s: float) -> float:
    """The bench's ideal: FIFO in the file's order, each request a step longer (the refill gap)."""
    return makespan([n + TOKENS_PER_STEP for n in lengths], speeds, lambda s, unsent: True, step_s)


def policies(lengths: list[int], speeds: list[float], step_s: float, ks: tuple[float, ...],
             ideal: float) -> dict[str, float]:
    """Each policy's makespan over the bench's ideal, on these prompts in this order."""
    out = {"FIFO": makespan(lengths, speeds, lambda s, unsent: True, step_s) / ideal}
    for k in ks:
        out[f"hold back k={k}"] = makespan(lengths, speeds, hold_back(speeds, k), step_s) / ideal
    out["longest first"] = makespan(sorted(lengths, reverse=True), speeds, lambda s, u: True, step_s) / ideal
    out["bound"] = bound(lengths, speeds, step_s) / ideal
    return out


def report(title: str, runs: list[dict[str, float]], target: float) -> dict[str, dict[str, float | str]]:
    print(title)
    summary: dict[str, dict[str, float | str]] = {}
    for name in runs[0]:
        values = [r[name] for r in runs]
        met = f"{sum(v <= target for v in values)}/{len(values)}"
        summary[name] = {"mean": round(statistics.mean(values), 3), "min": round(min(values), 3),
                         "max": round(max(values), 3), f"at_most_{target}": met}
        print(f"  {name:>16}: mean {statistics.mean(values):.3f}, min {min(values):.3f}, max {max(values):.3f}, "
              f"<= {target} in {met}")
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=1600)
    p.add_argument("--servers", type=int, default=4, help="one of them at half speed")
    p.add_argument("--sets", type=int, default=30, help="prompt sets: write_prompts seeds, the bench's first")
    p.add_argument("--shuffles", type=int, default=30, help="random orders of the bench's prompts")
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--mean-tokens", type=float, default=256)
    p.add_argument("--output-sigma", type=float, default=0.5)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--target", type=float, default=0.93)
    args = p.parse_args()
    speeds = [1.0] * (args.servers - 1) + [2.0]
    step_s = args.step_ms / 1000
    ks = (1.0, 1.5, 2.0, 3.0, 4.0)
    seeds = [PROMPT_SEED, *(s for s in range(args.sets + 1) if s != PROMPT_SEED)][:args.sets]
    sets = []
    for seed in seeds:
        lengths = bench_lengths(args.prompts, seed, args.mean_tokens, args.output_sigma, args.max_tokens)
        sets.append(policies(lengths, speeds, step_s, ks, ideal_of(lengths, speeds, step_s)))
    mine = bench_lengths(args.prompts, PROMPT_SEED, args.mean_tokens, args.output_sigma, args.max_tokens)
    ideal = ideal_of(mine, speeds, step_s)  # the bench's ideal keeps the file's order
    rng = random.Random(0)
    shuffled = [policies(rng.sample(mine, len(mine)), speeds, step_s, ks, ideal) for _ in range(args.shuffles)]
    print(f"the bench's prompts (seed {PROMPT_SEED}), in the file's order, / the bench's ideal:")
    for name, value in sets[0].items():
        print(f"  {name:>16}: {value:.3f}")
    summary = {"bench_prompts": {k: round(v, 3) for k, v in sets[0].items()},
               "shuffled": report(f"the bench's prompts in {args.shuffles} random orders:", shuffled, args.target),
               "sets": report(f"{len(sets)} prompt sets (seeds {seeds[0]}, {seeds[1]}, ...), each in its order:", sets,
                              args.target)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
