"""The records of the written output, genq's durable truth (docs/recovery.md): what lies beside
the shards so that a ledger lost with Redis can be rebuilt from the output alone. Apart from
genq.core.records (which they extend) because only the output's writers and readers need them."""

from __future__ import annotations

import msgspec

from genq.core.records import DeadLetter, JobConfig, ShardInfo


class ShardMarker(ShardInfo):
    """A shard's marker on disk (OUTPUT/JOB/manifest/BATCH.json): its ShardInfo plus what
    rebuilding the job's ledger from the output needs, without reading the shard.
    Redis keeps only the ShardInfo (keys.job_shards); the rest lives in the output."""

    sha256: str = ""  # of the shard's bytes: a second writer with other bytes is told apart
    digests: dict[str, str] = {}  # every prompt of the batch with an outcome -> content digest (hex)
    dead_letters: list[DeadLetter] = []  # the batch's dead letters (with their prompt: requeue needs it)
    tally: dict[str, list[int]] = {}  # worker -> [results, input tokens, output tokens] in the shard
    hist: dict[int, int] = {}  # output-length bucket (genq.core.histogram) -> results in the shard


class JobRecord(msgspec.Struct, omit_defaults=True):
    """OUTPUT/JOB/job.json: the job as created, at its current settings (`genq jobs set` writes
    them here first), kept beside its shards so that a ledger lost
    with Redis can be rebuilt (genq recover) and a batch number is never used twice there."""

    config: JobConfig
    inputs: list[str] = []  # what was enqueued (absolute paths or s3:// URIs), for genq recover
    # Batch numbers up to this one may be in use: written before any batch above it is queued,
    # so a counter lost with Redis restarts above it (no shard name is ever reused).
    reserved: int = 0
    # Set by `genq jobs delete`: the name's next enqueue starts a new job, not this one again
    # (`genq recover` brings this one back, and clears it).
    deleted_at: float | None = None


class EnqueueRecord(msgspec.Struct, omit_defaults=True):
    """OUTPUT/JOB/enqueues/RUN.json: what one `genq enqueue` (or `genq dlq requeue`) brought into
    the job, written before its batches are queued (and again before each further group), so a
    Redis that lost them (a snapshot restored, a lagging replica promoted) is found out and they
    are queued again (genq.producer.enqueue.queue_lost)."""

    incarnation: str
    input: str  # the input read (absolute path or s3:// URI)
    batches: list[list[int]] = []  # the batches it queued: [first, last] number ranges (genq.output.truth)
    prompts: int = 0  # the prompts in them
    letters: list[str] = []  # a requeue's: the dead letters it moved into those batches
