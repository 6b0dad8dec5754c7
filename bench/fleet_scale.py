"""How many GPUs one Redis serves (issue #29): Redis commands and CPU per prompt.

Two parts, each against a private redis-server of its own (a free loopback port,
nothing on disk, stopped at the end):

1. real: --workers real `genq worker --burst` processes, each against a near-free
   `genq sim` (outputs of ~16 tokens), run a job of --prompts prompts in batches of
   --batch-size. Redis's own counters (INFO commandstats, INFO cpu) over the whole run
   after the enqueue: commands per prompt, by command, and Redis CPU per prompt.
2. fleet: --fleet lightweight workers (threads of this process, no server, no RQ
   loops) doing what a worker does in Redis for each batch, with genq's own scripts:
   the lease (TAKE: the queue's head, as the engine's intake takes it), the claims
   (worker/held.py's CLAIM, --claim-chunk prompts a call), the results
   (worker/results.py's RECORD, --record-chunk a call), the release (the ledger's
   RELEASE), and its busy heartbeat once per simulated second (a worker making
   --prompts-per-s prompts a second: the heartbeat's status, liveness and in-flight
   records and its control reads, as worker/heartbeat.py writes them). What it does
   not replay: RQ's own bookkeeping of each batch job (hashes, registries, the loop's heartbeats),
   which part 1 counts; part 1's figure is the one to size with, part 2 shows what
   hundreds of clients at once do to Redis's latency and CPU. Redis's p99 latency per
   command is its own (INFO latencystats); a probe connection PINGs every 10 ms
   throughout and reports the p99 round trip a client sees.

    .venv/bin/python bench/fleet_scale.py                    # ~3-5 minutes on 2 loaded cores
    .venv/bin/python bench/fleet_scale.py --skip-real --fleet 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import redis
from common import PY, ROOT, Sim, conditions, table, write_prompts
from footprint import Filler

from genq.core import keys, scripts
from genq.core.records import BatchRef, InFlight, WorkerStatus, pack
from genq.core.redisconn import LocalRedis

FAST_SIM = dict(mean_output_tokens=16, output_sigma=0.5, tokens_per_step=16, step_ms_base=2, max_running_requests=64)


@dataclass
class RedisCounters:
    calls: dict[str, int]
    cpu_s: float

    @staticmethod
    def read(conn: redis.Redis) -> RedisCounters:
        stats = conn.info("commandstats")
        cpu = conn.info("cpu")
        calls = {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}
        for own in ("info", "config|resetstat", "ping"):  # the bench's reads and probe
            calls.pop(own, None)
        return RedisCounters(calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]))


def reset(conn: redis.Redis) -> float:
    conn.config_resetstat()
    cpu = conn.info("cpu")
    return float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def real_run(a: argparse.Namespace, work: Path) -> tuple[RedisCounters, float]:
    """Commands and Redis CPU of a whole run of real workers, after the enqueue."""
    src = work / "prompts.jsonl"
    write_prompts(src, a.prompts)
    with LocalRedis() as r:
        conn = redis.Redis.from_url(r.url)
        sims = [Sim(work / f"sim{i}.log", **FAST_SIM) for i in range(a.workers)]
        try:
            subprocess.run([PY, "-m", "genq", "--redis", r.url, "enqueue", str(src), "--job", "fleet",
                            "--batch-size", str(a.batch_size), "--max-tokens", "32", "--output", str(work / "out")],
                           check=True, cwd=ROOT, capture_output=True)
            cpu0 = reset(conn)
            started = time.monotonic()
            procs = [subprocess.Popen([PY, "-m", "genq", "--redis", r.url, "worker", "--server", s.url, "--burst",
                                       "--name", f"w{i}"], cwd=ROOT, stdout=open(work / f"worker{i}.log", "wb"),
                                      stderr=subprocess.STDOUT) for i, s in enumerate(sims)]
            for p in procs:
                p.wait(timeout=900)
            wall = time.monotonic() - started
            counters = RedisCounters.read(conn)
            counters.cpu_s -= cpu0
            done = int(conn.scard(keys.job_done("fleet")))
            if done * a.batch_size < a.prompts:
                raise SystemExit(f"the real run finished {done} batches only: see {work}")
            return counters, wall
        finally:
            for s in sims:
                s.stop()


PROBE = """
import json, os, sys, time
import redis
conn, rtts = redis.Redis.from_url(sys.argv[1]), []
while not os.path.exists(sys.argv[2]):
    t = time.perf_counter()
    conn.ping()
    rtts.append(time.perf_counter() - t)
    time.sleep(0.01)
print(json.dumps(rtts))
"""


class Probe:
    """PINGs every 10 ms from a process of its own (not behind this one's threads): the
    round trip a client of this Redis sees while the fleet runs."""

    def __init__(self, url: str, work: Path) -> None:
        self.stop_file = work / "probe.stop"
        self.proc = subprocess.Popen([PY, "-c", PROBE, url, str(self.stop_file)], stdout=subprocess.PIPE)

    def finish(self) -> list[float]:
        self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=30)
        return sorted(json.loads(out))


def fleet_worker(url: str, job: str, name: str, count: int, by_id: dict, a: argparse.Namespace,
                 filler: Filler) -> None:
    conn = redis.Redis.from_url(url)
    claim = conn.register_script(scripts.CLAIM)
    record = conn.register_script(scripts.RECORD)
    instance = f"{name}.eng"
    beats_per_batch = max(1, round(a.batch_size / a.prompts_per_s))
    for _ in range(count):
        taken = filler.lease(1, instance)  # TAKE: whichever batch heads the queue
        if not taken:
            return
        (batch_id, token), = taken
        batch = by_id[batch_id]
        ref = BatchRef(job, batch.id)
        ids = [p.id for p in batch.prompts]
        for i in range(0, len(ids), a.claim_chunk):
            # the worker's own keys and arguments (the job's incarnation is "")
            script_keys, args = scripts.claim_call(ref, instance, "", token, ids[i:i + a.claim_chunk])
            granted = claim(keys=script_keys, args=args)
            assert granted not in (b"done", b"stale"), f"CLAIM of {ref} answered {granted!r}: the bench lost its lease"
        for i in range(0, len(batch.prompts), a.record_chunk):
            results = filler.results(batch, batch.prompts[i:i + a.record_chunk], name)
            script_keys, args = scripts.record_call(job, batch.id, name, repr(time.time()), results, [], "")
            record(keys=script_keys, args=args)
        for _ in range(beats_per_batch):
            heartbeat(conn, name, instance, ref)
        filler.release([batch], 400)


def heartbeat(conn: redis.Redis, name: str, instance: str, ref: BatchRef) -> None:
    """A busy worker's beat and control read (worker/heartbeat.py: beat, read_control)."""
    now = time.time()
    status = WorkerStatus(name=name, host="bench", pid=1, server="http://127.0.0.1:1", state="busy", started_at=now,
                          heartbeat_at=now, concurrency_target=64, server_capacity=64, in_flight=64, queued=64,
                          batches=[ref], prefetch=2)
    with conn.pipeline(transaction=False) as pipe:
        pipe.set(keys.engine_alive(instance), name, ex=10)
        pipe.set(keys.worker_status(name), pack(status), ex=15)
        pipe.set(keys.job_inflight(ref.job, name), pack(InFlight(worker=name, job=ref.job, at=now, tokens=[8] * 64,
                                                                 queued=64)), ex=5)
        pipe.get(keys.worker_control(name))
        pipe.exists(keys.PAUSED)
        pipe.exists(keys.job_paused(ref.job))
        pipe.execute()


def fleet_run(a: argparse.Namespace, work: Path) -> tuple[RedisCounters, float, int, list[float], dict]:
    with LocalRedis() as r:
        conn = redis.Redis.from_url(r.url)
        filler = Filler(conn, "fleet", prompt_chars=200, completion_chars=80, batch_size=a.batch_size)
        per_worker = a.fleet_batches
        batches = filler.queue(a.fleet * per_worker)
        cpu0 = reset(conn)
        probe = Probe(r.url, work)
        time.sleep(0.5)
        started = time.monotonic()
        by_id = {b.id: b for b in batches}
        threads = [threading.Thread(target=fleet_worker,
                                    args=(r.url, "fleet", f"f{i:03d}", per_worker, by_id, a, filler))
                   for i in range(a.fleet)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - started
        rtts = probe.finish()
        counters = RedisCounters.read(conn)
        counters.cpu_s -= cpu0
        latency = conn.info("latencystats")
        return counters, wall, len(batches) * a.batch_size, rtts, latency


def p99_by_command(latency: dict, calls: dict[str, int], top: int = 6) -> str:
    out = []
    for name, _ in sorted(calls.items(), key=lambda kv: -kv[1])[:top]:
        entry = latency.get(f"latency_percentiles_usec_{name}")
        if entry:
            out.append(f"{name} {entry.get('p99', 0):.0f} us")
    return ", ".join(out)


def describe(title: str, c: RedisCounters, prompts: int, wall: float) -> list[str]:
    total = sum(c.calls.values())
    mix = ", ".join(f"{k} {v / prompts:.2f}" for k, v in sorted(c.calls.items(), key=lambda kv: -kv[1])[:10])
    return [title, f"{prompts:,}", f"{wall:.1f}", f"{total / prompts:.2f}", f"{c.cpu_s / prompts * 1e6:.0f}",
            f"{prompts / c.cpu_s:,.0f}" if c.cpu_s > 0 else "-", mix]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=4, help="Real workers in part 1 [%(default)s].")
    p.add_argument("--prompts", type=int, default=2000, help="Prompts of part 1's job [%(default)s].")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--fleet", type=int, default=256, help="Lightweight workers in part 2; 0: no part 2 [%(default)s].")
    p.add_argument("--fleet-batches", type=int, default=4, help="Batches each of them finishes [%(default)s].")
    p.add_argument("--prompts-per-s", type=float, default=64.0,
                   help="Prompts a second one modelled worker makes: sets its heartbeats a batch [%(default)s].")
    p.add_argument("--claim-chunk", type=int, default=16, help="Prompts a CLAIM call claims [%(default)s].")
    p.add_argument("--record-chunk", type=int, default=16, help="Results a RECORD call commits [%(default)s].")
    p.add_argument("--skip-real", action="store_true")
    a = p.parse_args(argv)
    print(conditions())
    rows = []
    started = time.monotonic()
    if not a.skip_real:
        with tempfile.TemporaryDirectory(prefix="genq-fleet-") as tmp:
            real, wall = real_run(a, Path(tmp))
        rows.append(describe(f"real: {a.workers} genq workers, batch {a.batch_size}", real, a.prompts, wall))
    if a.fleet:
        with tempfile.TemporaryDirectory(prefix="genq-fleet-") as tmp:
            fleet, wall, prompts, rtts, latency = fleet_run(a, Path(tmp))
        rows.append(describe(f"fleet: {a.fleet} lightweight workers, batch {a.batch_size}", fleet, prompts, wall))
    print(table(["run", "prompts", "wall s", "commands/prompt", "Redis CPU us/prompt", "prompts/s per Redis core",
                 "commands per prompt, by command (top 10)"], rows))
    if a.fleet:
        print(f"fleet: {len(rtts)} probe PINGs, round trip median {statistics.median(rtts) * 1000:.2f} ms, "
              f"p99 {rtts[int(0.99 * (len(rtts) - 1))] * 1000:.2f} ms, max {rtts[-1] * 1000:.2f} ms")
        print(f"fleet: Redis's own p99 per command: {p99_by_command(latency, fleet.calls)}")
    print(f"bench took {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
