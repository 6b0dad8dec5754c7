"""The result writer where Redis says no: its scripts lost between two writes, and outcomes for a
job's life that is over (the two gaps `make mutation` showed in tests/test_commit.py, docs/mutation.md)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import redis

from genq.core import keys
from genq.core.queueing import save_config
from genq.core.records import JobConfig
from genq.core.redisconn import connect_async
from genq.worker.results import ResultWriter
from tests.commit_support import INCARNATION, JOB, result, stored_by


@pytest.fixture(autouse=True)
def job_config(rconn: redis.Redis) -> None:
    save_config(rconn, JobConfig(name=JOB, output="/nonexistent/commit", incarnation=INCARNATION))
    for n in range(1, 10):  # RECORD writes only for a batch the ledger has
        rconn.set(keys.batch(JOB, f"b{n:07d}"), b"a batch record")


async def _write(url: str, *rounds: list[tuple[str, str]], incarnation: str = INCARNATION,
                 between=None) -> list[tuple[str, str, list[str]]]:
    """Each round's (prompt id, batch) outcomes added at once and written; `between(conn)` runs
    after each round. Returns what the writer reported written, in order."""
    told: list[tuple[str, str, list[str]]] = []
    conn = connect_async(url)
    written = SimpleNamespace(on_written=lambda job, batch, ids, *_: told.append((job, batch, sorted(ids))))
    writer = ResultWriter(conn, "w1", written)
    task = asyncio.create_task(writer.run())
    try:
        for outcomes in rounds:
            for pid, batch in outcomes:
                writer.add_result(result(pid, "w1", batch=batch), incarnation)
            await stored_by(writer, task)
            if between is not None:
                await between(conn)
    finally:
        task.cancel()
        await conn.aclose()
    return told


async def _flush_scripts(conn) -> None:
    await conn.script_flush()


def test_a_write_lands_after_redis_lost_its_scripts(redis_url: str, rconn: redis.Redis) -> None:
    # One batch per write (one EVALSHA) and several (a pipeline of EVALSHAs): after SCRIPT FLUSH, as
    # after a restart, each must load RECORD again and store, not fail or store nothing.
    one = [("p00001", "b0000001")]
    several = [("p00002", "b0000002"), ("p00003", "b0000003")]
    told = asyncio.run(_write(redis_url, one, several, [("p00004", "b0000002"), ("p00005", "b0000003")],
                              between=_flush_scripts))
    assert told == [(JOB, "b0000001", ["p00001"]), (JOB, "b0000002", ["p00002"]), (JOB, "b0000003", ["p00003"]),
                    (JOB, "b0000002", ["p00004"]), (JOB, "b0000003", ["p00005"])]
    stored = {batch: sorted(k.decode() for k in rconn.hkeys(keys.batch_results(JOB, batch)))
              for batch in ("b0000001", "b0000002", "b0000003")}
    assert stored == {"b0000001": ["p00001"], "b0000002": ["p00002", "p00004"], "b0000003": ["p00003", "p00005"]}


@pytest.mark.parametrize("batches", [1, 2], ids=["one call", "pipelined"])
def test_outcomes_refused_for_another_life_of_the_job_are_not_reported_written(
        redis_url: str, rconn: redis.Redis, batches: int) -> None:
    # The job was deleted and enqueued again meanwhile (another incarnation): RECORD refuses the
    # late outcomes, and the worker must not take them as written (it would end the batch on them).
    outcomes = [(f"p{i:05d}", f"b{i:07d}") for i in range(1, batches + 1)]
    told = asyncio.run(_write(redis_url, outcomes, incarnation="a-life-before"))
    assert told == []
    assert all(rconn.hlen(keys.batch_results(JOB, batch)) == 0 for _, batch in outcomes)


def test_outcomes_for_a_batch_the_ledger_does_not_have_are_not_written_or_counted(
        redis_url: str, rconn: redis.Redis) -> None:
    # Redis restarted empty and the same enqueue queued the lost batches' prompts again in other
    # batches: a worker's late outcomes for an old batch id must not be stored or counted there (the
    # prompts' new batches count them: they were counted twice).
    rconn.delete(keys.batch(JOB, "b0000007"))
    told = asyncio.run(_write(redis_url, [("p00001", "b0000007")]))
    assert told == []
    assert rconn.hlen(keys.batch_results(JOB, "b0000007")) == 0
    assert not rconn.exists(keys.worker_stats(JOB, "w1")) and not rconn.exists(keys.job_hist(JOB))
