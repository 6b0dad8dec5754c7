"""Redis footprint of a job and the monitor's cost in the job's size (issue #15).

Fills private redis-servers (started here on free loopback ports, never 6379, stopped at the end)
through genq's own code paths: batches queued by core.queueing.write_batches (records, ids, RQ
jobs), leases taken by the engine's TAKE, outcomes committed by worker/results.py's
RECORD (the worker's exact arguments, scripts.record_call), batches finished by the
ledger's RELEASE (scripts.release_call; no shard file: only Redis is measured). Workers are
their heartbeat records as a live worker writes them. Then it reports:

- bytes of Redis `used_memory` per finished prompt (a job all of whose batches are released,
  their RQ jobs gone with RELEASE),
  per in-flight prompt (a leased batch whose results are all committed, its shard not yet
  written: the most a prompt costs before its release), and per queued prompt, with what each
  key of a finished job holds (MEMORY USAGE);
- the monitor's refresh (genq.core.ledger.figures: fleet.statuses + the queue mirror with the live monitor's
  cache + read_job, i.e. what `genq monitor` and each Prometheus scrape read) on a mid-job state
  (half the batches finished, 8 workers x 3 held batches half done, the rest queued in RQ) of
  SMALL prompts against the same state of LARGE prompts on two servers, one refresh of each in
  turn (ABAB...), medians. Exit 1 when LARGE's refresh is over 1.5x SMALL's.

The large state uses the same scripts in bulk (pipelines of whole batches) with short texts
(--bulk-chars): texts change the bytes, not the keys or fields a refresh reads. Bytes per
prompt are measured at --footprint-prompts prompts
with realistic texts (--prompt-chars, --completion-chars).

    .venv/bin/python bench/footprint.py                      # 20 K vs 2 M prompts, ~2-4 minutes
    .venv/bin/python bench/footprint.py --large 200000       # quicker
    from footprint import measure_footprint, measure_refresh  # from bench/scale.py
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
import uuid
from dataclasses import dataclass, field

import redis
from common import conditions, table

from genq.core import keys, scripts
from genq.core.ledger import fleet
from genq.core.ledger.figures import read_job
from genq.core.queueing import rq_queue, save_config, write_batches
from genq.core.records import (
    BatchRef,
    BatchSource,
    InFlight,
    JobConfig,
    Prompt,
    Result,
    ShardInfo,
    Usage,
    WorkerStatus,
    pack,
    without_prompt,
)
from genq.core.redisconn import LocalRedis
from genq.monitor.rqqueue import QueueMirror
from genq.producer.rows import claim_digest


@dataclass
class Batch:
    """A batch of prompts in memory, before it is stored as a BatchSource."""

    job: str
    id: str
    prompts: list[Prompt]
    created_at: float = 0.0


TARGET_RATIO = 1.5  # refresh at LARGE prompts within 1.5x the refresh at SMALL (issue #15)
WORKERS = 8
HELD_PER_WORKER = 3
WORDS = ("explain describe compare summarise translate classify protein market orbit theorem river "
         "harbor neuron compiler glacier contract poem recipe history physics").split()


@dataclass
class Filler:
    """Puts one job into a Redis through genq's code paths (see the module docstring)."""

    conn: redis.Redis
    job: str
    prompt_chars: int = 400
    completion_chars: int = 1500
    batch_size: int = 256
    seed: int = 0
    _next_index: int = 0
    _rng: random.Random = field(default_factory=random.Random)
    _rq_ids: dict[str, str] = field(default_factory=dict)  # batch id -> the RQ job that carried it

    def __post_init__(self) -> None:
        self._rng.seed(self.seed)
        self._record = self.conn.register_script(scripts.RECORD)
        self._release = self.conn.register_script(scripts.RELEASE)
        self._take = self.conn.register_script(scripts.TAKE)
        save_config(self.conn, JobConfig(name=self.job, output="/nonexistent/footprint",
                                         batch_size=self.batch_size, created_at=time.time()))

    def _text(self, chars: int) -> str:
        out, n = [], 0
        while n < chars:
            word = self._rng.choice(WORDS)
            out.append(word)
            n += len(word) + 1
        return " ".join(out)[:chars]

    def queue(self, n_batches: int, chunk: int = 64) -> list[Batch]:
        """Queue n_batches full batches as the producer does (records, ids, RQ jobs, totals)."""
        made: list[Batch] = []
        text = self._text(self.prompt_chars)
        seq = int(self.conn.incrby(keys.job_batch_seq(self.job), n_batches)) - n_batches
        for start in range(0, n_batches, chunk):
            batches = []
            for b in range(start, min(n_batches, start + chunk)):
                prompts = []
                for _ in range(self.batch_size):
                    i = self._next_index
                    self._next_index += 1
                    prompts.append(Prompt(id=f"{self.job}-{i:09d}", index=i,
                                          messages=[{"role": "user", "content": f"{i} {text}"}],
                                          metadata={"source": "footprint", "row": i}))
                batches.append(Batch(job=self.job, id=f"b{seq + b + 1:07d}", prompts=prompts, created_at=time.time()))
            digests = {p.id: claim_digest(p) for b in batches for p in b.prompts}
            with self.conn.pipeline(transaction=True) as pipe:
                write_batches(pipe, self.conn,
                              [BatchSource.inline(b.job, b.id, b.prompts, b.created_at) for b in batches],
                              digests)
                pipe.execute()
            made.extend(batches)
        return made

    def lease(self, count: int, instance: str) -> list[tuple[str, str]]:
        """An engine takes `count` batches, as its intake does: one TAKE each, off the head of RQ's
        queue. Returns (batch id, lease token) of each taken."""
        now = time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())
        tokens = [uuid.uuid4().hex for _ in range(count)]
        with self.conn.pipeline(transaction=False) as pipe:
            for token in tokens:
                script_keys, args = scripts.take_call(instance, token, now, [])
                self._take(keys=script_keys, args=args, client=pipe)
            answers = pipe.execute()
        taken = []
        for token, got in zip(tokens, answers):
            if got:
                self._rq_ids[got[1].decode()] = got[2].decode()
                taken.append((got[1].decode(), token))
        return taken

    def results(self, batch: Batch, prompts: list[Prompt], worker: str) -> list[Result]:
        text = self._text(self.completion_chars)
        return [Result(id=p.id, job=self.job, batch=batch.id, index=p.index, completion=f"{p.index} {text}",
                       finish_reason="stop", usage=Usage(prompt_tokens=90, completion_tokens=350),
                       model="footprint/Sim-8B", worker=worker, attempts=1, latency_s=12.5,
                       messages=p.messages, metadata=p.metadata, response_id=f"chatcmpl-{p.id}",
                       finished_at=time.time()) for p in prompts]

    def commit(self, batches: list[Batch], worker: str, share: float = 1.0) -> None:
        """The worker's result writer commits the first `share` of each batch's prompts."""
        now = repr(time.time())
        with self.conn.pipeline(transaction=False) as pipe:
            for b in batches:
                done = b.prompts[: int(len(b.prompts) * share)]
                script_keys, args = scripts.record_call(self.job, b.id, worker, now,
                                                        self.results(b, done, worker), [], "")
                self._record(keys=script_keys, args=args, client=pipe)
            pipe.execute()

    def release(self, batches: list[Batch], shard_bytes_per_record: int) -> None:
        """Completion: RELEASE with each batch's ShardInfo (the shard itself is not written), built from the
        results Redis holds, as a worker's is."""
        with self.conn.pipeline(transaction=False) as pipe:
            for b in batches:
                pipe.hgetall(keys.batch_results(self.job, b.id))
            stored = [{k.decode(): v for k, v in found.items()} for found in pipe.execute()]
        with self.conn.pipeline(transaction=False) as pipe:
            for b, results in zip(batches, stored):
                info = ShardInfo(batch=b.id, uri=f"/nonexistent/footprint/{self.job}/shards/{b.id}.jsonl",
                                 records=len(b.prompts), bytes=len(b.prompts) * shard_bytes_per_record, at=time.time())
                script_keys, args = scripts.release_call(BatchRef(self.job, b.id), info, "", results, [])
                self._release(keys=script_keys, args=args, client=pipe)
            pipe.execute()

    def expire_rq_jobs(self, batches: list[Batch]) -> None:
        """What RQ's result_ttl does an hour after each batch finished: its RQ job hash goes."""
        with self.conn.pipeline(transaction=False) as pipe:
            for b in batches:
                pipe.delete(rq_queue(self.conn).job_class.key_for(self._rq_ids.pop(b.id, "")))
            pipe.execute()

    def finish(self, batches: list[Batch], worker: str, chunk: int = 32) -> None:
        for start in range(0, len(batches), chunk):
            part = batches[start:start + chunk]
            self.lease(len(part), f"{worker}.eng")
            self.commit(part, worker)
            self.release(part, self.prompt_chars + self.completion_chars + 300)

    def heartbeat(self, worker: str, held: list[Batch]) -> None:
        """A live worker's status and in-flight records, as its heartbeat writes them."""
        now = time.time()
        status = WorkerStatus(name=worker, host="bench", pid=1, server="http://127.0.0.1:1", state="busy",
                              started_at=now, heartbeat_at=now, concurrency_target=64, server_capacity=64,
                              in_flight=64, queued=len(held) * self.batch_size // 2,
                              batches=[BatchRef(self.job, b.id) for b in held], prefetch=HELD_PER_WORKER)
        with self.conn.pipeline(transaction=False) as pipe:
            pipe.sadd(keys.WORKERS, worker)
            pipe.set(keys.worker_status(worker), pack(status), ex=3600)
            pipe.set(keys.job_inflight(self.job, worker),
                     pack(InFlight(worker=worker, job=self.job, at=now, tokens=[100] * 64, queued=status.queued)),
                     ex=3600)
            pipe.execute()


# ------------------------------------------------------------------ bytes per prompt


@dataclass
class Footprint:
    prompts: int
    per_queued: float  # used_memory bytes per queued prompt (batch record, id, RQ job)
    per_in_flight: float  # per prompt of a leased batch with every result committed, not yet released
    per_finished: float  # per prompt of a job whose every batch is released
    result_blob: int  # bytes of one stored result (without its prompt)
    result_blob_with_prompt: int  # the same result with the prompt's copy (what genq stored before)
    finished_keys: dict[str, int]  # key (kind) of the finished job -> MEMORY USAGE bytes


def _key_kind(key: str, job: str) -> str:
    """keys.py's name for a key of the job (its last part), else the key with its variable parts as *."""
    prefix = f"genq:job:{job}:"
    if key.startswith(prefix):
        return key[len(prefix):].split(":", 1)[0]
    parts = key.split(":")
    if parts[0] == "rq" and len(parts) > 2:
        return ":".join(parts[:2]) + ":*"
    if key.startswith("genq:lease:"):
        return "genq:lease:*:reply"
    return key


def measure_footprint(n_prompts: int = 20_480, *, prompt_chars: int = 400, completion_chars: int = 1500,
                      batch_size: int = 256) -> Footprint:
    """Bytes of Redis per queued, in-flight and finished prompt, at realistic texts."""
    n_batches = max(1, n_prompts // batch_size)
    n = n_batches * batch_size
    with LocalRedis() as r:
        base = r.used_memory()
        fill = Filler(r.conn, "fp", prompt_chars=prompt_chars, completion_chars=completion_chars, batch_size=batch_size)
        batches = fill.queue(n_batches)
        queued = r.used_memory()
        fill.lease(len(batches), "fp-w.eng")
        fill.commit(batches, "fp-w")
        in_flight = r.used_memory()
        fill.release(batches, prompt_chars + completion_chars + 300)
        fill.expire_rq_jobs(batches)
        finished = r.used_memory()
        kinds: dict[str, int] = {}
        for raw in r.conn.scan_iter(count=1000):
            kind = _key_kind(raw.decode(), "fp")
            kinds[kind] = kinds.get(kind, 0) + int(r.conn.memory_usage(raw, samples=0) or 0)
        sample = fill.results(batches[0], batches[0].prompts[:1], "fp-w")[0]
    return Footprint(prompts=n, per_queued=(queued - base) / n, per_in_flight=(in_flight - base) / n,
                     per_finished=(finished - base) / n, result_blob=len(pack(without_prompt(sample))),
                     result_blob_with_prompt=len(pack(sample)), finished_keys=dict(sorted(kinds.items())))


# ------------------------------------------------------------------ refresh time


def fill_mid_job(conn: redis.Redis, n_prompts: int, *, chars: int = 16, batch_size: int = 256,
                 job: str = "scale") -> int:
    """Half the batches finished, WORKERS workers holding HELD_PER_WORKER half-done batches each,
    the rest queued in RQ; returns the number of batches."""
    n_batches = max(2 * WORKERS * HELD_PER_WORKER, n_prompts // batch_size)
    fill = Filler(conn, job, prompt_chars=chars, completion_chars=chars, batch_size=batch_size)
    batches = fill.queue(n_batches, chunk=128)
    n_done = n_batches // 2
    for w in range(WORKERS):
        fill.finish(batches[w:n_done:WORKERS], f"w{w}")
    held = batches[n_done:n_done + WORKERS * HELD_PER_WORKER]
    for w in range(WORKERS):
        mine = held[w * HELD_PER_WORKER:(w + 1) * HELD_PER_WORKER]
        fill.lease(len(mine), f"w{w}.eng")
        fill.commit(mine, f"w{w}", share=0.5)
        fill.heartbeat(f"w{w}", mine)
    return n_batches


def refresh_once(conn: redis.Redis, job: str, names: QueueMirror) -> float:
    """One monitor refresh's reads (what Monitor.refresh reads for one job), in seconds."""
    started = time.perf_counter()
    workers = fleet.statuses(conn)
    names.refresh(conn)
    snap = read_job(conn, job, workers, queued=names.by_job.get(job, 0), rq_queued=names.total)
    elapsed = time.perf_counter() - started
    assert snap is not None and snap.total > 0
    return elapsed


@dataclass
class RefreshFigures:
    small: int
    large: int
    small_batches: int
    large_batches: int
    small_ms: float  # median of the refreshes at `small` prompts
    large_ms: float
    fill_s: float  # time to fill the large state

    @property
    def ratio(self) -> float:
        return self.large_ms / self.small_ms

    @property
    def met(self) -> bool:
        return self.ratio <= TARGET_RATIO


def measure_refresh(small: int = 20_000, large: int = 2_000_000, *, rounds: int = 10, per_round: int = 20,
                    chars: int = 16) -> RefreshFigures:
    with LocalRedis() as a, LocalRedis() as b:
        small_batches = fill_mid_job(a.conn, small, chars=chars)
        started = time.monotonic()
        large_batches = fill_mid_job(b.conn, large, chars=chars)
        fill_s = time.monotonic() - started
        gc.collect()
        gc.freeze()  # the fill's garbage is gone; timing is not charged with collecting it
        names_a = QueueMirror()
        names_b = QueueMirror()
        refresh_once(a.conn, "scale", names_a)  # warm: the live monitor's cache of queued RQ ids
        refresh_once(b.conn, "scale", names_b)
        times_a: list[float] = []
        times_b: list[float] = []
        for _ in range(rounds * per_round):  # alternately, so that the machine's load falls on both alike
            times_a.append(refresh_once(a.conn, "scale", names_a))
            times_b.append(refresh_once(b.conn, "scale", names_b))
    return RefreshFigures(small=small, large=large, small_batches=small_batches, large_batches=large_batches,
                          small_ms=statistics.median(times_a) * 1000, large_ms=statistics.median(times_b) * 1000,
                          fill_s=fill_s)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", type=int, default=20_000, help="prompts of the small job (default 20,000)")
    ap.add_argument("--large", type=int, default=2_000_000, help="prompts of the large job (default 2,000,000)")
    ap.add_argument("--footprint-prompts", type=int, default=20_480, help="prompts for the bytes per prompt")
    ap.add_argument("--prompt-chars", type=int, default=400)
    ap.add_argument("--completion-chars", type=int, default=1500)
    ap.add_argument("--bulk-chars", type=int, default=16, help="prompt and completion length in the refresh states")
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args(argv)
    print(f"conditions: {conditions()}")
    fp = measure_footprint(args.footprint_prompts, prompt_chars=args.prompt_chars,
                           completion_chars=args.completion_chars)
    print(f"\nRedis used_memory per prompt ({fp.prompts:,} prompts, prompt {args.prompt_chars} chars, "
          f"completion {args.completion_chars} chars, batches of 256):")
    print(table(["state", "bytes per prompt"], [
        ["queued (batch record, id, RQ job)", round(fp.per_queued)],
        ["in flight (leased, every result committed, shard not yet written)", round(fp.per_in_flight)],
        ["finished (shard written and released)", round(fp.per_finished)],
    ]))
    print(f"one stored result: {fp.result_blob:,} bytes; with the prompt's copy (genq before #15): "
          f"{fp.result_blob_with_prompt:,} bytes")
    print("\nwhat the finished job keeps (MEMORY USAGE, bytes in all / per prompt):")
    print(table(["key", "bytes", "per prompt"],
                [[k, v, round(v / fp.prompts, 1)] for k, v in fp.finished_keys.items()]))
    rf = measure_refresh(args.small, args.large, rounds=args.rounds, chars=args.bulk_chars)
    print(f"\nmonitor refresh (fleet.statuses + queue mirror + read_job), mid-job: half the batches finished, "
          f"{WORKERS} workers x {HELD_PER_WORKER} held batches, the rest queued; "
          f"large state filled in {rf.fill_s:.0f}s")
    print(table(["prompts", "batches", "refresh, median ms"], [
        [rf.small, rf.small_batches, round(rf.small_ms, 2)], [rf.large, rf.large_batches, round(rf.large_ms, 2)]]))
    verdict = "met" if rf.met else "MISSED"
    print(f"ratio {rf.ratio:.2f} (target <= {TARGET_RATIO}): {verdict}")
    per10m = fp.per_finished * 10_000_000 / 2**20
    print(f"extrapolated: a finished 10 M-prompt job keeps {per10m:,.0f} MiB in Redis")
    return 0 if rf.met else 1


if __name__ == "__main__":
    raise SystemExit(main())
