"""Redis losing everything, or its recent writes: the written output is the truth (#31).

Each test runs a real job (real redis-server of its own, restarted or flushed mid-job,
real `genq sim`, real `genq worker`s) and ends with the shared exactly-once audit and an
export: every prompt once, no shard shrunk or rewritten with other records, and what
the simulator generated counted against the prompts.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import redis

from genq.core import keys
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


def in_flight_at_loss(server: str, url: str, job: str) -> int:
    """What Redis can lose of the work done: prompts generated (results recorded) for batches
    whose shard is not written yet, and requests the server is running. Read with Redis's
    writes paused (no claim, no result can be recorded meanwhile), just before it is killed."""
    conn = redis.Redis.from_url(url)
    conn.execute_command("CLIENT", "PAUSE", "30000", "WRITE")
    unwritten = [b.decode() for b in conn.hkeys(keys.job_leases(job))]
    recorded = sum(conn.hlen(keys.batch_results(job, b)) for b in unwritten)
    stats = sim_stats(server)
    return recorded + int(stats["num_running"]) + int(stats["num_waiting"])


def start_worker(procs, url: str, server: str, name: str):
    return procs(genq_cmd("worker", "--server", server, "--name", name, "--retry-backoff", "0.1",
                          redis_url=url), name=name)


def export_ids(url: str, job: str, tmp_path: Path, *extra: str) -> list[str]:
    dest = tmp_path / f"{job}-export.jsonl"
    run_genq("export", "--job", job, "--to", str(dest), *extra, redis_url=url)
    return [json.loads(line)["id"] for line in dest.read_text().splitlines()]


def wait_done(url: str, job: str, timeout: float = 180) -> dict:
    def done():
        proc = run_genq("monitor", "--job", job, "--once", "--json", redis_url=url, check=False)
        if proc.returncode != 0:
            return None
        report = json.loads(proc.stdout)
        return report if report.get("status") == "done" else None

    return wait_until(done, timeout, f"job {job} done", interval=0.5)


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
    at_loss = in_flight_at_loss(server, lost_redis.url, "lost")  # all that may be generated twice
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
