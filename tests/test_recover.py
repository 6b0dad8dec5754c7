"""Redis losing everything, or its recent writes: the written output is the truth (#31).

Each test runs a real job (real redis-server of its own, restarted or flushed mid-job,
real `genq sim`, real `genq worker`s) and ends with the shared exactly-once audit and an
export: every prompt once, no shard shrunk or rewritten with other records, and what
the simulator generated counted against the prompts.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import redis
from rq.registry import FailedJobRegistry, StartedJobRegistry

from genq.core import keys
from genq.core.queueing import fetch_rq_jobs, rq_queue
from genq.sim.lengths import prompt_key
from tests.audit import audit
from tests.conftest import free_port, genq_cmd, run_genq, sim_stats, wait_until, write_prompts

FAST = dict(mean_output_tokens=60, output_sigma=0.5, tokens_per_step=16, step_ms_base=10)


class RestartableRedis:
    """A private redis-server on a fixed port that a test can kill and start again,
    empty or from its RDB snapshot (dump.rdb in its folder)."""

    def __init__(self, folder: Path) -> None:
        self.dir = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start(empty=True)

    def start(self, *, empty: bool) -> None:
        if empty:
            (self.dir / "dump.rdb").unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.dir), "--dbfilename", "dump.rdb"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(self._ping, 10, f"redis-server on port {self.port}")

    def _ping(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.5).ping())
        except redis.ConnectionError:
            return False

    def snapshot(self) -> None:
        """SAVE: dump.rdb holds the data set as it is now."""
        redis.Redis.from_url(self.url).save()

    def kill(self) -> None:
        """SIGKILL: nothing is saved (the snapshot on disk, if any, stays as it was)."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.kill()


@pytest.fixture
def lost_redis(tmp_path: Path):
    server = RestartableRedis(tmp_path / "redis")
    yield server
    server.stop()


def shard_records(out: Path, job: str) -> dict[str, list[str]]:
    """batch -> the ids its shard holds, for every shard with a marker."""
    found = {}
    for marker in sorted((out / job / "manifest").glob("*.json")):
        info = json.loads(marker.read_text())
        shard = out / job / "shards" / info["uri"].rsplit("/", 1)[-1]
        found[info["batch"]] = [json.loads(line)["id"] for line in shard.read_text().splitlines() if line.strip()]
    return found


def generated(server: str) -> int:
    """Requests the simulator admitted (every one generates tokens), finished or not."""
    return sum(sim_stats(server)["generated_by_key"].values())


def in_flight_at_loss(url: str, job: str) -> int:
    """What a Redis loss can cost: prompts of batches whose shard is not written yet that a
    worker has claimed (sent, about to be sent, or answered and not yet recorded) or whose
    result Redis recorded. Read with Redis's writes paused (no claim or result can be
    recorded meanwhile), just before it is killed."""
    conn = redis.Redis.from_url(url)
    conn.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    unwritten = [b.decode() for b in conn.hkeys(keys.job_leases(job))]
    return sum(len(set(conn.hkeys(keys.batch_claims(job, b))) | set(conn.hkeys(keys.batch_results(job, b))))
               for b in unwritten)


def start_worker(procs, url: str, server: str, name: str):
    return procs(genq_cmd("worker", "--server", server, "--name", name, "--retry-backoff", "0.1",
                          redis_url=url), name=name)


def export_ids(url: str, job: str, tmp_path: Path, *extra: str) -> list[str]:
    dest = tmp_path / f"{job}-export.jsonl"
    run_genq("export", "--job", job, "--to", str(dest), *extra, redis_url=url)
    return [json.loads(line)["id"] for line in dest.read_text().splitlines()]


def wait_done(url: str, job: str, timeout: float = 180) -> dict:
    last: dict = {}

    def done():
        proc = run_genq("monitor", "--job", job, "--once", "--json", redis_url=url, check=False)
        if proc.returncode != 0:
            return None
        last.update(json.loads(proc.stdout))
        return dict(last) if last.get("status") == "done" else None

    try:
        return wait_until(done, timeout, f"job {job} done", interval=0.5)
    except AssertionError:
        raise AssertionError(f"job {job} not done after {timeout}s: {describe_pending(url, job)}; "
                             f"monitor: { {k: v for k, v in last.items() if k != 'worker_details'} }") from None


def rq_settled(url: str, job: str) -> None:
    """RQ's started and failed registries and its intermediate list hold nothing of the job: jobs a
    restored snapshot still shows as started or being taken, and those of batches lost with Redis
    that were recorded as failed into it, leave them once the reconciler has seen their batches done
    or gone from the ledger (ledger.Reconciler)."""
    conn = redis.Redis.from_url(url)
    queue = rq_queue(conn)

    def settled() -> bool:
        ids = (StartedJobRegistry(queue=queue).get_job_ids() + FailedJobRegistry(queue=queue).get_job_ids()
               + [i.decode() for i in conn.lrange(queue.intermediate_queue_key, 0, -1)])
        return not any(j is not None and j.args[0] == job for j in fetch_rq_jobs(conn, ids))

    wait_until(settled, 60, "RQ's registries to hold nothing of the job", interval=0.5)


def describe_pending(url: str, job: str) -> str:
    conn = redis.Redis.from_url(url)
    done = conn.smembers(keys.job_done(job))
    pending = [b.decode() for b in conn.zrange(keys.job_batches(job), 0, -1) if b not in done]
    return "; ".join(
        f"{b}: lease {conn.hget(keys.job_leases(job), b)}, transport {conn.hget(keys.job_transport(job), b)}, "
        f"{conn.hlen(keys.batch_results(job, b))} results, claims {conn.hgetall(keys.batch_claims(job, b))}"
        for b in pending[:6])


def never_shrunk(before: dict[str, list[str]], after: dict[str, list[str]]) -> None:
    for batch, ids in before.items():
        assert after.get(batch) == ids, f"shard of {batch} was rewritten: {len(ids)} -> {len(after.get(batch, []))}"


def test_redis_restarted_empty_mid_job_then_the_same_enqueue(lost_redis, sim, procs, tmp_path):
    """(a) Redis restarted empty at ~50%; the same enqueue again resumes from the output:
    only what had no written outcome is generated again, the export holds every prompt once."""
    n = 400
    server = sim(max_running_requests=16, **FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_prompts(src, n)
    enqueue = ("enqueue", str(src), "--job", "lost", "--output", str(out), "--batch-size", "20", "--max-tokens", "64")
    run_genq(*enqueue, redis_url=lost_redis.url)
    start_worker(procs, lost_redis.url, server, "w1")
    wait_until(lambda: sum(map(len, shard_records(out, "lost").values())) >= n // 2, 120, "half the job written")
    at_loss = in_flight_at_loss(lost_redis.url, "lost")  # all that may be generated twice
    lost_redis.kill()
    before = shard_records(out, "lost")
    lost_redis.start(empty=True)

    run_genq(*enqueue, redis_url=lost_redis.url)
    wait_done(lost_redis.url, "lost")
    conn = redis.Redis.from_url(lost_redis.url)
    audit(conn, "lost", out, ids)
    assert sorted(export_ids(lost_redis.url, "lost", tmp_path)) == sorted(ids)
    never_shrunk(before, shard_records(out, "lost"))
    print(f"\n[a] requests generated {generated(server)} for {n} prompts; in flight at the loss {at_loss}")
    assert generated(server) <= n + at_loss, (generated(server), n, at_loss)


def generated_by_prompt(servers: list[str]) -> dict[str, int]:
    total: dict[str, int] = {}
    for server in servers:
        for key, count in sim_stats(server)["generated_by_key"].items():
            total[key] = total.get(key, 0) + count
    return total


def written_records(out: Path, job: str) -> dict[str, dict]:
    """id -> its record, in every shard named by a marker."""
    found = {}
    for marker in sorted((out / job / "manifest").glob("*.json")):
        shard = out / job / "shards" / json.loads(marker.read_text())["uri"].rsplit("/", 1)[-1]
        for line in shard.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                found[record["id"]] = record
    return found


def never_regenerated(written: dict[str, dict], servers: list[str]) -> None:
    """Every prompt written before the loss was generated exactly once, and its record stands."""
    counts = generated_by_prompt(servers)
    again = sorted(i for i, r in written.items() if counts.get(prompt_key(r["messages"]), 0) != 1)
    assert not again, f"{len(again)} prompts written before the loss were generated again: {again[:10]}"


def test_redis_restored_from_a_snapshot_10s_old_two_workers(lost_redis, sim, procs, tmp_path):
    """(b) Redis killed and started from an RDB snapshot taken ~10 s earlier: batches written
    since look unfinished to it; they are adopted from their markers, never generated again,
    and nothing is lost."""
    n = 2000
    servers = [sim(max_running_requests=16, mean_output_tokens=40, output_sigma=0.5, tokens_per_step=8,
                   step_ms_base=40) for _ in range(2)]
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_prompts(src, n)
    run_genq("enqueue", str(src), "--job", "roll", "--output", str(out), "--batch-size", "50", "--max-tokens", "64",
             redis_url=lost_redis.url)
    for i, server in enumerate(servers):
        start_worker(procs, lost_redis.url, server, f"w{i}")
    wait_until(lambda: len(written_records(out, "roll")) >= n // 5, 120, "a fifth of the job written")
    lost_redis.snapshot()
    taken = time.monotonic()
    at_snapshot = len(written_records(out, "roll"))
    markers = out / "roll" / "manifest"
    wait_until(lambda: time.monotonic() - taken >= 10 or len(list(markers.glob("*.json"))) >= 36, 60, "10 s")
    lost_redis.kill()
    snapshot_age = time.monotonic() - taken
    written = written_records(out, "roll")
    lost_redis.start(empty=False)  # from dump.rdb: the job as it was ~10 s ago

    wait_done(lost_redis.url, "roll")
    rq_settled(lost_redis.url, "roll")
    conn = redis.Redis.from_url(lost_redis.url)
    audit(conn, "roll", out, ids)
    assert sorted(export_ids(lost_redis.url, "roll", tmp_path)) == sorted(ids)
    after = written_records(out, "roll")
    assert all(after[i] == r for i, r in written.items()), "a written record was replaced"
    never_regenerated(written, servers)
    print(f"\n[b] snapshot at {at_snapshot} written, Redis killed {snapshot_age:.1f}s later at {len(written)} "
          f"written; requests {sum(generated_by_prompt(servers).values())} for {n} prompts")
    assert len(written) - at_snapshot >= 100, "the snapshot was not behind the output: the test proves nothing"


def test_recover_after_flushall_finishes_the_job(lost_redis, sim, procs, tmp_path):
    """(c) FLUSHALL mid-job; `genq recover --job JOB --output OUT` rebuilds the ledger from the
    output (the input recorded in job.json) and the running workers finish the job exactly once."""
    n = 400
    server = sim(max_running_requests=16, **FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_prompts(src, n)
    run_genq("enqueue", str(src), "--job", "flushed", "--output", str(out), "--batch-size", "20",
             "--max-tokens", "64", redis_url=lost_redis.url)
    start_worker(procs, lost_redis.url, server, "w1")
    wait_until(lambda: len(written_records(out, "flushed")) >= n // 2, 120, "half the job written")
    redis.Redis.from_url(lost_redis.url).flushall()
    written = written_records(out, "flushed")

    done = run_genq("recover", "--job", "flushed", "--output", str(out), redis_url=lost_redis.url)
    assert "created again from" in done.stdout, done.stdout
    wait_done(lost_redis.url, "flushed")
    rq_settled(lost_redis.url, "flushed")
    conn = redis.Redis.from_url(lost_redis.url)
    audit(conn, "flushed", out, ids)
    assert sorted(export_ids(lost_redis.url, "flushed", tmp_path)) == sorted(ids)
    assert all(written_records(out, "flushed")[i] == r for i, r in written.items()), "a written record was replaced"
    never_regenerated(written, [server])
    print(f"\n[c] FLUSHALL at {len(written)} written; requests {generated(server)} for {n} prompts")


def test_a_job_with_dead_letters_is_created_again_from_its_output(lost_redis, sim, procs, tmp_path):
    """A finished job whose shards' markers carry dead letters, after FLUSHALL: the same enqueue
    creates it again from its output with its letters back in the dead-letter queue. It failed with
    "cannot reach Redis ...: Bad data format in input": ADOPT handed Redis's cmsgpack the letters as
    msgpack bin, which it cannot read."""
    from tests.test_dlq import SMALL_CONTEXT, write_mixed

    server = sim(context_length=SMALL_CONTEXT, **FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids, long_ids = write_mixed(src, 12, long_every=3)
    enqueue = ("enqueue", str(src), "--job", "lettered", "--output", str(out), "--batch-size", "6", "--max-tokens", "8")
    run_genq(*enqueue, redis_url=lost_redis.url)
    burst = procs(genq_cmd("worker", "--server", server, "--burst", redis_url=lost_redis.url), name="burst")
    assert burst.wait(timeout=120) == 0, burst.log()
    conn = redis.Redis.from_url(lost_redis.url)
    letters = set(audit(conn, "lettered", out, ids).letters)
    assert letters == set(long_ids), (letters, long_ids)
    conn.flushall()

    again = run_genq(*enqueue, redis_url=lost_redis.url)
    assert "job created again from its output" in again.stdout, again.stdout
    found = audit(conn, "lettered", out, ids)
    assert set(found.letters) == letters and len(found.results) == len(ids) - len(letters)
    dlq = json.loads(run_genq("dlq", "list", "--job", "lettered", "--json", redis_url=lost_redis.url).stdout)
    assert sorted(e["id"] for e in dlq) == sorted(letters), dlq


@pytest.mark.e2e
def test_an_enqueue_cut_by_a_redis_outage_says_the_same_command_finishes_it(lost_redis, tmp_path):
    """Redis stops mid-enqueue (a failover or an outage, back from a snapshot taken part way: the writes after it
    are lost). The enqueue says the same command again is safe, though it cannot ask Redis what the job holds;
    run again once Redis is back, it queues the rest, each prompt once."""
    from genq.core.ledger.jobs import counts

    n = 20_000
    write_prompts(src := tmp_path / "big.jsonl", n)
    args = ("enqueue", str(src), "--job", "big", "--output", str(tmp_path / "out"), "--batch-size", "1")
    conn = redis.Redis.from_url(lost_redis.url)
    first = subprocess.Popen(genq_cmd(*args, redis_url=lost_redis.url), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    wait_until(lambda: counts(conn, "big").total > 0, 60, "the enqueue to queue some prompts")
    lost_redis.snapshot()
    lost_redis.kill()
    err = first.communicate(timeout=120)[1]
    assert first.returncode == 1 and "cannot reach Redis" in err and "Traceback" not in err, err
    assert "run the same command again" in err and "each prompt once" in err, err
    lost_redis.start(empty=False)
    assert 0 < counts(conn, "big").total < n  # cut part way
    run_genq(*args, redis_url=lost_redis.url)
    assert (counts(conn, "big").total, counts(conn, "big").batches, rq_queue(conn).count) == (n, n, n)
