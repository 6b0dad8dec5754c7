"""The one exactly-once audit every end-to-end test ends with.

    found = audit(rconn, "job", out_dir, input_ids)

checks, against what is really stored (shard files, Redis, RQ's registries) and
what `genq monitor --job JOB --once --json` reports:

- shards: every shard has its manifest marker and vice versa, the marker's record
  count is the shard's, each record belongs to this job and to the shard's batch,
  and no prompt id is in the shards twice;
- prompts: every input id has exactly one result (in a shard, or still in Redis for
  a batch that failed in RQ) or exactly one dead letter; none both, none invented,
  none lost (prompts of a batch the caller expects to have failed may have neither);
- the shard invariant: every shard was written with its batch's prompt count minus the
  batch's dead letters (its records, in its file), and no dead letter of its batch came since;
- counters: the workers' done/in_tok/out_tok and the length histogram equal the
  results stored, the job's running shard totals (records, bytes: RELEASE keeps
  them) equal a recount of the shard records in Redis and of the markers (their failed
  counts every letter stored: requeue and purge keep that
  history), and the monitor's completed, failed, total,
  shard_records, shards, batches_done/batches_total and tokens equal them too;
- RQ: the queue `genq`, its intermediate list and the started registry hold no batch of this job, the failed
  registry holds exactly the batches the caller names in `failed_batches`, and none of them holds
  an id whose job hash is gone (`rq info` counts those too).

Every disagreement is collected and raised together as one AssertionError that
names what disagrees. The findings come back (Audit) for further checks.
"""

from __future__ import annotations

import gzip
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import redis
from rq.registry import FailedJobRegistry, StartedJobRegistry

from genq.core import keys, scripts
from genq.core.queueing import RUN_BATCH, fetch_rq_jobs, load_batch, rq_queue
from genq.core.records import DeadLetter, Result, ShardInfo, unpack
from tests.conftest import run_genq


@dataclass
class Audit:
    rows: list[dict]  # every shard record, shard by shard
    results: dict[str, dict]  # prompt id -> its shard record
    pending: dict[str, Result]  # prompt id -> a result still in Redis (a batch RQ gave up on)
    letters: dict[str, DeadLetter]  # prompt id -> its dead letter
    unfinished: set[str]  # input ids of expected failed batches with neither
    monitor: dict  # `genq monitor --job JOB --once --json`
    shard_batches: list[str] = field(default_factory=list)


def _redis_url(conn: redis.Redis) -> str:
    kw = conn.connection_pool.connection_kwargs
    return f"redis://{kw.get('host', '127.0.0.1')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


def _read_shard(path: Path) -> list[dict]:
    raw = path.read_bytes()
    if path.name.endswith(".gz"):
        raw = gzip.decompress(raw)
    return [json.loads(line) for line in raw.decode().splitlines() if line.strip()]


def _rq_holdings(conn: redis.Redis, rq_ids: list[str], job: str) -> tuple[list[str], list[str]]:
    """Of these RQ job ids: those whose job hash is gone, and the batches of `job` the rest carry."""
    orphans, batches = [], []
    for rq_id, rq_job in zip(rq_ids, fetch_rq_jobs(conn, rq_ids)):  # JSON: genq's jobs are never pickled
        if rq_job is None:
            orphans.append(rq_id)
        elif rq_job.func_name == RUN_BATCH and str(rq_job.args[0]) == job:
            batches.append(str(rq_job.args[1]))
    return orphans, sorted(batches)


def monitor_json(conn: redis.Redis, job: str) -> dict:
    proc = run_genq("monitor", "--job", job, "--once", "--json", redis_url=_redis_url(conn))
    return json.loads(proc.stdout)


def audit(conn: redis.Redis, job: str, out: Path | str, ids: list[str], *,
          failed_batches: set[str] | frozenset[str] = frozenset()) -> Audit:
    """Check exactly-once for `job` whose input ids are `ids`; raise one AssertionError listing every problem."""
    problems: list[str] = []
    out = Path(out)
    inputs = Counter(ids)
    if dupes := sorted(i for i, n in inputs.items() if n > 1):
        raise ValueError(f"audit: the input ids themselves repeat: {dupes[:10]}")
    wanted = set(ids)

    # --- shards and their markers
    shard_dir, manifest_dir = out / job / "shards", out / job / "manifest"
    shards = {p.name.split(".")[0]: p for p in sorted(shard_dir.glob("*.jsonl*")) if not p.name.startswith(".")}
    markers = {p.stem: json.loads(p.read_text()) for p in sorted(manifest_dir.glob("*.json"))
               if not p.name.startswith(".")}
    if set(shards) != set(markers):
        problems.append(f"shards without a marker: {sorted(set(shards) - set(markers))}; "
                        f"markers without a shard: {sorted(set(markers) - set(shards))}")
    rows: list[dict] = []
    for batch_id, path in shards.items():
        shard_rows = _read_shard(path)
        rows.extend(shard_rows)
        if batch_id in markers and markers[batch_id].get("records") != len(shard_rows):
            problems.append(f"shard {path} holds {len(shard_rows)} records but its marker says "
                            f"{markers[batch_id].get('records')}")
        strangers = [r["id"] for r in shard_rows if r.get("job") != job or r.get("batch") != batch_id]
        if strangers:
            problems.append(f"shard {path} holds records of another job or batch: {strangers[:10]}")
    in_shards = Counter(r["id"] for r in rows)
    if twice := {i: n for i, n in in_shards.items() if n > 1}:
        problems.append(f"prompt ids in the shards more than once: {dict(sorted(twice.items())[:10])}")
    results = {r["id"]: r for r in rows}

    # --- Redis: letters, done batches, results not yet in a shard
    letters = {k.decode(): unpack(v, DeadLetter) for k, v in conn.hgetall(keys.job_dlq(job)).items()}
    done = {b.decode() for b in conn.smembers(keys.job_done(job))}
    all_batches = [b.decode() for b in conn.zrange(keys.job_batches(job), 0, -1)]
    if done != set(shards):
        problems.append(f"Redis's done set {sorted(done)} is not the batches with a shard {sorted(shards)}")
    pending: dict[str, Result] = {}
    for batch_id in all_batches:
        stored = conn.hgetall(keys.batch_results(job, batch_id))
        if stored and batch_id in done:
            problems.append(f"batch {batch_id} has its shard but still {len(stored)} results in Redis")
        if stored and batch_id not in done:
            for k, v in stored.items():
                if k.decode() in results:
                    problems.append(f"prompt {k.decode()} is in a shard and again in Redis under batch {batch_id}")
                pending[k.decode()] = unpack(v, Result)
    unexpected_pending = {pid for pid, r in pending.items() if r.batch not in failed_batches}
    if unexpected_pending:
        problems.append(f"results still in Redis, in no shard, of batches not expected to fail: "
                        f"{sorted(unexpected_pending)[:10]}")

    # --- exactly one outcome per input id
    finished = set(results) | set(pending)
    if both := sorted(finished & set(letters)):
        problems.append(f"prompts with both a result and a dead letter: {both[:10]}")
    if invented := sorted((finished | set(letters)) - wanted):
        problems.append(f"results or letters for ids not in the input: {invented[:10]}")
    held_by_failed: set[str] = set()
    for batch_id in failed_batches:
        batch = load_batch(conn, job, batch_id)
        if batch is None:
            problems.append(f"batch {batch_id} is expected to have failed but its record is gone")
        else:
            held_by_failed |= set(batch.prompt_ids())
    missing = wanted - finished - set(letters)
    if lost := sorted(missing - held_by_failed):
        problems.append(f"input ids with neither a result nor a dead letter (lost): {lost[:10]} "
                        f"({len(lost)} in all)")
    unfinished = missing & held_by_failed

    # --- counters against what is stored
    names = sorted(w.decode() for w in conn.smembers(keys.job_workers(job)))
    sums = Counter()
    for name in names:
        for k, v in conn.hgetall(keys.worker_stats(job, name)).items():
            if k.decode() in ("done", "failed", "in_tok", "out_tok"):
                sums[k.decode()] += int(v)
    stored_results = list(results.values()) + [msgspec.to_builtins(r) for r in pending.values()]
    in_tok = sum(r["usage"]["prompt_tokens"] for r in stored_results)
    out_tok = sum(r["usage"]["completion_tokens"] for r in stored_results)
    hist = sum(int(v) for v in conn.hvals(keys.job_hist(job)))
    for what, counted, stored in (
        ("workers' done", sums["done"], len(stored_results)),
        ("workers' in_tok", sums["in_tok"], in_tok),
        ("workers' out_tok", sums["out_tok"], out_tok),
        ("length histogram", hist, len(stored_results)),
    ):
        if counted != stored:
            problems.append(f"{what} counter is {counted} but {stored} are stored")
    # A worker's `failed` counts its letters still stored: `genq dlq requeue`/`purge` take theirs off.
    if sums["failed"] != len(letters):
        problems.append(f"workers' failed counter is {sums['failed']} but {len(letters)} letters are stored")

    # The running totals the monitor reads (kept by the ledger's RELEASE) against a full recount.
    infos = [unpack(v, ShardInfo) for v in conn.hvals(keys.job_shards(job))]
    stats = conn.hgetall(keys.job_stats(job))
    for what, kept, counted in (
        ("shard_records", int(stats.get(scripts.SHARD_RECORDS.encode(), 0)), sum(i.records for i in infos)),
        ("shard_bytes", int(stats.get(scripts.SHARD_BYTES.encode(), 0)), sum(i.bytes for i in infos)),
        ("shard_records (markers)", int(stats.get(scripts.SHARD_RECORDS.encode(), 0)),
         sum(int(m.get("records", 0)) for m in markers.values())),
        ("shard_bytes (markers)", int(stats.get(scripts.SHARD_BYTES.encode(), 0)),
         sum(int(m.get("bytes", 0)) for m in markers.values())),
    ):
        if kept != counted:
            problems.append(f"the job's running total {what} is {kept} but a recount gives {counted}")
    if len(infos) != len(done):
        problems.append(f"{len(infos)} shard records in Redis for {len(done)} done batches")
    # The shard invariant (#30): a shard is written only when every prompt of its batch has an
    # outcome: its records and the batch's dead letters then were the batch's prompts. Letters can
    # only leave the DLQ since (`genq dlq requeue` / `purge`), never come.
    letters_of = Counter(d.batch for d in letters.values())
    rows_of = Counter(r.get("batch") for r in rows)
    for info in infos:
        if info.records + info.letters != info.prompts or rows_of[info.batch] != info.records:
            problems.append(f"shard {info.batch} was written with {info.records} records ({rows_of[info.batch]} in "
                            f"its file) and {info.letters} dead letters for a batch of {info.prompts} prompts")
        if letters_of[info.batch] > info.letters:
            problems.append(f"batch {info.batch} has {letters_of[info.batch]} dead letters, its shard counted "
                            f"{info.letters}")

    mon = monitor_json(conn, job)
    for what, reported, stored in (
        ("completed", mon.get("completed"), len(stored_results)),
        ("failed", mon.get("failed"), len(letters)),
        ("total", mon.get("total"), len(ids)),
        ("shard_records", mon.get("shard_records"), len(rows)),
        ("s3_bytes", mon.get("s3_bytes"), sum(i.bytes for i in infos)),
        ("shards", mon.get("shards"), len(shards)),
        ("batches_done", mon.get("batches_done"), len(done)),
        ("batches_total", mon.get("batches_total"), len(all_batches)),
        ("total_input_tokens", mon.get("total_input_tokens"), in_tok),
        ("total_output_tokens", mon.get("total_output_tokens"), out_tok),
        ("in_flight", mon.get("in_flight"), 0),
    ):
        if reported != stored:
            problems.append(f"monitor says {what}={reported} but {stored} stored")
    shown_failed = sum(w["job_failed"] for w in mon.get("worker_details", []))
    if shown_failed != mon.get("failed"):
        problems.append(f"monitor's workers' failed add up to {shown_failed}, its job's failed is {mon.get('failed')}")
    if not failed_batches and mon.get("batches_done") != mon.get("batches_total"):
        problems.append(f"monitor says batches {mon.get('batches_done')}/{mon.get('batches_total')} done")
    # genq.core.ledger.figures: a job with nothing in it is empty; one with dead letters ends partial, never done
    finished_status = ("partial" if letters else "done") if ids else "empty"
    if not failed_batches and mon.get("status") != finished_status:
        problems.append(f"monitor says status={mon.get('status')!r}, not {finished_status!r}")

    # --- RQ's registries
    queue = rq_queue(conn)
    listed = {
        f"queue {keys.QUEUE!r}": queue.get_job_ids(),
        "RQ's intermediate list": [i.decode() for i in conn.lrange(queue.intermediate_queue_key, 0, -1)],
        "RQ's started registry": StartedJobRegistry(queue=queue).get_job_ids(),
        "RQ's failed registry": FailedJobRegistry(queue=queue).get_job_ids(),
    }
    for where, rq_ids in listed.items():
        orphans, batches = _rq_holdings(conn, rq_ids, job)
        if orphans:  # an id whose job hash is gone belongs to no job any more, but `rq info` still counts it
            problems.append(f"{where} holds ids with no job behind them (rq info counts them): {orphans}")
        if where == "RQ's failed registry":
            if set(batches) != set(failed_batches):
                problems.append(f"{where} holds batches {batches} of {job}, expected {sorted(failed_batches)}")
        elif batches:
            problems.append(f"{where} still holds batches of {job}: {batches}")

    if problems:
        raise AssertionError(f"exactly-once audit of job {job!r} ({len(ids)} input ids) failed:\n  - "
                             + "\n  - ".join(problems))
    return Audit(rows=rows, results=results, pending=pending, letters=letters, unfinished=unfinished,
                 monitor=mon, shard_batches=list(shards))

