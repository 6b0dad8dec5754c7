"""The one definition of where a job's output goes (a local directory or s3://bucket/prefix).

    OUTPUT/JOB/shards/BATCH.jsonl[.gz]   one shard per batch: its results, one JSON object a line,
                                         sorted by input index
    OUTPUT/JOB/manifest/BATCH.json       a marker written after its shard: ShardMarker JSON
                                         {batch, uri, records, bytes, at, incarnation, ...}
    OUTPUT/JOB/job.json                  the job as created (durable.JobRecord), written
                                         before its first batch is queued

A reader lists manifest/ and reads only the shards named there: a shard without a
marker may still be being written. The marker is the commit: it is created once and
never replaced (genq.output.truth), and names the shard it describes. Batch numbers
are never reused in a job's folder (JobRecord.reserved survives a Redis loss and a
job deleted and created again), so a name is one batch of one job's life. A shard
whose name holds other bytes is never overwritten: the second writer's copy goes
under an alternative name (alt_shard_name) and the first marker decides which counts.
"""

from __future__ import annotations

SHARDS_DIR = "shards"
MANIFEST_DIR = "manifest"


def shard_name(batch_id: str, compression: str) -> str:
    return f"{batch_id}.jsonl.gz" if compression == "gzip" else f"{batch_id}.jsonl"


def alt_shard_name(batch_id: str, compression: str, tag: str) -> str:
    """Where a batch's shard goes when its usual name already holds other bytes."""
    return shard_name(f"{batch_id}.{tag}", compression)


def marker_name(batch_id: str) -> str:
    return f"{batch_id}.json"


def batch_of_marker(name: str) -> str | None:
    """The batch id a manifest file name stands for; None for what is not a marker."""
    if name.startswith(".") or not name.endswith(".json"):
        return None
    return name[: -len(".json")]


JOB_FILE = "job.json"


def join(*parts: str) -> str:
    """Path or key parts joined with '/', without doubled or trailing separators."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def job_root(output: str, job: str) -> str:
    return f"{output.rstrip('/')}/{job}"


def shard_path(output: str, job: str, batch_id: str, compression: str) -> str:
    return f"{job_root(output, job)}/{SHARDS_DIR}/{shard_name(batch_id, compression)}"


def marker_path(output: str, job: str, batch_id: str) -> str:
    return f"{job_root(output, job)}/{MANIFEST_DIR}/{marker_name(batch_id)}"


def job_file_path(output: str, job: str) -> str:
    return f"{job_root(output, job)}/{JOB_FILE}"
