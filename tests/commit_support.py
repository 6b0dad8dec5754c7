"""What tests/test_commit.py writes with and reads back: records, the writer driven to completion,
and what Redis holds for the job afterwards (kept apart so that the tests file stays short)."""

from __future__ import annotations

import asyncio
import math
from types import SimpleNamespace

import redis

from genq.core import keys
from genq.core.records import DeadLetter, Prompt, Result, Usage, unpack
from genq.core.redisconn import connect_async
from genq.worker.results import ResultWriter

JOB, BATCH = "cj", "b0000001"
INCARNATION = "c0ffee"  # the job's life the writes are for (RECORD refuses any other)


def result(pid: str, worker: str, *, completion: str | None = None, prompt_tokens: int = 5,
           completion_tokens: int = 7, batch: str = BATCH) -> Result:
    return Result(id=pid, job=JOB, batch=batch, index=int(pid[1:]), completion=completion or f"{pid} by {worker}",
                  finish_reason="stop", usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens),
                  model="m", worker=worker, attempts=1, latency_s=0.1)


def letter(pid: str, worker: str, *, batch: str = BATCH) -> DeadLetter:
    return DeadLetter(id=pid, job=JOB, batch=batch, attempts=5, kind="server_error", message=f"gave up ({worker})",
                      worker=worker, at=1.0, status=500, prompt=Prompt(id=pid, index=int(pid[1:]), prompt="x"))


async def stored_by(writer: ResultWriter, task: asyncio.Task, *, errors_expected: bool = False,
                    within: float = 30.0) -> list[str]:
    """Wait until the writer has stored everything it was given; return the errors it showed meanwhile.
    Against a healthy Redis a failed write is a bug (the writer would retry it for ever): fail at once,
    naming the error; so does a writer task that died."""
    deadline = asyncio.get_running_loop().time() + within
    errors: list[str] = []
    while True:
        try:
            await asyncio.wait_for(asyncio.shield(writer.wait_idle()), 0.01)
            assert writer.last_error is None, f"idle, yet last_error is {writer.last_error!r}"
            return errors
        except TimeoutError:
            pass
        if task.done():
            raise AssertionError(f"the writer stopped: {task.exception()!r}")
        if writer.last_error is not None and writer.last_error not in errors:
            errors.append(writer.last_error)
        assert errors_expected or not errors, f"the write failed: {errors}"
        assert asyncio.get_running_loop().time() < deadline, f"nothing stored within {within}s"


async def commit(url: str, worker: str, *groups: list[Result | DeadLetter], pause: float = 0.0) -> list[str]:
    """Write each group through one ResultWriter (waiting for it to be stored) and return the ids it reported."""
    written: list[str] = []

    def on_written(job: str, batch: str, ids: list[str], results: object = None) -> None:
        assert (job, batch) == (JOB, BATCH), f"on_written was told {(job, batch)}"
        written.extend(ids)

    conn = connect_async(url)
    writer = ResultWriter(conn, worker, SimpleNamespace(on_written=on_written))
    assert writer.last_error is None and writer.pending == 0
    task = asyncio.create_task(writer.run())
    try:
        for group in groups:
            for record in group:
                (writer.add_result if isinstance(record, Result) else writer.add_dead)(record, INCARNATION)  # type: ignore[arg-type]
            assert writer.pending == len(group)
            await stored_by(writer, task)
            if pause:
                await asyncio.sleep(pause)
    finally:
        task.cancel()
        await conn.aclose()
    return written


class Stored:
    """What Redis holds for JOB after the writes."""

    def __init__(self, conn: redis.Redis) -> None:
        self.results = {k.decode(): unpack(v, Result) for k, v in conn.hgetall(keys.batch_results(JOB, BATCH)).items()}
        self.letters = {k.decode(): unpack(v, DeadLetter) for k, v in conn.hgetall(keys.job_dlq(JOB)).items()}
        self.workers = {w.decode() for w in conn.smembers(keys.job_workers(JOB))}
        names = self.workers | {"w1", "w2"}
        self.stats = {w: {k.decode(): int(float(v)) for k, v in conn.hgetall(keys.worker_stats(JOB, w)).items()}
                      for w in names}
        self.hist = {int(k): int(v) for k, v in conn.hgetall(keys.job_hist(JOB)).items()}

    def counted(self, field: str) -> int:
        return sum(s.get(field, 0) for s in self.stats.values())

    def check_counters(self) -> None:
        """Every counter equals the records stored, per worker and in all."""
        for name, stats in self.stats.items():
            mine = [r for r in self.results.values() if r.worker == name]
            assert stats.get("done", 0) == len(mine), (name, stats)
            assert stats.get("in_tok", 0) == sum(r.usage.prompt_tokens for r in mine), (name, stats)
            assert stats.get("out_tok", 0) == sum(r.usage.completion_tokens for r in mine), (name, stats)
            assert stats.get("failed", 0) == sum(1 for d in self.letters.values() if d.worker == name), (name, stats)
            assert (name in self.workers) == bool(stats), f"{name} is a worker of the job iff it has counters"
        assert self.counted("done") == len(self.results)
        assert self.counted("failed") == len(self.letters)
        want_hist: dict[int, int] = {}
        for r in self.results.values():
            bucket = round(4 * math.log2(r.usage.completion_tokens + 1))  # 4 buckets per doubling
            want_hist[bucket] = want_hist.get(bucket, 0) + 1
        assert self.hist == want_hist
        assert not set(self.results) & set(self.letters), "a prompt with both a result and a dead letter"
