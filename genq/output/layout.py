"""The one definition of where a job's output goes (a local directory or s3://bucket/prefix).

    OUTPUT/JOB/shards/BATCH.jsonl[.gz]   one shard per batch: its results, one JSON object a line,
                                         sorted by input index
    OUTPUT/JOB/manifest/BATCH.json       a marker written after its shard: ShardInfo JSON
                                         {batch, uri, records, bytes, at}

A reader lists manifest/ and reads only the shards named there: a shard without a
marker may still be being written. Names depend only on the batch id, so a batch
that is redone overwrites its shard and marker instead of adding a second copy.
"""

from __future__ import annotations

SHARDS_DIR = "shards"
MANIFEST_DIR = "manifest"


def shard_name(batch_id: str, compression: str) -> str:
    return f"{batch_id}.jsonl.gz" if compression == "gzip" else f"{batch_id}.jsonl"


def marker_name(batch_id: str) -> str:
    return f"{batch_id}.json"


def join(*parts: str) -> str:
    """Path or key parts joined with '/', without doubled or trailing separators."""
    return "/".join(p.strip("/") for p in parts if p.strip("/"))


def job_root(output: str, job: str) -> str:
    return f"{output.rstrip('/')}/{job}"


def shard_path(output: str, job: str, batch_id: str, compression: str) -> str:
    return f"{job_root(output, job)}/{SHARDS_DIR}/{shard_name(batch_id, compression)}"


def marker_path(output: str, job: str, batch_id: str) -> str:
    return f"{job_root(output, job)}/{MANIFEST_DIR}/{marker_name(batch_id)}"
