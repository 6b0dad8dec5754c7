"""A Redis that answers but refuses genq's writes, and one whose policy would evict genq's keys.

Three refusals a run of days meets (genq.core.redisconn): Redis full at its maxmemory under
noeviction ("OOM command not allowed when used memory > 'maxmemory'"; inside MULTI it refuses
reads too), Redis unable to save its snapshot, as with a full disk ("MISCONF ...": it refuses
writes and PING), and an address that is a read-only replica now ("READONLY ..."). Each is
waited out like an outage and named with its fix; nothing is lost or generated twice.

Any maxmemory-policy but noeviction (with a maxmemory set) lets Redis drop genq's keys as it
fills: `genq enqueue`, the worker and the monitor name it (docs/operations.md).
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from genq.core import keys
from genq.core.redisconn import NO_DISK, NOTE_REASONS, REPLICA, LocalRedis
from genq.core.timings import LEASE_TIMEOUT_S
from genq.monitor.exporter import make_registry
from genq.monitor.progress import Monitor
from tests.audit import audit
from tests.conftest import free_port, genq_cmd, run_genq, sim_stats, wait_http, wait_until, write_prompts

FAST = dict(mean_output_tokens=120, output_sigma=1.0, tokens_per_step=16, step_ms_base=5)
SLOW = dict(mean_output_tokens=400, output_sigma=0.5, tokens_per_step=8, step_ms_base=20)
FULL = "Redis is full"
pytestmark = pytest.mark.e2e  # every test here starts a redis-server of its own


@pytest.fixture
def own_redis() -> Iterator[LocalRedis]:
    """A private Redis of this test's own: its settings are changed, the shared one's never."""
    with LocalRedis("--maxmemory-policy", "noeviction") as server:
        yield server


@pytest.fixture
def redis_url(own_redis: LocalRedis) -> str:
    return own_redis.url


def warning_gauge(conn: redis.Redis) -> set[str]:
    """The reasons genq_redis_warning (`genq monitor --serve`) says 1 for, the others being 0."""
    said = {s.labels["reason"]: s.value for family in text_string_to_metric_families(
        generate_latest(make_registry(Monitor(conn, once=True))).decode())
        for s in family.samples if s.name == "genq_redis_warning"}
    assert set(said) == set(NOTE_REASONS), said
    return {reason for reason, value in said.items() if value == 1}


def enqueue(tmp_path: Path, redis_url: str, job: str, n: int) -> tuple[list[str], Path, str]:
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n)
    out = tmp_path / "out"
    done = run_genq("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "10",
                    "--max-tokens", "400", redis_url=redis_url)
    return ids, out, done.stderr


def generated_once(server: str, n: int) -> None:
    generated = sim_stats(server)["generated_by_key"]
    assert sum(generated.values()) == n and set(generated.values()) == {1}, f"regenerated: {generated}"


def test_a_worker_started_on_a_full_redis_waits_for_room(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, **FAST)
    ids, out, _ = enqueue(tmp_path, redis_url, "full0", 40)
    rconn.config_set("maxmemory", 1)  # below what it holds: every write is refused from now on
    proc = worker(server, "--burst")
    wait_until(lambda: FULL in proc.log(), 30, "the worker to say Redis is full")
    refused = run_genq("jobs", "delete", "full0", "--yes", redis_url=redis_url, check=False)
    assert refused.returncode == 1 and FULL in refused.stderr, refused.stderr  # one line, no traceback
    assert "Traceback" not in refused.stderr, refused.stderr
    time.sleep(3)
    assert proc.alive, proc.log()
    assert "Traceback" not in proc.log(), proc.log()
    rconn.config_set("maxmemory", 0)
    assert proc.wait(timeout=120) == 0, proc.log()
    audit(rconn, "full0", out, ids)
    generated_once(server, len(ids))


def test_redis_full_mid_job_loses_nothing_and_the_monitor_still_reads(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, **SLOW)
    ids, out, _ = enqueue(tmp_path, redis_url, "full1", 50)
    proc = worker(server, "--burst")
    wait_until(lambda: rconn.scard(keys.job_done("full1")) >= 1, 60, "a first batch done")
    rconn.config_set("maxmemory", 1)
    wait_until(lambda: FULL in proc.log(), 30, "the worker to say Redis is full")
    time.sleep(LEASE_TIMEOUT_S + 2)  # past the alive key's life: the engine could not renew it
    assert proc.alive, proc.log()
    assert "Redis unreachable" not in proc.log(), "a full Redis was called unreachable"
    # The results kept in memory are named with the refusal, not Redis's text about a script's sha.
    held = [line for line in proc.log().splitlines() if "cannot write results" in line or "cannot claim" in line]
    assert held and all(FULL in line and "script" not in line for line in held), held
    seen = run_genq("monitor", "--job", "full1", "--once", redis_url=redis_url, check=False)
    assert seen.returncode == 0, seen.stderr
    assert "full1" in seen.stdout and FULL in seen.stdout + seen.stderr, seen.stdout + seen.stderr
    as_json = run_genq("monitor", "--job", "full1", "--json", "--once", redis_url=redis_url, check=False)
    assert json.loads(as_json.stdout)["job"] == "full1" and FULL in as_json.stderr, as_json.stderr
    assert warning_gauge(rconn) == {"full"}
    fleet = run_genq("workers", redis_url=redis_url, check=False)  # its row reads lost: no heartbeat
    assert fleet.returncode == 0 and FULL in fleet.stderr, fleet.stderr
    rconn.config_set("maxmemory", 0)
    assert proc.wait(timeout=180) == 0, proc.log()
    # Nothing took the engine for lost while its alive key could not be renewed.
    assert "stopped heartbeating" not in proc.log() and "Traceback" not in proc.log(), proc.log()
    audit(rconn, "full1", out, ids)
    generated_once(server, len(ids))


def test_two_workers_ride_out_a_full_redis_of_two_leases_each_prompt_generated_once(redis_url, rconn, sim, worker,
                                                                                    tmp_path):
    """A full Redis still serves reads and lets keys expire: both workers' alive keys lapse while it
    refuses their renewals. When it takes writes again, neither worker's reconciler may take the
    other's batches for abandoned and send their prompts again (a fleet, where one worker alone
    has no one to take them)."""
    servers = [sim(max_running_requests=8, **SLOW) for _ in range(2)]
    ids, out, _ = enqueue(tmp_path, redis_url, "full2", 100)
    procs = [worker(server, "--burst", name=f"w{i}") for i, server in enumerate(servers)]
    wait_until(lambda: rconn.scard(keys.job_done("full2")) >= 2, 60, "first batches done")
    rconn.config_set("maxmemory", 1)
    wait_until(lambda: all(FULL in p.log() for p in procs), 30, "both workers to say Redis is full")
    time.sleep(2 * LEASE_TIMEOUT_S + 2)
    assert all(p.alive for p in procs), [p.log() for p in procs]
    rconn.config_set("maxmemory", 0)
    for p in procs:
        assert p.wait(timeout=240) == 0, p.log()
        assert "stopped heartbeating" not in p.log() and "Traceback" not in p.log(), p.log()
    audit(rconn, "full2", out, ids)
    generated: dict[str, int] = {}
    for server in servers:
        for key, n in sim_stats(server)["generated_by_key"].items():
            generated[key] = generated.get(key, 0) + n
    assert sum(generated.values()) == len(ids) and set(generated.values()) == {1}, f"regenerated: {generated}"


def test_an_evicting_policy_is_named_where_a_user_looks(redis_url, rconn, sim, worker, procs, tmp_path):
    rconn.config_set("maxmemory-policy", "volatile-lru")  # ElastiCache's default
    quiet = enqueue(tmp_path, redis_url, "unlimited", 5)[2]  # maxmemory 0: no limit, nothing evicted
    assert "maxmemory-policy" not in quiet, quiet
    rconn.config_set("maxmemory", 1 << 30)
    server = sim(max_running_requests=8, **FAST)
    ids, out, said = enqueue(tmp_path, redis_url, "evict", 20)
    assert "maxmemory-policy volatile-lru" in said and "noeviction" in said, said
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    assert "maxmemory-policy volatile-lru" in proc.log(), proc.log()
    seen = run_genq("monitor", "--job", "evict", "--once", redis_url=redis_url)
    assert "maxmemory-policy volatile-lru" in seen.stdout + seen.stderr, seen.stdout
    assert warning_gauge(rconn) == {"evicting_policy"}
    port = free_port()  # the web page's state carries it too (app.js shows it above the cards)
    procs(genq_cmd("monitor", "--web", f"127.0.0.1:{port}", "--json", redis_url=redis_url), name="monitor")
    wait_http(f"http://127.0.0.1:{port}/api/state")
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=5) as resp:
        assert "maxmemory-policy volatile-lru" in json.loads(resp.read())["redis_note"]
    audit(rconn, "evict", out, ids)
    rconn.config_set("maxmemory-policy", "noeviction")
    quiet = run_genq("enqueue", str(tmp_path / "evict.jsonl"), "--job", "evict2", "--output", str(out),
                     redis_url=redis_url)
    assert "maxmemory-policy" not in quiet.stderr + quiet.stdout, quiet.stderr
    assert warning_gauge(rconn) == set()


def test_the_refusal_is_told_apart_from_an_outage():
    """describe_error on a real refusal: the message names the setting, not a lost connection."""
    from genq.core.redisconn import describe_error

    with LocalRedis("--maxmemory-policy", "noeviction", "--maxmemory", "1") as server:
        try:
            server.conn.set("genq:probe", "x")
        except redis.OutOfMemoryError as exc:
            said = describe_error(server.url, exc)
        else:
            raise AssertionError("a Redis at maxmemory 1 took a write")
    assert FULL in said and "maxmemory" in said, said


def test_redis_without_disk_mid_job_is_waited_out(own_redis, redis_url, rconn, sim, worker, tmp_path):
    """MISCONF: Redis's snapshot cannot be written (here its file's place is taken by a folder, as a
    full disk fails it); with a save point and stop-writes-on-bgsave-error (Redis's defaults) it
    refuses writes, and PING, until a snapshot succeeds."""
    server = sim(max_running_requests=8, **SLOW)
    ids, out, _ = enqueue(tmp_path, redis_url, "nodisk", 40)
    proc = worker(server, "--burst")
    wait_until(lambda: rconn.scard(keys.job_done("nodisk")) >= 1, 60, "a first batch done")
    blocker = Path(own_redis.dir) / "dump.rdb"
    blocker.mkdir()
    (blocker / "taken").touch()
    rconn.config_set("save", "3600 1")
    rconn.bgsave()
    wait_until(lambda: rconn.info("persistence")["rdb_last_bgsave_status"] == "err", 30, "the snapshot to fail")
    wait_until(lambda: NO_DISK in proc.log(), 30, "the worker to say Redis cannot save")
    time.sleep(LEASE_TIMEOUT_S + 2)  # past the alive key's life: Redis lets it expire and be read
    assert proc.alive, proc.log()
    seen = run_genq("monitor", "--job", "nodisk", "--once", redis_url=redis_url)
    assert NO_DISK in seen.stdout, seen.stdout
    shutil.rmtree(blocker)
    rconn.bgsave()
    wait_until(lambda: rconn.info("persistence")["rdb_last_bgsave_status"] == "ok", 30, "a snapshot to succeed")
    assert proc.wait(timeout=180) == 0, proc.log()
    assert "stopped heartbeating" not in proc.log() and "Traceback" not in proc.log(), proc.log()
    audit(rconn, "nodisk", out, ids)
    generated_once(server, len(ids))


def test_a_worker_on_a_read_only_replica_waits_and_says_so(redis_url, rconn, sim, worker, tmp_path):
    """READONLY: after a failover the address a worker was given is a replica. Made one here of a
    primary that is not there: it keeps its data and refuses writes."""
    server = sim(max_running_requests=8, **FAST)
    ids, out, _ = enqueue(tmp_path, redis_url, "replica", 30)
    rconn.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
    refused = run_genq("enqueue", str(tmp_path / "replica.jsonl"), "--job", "r2", "--output", str(out),
                       redis_url=redis_url, check=False)
    assert refused.returncode == 1 and REPLICA in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
    proc = worker(server, "--burst")
    wait_until(lambda: REPLICA in proc.log(), 30, "the worker to say Redis is a replica")
    time.sleep(3)
    assert proc.alive, proc.log()
    rconn.execute_command("REPLICAOF", "NO", "ONE")
    assert proc.wait(timeout=120) == 0, proc.log()
    audit(rconn, "replica", out, ids)
    generated_once(server, len(ids))


def test_an_enqueue_that_fills_redis_says_what_is_queued_and_the_same_command_finishes_it(redis_url, rconn,
                                                                                          tmp_path):
    """The usual way a Redis fills: a large input queued inline. The enqueue stops at the refusal,
    says what the job holds and how to go on; run again once Redis has room, it queues the rest,
    each prompt once."""
    import json as _json

    from genq.core.ledger.jobs import counts
    from genq.core.queueing import rq_queue

    src = tmp_path / "big.jsonl"
    n = 12_000
    src.write_text("".join(_json.dumps({"id": f"p{i:05d}", "prompt": f"item {i} " + "lorem ipsum " * 20}) + "\n"
                           for i in range(n)))
    rconn.config_set("maxmemory", rconn.info("memory")["used_memory"] + 1_000_000)  # room for about a third
    args = ("enqueue", str(src), "--job", "big", "--output", str(tmp_path / "out"), "--batch-size", "100")
    first = run_genq(*args, redis_url=redis_url, check=False)
    held = counts(rconn, "big").total
    assert first.returncode == 1 and 0 < held < n, (held, first.stderr)
    assert FULL in first.stderr and f"holds {held:,} prompts" in first.stderr, first.stderr
    assert "run the same command again" in first.stderr and "Traceback" not in first.stderr, first.stderr
    rconn.config_set("maxmemory", 0)
    again = run_genq(*args, redis_url=redis_url)
    assert f"skipped {held:,} prompts already queued" in again.stdout + again.stderr, again.stdout + again.stderr
    assert counts(rconn, "big").total == n and counts(rconn, "big").batches == n // 100
    assert rq_queue(rconn).count == n // 100  # every batch in RQ's queue once


@pytest.mark.parametrize("deny", [("--rename-command", "INFO", ""),
                                  ("--user", "default", "on", "nopass", "~*", "&*", "+@all", "-info")],
                         ids=["renamed", "acl"])
def test_info_not_allowed_a_job_still_runs_and_every_command_works(deny, sim, procs, tmp_path):
    """Some managed Redis disable INFO: no restart is seen by run_id then (docs/exactly-once.md), nothing else
    changes; no command fails or logs a traceback for it."""
    with LocalRedis(*deny) as own:
        server = sim(max_running_requests=8, **FAST)
        ids, out, _ = enqueue(tmp_path, own.url, "noinfo", 30)
        proc = procs(genq_cmd("worker", "--server", server, "--burst", redis_url=own.url), name="worker")
        assert proc.wait(timeout=120) == 0, proc.log()
        assert "Traceback" not in proc.log(), proc.log()
        for args in (("monitor", "--job", "noinfo", "--once"), ("monitor", "--json", "--once"), ("workers",),
                     ("jobs",)):
            done = run_genq(*args, redis_url=own.url, check=False)
            assert done.returncode == 0 and "Traceback" not in done.stderr, (args, done.stderr)
        assert warning_gauge(own.conn) == set()
        audit(own.conn, "noinfo", out, ids)
        generated_once(server, len(ids))
