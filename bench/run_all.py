"""Run the three benchmarks one after another and print their tables.

    .venv/bin/python bench/run_all.py            # ~5 minutes on 2 cores
    .venv/bin/python bench/run_all.py --quick    # fewer prompts, ~2 minutes

Each benchmark runs on a private redis-server (bench/common.py), or flushes the database
GENQ_BENCH_REDIS_URL names.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="Fewer prompts: a smoke run, not figures to publish.")
    args = p.parse_args()
    runs = [
        ("saturation", ["saturation.py"] + (["--prompts", "1000"] if args.quick else [])),
        ("overhead", ["overhead.py"] + (["--prompts", "10000"] if args.quick else [])),
        ("producer", ["producer_bench.py"] + (["--prompts", "100000"] if args.quick else [])),
    ]
    failed, running, stopping = [], [], []

    # SIGTERM goes on to the running benchmark, which stops what it started; the loop then ends. The
    # handler only signals: it runs inside Popen.wait, whose lock a second wait() would deadlock on.
    def stop(*_: object) -> None:
        stopping.append(True)
        for child in running:
            child.terminate()

    signal.signal(signal.SIGTERM, stop)
    for name, argv in runs:
        print(f"\n===== {name}: {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        running[:] = [subprocess.Popen([sys.executable, str(HERE / argv[0]), *argv[1:]], cwd=HERE.parent)]
        rc = running[0].wait()
        if stopping:
            raise SystemExit(128 + signal.SIGTERM)
        print(f"===== {name}: exit {rc} after {time.monotonic() - t0:.0f}s", flush=True)
        if rc:
            failed.append(name)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
