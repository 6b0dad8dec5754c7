"""The one place that names Redis keys. Nothing else in genq builds a key string.

Everything genq owns lives under ``genq:``; RQ's own keys (``rq:*``) hold the
batch jobs of the single RQ queue named by QUEUE.
"""

from __future__ import annotations

import re

QUEUE = "genq"  # the RQ queue every batch job goes to (`rq info` shows it)
# RQ's own keys of that queue, as RQ 2.x names them (tests/test_scripts.py checks them against RQ):
# the engine takes batches with TAKE, and must write where `rq info` reads.
RQ_QUEUE = f"rq:queue:{QUEUE}"
RQ_STARTED = f"rq:wip:{QUEUE}"  # StartedJobRegistry: "RQID:EXECUTION" -> expiry (+inf: genq's ledger decides)
RQ_SUSPENDED = "rq:suspended"  # `rq suspend`

JOBS = "genq:jobs"  # set of job names
PAUSED = "genq:paused"  # global pause flag (genq pause without --job)
WORKERS = "genq:workers"  # set of worker names that have ever heartbeated
WAKE = "genq:wake"  # pub/sub channel: prompts were given back, idle workers look for some to take (worker/idle.py)
# A WAKE message that says an operator changed a control (drain, pause, cap): idle workers read
# theirs at once rather than at their next idle beat (worker/idle.py). Any other message is work.
WAKE_CONTROL = b"control"
WAKE_QUEUED = b"queued"  # a WAKE message that says batches were queued: engines wanting one TAKE now

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise ValueError(
            f"invalid job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return name


def _job(job: str) -> str:
    return f"genq:job:{job}"


def job_config(job: str) -> str:
    return f"{_job(job)}:config"


def job_ids(job: str) -> str:
    """Hash: prompt id -> content digest (8 bytes), for idempotent enqueue."""
    return f"{_job(job)}:ids"


def job_batch_seq(job: str) -> str:
    return f"{_job(job)}:batch_seq"


def job_batches(job: str) -> str:
    """Sorted set of batch ids scored by creation order."""
    return f"{_job(job)}:batches"


def job_done(job: str) -> str:
    """Set of batch ids whose shard is written."""
    return f"{_job(job)}:done"


def job_stats(job: str) -> str:
    """Hash of job-level facts: total prompts, started_at, ..."""
    return f"{_job(job)}:stats"


def job_shards(job: str) -> str:
    """Hash: batch id -> ShardInfo (the manifest's source)."""
    return f"{_job(job)}:shards"


def job_hist(job: str) -> str:
    """Hash: length bucket -> count of finished completions (see genq.lengths)."""
    return f"{_job(job)}:hist"


def job_dlq(job: str) -> str:
    """Hash: prompt id -> DeadLetter."""
    return f"{_job(job)}:dlq"


def job_paused(job: str) -> str:
    return f"{_job(job)}:paused"


def job_schedule(job: str) -> str:
    """JobSchedule record: the job's priority and fair-share weight (genq.core.order; not a settings version)."""
    return f"{_job(job)}:schedule"


def job_share(job: str) -> str:
    """Hash: engine instance -> "REDIS_SECONDS COUNT", the job's prompts each engine has claimed or in
    flight, refreshed each second while it holds any: the fleet-wide fair share (worker/shares.py)."""
    return f"{_job(job)}:share"


def job_blocked(job: str) -> str:
    """JobBlock record: why the job is blocked (set with keys.job_paused; `genq resume --job` clears both)."""
    return f"{_job(job)}:blocked"


def job_workers(job: str) -> str:
    """Set of workers that have counters for this job."""
    return f"{_job(job)}:workers"


def worker_stats(job: str, worker: str) -> str:
    """Hash of one worker's counters for one job: done, failed, in_tok, out_tok, ..."""
    return f"{_job(job)}:wstats:{worker}"


def job_inflight(job: str, worker: str) -> str:
    """InFlight record (short TTL): a worker's running requests for the job."""
    return f"{_job(job)}:inflight:{worker}"


def batch(job: str, batch_id: str) -> str:
    """The Batch record (msgpack): the prompts themselves."""
    return f"{_job(job)}:batch:{batch_id}"


def batch_results(job: str, batch_id: str) -> str:
    """Hash: prompt id -> Result, kept until the batch's shard is written."""
    return f"{_job(job)}:res:{batch_id}"


def batch_claims(job: str, batch_id: str) -> str:
    """Hash: prompt id -> engine instance that is sending it (or about to): one sender per prompt.

    A claim counts while its engine heartbeats (engine_alive); an outcome ends it."""
    return f"{_job(job)}:claims:{batch_id}"


def batch_tries(job: str, batch_id: str) -> str:
    """Hash: prompt id -> tries lost: claims of it that ended without an outcome (their engine
    was killed, their lease is over). Written only when such a claim is taken over; gone with
    the batch's release. A record's `attempts` adds them (worker/claims.py)."""
    return f"{_job(job)}:tries:{batch_id}"


def worker_status(worker: str) -> str:
    return f"genq:worker:{worker}"


SERVERS = "genq:server:"  # what genq keeps of a server beyond its workers' lives: nothing of any job


def server_decode(server: str, model: str) -> str:
    """String: msgpack ServerDecode, a server's decode figures as its last worker left them (worker/decoding.py)."""
    return f"{SERVERS}{model}@{server}:decode"


def worker_control(worker: str) -> str:
    return f"genq:worker:{worker}:control"


def engine_alive(instance: str) -> str:
    return f"genq:engine:{instance}:alive"


def engine_took(instance: str) -> str:
    """"TOKEN JOB BATCH RQID": the batch an engine's last TAKE leased (a resent TAKE answers it again)."""
    return f"genq:engine:{instance}:took"


def job_leases(job: str) -> str:
    """Hash: batch id -> the current lease ("TOKEN INSTANCE"): who is driving the batch now."""
    return f"{_job(job)}:leases"


def job_transport(job: str) -> str:
    """Hash: batch id -> id of the RQ job that carries the batch now (queued or held)."""
    return f"{_job(job)}:transport"


RECONCILE_LOCK = "genq:reconcile:lock"  # one reconciler pass at a time across the fleet


def job_keys_pattern(job: str) -> str:
    """SCAN MATCH pattern for every key of a job (genq jobs delete); glob characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", f"{_job(job)}:") + "*"
