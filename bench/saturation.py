"""Saturation benchmark: does genq keep a server's running slots full?

Runs the same prompts, one after another, against a fresh `genq sim` each time
(37 running slots, heavy-tailed output lengths, step time dominated by a fixed
cost as in memory-bound decode, so an idle slot is throughput lost):

  limit     every request submitted at once: the server's waiting queue never
            runs dry, so this is the physical limit of that server
  baseline  bench/baseline.py, the script people run today (semaphore of 32,
            staggered task creation, one batch after another with gather)
  genq      real `genq enqueue` + one real `genq worker --burst` (auto concurrency)

and prints one table: makespan (server busy window, first admission to last
finish), output tok/s, the server's time-weighted mean running requests / 37
(over the busy window, and until the last prompt was admitted), time from the
client's start to the first running request and to all slots full, and the
ratios to the limit.

    .venv/bin/python bench/saturation.py                 # ~3 minutes
    .venv/bin/python bench/saturation.py --prompts 1000  # quicker look
    # answers of one length ending together, a wave at a time, on a server whose capacity is learned
    .venv/bin/python bench/saturation.py --flavor vllm --output-sigma 0 --max-running-requests 128
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import (
    PY,
    ROOT,
    Poller,
    RunFigures,
    Sim,
    bench_redis_url,
    busy_processes,
    conditions,
    figures,
    flush_bench_db,
    genq,
    mask_url,
    read_messages,
    table,
    write_prompts,
)

RUNS = ("limit", "baseline", "genq")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--prompts", type=int, default=3000, help="Prompts per run (the same prompts in every run).")
    p.add_argument("--runs", default=",".join(RUNS),
                   help=f"Comma-separated runs, in order: {', '.join(RUNS)}, genq-nostream (genq with --no-stream).")
    p.add_argument("--flavor", default="sglang", help="The server genq sim plays (vllm: its capacity is learned).")
    p.add_argument("--max-running-requests", type=int, default=37)
    p.add_argument("--step-ms-base", type=float, default=30.0, help="Fixed cost of a decode step (dominant).")
    p.add_argument("--step-ms-per-req", type=float, default=0.05)
    p.add_argument("--tokens-per-step", type=int, default=32, help="Time compression.")
    p.add_argument("--mean-output-tokens", type=float, default=512)
    p.add_argument("--output-sigma", type=float, default=1.0, help="Lognormal sigma of output lengths (heavy tail).")
    p.add_argument("--max-tokens", type=int, default=4096, help="max_tokens of every request (genq's default).")
    p.add_argument("--batch-size", type=int, default=256, help="genq's batch size, and the baseline's.")
    p.add_argument("--baseline-concurrency", type=int, default=32)
    p.add_argument("--baseline-stagger", type=float, default=0.01,
                   help="Seconds between the baseline's task creations.")
    p.add_argument("--worker-args", default="", help="Extra arguments for `genq worker` (e.g. '--prefetch 3').")
    p.add_argument("--redis", default=None, help="A spare Redis database: it is flushed.")
    p.add_argument("--workdir", default=None, help="Where prompts, logs and outputs go. [default: a temp dir]")
    p.add_argument("--json", dest="json_out", default=None, help="Also write the figures as JSON here.")
    return p.parse_args(argv)


def sim_options(args: argparse.Namespace) -> dict[str, object]:
    return {
        "flavor": args.flavor,
        "max_running_requests": args.max_running_requests,
        "step_ms_base": args.step_ms_base,
        "step_ms_per_req": args.step_ms_per_req,
        "tokens_per_step": args.tokens_per_step,
        "mean_output_tokens": args.mean_output_tokens,
        "output_sigma": args.output_sigma,
        # Large enough that the KV budget never binds: this measures scheduling, not memory.
        "max_total_num_tokens": 10_000_000,
    }


def run_one(name: str, args: argparse.Namespace, work: Path, prompts: Path) -> RunFigures:
    extra: dict[str, object] = {}
    with Sim(work / f"sim-{name}.log", **sim_options(args)) as sim:
        if name.startswith("genq"):
            flush_bench_db(args.redis)
            t0 = time.monotonic()
            subprocess.run(genq("enqueue", str(prompts), "--job", "sat", "--output", str(work / f"out-{name}"),
                                "--batch-size", str(args.batch_size), "--max-tokens", str(args.max_tokens),
                                redis_url=args.redis), check=True, capture_output=True, cwd=ROOT)
            extra["enqueue_s"] = time.monotonic() - t0
            cmd = genq("worker", "--server", sim.url, "--burst", "--name", f"bench-{name}",
                       *(["--no-stream"] if name == "genq-nostream" else []), *args.worker_args.split(),
                       redis_url=args.redis)
        elif name == "baseline":
            cmd = [PY, str(ROOT / "bench" / "baseline.py"), "--server", sim.url, "--input", str(prompts),
                   "--output", str(work / "baseline-results.jsonl"), "--concurrency", str(args.baseline_concurrency),
                   "--batch-size", str(args.batch_size), "--stagger", str(args.baseline_stagger),
                   "--max-tokens", str(args.max_tokens)]
        elif name == "limit":
            cmd = [PY, str(Path(__file__).resolve()), "limit-client", sim.url, str(prompts), str(args.max_tokens)]
        else:
            raise SystemExit(f"unknown run {name!r}: choose from {', '.join(RUNS)}, genq-nostream")
        sim.reset()
        poller = Poller(sim.url).start()
        started = time.monotonic()
        with open(work / f"client-{name}.log", "wb") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        ended = time.monotonic()
        time.sleep(0.2)
        poller.stop()
        final = sim.stats()
    if rc != 0:
        raise SystemExit(f"{name}: client exited {rc}; see {work / f'client-{name}.log'}")
    figs = figures(name, args.prompts, args.max_running_requests, final, poller.samples, started, ended)
    figs.extra.update(extra)
    if name.startswith("genq"):
        shards = list((work / f"out-{name}" / "sat" / "shards").glob("*.jsonl"))
        figs.extra["results_written"] = sum(1 for s in shards for line in open(s) if line.strip())
    if figs.finished != args.prompts:
        print(f"MISSED: {name}: the server finished {figs.finished} requests, expected {args.prompts}",
              file=sys.stderr)
        figs.extra["finished_mismatch"] = True
    return figs


# Targets (docs/performance.md "Saturation"): genq keeps the slots busy and ends within 3% of the limit.
UTILIZATION_TARGET = 0.98
MAKESPAN_TARGET = 1.03


def missed_targets(runs: list) -> list[str]:
    """Every target a run missed, in words; empty when all were met."""
    misses = [f"{r.name}: the server finished {r.finished} requests" for r in runs if r.extra.get("finished_mismatch")]
    limit = next((r for r in runs if r.name == "limit"), None)
    for r in runs:
        if not r.name.startswith("genq"):
            continue
        if r.util_until_empty is None or r.util_until_empty < UTILIZATION_TARGET:
            misses.append(f"{r.name}: slot utilization until the queue is empty {r.util_until_empty} "
                          f"< {UTILIZATION_TARGET}")
        if limit is not None and r.makespan_s / limit.makespan_s > MAKESPAN_TARGET:
            misses.append(f"{r.name}: makespan {r.makespan_s / limit.makespan_s:.3f}x the limit's > {MAKESPAN_TARGET}")
    return misses


async def limit_client(url: str, prompts: Path, max_tokens: int) -> None:
    """Every request at once, non-streamed: the client does as little as it can."""
    import aiohttp

    messages = read_messages(prompts)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(url, connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:
        async def one(m: list) -> int:
            body = {"model": "default", "messages": m, "max_tokens": max_tokens}
            async with http.post("/v1/chat/completions", json=body) as resp:
                await resp.read()
                return resp.status

        statuses = await asyncio.gather(*(one(m) for m in messages))
    bad = [s for s in statuses if s != 200]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed (statuses {sorted(set(bad))})")


def report(args: argparse.Namespace, runs: list[RunFigures]) -> str:
    limit = next((r for r in runs if r.name == "limit"), None)
    headers = ["run", "makespan s", "output tok/s", "util (busy)", "util (until queue empty)", "queue empty at s",
               "tail drain s", "first running s", "all slots full s", "makespan / limit", "tok/s / limit"]
    rows = []
    for r in runs:
        drain = r.makespan_s - r.queue_empty_s if r.queue_empty_s is not None else None
        rows.append([r.name, r.makespan_s, r.tok_s, r.util_busy, r.util_until_empty, r.queue_empty_s, drain,
                     r.first_admit_s, r.full_s,
                     r.makespan_s / limit.makespan_s if limit else None, r.tok_s / limit.tok_s if limit else None])
    lines = [table(headers, rows), ""]
    base = next((r for r in runs if r.name == "baseline"), None)
    for r in runs:
        if r.name.startswith("genq") and base and limit and limit.tok_s > base.tok_s:
            closed = (r.tok_s - base.tok_s) / (limit.tok_s - base.tok_s)
            lines.append(f"{r.name}: closes {closed:.0%} of the baseline's throughput gap to the limit "
                         f"({base.tok_s:,.0f} -> {r.tok_s:,.0f} of {limit.tok_s:,.0f} tok/s)")
        if r.extra:
            lines.append(f"{r.name}: " + ", ".join(
                f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.extra.items()))
    lines.append("wall (client start to exit): " + ", ".join(f"{r.name} {r.wall_s:.1f}s" for r in runs))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.redis = args.redis or bench_redis_url()
    names = [n.strip() for n in args.runs.split(",") if n.strip()]
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="genq-saturation-"))
    work.mkdir(parents=True, exist_ok=True)
    prompts = work / "prompts.jsonl"
    write_prompts(prompts, args.prompts)
    opts = sim_options(args)
    print(f"saturation: {args.prompts} prompts, "
          f"sim {' '.join(f'--{k.replace(chr(95), chr(45))} {v}' for k, v in opts.items())}, "
          f"max_tokens {args.max_tokens}, batch size {args.batch_size}; redis {mask_url(args.redis)}; work dir {work}")
    print(f"machine: {conditions()}")
    for p in busy_processes():
        print(f"  busy before start: {p}")
    runs = []
    for name in names:
        figs = run_one(name, args, work, prompts)
        print(f"  {name}: makespan {figs.makespan_s:.2f}s, {figs.tok_s:,.0f} tok/s, "
              f"util {figs.util_busy:.3f} busy / {figs.util_until_empty or 0:.3f} until empty", flush=True)
        runs.append(figs)
    print()
    print(report(args, runs))
    print(f"machine after: {conditions()}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps([r.__dict__ for r in runs], indent=2, default=str))
    misses = missed_targets(runs)
    print("targets (utilization >= 0.98 until the queue is empty, makespan within 3% of the limit): "
          + ("met" if not misses else "NOT met: " + "; ".join(misses)))
    if misses:
        raise SystemExit(1)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "limit-client":
        asyncio.run(limit_client(sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])))
    else:
        main()
