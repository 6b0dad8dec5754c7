"""The end of a job on a fleet: genq against the fleet's ideal, side by side.

A fleet of `genq sim` servers (16 running slots each, heavy-tailed output lengths;
optionally one at half speed) runs the same prompts twice:

  ideal  one shared queue in this script: every free slot of every server takes the
         next prompt (a slot per asyncio task, non-streamed), so no slot idles while
         a prompt is unsent. The best any scheduler can do on that fleet.
  router SGLang's router (sglang-router from PyPI, `--policy cache_aware`) in front of the same
         servers, one client keeping the fleet's total slot count in flight through it: what a
         user would run instead of genq.
  genq   real `genq enqueue` + one real `genq worker` per server, defaults, started and idle
         before the job is enqueued (as the router is up before its client starts).

Makespan is timed by the servers: the first admission on any of them to the last
finish on any of them. Both runs also count every generation the servers did: each
prompt must be generated exactly once (nothing twice), and genq must write one
result per prompt.

    .venv/bin/python bench/fleet_tail.py                       # the three scenarios, ~5 min
    .venv/bin/python bench/fleet_tail.py --scenarios half      # one of them

Scenarios (targets, genq makespan / ideal): `half` 1,600 prompts, batches of 64, 4
servers, one at half speed (<= 0.93, and no slower than the router in the same run); `even`
the same on an even fleet (<= 1.03); `large` 10,000 prompts, batches of 256, 8 servers, one
at half speed (<= 0.95). Exits 1 when a target is missed. Uses a private redis-server on a
free port. The router run needs `sglang-router`, in this Python (`.venv/bin/pip install
sglang-router`) or in the one `--router-python` (or $GENQ_ROUTER_PYTHON) names, e.g. a venv of
its own outside the repository; without it the bench says so and runs the others.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import PY, ROOT, Sim, conditions, free_port, genq, stop_process, table, write_prompts
from fleet_trace import Trace, summary

from genq.core.redisconn import LocalRedis

SLOTS = 16
PROMPT_SEED = 1  # write_prompts' seed for every scenario's prompts (bench/tail_model.py replays them)


@dataclass
class Scenario:
    name: str
    prompts: int
    batch_size: int
    servers: int
    half_speed: bool
    target: float


SCENARIOS = {
    "half": Scenario("half", 1600, 64, 4, True, 0.93),
    "even": Scenario("even", 1600, 64, 4, False, 1.03),
    "large": Scenario("large", 10_000, 256, 8, True, 0.95),
}


def sim_options(slow: bool, args: argparse.Namespace) -> dict[str, Any]:
    factor = 2.0 if slow else 1.0
    return {"max_running_requests": SLOTS, "step_ms_base": args.step_ms * factor,
            "step_ms_per_req": 0.05 * factor, "tokens_per_step": 16, "mean_output_tokens": 256,
            "output_sigma": args.output_sigma, "max_total_num_tokens": 10_000_000}


def fleet_figures(sims: list[Sim]) -> dict[str, Any]:
    stats = [s.stats() for s in sims]
    firsts = [s["first_admit_at"] for s in stats if s["first_admit_at"] is not None]
    lasts = [s["last_finish_at"] for s in stats if s["last_finish_at"] is not None]
    generated: dict[str, int] = {}
    for s in stats:
        for key, n in s["generated_by_key"].items():
            generated[key] = generated.get(key, 0) + n
    return {
        "makespan_s": max(lasts) - min(firsts) if firsts and lasts else float("nan"),
        "finished": sum(s["finished_requests"] for s in stats),
        "generated_twice": sum(1 for n in generated.values() if n > 1),
        "per_server": [s["finished_requests"] for s in stats],
        "last_finish_s": [round(s["last_finish_at"] - min(firsts), 1) if s["last_finish_at"] else None
                          for s in stats],
        "first_admit_s": [round(s["first_admit_at"] - min(firsts), 2) if s["first_admit_at"] else None
                          for s in stats],
        "busy_mean_running": [round(s["busy_mean_running"], 1) for s in stats],
        # The simulated GPU's step, as it ran: 50 ms (100 on the slow server) plus what the CPU,
        # shared with the scheduler under test, added.
        "step_ms": [round(1000 * s["busy_s"] / s["steps"], 1) if s["steps"] else None for s in stats],
    }


async def ideal_client(urls: list[str], prompts: Path, max_tokens: int, per_url: int = SLOTS) -> None:
    """One shared queue; per_url tasks per server (or router), each takes the next prompt when free."""
    import aiohttp

    queue: asyncio.Queue[list] = asyncio.Queue()
    for line in prompts.read_text().splitlines():
        queue.put_nowait(json.loads(line)["messages"])
    failures = 0

    async def slot(http: aiohttp.ClientSession) -> None:
        nonlocal failures
        while not queue.empty():
            messages = queue.get_nowait()
            body = {"model": "default", "messages": messages, "max_tokens": max_tokens}
            async with http.post("/v1/chat/completions", json=body) as resp:
                await resp.read()
                failures += resp.status != 200

    sessions = [aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0),
                                      timeout=aiohttp.ClientTimeout(total=None)) for url in urls]
    try:
        await asyncio.gather(*(slot(http) for http in sessions for _ in range(per_url)))
    finally:
        for http in sessions:
            await http.close()
    if failures:
        raise SystemExit(f"ideal client: {failures} requests failed")


ROUTER_MISSING = ("the router run needs sglang-router: `.venv/bin/pip install sglang-router`, or --router-python "
                  "a Python that has it (or leave it out: --order ideal,genq)")


def router_available(python: str) -> bool:
    return subprocess.run([python, "-c", "import sglang_router"], capture_output=True).returncode == 0


class Router:
    """SGLang's router (cache_aware) in front of the servers, on a free port."""

    def __init__(self, urls: list[str], log_path: Path, python: str) -> None:
        if not router_available(python):
            raise SystemExit(ROUTER_MISSING)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [python, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(self.port),
             "--policy", "cache_aware", "--worker-urls", *urls, "--log-level", "warn"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"sglang-router did not start; see {log_path}")
            time.sleep(0.2)

    def stop(self) -> None:
        stop_process(self.proc)
        self.log.close()


def run_genq(sc: Scenario, sims: list[Sim], redis: LocalRedis, prompts: Path, work: Path, max_tokens: int) -> float:
    """One `genq worker` per server, started and idle before the job is enqueued (as the router is
    up before its client starts): the makespan is the job's, not the workers' start-up, which on a
    loaded machine spread their first admissions over up to 5.8 s. Stopped (SIGTERM) once done."""
    import redis as redis_py

    from genq.ops.control import fleet, job_rows

    redis.conn.flushall()
    conn = redis_py.Redis.from_url(redis.url)
    out = work / f"out-{sc.name}"
    shutil.rmtree(out, ignore_errors=True)
    logs = [open(work / f"worker-{sc.name}-{i}.log", "wb") for i in range(len(sims))]
    procs = [subprocess.Popen(genq("worker", "--server", sim.url, "--name", f"tail-{i}", redis_url=redis.url),
                              stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
             for i, (sim, log) in enumerate(zip(sims, logs))]
    try:
        deadline = time.monotonic() + 120
        while sum(1 for w in fleet(conn) if w.status is not None and w.status.state == "idle") < len(sims):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit(f"genq workers did not all start; see {work}/worker-{sc.name}-*.log")
            time.sleep(0.2)
        t0 = time.monotonic()
        subprocess.run(genq("enqueue", str(prompts), "--job", "tail", "--output", str(out), "--batch-size",
                            str(sc.batch_size), "--max-tokens", str(max_tokens), redis_url=redis.url),
                       check=True, capture_output=True, cwd=ROOT)
        while job_rows(conn, ["tail"])[0].state != "done":
            if time.monotonic() - t0 > 600 or any(p.poll() is not None for p in procs):
                raise SystemExit(f"the genq job did not finish; see {work}/worker-{sc.name}-*.log")
            time.sleep(0.5)
        wall = time.monotonic() - t0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        codes = [proc.wait() for proc in procs]
        for log in logs:
            log.close()
    if any(codes):
        raise SystemExit(f"genq workers exited {codes}; see {work}/worker-{sc.name}-*.log")
    results = [json.loads(line)["id"] for shard in (out / "tail" / "shards").glob("*.jsonl")
               for line in shard.read_text().splitlines() if line.strip()]
    if len(results) != sc.prompts or len(set(results)) != sc.prompts:
        raise SystemExit(f"genq wrote {len(results)} results ({len(set(results))} distinct) for {sc.prompts} prompts")
    return wall


def run_scenario(sc: Scenario, args: argparse.Namespace, work: Path, redis: LocalRedis) -> dict[str, Any]:
    prompts = work / f"prompts-{sc.name}.jsonl"
    write_prompts(prompts, sc.prompts, seed=PROMPT_SEED)
    sims = [Sim(work / f"sim-{sc.name}-{i}.log", **sim_options(sc.half_speed and i == 0, args))
            for i in range(sc.servers)]
    figures: dict[str, Any] = {}
    try:
        for run in args.order.split(","):
            for sim in sims:
                sim.reset()
            trace = Trace([s.url for s in sims]).start() if args.trace else None
            if run == "ideal":
                started = time.monotonic()
                subprocess.run([PY, str(Path(__file__).resolve()), "ideal-client", str(prompts), str(args.max_tokens),
                                str(SLOTS), *[s.url for s in sims]], check=True, cwd=ROOT)
                wall = time.monotonic() - started
            elif run == "router":
                router = Router([s.url for s in sims], work / f"router-{sc.name}.log", args.router_python)
                try:
                    for sim in sims:  # its health checks are no generations, but reset what they touched
                        sim.reset()
                    started = time.monotonic()
                    subprocess.run([PY, str(Path(__file__).resolve()), "ideal-client", str(prompts),
                                    str(args.max_tokens), str(SLOTS * len(sims)), router.url], check=True, cwd=ROOT)
                    wall = time.monotonic() - started
                finally:
                    router.stop()
            else:
                wall = run_genq(sc, sims, redis, prompts, work, args.max_tokens)
            time.sleep(0.2)
            figs = fleet_figures(sims)
            figs["wall_s"] = wall
            if trace is not None:
                trace.stop()
                figs["trace"] = summary(trace, sc.prompts, SLOTS, list(range(1 if sc.half_speed else 0, sc.servers)))
            if figs["finished"] != sc.prompts or figs["generated_twice"]:
                raise SystemExit(f"{sc.name}/{run}: servers finished {figs['finished']} of {sc.prompts}, "
                                 f"{figs['generated_twice']} prompts generated twice")
            figures[run] = figs
    finally:
        for sim in sims:
            sim.stop()
    return figures


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["ideal-client"]:
        asyncio.run(ideal_client(argv[4:], Path(argv[1]), int(argv[2]), int(argv[3])))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--scenarios", default="half,even,large", help=f"Of: {', '.join(SCENARIOS)}.")
    p.add_argument("--order", default="ideal,router,genq",
                   help="Runs, in this order, per scenario (of: ideal, router, genq).")
    p.add_argument("--step-ms", type=float, default=50.0, help="Decode step of a full-speed server (ms).")
    p.add_argument("--output-sigma", type=float, default=0.5,
                   help="Lognormal sigma of output lengths. Larger: the last long completions, which run "
                        "where they started in any scheduler, hide what holding batches costs.")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--router-python", default=os.environ.get("GENQ_ROUTER_PYTHON", PY),
                   help="The Python whose sglang-router runs the router ($GENQ_ROUTER_PYTHON).")
    p.add_argument("--workdir", default=None, help="Keep the logs (workers, servers, router) here.")
    p.add_argument("--trace", action="store_true",
                   help="Read every server's /metrics each 0.1 s: when the prompts were all sent, each server's "
                        "last prompt, mean running before and after (bench/fleet_trace.py); timelines in --json.")
    p.add_argument("--json", dest="json_out", default=None, help="Also write the figures as JSON here.")
    args = p.parse_args(argv)
    print(conditions(), flush=True)
    if "router" in args.order.split(",") and not router_available(args.router_python):
        print(f"NOTE: {ROUTER_MISSING}; running without it", file=sys.stderr)
        args.order = ",".join(r for r in args.order.split(",") if r != "router")
    rows, misses, all_figures = [], [], {}
    with tempfile.TemporaryDirectory(prefix="genq-tail-") as tmp:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        redis = LocalRedis()
        try:
            for name in args.scenarios.split(","):
                sc = SCENARIOS[name]
                figs = run_scenario(sc, args, work, redis)
                all_figures[name] = figs
                ideal = figs["ideal"]["makespan_s"]
                ratio = figs["genq"]["makespan_s"] / ideal
                router = figs["router"]["makespan_s"] / ideal if "router" in figs else float("nan")
                rows.append([name, sc.prompts, sc.batch_size, sc.servers, "yes" if sc.half_speed else "no",
                             ideal, figs["genq"]["makespan_s"], ratio, router, sc.target,
                             " ".join(str(x) for x in figs["genq"]["last_finish_s"])])
                for run, f in figs.items():
                    print(f"  {run}: each server's first admission {f['first_admit_s']} s, last finish "
                          f"{f['last_finish_s']} s, mean running {f['busy_mean_running']}, step {f['step_ms']} ms",
                          flush=True)
                    if "trace" in f:
                        print(f"    trace: {({k: v for k, v in f['trace'].items() if k != 'timeline'})}", flush=True)
                print(f"{name}: ideal {ideal:.1f}s, genq {figs['genq']['makespan_s']:.1f}s ({ratio:.3f}x), router "
                      f"{router:.3f}x; genq per server {figs['genq']['per_server']}", flush=True)
                if ratio > sc.target:
                    misses.append(f"{name}: genq {ratio:.3f}x the ideal > {sc.target}")
                if sc.half_speed and ratio > router:
                    misses.append(f"{name}: genq {ratio:.3f}x the ideal, slower than the router's {router:.3f}x")
        finally:
            redis.stop()
    print(table(["scenario", "prompts", "batch", "servers", "one at half speed", "ideal makespan s",
                 "genq makespan s", "genq / ideal", "router / ideal", "target",
                 "genq: each server's last finish s"], rows))
    print(conditions())
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(all_figures, indent=2))
    if misses:
        print("target NOT met: " + "; ".join(misses), file=sys.stderr)
        raise SystemExit(1)
    print("all targets met")


if __name__ == "__main__":
    main()
