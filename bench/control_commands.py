"""What the operator's control commands cost Redis on a loaded queue: Redis commands processed
(INFO's total_commands_processed before and after, a figure that does not depend on the machine)
and wall time of each of `genq jobs`, `workers`, `pause`, `resume`, `pause --job`, `resume --job`
while two jobs' batches wait in RQ's queue. `pause --job` takes its job's batches out of the queue;
its commands per batch taken out is the figure to watch (RQ's Job.delete cost 7 status reads a
batch before 2026-12-06, each a round trip).

    .venv/bin/python bench/control_commands.py --prompts 20000 --batch-size 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import redis

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from genq.core.redisconn import LocalRedis  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20_000, help="per job (two jobs)")
    ap.add_argument("--batch-size", type=int, default=16)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="genq-bench-control-")
    src = os.path.join(work, "p.jsonl")
    with open(src, "w") as f:
        for i in range(args.prompts):
            f.write(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"think {i}"}]}) + "\n")
    batches = -(-args.prompts // args.batch_size)
    with LocalRedis() as server:
        conn = redis.Redis.from_url(server.url)

        def run(*words: str) -> tuple[int, float]:
            before = int(conn.info("stats")["total_commands_processed"])
            started = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "genq", "--redis", server.url, *words], cwd=work,
                                  capture_output=True, text=True)
            took = time.monotonic() - started
            if proc.returncode != 0:
                raise SystemExit(f"genq {' '.join(words)} exited {proc.returncode}: {proc.stderr}")
            return int(conn.info("stats")["total_commands_processed"]) - before - 1, took  # less our INFO

        for job in ("a", "b"):
            run("enqueue", src, "--job", job, "--output", os.path.join(work, "out"), "--batch-size",
                str(args.batch_size))
        print(f"two jobs of {args.prompts:,} prompts, {batches:,} batches each in RQ's queue; "
              f"load {os.getloadavg()[0]:.1f}\n")
        print("| command | Redis commands | per batch of the job | wall s |\n|---|---:|---:|---:|")
        for words in (("jobs",), ("workers",), ("pause",), ("resume",), ("pause", "--job", "a"),
                      ("resume", "--job", "a")):
            commands, took = run(*words)
            per = f"{commands / batches:.2f}" if "--job" in words else ""
            print(f"| genq {' '.join(words)} | {commands:,} | {per} | {took:.1f} |")


if __name__ == "__main__":
    main()
