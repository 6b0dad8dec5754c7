"""TAKE (genq/core/scripts/take.lua), what an engine's intake runs: against the real test Redis,
with batches queued the way `genq enqueue` queues them."""

from __future__ import annotations

import time

import pytest
import redis
from rq.registry import StartedJobRegistry
from rq.suspension import resume, suspend

from genq.core import keys, scripts
from genq.core.ledger import lease_holder, lease_token
from genq.core.queueing import enqueue_batch_jobs, fetch_rq_job, new_batches, rq_queue, save_config, write_batches
from genq.core.records import JobConfig, Prompt


def queue(conn: redis.Redis, job: str, n: int) -> list[str]:
    """n batches of one prompt each for `job`, queued as enqueue queues them; their ids."""
    save_config(conn, JobConfig(name=job, output="/nowhere", incarnation="i-" + job))
    made = new_batches(conn, job, [Prompt(id=f"{job}-{i}", index=i, messages=[{"role": "user", "content": "x"}])
                                   for i in range(n)], 1)
    with conn.pipeline(transaction=True) as pipe:
        write_batches(pipe, conn, made, {})
        pipe.execute()
    return [b.id for b in made]


def take(conn: redis.Redis, instance: str = "e1.aaaa", skip: tuple[str, ...] = ()) -> tuple[str, str, str] | None:
    token = f"tok-{time.monotonic_ns()}"
    got = scripts.evaluate(conn, scripts.TAKE, scripts.take_call(instance, token, "2026-12-06T00:00:00Z", skip))
    if got is None:
        return None
    job, batch, rq_id = (part.decode() for part in got)
    assert lease_token(conn.hget(keys.job_leases(job), batch)) == token
    return job, batch, rq_id


def test_the_first_queued_batch_is_started_by_the_engine_and_leased_to_it(rconn: redis.Redis) -> None:
    first, second = queue(rconn, "a", 2)
    job, batch, rq_id = take(rconn)  # type: ignore[misc]
    assert (job, batch) == ("a", first)
    assert lease_holder(rconn.hget(keys.job_leases("a"), first)) == "e1.aaaa"
    assert rconn.hget(keys.job_transport("a"), first).decode() == rq_id
    rq_job = fetch_rq_job(rconn, rq_id)
    assert (rq_job.get_status(), rq_job.worker_name) == ("started", "e1.aaaa")
    registry = StartedJobRegistry(queue=rq_queue(rconn))
    assert registry.get_job_ids(cleanup=True) == [rq_id]  # RQ's own cleanup keeps it: no expiry
    assert rq_queue(rconn).count == 1 and take(rconn)[1] == second  # type: ignore[index]
    assert take(rconn) is None


def test_the_jobs_it_is_told_to_leave_stay_queued_in_their_order(rconn: redis.Redis) -> None:
    queue(rconn, "other", 2)
    (mine,) = queue(rconn, "mine", 1)
    assert take(rconn, skip=("other",))[:2] == ("mine", mine)  # type: ignore[index]
    assert take(rconn, skip=("other",)) is None
    assert rq_queue(rconn).count == 2 and not rconn.hlen(keys.job_leases("other"))


def test_rq_jobs_of_done_deleted_or_superseded_batches_leave_rq_as_they_are_met(rconn: redis.Redis) -> None:
    done, deleted, superseded, live = queue(rconn, "a", 4)
    rconn.sadd(keys.job_done("a"), done)
    rconn.delete(keys.batch("a", deleted))
    old = rconn.hget(keys.job_transport("a"), superseded).decode()
    with rconn.pipeline(transaction=True) as pipe:  # queued again: the newer RQ job carries it
        enqueue_batch_jobs(pipe, rconn, [("a", superseded, 1)])
        pipe.execute()
    stale = [rconn.hget(keys.job_transport("a"), b).decode() for b in (done, deleted)] + [old]
    assert take(rconn)[1] == live  # type: ignore[index]
    assert take(rconn)[1] == superseded  # type: ignore[index]  # by its newer RQ job
    assert take(rconn) is None and rq_queue(rconn).count == 0
    assert not any(rconn.exists(scripts.RQ_JOB_PREFIX + rq_id) for rq_id in stale)


def test_nothing_is_taken_while_rq_is_suspended(rconn: redis.Redis) -> None:
    queue(rconn, "a", 1)
    suspend(rconn)
    assert take(rconn) is None
    resume(rconn)
    assert take(rconn) is not None


def test_release_takes_the_batch_rq_job_out_of_rq(rconn: redis.Redis) -> None:
    from genq.core.records import BatchRef, ShardInfo

    (batch,) = queue(rconn, "a", 1)
    _, _, rq_id = take(rconn)  # type: ignore[misc]
    info = ShardInfo(batch=batch, uri="u", records=0, bytes=0, at=1.0)
    release = scripts.release_call(BatchRef("a", batch), info, "i-a", {}, [])
    assert scripts.evaluate(rconn, scripts.RELEASE, release) == 1
    assert not rconn.exists(scripts.RQ_JOB_PREFIX + rq_id)
    assert StartedJobRegistry(queue=rq_queue(rconn)).count == 0


@pytest.mark.parametrize("job", ["a.b-c_1", "x" * 64])
def test_any_valid_job_name_is_read_back_from_the_rq_jobs_description(rconn: redis.Redis, job: str) -> None:
    (batch,) = queue(rconn, job, 1)
    assert take(rconn)[:2] == (job, batch)  # type: ignore[index]


def test_an_rq_job_of_another_app_is_left_alone(rconn: redis.Redis) -> None:
    other = rq_queue(rconn).enqueue("os.getcwd")
    (batch,) = queue(rconn, "a", 1)
    assert take(rconn)[1] == batch  # type: ignore[index]
    assert rq_queue(rconn).job_ids == [other.id]




def test_a_take_sent_again_answers_what_the_first_took_and_leases_nothing_more(rconn: redis.Redis) -> None:
    """A TAKE whose answer was lost (a dropped connection, a Sentinel failover that resends an
    unconfirmed write) is sent again with its token: it must not lease a second batch that the
    engine would never hear of (leased to a live engine, nobody else would ever take it)."""
    first, _ = queue(rconn, "a", 2)
    call = scripts.take_call("e1.aaaa", "tok-once", "2026-12-06T00:00:00Z", ())
    answers = [scripts.evaluate(rconn, scripts.TAKE, call) for _ in range(2)]
    assert answers[0] == answers[1] and answers[0][1].decode() == first
    assert rconn.hlen(keys.job_leases("a")) == 1 and rq_queue(rconn).count == 1


def test_a_batch_taken_while_its_job_is_deleted_leaves_nothing_in_rq(rconn: redis.Redis) -> None:
    """`genq jobs delete --force` looks first, then deletes: an engine that takes a queued batch in
    between moves its RQ job to the started registry, where the delete did not look. The id must
    not stay there with its hash gone (`rq info` would count it forever)."""
    from genq.ops import control

    queue(rconn, "gone", 3)
    found = control.find_job(rconn, "gone")
    assert len(found.rq_jobs["queued"]) == 3
    take(rconn)  # between the look and the delete
    control.delete_job(rconn, found)
    registry = StartedJobRegistry(queue=rq_queue(rconn))
    assert registry.get_job_ids(cleanup=False) == []
    assert rq_queue(rconn).count == 0 and not rconn.keys(scripts.RQ_JOB_PREFIX + "*")


def test_release_refuses_a_shard_whose_result_redis_holds_in_another_writers_form(rconn: redis.Redis) -> None:
    # After a rollback another writer may record the same prompt with its own answer: the shard read the first.
    from genq.core.records import BatchRef, ShardInfo

    (batch,) = queue(rconn, "a", 1)
    take(rconn)
    rconn.hset(keys.batch_results("a", batch), "p0", b"another writer's longer answer")
    info = ShardInfo(batch=batch, uri="u", records=1, bytes=10, at=1.0)
    shard_read = {"p0": b"the answer"}
    assert scripts.evaluate(rconn, scripts.RELEASE, scripts.release_call(BatchRef("a", batch), info, "i-a",
                                                                         shard_read, [])) == b"short"
    stored = {"p0": rconn.hget(keys.batch_results("a", batch), "p0")}
    assert scripts.evaluate(rconn, scripts.RELEASE, scripts.release_call(BatchRef("a", batch), info, "i-a",
                                                                         stored, [])) == 1


def test_a_late_let_go_of_an_old_lease_keeps_the_claims_made_under_the_newer_one(rconn: redis.Redis) -> None:
    """Engine A sends a prompt under lease 1; the batch goes to B, then back to A (lease 3), which claims the
    prompt again. The let-go of lease 1 (a request of it failing late: Todo.let_go, or a hand-back waiting
    out a Redis outage) then runs: it must not drop the claim of lease 3, or idle B steals the prompt and
    sends it while A sends it too."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.core.queueing import load_config
    from genq.core.records import BatchRef
    from genq.worker.held import Claims, HeldBatch
    from tests.conftest import REDIS_URL

    (batch,) = queue(rconn, "a", 1)
    ref, config, prompt = BatchRef("a", batch), load_config(rconn, "a"), "a-0"
    assert config is not None
    for engine in ("A.1", "B.1"):
        rconn.set(keys.engine_alive(engine), "1")

    def lease_to(engine: str) -> str:
        with rconn.pipeline(transaction=True) as pipe:  # queued again (the reconciler), then taken
            enqueue_batch_jobs(pipe, rconn, [("a", batch, 1)])
            pipe.execute()
        assert take(rconn, engine)[1] == batch  # type: ignore[index]
        return lease_token(rconn.hget(keys.job_leases("a"), batch))  # type: ignore[return-value]

    def claim(token: str) -> bytes:
        call = scripts.claim_call(ref, "A.1", config.incarnation, token, [prompt])
        return scripts.evaluate(rconn, scripts.CLAIM, call)[0]

    take(rconn, "A.1")
    first = lease_token(rconn.hget(keys.job_leases("a"), batch))
    assert claim(first) == b"c"  # type: ignore[arg-type]
    lease_to("B.1")
    assert claim(lease_to("A.1")) == b"c"

    async def late_let_go() -> None:
        conn = aioredis.Redis.from_url(REDIS_URL)
        try:
            await Claims(conn, "A.1").unclaim(HeldBatch(ref, first, config, {prompt}), [prompt])  # type: ignore[arg-type]
        finally:
            await conn.aclose()

    asyncio.run(late_let_go())
    steal = scripts.steal_call(ref, "B.1", config.incarnation, "A.1", [prompt], 1)
    assert scripts.evaluate(rconn, scripts.STEAL, steal) == [], "B steals a prompt A sends"


def test_a_let_go_clears_this_engines_void_claims_of_an_older_lease(rconn: redis.Redis) -> None:
    """A claim of mine under a lease that is over is void; a let-go drops it too, or whoever claims that prompt
    next counts a try lost on it (and a prompt never sent may reach its dead letter sooner)."""
    from genq.core.queueing import load_config
    from genq.core.records import BatchRef

    (batch,) = queue(rconn, "a", 1)
    ref, config = BatchRef("a", batch), load_config(rconn, "a")
    assert config is not None
    rconn.set(keys.engine_alive("A.1"), "1")
    take(rconn, "A.1")
    current = lease_token(rconn.hget(keys.job_leases("a"), batch))
    rconn.hset(keys.batch_claims("a", batch), mapping={"a-0": "A.1 older", "a-1": f"A.1 {current}", "a-2": "B.1 older"})
    scripts.evaluate(rconn, scripts.UNCLAIM, scripts.unclaim_call(ref, "A.1", config.incarnation, current))
    assert rconn.hgetall(keys.batch_claims("a", batch)) == {b"a-2": b"B.1 older"}
