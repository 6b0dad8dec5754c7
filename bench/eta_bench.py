"""How honest is `genq monitor`'s ETA on a heavy-tailed job?

Runs a real job end to end on this machine: `genq sim` servers with
lognormal output lengths (sigma >= 1, time compressed), `genq enqueue`, one
or more `genq worker` processes, and in this process the monitor's own
estimator (genq.monitor.progress.Monitor, the code behind `genq monitor --json`,
refreshed every --interval seconds exactly as the live monitor does). When
5, 25, 50, 75 and 95 % of the prompts are done it records the monitor's ETA,
its range and the machine's load; after the job ends it compares them with the
true finish time (the last result's commit time) next to two naive estimates,
and says how long after 5 % done the first ETA was shown:

  (a) elapsed / done x remaining prompts
  (b) remaining prompts x average output tokens so far / output tok/s now
      (the monitor's current throughput, as an old-style monitor would show it)

Usage:
  .venv/bin/python bench/eta_bench.py            # ~2.5 minutes on 2 cores, 2 workers
  .venv/bin/python bench/eta_bench.py --quick    # ~1.5 minutes, 1 worker
Use an otherwise empty Redis database: the bench refuses to start when the
RQ queue there already holds work.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common import bench_redis_url, free_port, wait_http  # noqa: E402  (bench/ is on sys.path: run as a script)

from genq.core.queueing import rq_queue  # noqa: E402
from genq.core.redisconn import connect, mask_url  # noqa: E402
from genq.monitor.progress import Monitor  # noqa: E402

CHECKPOINTS = (0.05, 0.25, 0.50, 0.75, 0.95)


@dataclass
class Point:
    checkpoint: float
    at: float  # seconds since the workers started
    finished: int
    eta_s: float | None
    eta_low_s: float | None
    eta_high_s: float | None
    eta_state: str
    naive_a_s: float | None
    naive_b_s: float | None
    workers: int
    fit_mean: float | None = None  # the estimator's fitted mean output length
    fit_sigma: float | None = None
    per_request_tok_s: float | None = None
    decoding_avg: float | None = None
    overhead: float | None = None  # the speed curve's a/b (None: a request's speed does not depend on the count)
    true_s: float | None = None
    load: float | None = None  # the machine's 1-minute load average


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=None,
                   help="Redis URL (an otherwise idle database) [default: a private redis-server, bench/common.py]")
    p.add_argument("--quick", action="store_true", help="A smaller, faster run: 1 worker, 1000 prompts.")
    p.add_argument("--prompts", type=int, default=None, help="Prompts to enqueue [3000; quick 1000].")
    p.add_argument("--workers", type=int, default=None, help="Workers, one sim each [2; quick 1].")
    p.add_argument("--join-at", type=float, default=None, metavar="FRACTION",
                   help="Start one more worker (and sim) when this fraction is done: a worker joining.")
    p.add_argument("--mean-output-tokens", type=float, default=512.0)
    p.add_argument("--output-sigma", type=float, default=1.2, help="Lognormal sigma (>= 1: a heavy tail).")
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--max-running-requests", type=int, default=37)
    p.add_argument("--tokens-per-step", type=int, default=4,
                   help="Sim time compression: tokens per 20 ms step [%(default)s].")
    p.add_argument("--step-ms-base", type=float, default=20.0)
    p.add_argument("--seed", type=int, default=0, help="Sim seed: the output lengths.")
    p.add_argument("--interval", type=float, default=1.0, help="Monitor refresh, seconds.")
    p.add_argument("--rate-window", type=float, default=120.0, help="Monitor's throughput window, seconds.")
    p.add_argument("--json-out", default=None, help="Also write the results here as JSON.")
    p.add_argument("--trace", default=None, help="Write one JSON line per monitor refresh here (diagnosis).")
    p.add_argument("--timeout", type=float, default=900.0, help="Give up after this many seconds.")
    a = p.parse_args(argv)
    a.prompts = a.prompts or (1000 if a.quick else 3000)
    a.workers = a.workers or (1 if a.quick else 2)
    if a.output_sigma < 1.0:
        print("note: --output-sigma below 1 is not a heavy tail", file=sys.stderr)
    return a


def reproduce_line(a: argparse.Namespace) -> str:
    args = [".venv/bin/python", "bench/eta_bench.py", "--redis", mask_url(a.redis), "--prompts", str(a.prompts),
            "--workers", str(a.workers), "--mean-output-tokens", f"{a.mean_output_tokens:g}",
            "--output-sigma", f"{a.output_sigma:g}", "--max-tokens", str(a.max_tokens),
            "--batch-size", str(a.batch_size), "--max-running-requests", str(a.max_running_requests),
            "--tokens-per-step", str(a.tokens_per_step), "--step-ms-base", f"{a.step_ms_base:g}",
            "--seed", str(a.seed), "--interval", f"{a.interval:g}", "--rate-window", f"{a.rate_window:g}"]
    if a.join_at is not None:
        args += ["--join-at", f"{a.join_at:g}"]
    return " ".join(shlex.quote(x) for x in args)


class Procs:
    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.items: list[subprocess.Popen] = []

    def start(self, args: list[str], name: str) -> subprocess.Popen:
        log = open(self.logdir / f"{name}.log", "ab")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.items.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.items):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.items):
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the worker's session
            except (ProcessLookupError, PermissionError):
                pass


def genq(redis_url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "genq", "--redis", redis_url, *args]


def run(a: argparse.Namespace) -> dict:
    conn = connect(a.redis)
    conn.ping()
    waiting = rq_queue(conn).count
    if waiting:
        raise SystemExit(f"the RQ queue in {mask_url(a.redis)} holds {waiting} jobs already; "
                         "use an idle database (e.g. --redis redis://127.0.0.1:6379/N)")
    stamp = time.strftime("%H%M%S")
    job = f"etabench-{stamp}-{os.getpid()}"
    work = Path(tempfile.mkdtemp(prefix="genq-eta-bench-"))
    procs = Procs(work)
    print(f"eta bench: job {job}, {a.prompts} prompts, {a.workers} worker(s), lognormal mean "
          f"{a.mean_output_tokens:g} sigma {a.output_sigma:g} (cap {a.max_tokens}), batch {a.batch_size}, "
          f"{a.max_running_requests} slots/server; redis {mask_url(a.redis)}; logs in {work}", flush=True)

    worker_procs: list[subprocess.Popen] = []

    def start_sim(i: int) -> str:
        port = free_port()
        procs.start([sys.executable, "-m", "genq", "sim", "--port", str(port), "--seed", str(a.seed),
                     "--max-running-requests", str(a.max_running_requests),
                     "--mean-output-tokens", f"{a.mean_output_tokens}", "--output-sigma", f"{a.output_sigma}",
                     "--tokens-per-step", str(a.tokens_per_step), "--step-ms-base", f"{a.step_ms_base}"],
                    f"sim{i}")
        return f"http://127.0.0.1:{port}"

    def start_worker(i: int, url: str) -> None:
        wait_http(url + "/v1/models")
        worker_procs.append(procs.start(genq(a.redis, "worker", "--server", url, "--name", f"{job}-w{i}",
                                             "--burst", "--log-level", "warning"), f"worker{i}"))

    try:
        prompts = work / "prompts.jsonl"
        with open(prompts, "w") as f:
            for i in range(a.prompts):
                # The sim's length for a prompt depends on its text and --seed only: same seed, same lengths.
                row = {"id": f"q{i:06d}", "messages": [{"role": "user", "content": f"bench prompt {i}"}]}
                f.write(json.dumps(row) + "\n")
        subprocess.run(genq(a.redis, "enqueue", str(prompts), "--job", job, "--output", str(work / "out"),
                            "--batch-size", str(a.batch_size), "--max-tokens", str(a.max_tokens)),
                       check=True, cwd=ROOT, capture_output=True)
        mon = Monitor(conn, job, window_s=a.rate_window)
        # Every sim up before the first worker starts: the job's clock starts with all of them.
        urls = [start_sim(i) for i in range(a.workers)]
        for url in urls:
            wait_http(url + "/v1/models")
        for i, url in enumerate(urls):
            start_worker(i, url)
        t0 = time.time()
        points: list[Point] = []
        pending = list(CHECKPOINTS)
        joined = a.join_at is None
        workers = a.workers
        refresh_s: list[float] = []
        five_at: float | None = None  # when 5 % was done
        shown: float | None = None  # seconds from 5 % done to the first ETA shown
        trace = open(a.trace, "w") if a.trace else None
        while True:
            tick = time.monotonic()
            (report,) = mon.refresh()
            refresh_s.append(time.monotonic() - tick)
            p, snap = report.progress, report.snapshot
            finished = p.completed + p.failed
            if trace:
                trace.write(json.dumps({
                    "t": round(snap.at - t0, 2), "finished": finished, "in_flight": p.in_flight,
                    "decoding": snap.decoding, "generated": snap.generated_tokens, "held": p.held,
                    "held_batches": [len(w.held_unfinished) for w in snap.workers if w.live],
                    "eta_s": p.eta_s, "eta_low_s": p.eta_low_s, "eta_high_s": p.eta_high_s,
                    "state": p.eta_state, "tok_s": p.output_tokens_per_sec,
                    "per_request": report.speed.per_request if report.speed else None,
                    "decoding_lately": report.speed.running if report.speed else None,
                    "fit_mean": report.estimate.model.mean() if report.estimate.model else None,
                }) + "\n")
            frac = finished / a.prompts
            elapsed = snap.at - t0
            if five_at is None and frac >= 0.05:
                five_at = elapsed
            if five_at is not None and shown is None and p.eta_s is not None:
                shown = elapsed - five_at
            if not joined and frac >= a.join_at:
                start_worker(workers, start_sim(workers))
                workers += 1
                joined = True
                print(f"  {elapsed:6.1f}s  {frac:6.1%} done: worker {workers} joins", flush=True)
            while pending and frac >= pending[0]:
                cp = pending.pop(0)
                remaining = a.prompts - finished
                naive_a = elapsed / finished * remaining if finished else None
                tok_s = p.output_tokens_per_sec or 0.0
                naive_b = (remaining * p.avg_output_tokens / tok_s) if p.avg_output_tokens and tok_s > 0 else None
                m, sp = report.estimate.model, report.speed
                points.append(Point(cp, elapsed, finished, p.eta_s, p.eta_low_s, p.eta_high_s, p.eta_state,
                                    naive_a, naive_b, workers,
                                    fit_mean=m.mean() if m else None, fit_sigma=m.sigma if m else None,
                                    per_request_tok_s=sp.per_request if sp else None,
                                    decoding_avg=sp.running if sp else None, overhead=sp.overhead if sp else None,
                                    load=os.getloadavg()[0]))
                print(f"  {elapsed:6.1f}s  {frac:6.1%} done: monitor ETA "
                      f"{_fmt(p.eta_s)} [{_fmt(p.eta_low_s)}, {_fmt(p.eta_high_s)}] ({p.eta_state}); "
                      f"load {os.getloadavg()[0]:.1f}", flush=True)
            if p.status == "done":
                break
            if all(w.poll() is not None for w in worker_procs):
                tail = (work / "worker0.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"every worker exited before the job was done (at {frac:.1%}); "
                                 f"worker0.log ends:\n{tail}")
            if elapsed > a.timeout:
                raise SystemExit(f"gave up after {a.timeout:.0f}s at {frac:.1%}; logs in {work}")
            time.sleep(max(0.0, a.interval - (time.monotonic() - tick)))
        # The true finish: the last result's commit time (workers' last_at), not our polling.
        end = max(w.counters.last_at or 0.0 for w in snap.workers)
        for pt in points:
            pt.true_s = end - (t0 + pt.at)
        return {"job": job, "args": vars(a), "wall_s": end - t0, "points": [asdict(pt) for pt in points],
                "refresh_mean_s": sum(refresh_s) / len(refresh_s), "refresh_max_s": max(refresh_s),
                "shown_after_5pct_s": shown,
                "logs": str(work)}
    finally:
        procs.stop()


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _err(est: float | None, true: float) -> str:
    if est is None or true <= 0:
        return "-"
    return f"{(est - true) / true:+.0%}"


def table(result: dict) -> tuple[str, bool]:
    rows = [("done", "at", "true left", "monitor ETA", "err", "90% range", "in?", "state", "load",
             "naive (a)", "err", "naive (b)", "err")]
    ok = True
    for pt in result["points"]:
        true = pt["true_s"]
        inside = (pt["eta_low_s"] is not None and pt["eta_low_s"] <= true <= pt["eta_high_s"])
        err = None if pt["eta_s"] is None else (pt["eta_s"] - true) / true
        if pt["checkpoint"] >= 0.05 and not (err is not None and abs(err) <= 0.10 and inside):
            ok = False
        rng = "-" if pt["eta_low_s"] is None else f"[{pt['eta_low_s']:.0f}, {pt['eta_high_s']:.0f}]"
        rows.append((f"{pt['checkpoint']:.0%}", f"{pt['at']:.0f}s", f"{true:.1f}s", _fmt(pt["eta_s"]),
                     _err(pt["eta_s"], true), rng, "yes" if inside else "no", pt["eta_state"],
                     _num(pt["load"], 1),
                     _fmt(pt["naive_a_s"]), _err(pt["naive_a_s"], true),
                     _fmt(pt["naive_b_s"]), _err(pt["naive_b_s"], true)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    a.redis = a.redis or bench_redis_url()
    result = run(a)
    text, ok = table(result)
    print()
    print(text)
    print()
    print("estimator inputs at each checkpoint: " + "; ".join(
        f"{pt['checkpoint']:.0%}: fit mean {_num(pt['fit_mean'])} sigma {_num(pt['fit_sigma'], 2)}, "
        f"{_num(pt['per_request_tok_s'])} tok/s per request, {_num(pt['decoding_avg'], 1)} decoding, "
        f"overhead {_num(pt['overhead'], 1)}"
        for pt in result["points"]))
    shown = result["shown_after_5pct_s"]
    print(f"first ETA shown {'never' if shown is None else f'{shown:.1f}s'} after 5 % done (target: within 10 s)")
    print(f"job took {result['wall_s']:.1f}s from the workers' start; monitor refresh "
          f"{result['refresh_mean_s'] * 1000:.0f} ms mean, {result['refresh_max_s'] * 1000:.0f} ms max")
    print("naive (a) = elapsed/done x remaining; (b) = remaining x avg output tokens so far / output tok/s now")
    print(f"target (from 5% done: within ±10% and truth inside the range): {'met' if ok else 'NOT met'}")
    print(f"reproduce: {reproduce_line(a)}")
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1  # a missed target is a failed benchmark run


if __name__ == "__main__":
    sys.exit(main())
