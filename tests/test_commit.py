"""The result commit path on its own: write through the worker's writer, read real Redis.

What two workers racing on one batch, a retried write whose reply was lost, or a late
write after the shard was written can do to the stored records and to the counters the
monitor reads. The first record stored for a prompt wins; it is counted once, by the
worker that stored it; a prompt never ends with both a result and a dead letter.

Written against `worker.results.ResultWriter` only through `commit()` below, so that a
reshaped commit path needs one helper changed, not the tests.
"""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest
import redis

from genq.core import keys
from genq.core.queueing import save_config
from genq.core.records import JobConfig, Result, length_bucket, unpack
from genq.core.redisconn import connect_async
from genq.worker.results import ResultWriter
from tests.commit_support import BATCH, INCARNATION, JOB, Stored, commit, letter, result, stored_by


@pytest.fixture(autouse=True)
def job_config(rconn: redis.Redis) -> None:
    save_config(rconn, JobConfig(name=JOB, output="/nonexistent/commit", incarnation=INCARNATION))
    for n in range(1, 10):  # RECORD writes only for a batch the ledger has
        rconn.set(keys.batch(JOB, f"b{n:07d}"), b"a batch record")


def test_first_result_wins_and_is_counted_once(redis_url, rconn):
    first = result("p00001", "w1", completion="the first answer", prompt_tokens=11, completion_tokens=13)
    second = result("p00001", "w2", completion="a second answer", prompt_tokens=17, completion_tokens=400)
    assert asyncio.run(commit(redis_url, "w1", [first])) == ["p00001"]
    asyncio.run(commit(redis_url, "w2", [second]))
    stored = Stored(rconn)
    assert stored.results == {"p00001": first}, "the second write replaced the stored record"
    assert stored.stats["w1"] == {"done": 1, "failed": 0, "in_tok": 11, "out_tok": 13,
                                  "first_at": stored.stats["w1"]["first_at"], "last_at": stored.stats["w1"]["last_at"]}
    assert stored.stats["w2"] == {} and stored.workers == {"w1"}, "a write that stored nothing was counted"
    assert stored.hist == {15: 1} == {length_bucket(13): 1}  # 4 * log2(14) = 15.2
    stored.check_counters()


def test_the_same_write_repeated_by_one_worker_is_counted_once(redis_url, rconn):
    # A group commit whose reply was lost (connection dropped after Redis ran it) is sent again.
    records = [result(f"p{i:05d}", "w1", completion_tokens=i + 1) for i in range(5)]
    asyncio.run(commit(redis_url, "w1", records, records, records[:2]))
    stored = Stored(rconn)
    assert sorted(stored.results) == [r.id for r in records]
    assert stored.stats["w1"]["done"] == 5 and stored.stats["w1"]["out_tok"] == sum(range(1, 6))
    stored.check_counters()


def test_two_workers_racing_on_one_batch_store_each_prompt_once(redis_url, rconn):
    ids = [f"p{i:05d}" for i in range(60)]
    rng = random.Random(7)

    def groups(worker: str) -> list[list[Result]]:
        order = ids[:]
        rng.shuffle(order)
        mine = [result(pid, worker, completion_tokens=rng.randint(1, 900)) for pid in order]
        return [mine[i:i + 7] for i in range(0, len(mine), 7)]

    async def race() -> None:
        await asyncio.gather(commit(redis_url, "w1", *groups("w1"), pause=0.001),
                             commit(redis_url, "w2", *groups("w2"), pause=0.001))

    asyncio.run(race())
    stored = Stored(rconn)
    assert sorted(stored.results) == ids
    assert stored.counted("done") == 60 and stored.counted("out_tok") == sum(
        r.usage.completion_tokens for r in stored.results.values())
    stored.check_counters()


def test_a_dead_letter_after_a_result_is_dropped(redis_url, rconn):
    kept = result("p00003", "w1")
    asyncio.run(commit(redis_url, "w1", [kept]))
    asyncio.run(commit(redis_url, "w2", [letter("p00003", "w2")]))
    stored = Stored(rconn)
    assert stored.results == {"p00003": kept} and stored.letters == {}
    assert stored.stats["w2"] == {} and stored.counted("failed") == 0
    stored.check_counters()


def test_a_result_and_a_letter_in_one_write_keep_the_result(redis_url, rconn):
    kept = result("p00004", "w1")
    asyncio.run(commit(redis_url, "w1", [letter("p00004", "w1"), kept]))
    stored = Stored(rconn)
    assert stored.results == {"p00004": kept} and stored.letters == {}
    stored.check_counters()


def test_the_first_dead_letter_wins(redis_url, rconn):
    first = letter("p00005", "w1")
    asyncio.run(commit(redis_url, "w1", [first]))
    asyncio.run(commit(redis_url, "w2", [letter("p00005", "w2")]))
    stored = Stored(rconn)
    assert stored.letters == {"p00005": first} and stored.results == {}
    assert stored.stats["w1"]["failed"] == 1 and stored.stats["w2"] == {}
    stored.check_counters()


def test_a_result_after_a_dead_letter_is_dropped(redis_url, rconn):
    first = letter("p00006", "w1")
    asyncio.run(commit(redis_url, "w1", [first]))
    asyncio.run(commit(redis_url, "w2", [result("p00006", "w2")]))
    stored = Stored(rconn)
    assert stored.letters == {"p00006": first}
    assert stored.results == {}, "the prompt now has both a dead letter and a result"
    stored.check_counters()


def test_a_write_after_the_batch_is_done_stores_and_counts_nothing(redis_url, rconn):
    asyncio.run(commit(redis_url, "w1", [result("p00001", "w1")]))
    # The shard is written: the engine adds the batch to the done set and deletes its results.
    rconn.sadd(keys.job_done(JOB), BATCH)
    rconn.delete(keys.batch_results(JOB, BATCH))
    reported = asyncio.run(commit(redis_url, "w2", [result("p00002", "w2"), letter("p00003", "w2")]))
    assert reported == ["p00002", "p00003"], "the writer still reports the group as handled"
    assert not rconn.exists(keys.batch_results(JOB, BATCH)), "a late write brought the batch's results back"
    assert rconn.hlen(keys.job_dlq(JOB)) == 0
    stored = Stored(rconn)
    assert stored.stats["w2"] == {} and stored.stats["w1"]["done"] == 1


def test_writes_survive_the_connection_being_killed_between_them(redis_url, rconn):
    # Two batches in flight at once: what is kept in memory after a failed write goes back to its own batch.
    records = [result(f"p{i:05d}", "w1", completion_tokens=3 * i + 1, batch=BATCH if i % 2 else "b0000002")
               for i in range(30)]

    async def go() -> tuple[list[tuple[str, str, str]], list[str]]:
        written: list[tuple[str, str, str]] = []
        errors: list[str] = []
        conn = connect_async(redis_url)
        told = SimpleNamespace(on_written=lambda job, batch, ids, *_: written.extend((job, batch, i) for i in ids))
        writer = ResultWriter(conn, "w1", told)
        task = asyncio.create_task(writer.run())
        try:
            for i in range(0, 30, 5):
                for r in records[i:i + 5]:
                    writer.add_result(r, INCARNATION)
                if i in (5, 15):
                    # Every client but this test's own is dropped, and none may connect again for a while
                    # (else redis-py reconnects by itself): what the writer keeps in memory is tested here.
                    rconn.config_set("maxclients", 1)
                    assert rconn.execute_command("CLIENT", "KILL", "TYPE", "normal") >= 1
                for r in records[i:i + 3]:
                    writer.add_result(r, INCARNATION)  # and some are sent twice, as after a lost reply
                if i in (5, 15):
                    while writer.last_error is None:
                        await asyncio.sleep(0.01)
                    rconn.config_set("maxclients", 10000)
                errors += await stored_by(writer, task, errors_expected=True, within=60)
        finally:
            task.cancel()
            await conn.aclose()
        return written, errors

    written, errors = asyncio.run(go())
    assert errors and all(e.startswith("ConnectionError: ") for e in errors), errors
    assert {(j, b, i) for j, b, i in written} == {(JOB, r.batch, r.id) for r in records}
    for batch in (BATCH, "b0000002"):
        held = {k.decode(): unpack(v, Result) for k, v in rconn.hgetall(keys.batch_results(JOB, batch)).items()}
        assert held == {r.id: r for r in records if r.batch == batch}, f"batch {batch} holds the wrong records"
    stats = {k.decode(): int(float(v)) for k, v in rconn.hgetall(keys.worker_stats(JOB, "w1")).items()}
    assert stats["done"] == 30 and stats["out_tok"] == sum(r.usage.completion_tokens for r in records)
    assert sum(int(v) for v in rconn.hvals(keys.job_hist(JOB))) == 30


def test_records_added_while_a_write_fails_are_kept_with_the_ones_put_back(redis_url, rconn):
    """A write held open by Redis (CLIENT PAUSE WRITE) and then failed (its connection killed) while
    new records for the same batch arrive: the failed write's records go back in front of the new
    ones and every one is stored. (Putting them back over the first new record instead, mutmut's
    run__mutmut_36 and _38, loses that record.)"""
    held = [result(f"p{i:05d}", "w1") for i in range(1, 4)]
    held_letter = letter("p00004", "w1")
    arriving = [result(f"p{i:05d}", "w1") for i in range(5, 8)]
    arriving_letter = letter("p00008", "w1")

    def write_blocked() -> bool:
        return any("b" in c["flags"] and c["cmd"] in ("evalsha", "eval") for c in rconn.client_list())

    async def go() -> list[str]:
        conn = connect_async(redis_url)
        writer = ResultWriter(conn, "w1", SimpleNamespace(on_written=lambda job, batch, ids, *_: None))
        task = asyncio.create_task(writer.run())
        try:
            writer.add_result(result("p00000", "w1"), INCARNATION)  # the script loaded, the connection open
            await stored_by(writer, task)
            rconn.execute_command("CLIENT", "PAUSE", "20000", "WRITE")
            try:
                for r in held:
                    writer.add_result(r, INCARNATION)
                writer.add_dead(held_letter, INCARNATION)
                deadline = asyncio.get_running_loop().time() + 15
                while not write_blocked():
                    assert asyncio.get_running_loop().time() < deadline, "the writer's write never reached Redis"
                    await asyncio.sleep(0.01)
                for r in arriving:
                    writer.add_result(r, INCARNATION)
                writer.add_dead(arriving_letter, INCARNATION)
                assert rconn.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") >= 1
            finally:
                rconn.execute_command("CLIENT", "UNPAUSE")
            return await stored_by(writer, task, errors_expected=True, within=60)
        finally:
            task.cancel()
            await conn.aclose()

    errors = asyncio.run(go())
    assert errors and all(e.startswith("ConnectionError: ") for e in errors), errors
    stored = {k.decode(): unpack(v, Result) for k, v in rconn.hgetall(keys.batch_results(JOB, BATCH)).items()}
    assert stored == {r.id: r for r in [result("p00000", "w1"), *held, *arriving]}
    letters = {k.decode() for k in rconn.hkeys(keys.job_dlq(JOB))}
    assert letters == {"p00004", "p00008"}


def bucket_bounds(bucket: int) -> tuple[float, float]:
    """Token range a bucket stands for (the inverse of length_bucket)."""
    return 2 ** ((bucket - 0.5) / 4) - 1, 2 ** ((bucket + 0.5) / 4) - 1


def test_length_buckets_are_four_per_doubling_and_bounds_invert_them():
    assert [length_bucket(t) for t in (0, 1, 3, 7, 15, 255, 32767)] == [0, 4, 8, 12, 16, 32, 60]
    for tokens in (0, 1, 2, 5, 13, 100, 999, 4096, 32000):
        low, high = bucket_bounds(length_bucket(tokens))
        assert low <= tokens <= high, (tokens, low, high)
    assert bucket_bounds(16) == (2 ** 3.875 - 1, 2 ** 4.125 - 1)



@pytest.mark.e2e  # starts a process
def test_a_writer_started_before_redis_keeps_everything_until_redis_comes_up(tmp_path):
    """Several failed writes in a row (nothing listens yet), then Redis starts on that port: all stored once."""
    import logging
    import subprocess

    import redis as sync_redis

    from tests.conftest import free_port

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    records = [result(f"p{i:05d}", "w1", completion_tokens=i + 1) for i in range(12)]
    failures: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                failures.append(record.getMessage())

    handler = Count()
    logging.getLogger("genq.worker").addHandler(handler)

    _dump_with_the_job_config(tmp_path)

    async def go() -> None:
        conn = connect_async(url)
        writer = ResultWriter(conn, "w1", SimpleNamespace(on_written=lambda job, batch, ids, *_: None))
        task = asyncio.create_task(writer.run())
        server = None
        try:
            for r in records[:6]:
                writer.add_result(r, INCARNATION)
            while len(failures) < 3:  # three failed writes in a row, counted as the writer reports them
                await asyncio.sleep(0.01)
                assert not task.done(), f"the writer stopped after {len(failures)} failures: {task.exception()!r}"
            assert writer.last_error and writer.last_error.startswith("ConnectionError"), writer.last_error
            for r in records[6:]:
                writer.add_result(r, INCARNATION)
            server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                       "--appendonly", "no", "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
            # (it loads the job's config from dump.rdb, saved below before the writer started: RECORD
            # writes only for a job that exists in the incarnation the outcomes are for)
            await stored_by(writer, task, errors_expected=True, within=60)
            check = sync_redis.Redis.from_url(url)
            held = {k.decode(): unpack(v, Result) for k, v in check.hgetall(keys.batch_results(JOB, BATCH)).items()}
            done = int(check.hget(keys.worker_stats(JOB, "w1"), "done"))
            check.close()
            assert held == {r.id: r for r in records} and done == 12
        finally:
            task.cancel()
            await conn.aclose()
            if server is not None:
                server.terminate()
                server.wait(timeout=10)

    try:
        asyncio.run(go())
    finally:
        logging.getLogger("genq.worker").removeHandler(handler)


def _dump_with_the_job_config(folder) -> None:
    """A dump.rdb in `folder` holding the job's config (a Redis started there loads it)."""
    from tests.conftest import LocalRedis

    server = LocalRedis("--dir", str(folder))  # the later --dir wins
    try:
        conn = redis.Redis.from_url(server.url)
        save_config(conn, JobConfig(name=JOB, output="/nonexistent/commit", incarnation=INCARNATION))
        conn.set(keys.batch(JOB, BATCH), b"a batch record")
        conn.save()
    finally:
        server.stop()
