"""Where a job's output goes (a local directory or s3://bucket/prefix):

    OUTPUT/JOB/shards/BATCH.jsonl[.gz]   a batch's results, one JSON object a line, by input index
    OUTPUT/JOB/manifest/BATCH.json       its marker (durable.ShardMarker), created after the shard
    OUTPUT/JOB/job.json                  the job (durable.JobRecord), before its first batch is queued
    OUTPUT/JOB/enqueues/RUN.json         what one enqueue queued (durable.EnqueueRecord)
    OUTPUT/JOB/rejects/NAME.rejects.jsonl  the lines enqueue rejected from input NAME

A reader lists manifest/ and reads only the shards named there: a shard without a marker may still
be being written. The marker is the commit (genq.output.truth). Batch numbers are never reused in a
job's folder, so a name is one batch of one job's life; a shard whose name holds other bytes is
never overwritten, the second writer's copy gets a tag in its name.
"""

from __future__ import annotations

SHARDS_DIR = "shards"
MANIFEST_DIR = "manifest"
ENQUEUES_DIR = "enqueues"
REJECTS_DIR = "rejects"
JOB_FILE = "job.json"


def shard_name(batch_id: str, compression: str, tag: str = "") -> str:
    name = f"{batch_id}.{tag}" if tag else batch_id
    return f"{name}.jsonl.gz" if compression == "gzip" else f"{name}.jsonl"


def batch_of_marker(name: str) -> str | None:
    """The batch a manifest file name stands for; None for what is not a marker."""
    if name.startswith(".") or not name.endswith(".json"):
        return None
    return name.removesuffix(".json")


def job_root(output: str, job: str) -> str:
    return f"{output.rstrip('/')}/{job}"
