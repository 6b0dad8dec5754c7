"""The worker's side of "the output is the truth": a batch whose shard this life of the job wrote
is done from its marker (ADOPT, genq.ops.recover), before it is driven or when its shard is found there."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.records import BatchRef, DeadLetter, JobConfig, Prompt, Result, ShardMarker
from genq.output import truth
from genq.output.truth import open_store
from genq.producer.rows import claim_digest

log = logging.getLogger("genq.worker")


def written_marker(config: JobConfig, ref: BatchRef) -> ShardMarker | None:
    """The batch's marker in the output, if this life of the job wrote it."""
    store = open_store(config.output, config.s3_endpoint_url)
    marker = truth.read_marker(store, truth.marker_rel(ref.job, ref.batch))
    return marker if marker is not None and marker.incarnation == config.incarnation else None


async def adopt_marker(conn: aioredis.Redis, ref: BatchRef, marker: ShardMarker) -> bool:
    """Mark the batch done from its marker (False: it was done already)."""
    adopted = await scripts.evaluate(conn, scripts.ADOPT,
                                     scripts.adopt_call(ref.job, marker, truth.shard_info(marker))) == 1
    if adopted:
        log.warning("batch %s: its shard is in the output already (%d records, %s): marked done from its "
                    "marker, not generated again (Redis had lost it)", ref, marker.records, marker.uri)
    return adopted


async def adopt_if_written(conn: aioredis.Redis, config: JobConfig, ref: BatchRef) -> bool:
    """Before sending a batch's prompts: True if the output holds its shard for this life of the
    job, which is then the batch's outcome (marked done in Redis; nothing is sent)."""
    try:
        marker = await asyncio.to_thread(written_marker, config, ref)
    except Exception as exc:  # the output unreachable now: the shard write checks again (truth.commit_shard)
        log.warning("batch %s: cannot look for its shard in %s (%s: %s)", ref, config.output, type(exc).__name__, exc)
        return False
    if marker is None:
        return False
    await adopt_marker(conn, ref, marker)
    return True


def outcome_for(prompts: Iterable[Prompt], results: list[Result], letters: list[DeadLetter],
                size: int) -> ShardMarker:
    """The marker's outcome of a batch of `size` prompts about to be written (digests from the
    prompts held)."""
    return truth.outcome_of(results, letters, {p.id: claim_digest(p) for p in prompts}, size)
