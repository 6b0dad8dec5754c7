"""The one place that names Redis keys: genq's under ``genq:``, RQ's (``rq:*``) of the one queue QUEUE."""

from __future__ import annotations

import re

QUEUE = "genq"  # the RQ queue every batch job goes to (`rq info` shows it)
# RQ 2.x's own keys of that queue (tests/test_scripts.py checks them against RQ).
RQ_QUEUE = f"rq:queue:{QUEUE}"
RQ_STARTED = f"rq:wip:{QUEUE}"  # StartedJobRegistry: "RQID:EXECUTION" -> expiry (+inf: genq's ledger decides)
RQ_SUSPENDED = "rq:suspended"  # `rq suspend`

JOBS = "genq:jobs"  # set of job names
PAUSED = "genq:paused"  # global pause flag (genq pause without --job)
WORKERS = "genq:workers"  # set of worker names that have ever heartbeated
RECONCILE_LOCK = "genq:reconcile:lock"  # one reconciler pass at a time across the fleet
SERVERS = "genq:server:"  # what genq keeps of a server beyond its workers' lives: nothing of any job
# Pub/sub channel that wakes idle engines (worker/heartbeat.py): a control changed, batches were queued, or
# (anything else) prompts were given back.
WAKE = "genq:wake"
WAKE_CONTROL = b"control"
WAKE_QUEUED = b"queued"

JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_job_name(name: str) -> str:
    if not JOB_NAME.match(name):
        raise ValueError(f"invalid job name {name!r}: use 1-64 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit")
    return name


job_config = "genq:job:{}:config".format  # JobConfig
job_ids = "genq:job:{}:ids".format  # hash: id -> 8-byte content digest (idempotent enqueue) + 4-byte batch number
job_batch_seq = "genq:job:{}:batch_seq".format  # the last batch number allocated
job_batches = "genq:job:{}:batches".format  # sorted set: batch ids scored by creation order
job_done = "genq:job:{}:done".format  # set: batch ids whose shard is written
job_stats = "genq:job:{}:stats".format  # hash of job-level facts: total prompts, created_at, shard totals...
job_shards = "genq:job:{}:shards".format  # hash: batch id -> ShardInfo (the manifest's source)
job_hist = "genq:job:{}:hist".format  # hash: output-length bucket -> finished completions
job_dlq = "genq:job:{}:dlq".format  # hash: prompt id -> DeadLetter
job_paused = "genq:job:{}:paused".format
job_schedule = "genq:job:{}:schedule".format  # JobSchedule: priority and fair-share weight (not a settings version)
# Hash: engine instance -> "REDIS_SECONDS COUNT", its claimed or in-flight prompts (worker/intake.py).
job_share = "genq:job:{}:share".format
job_blocked = "genq:job:{}:blocked".format  # JobBlock: why the job is blocked (set with job_paused)
job_workers = "genq:job:{}:workers".format  # set of workers that have counters for this job
job_leases = "genq:job:{}:leases".format  # hash: batch id -> the current lease ("TOKEN INSTANCE")
job_transport = "genq:job:{}:transport".format  # hash: batch id -> the RQ job that carries the batch now
worker_stats = "genq:job:{}:wstats:{}".format  # (job, worker): hash of counters: done, failed, in_tok, out_tok...
job_inflight = "genq:job:{}:inflight:{}".format  # (job, worker): InFlight, short TTL
batch = "genq:job:{}:batch:{}".format  # (job, batch): BatchSource, the batch's prompts or their input range
batch_results = "genq:job:{}:res:{}".format  # (job, batch): hash: prompt id -> Result, until the shard is written
batch_claims = "genq:job:{}:claims:{}".format  # (job, batch): hash: prompt id -> its one sender (an engine instance)
# (job, batch): hash: prompt id -> tries lost (claims that ended without an outcome); `attempts` adds them.
batch_tries = "genq:job:{}:tries:{}".format


worker_status = "genq:worker:{}".format  # WorkerStatus
worker_control = "genq:worker:{}:control".format  # Control
engine_alive = "genq:engine:{}:alive".format  # an engine instance's liveness (its beats renew it)
engine_took = "genq:engine:{}:took".format  # "TOKEN JOB BATCH RQID": the batch an engine's last TAKE leased
server_decode = (SERVERS + "{1}@{0}:decode").format  # (server, model): ServerDecode, as its last worker left it


def job_keys_pattern(job: str) -> str:
    """SCAN MATCH pattern for every key of a job; glob characters escaped."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", f"genq:job:{job}:") + "*"
