"""Producer benchmark: time `genq enqueue` of 654,676 synthetic prompts end to end.

The JSONL file is generated first (not timed); then one `genq enqueue` process is
timed from start to exit against an empty Redis database, and what it stored is
checked (prompts counted, batches queued in RQ). A plain baseline script (read the
lines, RPUSH batches) is timed in the same run on the same file and the ratio printed.
Exits 1 when a check or the <= 30 s target fails. --profile runs it once more under
cProfile and prints where the time goes.

    .venv/bin/python bench/producer_bench.py            # ~1 minute
    .venv/bin/python bench/producer_bench.py --profile
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import tempfile
import time
from pathlib import Path

from common import PY, ROOT, bench_redis_url, busy_processes, conditions, flush_bench_db, genq, mask_url, table

N_PROMPTS = 654_676
TARGET_S = 30.0  # docs/performance.md "Producer": the whole file in 30 s or less

# The baseline, timed in the same run as its own process: what a plain script does to put the same
# file into Redis: read the lines, join every batch-size of them, RPUSH each batch (pipelined).
# No parsing, validation, ids, dedup or RQ jobs: the floor genq enqueue is compared with.
BASELINE = """
import sys, redis
src, url, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
conn = redis.Redis.from_url(url)
pipe = conn.pipeline(transaction=False)
batch, n = [], 0
with open(src, 'rb') as f:
    for line in f:
        batch.append(line)
        if len(batch) == size:
            pipe.rpush('producer-baseline', b''.join(batch)); batch = []; n += 1
            if n % 64 == 0:
                pipe.execute()
if batch:
    pipe.rpush('producer-baseline', b''.join(batch))
pipe.execute()
"""


def write_input(path: Path, n: int, seed: int = 0) -> None:
    """Chat prompts of a few hundred bytes with an id and some metadata, as a
    synthetic-data pipeline would produce them."""
    rng = random.Random(seed)
    words = ("explain describe compare summarise translate classify rewrite outline critique derive "
             "protein market orbit theorem river harbor neuron compiler glacier contract poem recipe "
             "history physics biology economics law music chemistry algebra").split()
    with open(path, "w") as f:
        for i in range(n):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 60)))
            row = {"id": f"syn-{i:07d}", "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Task {i}: {text}"}],
                "source": "synthetic", "shard": i % 64}
            f.write(json.dumps(row) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=N_PROMPTS)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--redis", default=None, help="A spare Redis database: it is flushed.")
    p.add_argument("--workdir", default=None)
    p.add_argument("--profile", action="store_true", help="Also run once under cProfile and show the top functions.")
    args = p.parse_args()
    args.redis = args.redis or bench_redis_url()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="genq-producer-"))
    work.mkdir(parents=True, exist_ok=True)
    src = work / "prompts.jsonl"
    if not src.exists() or sum(1 for _ in open(src)) != args.prompts:
        t0 = time.monotonic()
        write_input(src, args.prompts)
        print(f"wrote {args.prompts:,} prompts ({src.stat().st_size / 1e6:,.0f} MB) in {time.monotonic() - t0:.1f}s "
              "(not timed)")
    print(f"producer: redis {mask_url(args.redis)}, batch size {args.batch_size}, input {src}")
    print(f"machine: {conditions()}")
    for line in busy_processes():
        print(f"  busy before start: {line}")

    flush_bench_db(args.redis)
    cmd = genq("enqueue", str(src), "--job", "producer-bench", "--batch-size", str(args.batch_size),
               "--output", str(work / "out"), redis_url=args.redis)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    elapsed = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"genq enqueue exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    print(proc.stdout.strip())

    import redis

    from genq.core import keys
    from genq.core.queueing import rq_queue

    conn = redis.Redis.from_url(args.redis)
    total = int(conn.hget(keys.job_stats("producer-bench"), "total") or 0)
    queued = rq_queue(conn).count
    expected_batches = -(-args.prompts // args.batch_size)
    used = conn.info("memory").get("used_memory_human")

    # The baseline, in the same run, on the same file and an emptied database.
    flush_bench_db(args.redis)
    t0 = time.monotonic()
    base = subprocess.run([PY, "-c", BASELINE, str(src), args.redis, str(args.batch_size)], capture_output=True,
                          text=True, cwd=ROOT)
    base_s = time.monotonic() - t0
    if base.returncode != 0:
        raise SystemExit(f"the baseline script exited {base.returncode}:\n{base.stderr}")
    base_batches = conn.llen("producer-baseline")
    base_used = conn.info("memory").get("used_memory_human")

    rows = [["genq enqueue (end to end)", args.prompts, elapsed, args.prompts / elapsed, total, queued, used,
             elapsed / base_s],
            ["baseline: read lines, RPUSH batches", args.prompts, base_s, args.prompts / base_s, None, base_batches,
             base_used, 1.0]]
    print()
    print(table(["what", "prompts", "seconds", "prompts/s", "total in job_stats", "batches in Redis",
                 "redis used_memory", "seconds / baseline"], rows))
    ok = total == args.prompts and queued == expected_batches and base_batches == expected_batches
    met = elapsed <= TARGET_S
    print(f"check: {'ok' if ok else 'MISMATCH'} ({total:,} prompts counted, {queued:,} of {expected_batches:,} "
          f"batches queued; baseline {base_batches:,}); genq enqueue took {elapsed / base_s:.1f}x the baseline's "
          f"time; target <= {TARGET_S:.0f} s: {'met' if met else 'NOT met'}")
    print(f"machine after: {conditions()}")

    if args.profile:
        flush_bench_db(args.redis)
        out = work / "enqueue.prof"
        prof = [PY, "-m", "cProfile", "-o", str(out), "-m", "genq", "--redis", args.redis, "enqueue", str(src),
                "--job", "producer-bench", "--batch-size", str(args.batch_size), "--output", str(work / "out")]
        subprocess.run(prof, check=True, capture_output=True, cwd=ROOT)
        import pstats

        print("\ncProfile (cumulative, top 25):")
        pstats.Stats(str(out)).sort_stats("cumulative").print_stats(25)
        print("cProfile (own time, top 15):")
        pstats.Stats(str(out)).sort_stats("tottime").print_stats(15)
    flush_bench_db(args.redis)  # do not leave hundreds of MB in the shared Redis
    if not (ok and met):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
