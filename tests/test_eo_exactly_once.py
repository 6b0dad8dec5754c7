"""Exactly once, for real (#30): each test reproduces one interleaving the issue measured,
with real redis-server, real `genq sim` servers and real `genq worker` processes, and ends
with the shared audit (tests/audit.py).

1. a superseded holder's claims never hold a batch up (claims tied to the lease);
2. a shard is never written with prompts missing, and such a batch is never marked done;
3. workers ride out a Redis outage longer than the old 15 s;
4/5. a job deleted and enqueued again under its name is a new incarnation: nothing of the
   old one lands in the new one;
6. a worker's wall clock decides nothing (RQ's abandoned-job cleanup on local timestamps);
7. no process of a worker outlives it, whatever state Redis is in.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis
from rq.registry import StartedJobRegistry

from genq.core import keys, ledger
from genq.core.queueing import enqueue_batch_jobs, rq_queue
from genq.sim.lengths import prompt_key
from tests.audit import audit
from tests.conftest import (
    genq_cmd,
    post_json,
    restart_port,
    run_genq,
    sim_stats,
    wait_until,
    write_prompts,
)

FAST = dict(mean_output_tokens=120, output_sigma=1.0, tokens_per_step=16, step_ms_base=5)


def enqueue(tmp_path: Path, job: str, n: int, *args: str, redis_url: str, out: Path | None = None,
            extra: dict | None = None) -> tuple[list[str], Path]:
    src = tmp_path / f"{job}-{time.monotonic_ns()}.jsonl"
    ids = write_prompts(src, n, extra=extra)
    out = out or tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), *args, redis_url=redis_url)
    return ids, out


def _pings(conn: redis.Redis) -> bool:
    try:
        return bool(conn.ping())
    except redis.ConnectionError:
        return False


class OwnRedis:
    """A redis-server of this test's own, so it can be stopped. `appendonly`: a restart keeps its
    data; without, it has only what a SAVE wrote (a restart rolls it back to then)."""

    def __init__(self, procs, tmp_path: Path, *, appendonly: bool = True) -> None:
        self.procs = procs
        self.port = restart_port()
        data = tmp_path / f"redis-{self.port}"
        data.mkdir()
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if appendonly else ["--appendonly", "no"]
        self.args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", *persistence,
                     "--save", "", "--dir", str(data)]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.conn = redis.Redis.from_url(self.url)
        self.start()

    def start(self) -> None:
        self.proc = self.procs(self.args, name="redis")
        wait_until(lambda: _pings(self.conn), 15, "the test's redis-server")

    def stop(self) -> None:
        self.proc.signal(signal.SIGTERM)
        self.proc.wait(timeout=15)

    def crash(self) -> None:
        """Gone at once, nothing saved (SIGKILL)."""
        self.proc.signal(signal.SIGKILL)
        self.proc.wait(timeout=15)


def _holder(conn: redis.Redis, job: str, batch: str) -> str | None:
    return ledger.lease_holder(conn.hget(keys.job_leases(job), batch))


def test_a_superseded_holders_claims_do_not_hold_the_batch_up(redis_url, rconn, sim, worker, tmp_path):
    """#30 item 1. A holds a batch with requests in flight, freezes past its heartbeat, the batch
    is leased to B; A wakes, drops the batch (its lease check) with its requests going on, and
    they then fail (A's server crashes: resets, 5xx). A's claims on those prompts used to stay
    (A is alive) and B waited for them forever."""
    slow = sim(max_running_requests=8, mean_output_tokens=3000, output_sigma=0.2, tokens_per_step=2,
               step_ms_base=40)
    steady = sim(max_running_requests=16, mean_output_tokens=600, output_sigma=0.2, tokens_per_step=8,
                 step_ms_base=20)
    ids, out = enqueue(tmp_path, "leak", 40, "--batch-size", "40", "--max-tokens", "5000",
                       redis_url=redis_url)
    a = worker(slow, "--concurrency", "4", "--prefetch", "1", "--retry-backoff", "0.2", "--name", "a", name="a")
    wait_until(lambda: rconn.hlen(keys.batch_claims("leak", "b0000001")) >= 4, 60, "A sending its batch")
    a_instance = _holder(rconn, "leak", "b0000001")
    os.kill(a.pid, signal.SIGSTOP)  # past its heartbeat: its lease lapses, the batch goes round again
    try:
        # B sends one prompt at a time (it takes some from the back of A's batch meanwhile), so
        # A's claims on the front are still there when the batch is leased to B.
        b = worker(steady, "--concurrency", "1", "--prefetch", "1", "--name", "b", name="b")
        wait_until(lambda: (h := _holder(rconn, "leak", "b0000001")) and h != a_instance, 120,
                   "the batch leased to B")
    finally:
        os.kill(a.pid, signal.SIGCONT)
    wait_until(lambda: "elsewhere: dropping it here" in a.log(), 30, "A letting the batch go")
    # A's requests in flight now fail; its server stays down, so A (alive) takes nothing back by stealing.
    post_json(slow + "/sim/faults", {"outage_for": 600})
    run_genq("concurrency", "16", "--worker", "b", redis_url=redis_url)
    wait_until(lambda: rconn.sismember(keys.job_done("leak"), "b0000001"), 60,
               "B finishing the batch (a claim of A's held it up)")
    for proc in (a, b):
        proc.signal(signal.SIGTERM)
    assert a.wait(timeout=60) == 0, a.log()
    assert b.wait(timeout=60) == 0, b.log()
    audit(rconn, "leak", out, ids)


def test_a_redis_rolled_back_under_a_batch_never_gets_a_short_shard(sim, procs, tmp_path):
    """#30 item 2. Redis restarted from an older snapshot while a worker holds a batch: the
    outcomes recorded after the snapshot are gone. The shard used to be written from what Redis
    still held (a short shard) and the batch marked done: those prompts were never delivered
    and could not be queued again. Now they are sent again, and the shard is whole."""
    own = OwnRedis(procs, tmp_path, appendonly=False)
    server = sim(max_running_requests=4, mean_output_tokens=300, output_sigma=0.3, tokens_per_step=8,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, "short", 40, "--batch-size", "20", "--max-tokens", "1000", redis_url=own.url)
    proc = procs(genq_cmd("worker", "--server", server, "--burst", "--prefetch", "1", "--concurrency", "4",
                          redis_url=own.url), name="w")
    results = keys.batch_results("short", "b0000001")
    wait_until(lambda: own.conn.hlen(results) >= 4, 60, "part of the first batch recorded")
    own.conn.save()  # the snapshot Redis will come back from
    saved = own.conn.hlen(results)
    wait_until(lambda: own.conn.hlen(results) >= saved + 6, 60, "more of it recorded after the snapshot")
    own.crash()
    own.start()  # from the snapshot: the outcomes recorded since are gone (the worker still holds the batch)
    assert proc.wait(timeout=180) == 0, proc.log()
    found = audit(own.conn, "short", out, ids)
    assert len(found.results) == 40
    assert "no outcome in Redis" in proc.log(), "the rolled-back results were not noticed"


def test_a_redis_rolled_back_under_a_live_holder_generates_nothing_written_elsewhere(sim, procs, tmp_path):
    """Redis restarted from a snapshot taken while A held a batch that B then took, wrote and released:
    A's lease is current again, and A (frozen 6 s) saw no gap longer than a lease. A used to go on
    generating the batch's prompts (their outcomes written) until its output check adopted the batch;
    now the changed Redis run id makes its next lease check look in the output first."""
    own = OwnRedis(procs, tmp_path, appendonly=False)
    slow = sim(max_running_requests=8, mean_output_tokens=1000, output_sigma=0.05, tokens_per_step=1,
               step_ms_base=20)  # a request runs 20 s or more
    fast = sim(max_running_requests=32, **FAST)
    ids, out = enqueue(tmp_path, "rb", 40, "--batch-size", "40", "--max-tokens", "2000", redis_url=own.url)
    a = procs(genq_cmd("worker", "--server", slow, "--concurrency", "2", "--prefetch", "1", "--name", "a",
                       redis_url=own.url), name="a")
    wait_until(lambda: sim_stats(slow)["num_running"] == 2, 60, "A sending its batch")
    time.sleep(2)  # A's leases checked since its start (its first check looks in the output)
    own.conn.save()  # the snapshot Redis comes back from: the batch A's
    os.kill(a.pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    try:
        with own.conn.pipeline(transaction=True) as pipe:  # RQ delivers the batch again: B takes it
            enqueue_batch_jobs(pipe, own.conn, [("rb", "b0000001", 40)], at_front=True)
            pipe.execute()
        b = procs(genq_cmd("worker", "--server", fast, "--burst", "--concurrency", "32", "--name", "b",
                           redis_url=own.url), name="b")
        assert b.wait(timeout=60) == 0, b.log()
        assert own.conn.sismember(keys.job_done("rb"), "b0000001"), b.log()
        own.crash()
        own.start()  # from the snapshot: A's lease is current again, the batch not done
    finally:
        os.kill(a.pid, signal.SIGCONT)
    frozen_for = time.monotonic() - frozen_at
    before = sim_stats(slow)
    wait_until(lambda: "dropping it" in a.log(), 30, "A letting the batch go")
    wait_until(lambda: sim_stats(slow)["num_running"] == 0, 30, "A's requests ending")
    after = sim_stats(slow)
    a.signal(signal.SIGTERM)
    assert a.wait(timeout=60) == 0, a.log()
    assert frozen_for < 7, f"A frozen {frozen_for:.1f}s: near a gap its lease check notices anyway"
    sent, finished = (after[k] - before[k] for k in ("generation_requests", "finished_requests"))
    assert (sent, finished) == (0, 0), f"A sent {sent} and finished {finished} requests of a written batch:\n" + a.log()
    audit(own.conn, "rb", out, ids)


def test_workers_ride_out_a_redis_outage_longer_than_a_heartbeat(sim, procs, tmp_path):
    """Redis down for 30 s, three lease timeouts: no worker exits, nothing is lost or generated
    twice. Redis comes back with its data (appendonly)."""
    own = OwnRedis(procs, tmp_path)
    conn = own.conn
    server = sim(max_running_requests=8, mean_output_tokens=400, output_sigma=0.5, tokens_per_step=8,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, "rr", 80, "--batch-size", "10", "--max-tokens", "1500", redis_url=own.url)
    workers = [procs(genq_cmd("worker", "--server", server, "--name", f"w{i}", redis_url=own.url), name=f"w{i}")
               for i in range(2)]
    wait_until(lambda: conn.scard(keys.job_done("rr")) >= 1, 90, "a first batch done")
    own.stop()
    time.sleep(30)
    for w in workers:
        assert w.alive(), f"a worker exited during the outage:\n{w.log()}"
    own.start()
    wait_until(lambda: conn.scard(keys.job_done("rr")) == 8, 240, "every batch done after the outage")
    # RQ's started registry ends as the ledger does: no RQ job of a done batch is left "started".
    started = StartedJobRegistry(queue=rq_queue(conn))
    wait_until(lambda: not started.get_job_ids(cleanup=False), 60, "RQ's started registry holding no done batch")
    for w in workers:
        assert w.alive(), f"a worker exited:\n{w.log()}"
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=60) == 0, w.log()
    logs = "".join(w.log() for w in workers)
    assert "Redis unreachable for" in logs, logs[-3000:]
    assert "was frozen for" not in logs, "an outage of Redis was reported as a frozen engine"
    audit(conn, "rr", out, ids)


def test_a_job_deleted_and_enqueued_again_under_its_name_gets_nothing_of_the_old(redis_url, rconn, sim, worker,
                                                                                tmp_path):
    """#30 items 4 and 5. `genq jobs delete --force` while long-running workers hold its batches,
    then the same name enqueued again with another input (the same ids, other prompts), other
    settings and another output. The workers used to keep the old settings by job name (the new
    shards went to the OLD output, the new --max-tokens ignored) and old results landed on new
    prompts (recorded after the delete, then counted as finished in the new job)."""
    server = sim(max_running_requests=8, mean_output_tokens=300, output_sigma=0.3, tokens_per_step=8,
                 step_ms_base=10)
    first_out, second_out = tmp_path / "first", tmp_path / "second"
    enqueue(tmp_path, "again", 60, "--batch-size", "10", "--max-tokens", "400", redis_url=redis_url,
            out=first_out)
    workers = [worker(server, "--prefetch", "2", "--name", f"w{i}", name=f"w{i}") for i in range(2)]
    wait_until(lambda: rconn.scard(keys.job_done("again")) >= 1 and rconn.keys(keys.batch_results("again", "*")),
               90, "the first job under way")
    run_genq("jobs", "delete", "again", "--force", "--yes", redis_url=redis_url)
    before = _files(first_out)
    src = tmp_path / "second.jsonl"
    src.write_text("".join(f'{{"id": "p{i:05d}", "messages": [{{"role": "user", "content": "second life {i}"}}]}}\n'
                           for i in range(60)))
    ids = [f"p{i:05d}" for i in range(60)]
    run_genq("enqueue", str(src), "--job", "again", "--output", str(second_out), "--batch-size", "7",
             "--max-tokens", "20", redis_url=redis_url)
    wait_until(lambda: rconn.scard(keys.job_done("again")) == 9, 120, "the second job done")
    time.sleep(2)  # anything of the first job still on its way would land now
    for w in workers:
        w.signal(signal.SIGTERM)
    for w in workers:
        assert w.wait(timeout=120) == 0, w.log()
    assert _files(first_out) == before, "the deleted job's output changed after the delete"
    found = audit(rconn, "again", second_out, ids)
    generated = sim_stats(server)["generated_by_key"]
    for pid, row in found.results.items():
        assert row["messages"][0]["content"] == f"second life {int(pid[1:])}", row
        assert row["usage"]["completion_tokens"] <= 20, f"the new job's --max-tokens 20 was not honoured: {row}"
        assert generated.get(prompt_key(row["messages"]), 0) >= 1, f"{pid}: a result not generated for its prompt"
    leftovers = [k.decode() for k in rconn.scan_iter(match="genq:job:again:*")
                 if b":res:" in k or b":claims:" in k]
    assert not leftovers, f"keys of the deleted job came back: {leftovers}"


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


SKEWED_CLOCK = '''
"""Test-only: this process tree's wall clock runs {skew} s ahead (time.time and datetime.now);
monotonic clocks and Redis's own clock are untouched, as on a host whose clock is off."""
import datetime as _dt
import time as _time

_SKEW = {skew}
_time_real, _time_ns_real = _time.time, _time.time_ns
_time.time = lambda: _time_real() + _SKEW
_time.time_ns = lambda: _time_ns_real() + int(_SKEW * 1e9)


class _SkewedDatetime(_dt.datetime):
    @classmethod
    def now(cls, tz=None):
        return super().fromtimestamp(_time.time(), tz)

    @classmethod
    def utcnow(cls):
        return super().fromtimestamp(_time.time(), _dt.timezone.utc).replace(tzinfo=None)


_dt.datetime = _SkewedDatetime
'''


def test_a_worker_whose_clock_is_off_fails_no_healthy_batch(redis_url, rconn, sim, worker, tmp_path):
    """#30 item 6. A worker whose wall clock is 120 s ahead ran RQ's abandoned-job cleanup on its
    clock against the started-registry scores the other workers wrote with theirs: their healthy
    batches were marked abandoned and redelivered. Liveness is Redis TTLs only now."""
    hook = tmp_path / "skewed-clock"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SKEWED_CLOCK.format(skew=120))
    skewed_env = {"PYTHONPATH": os.pathsep.join([str(hook), *filter(None, [os.environ.get("PYTHONPATH")])])}
    probe = [sys.executable, "-c", "import time; print(time.time())"]
    ahead = float(subprocess.run(probe, env={**os.environ, **skewed_env}, capture_output=True, text=True,
                                 check=True).stdout) - time.time()
    assert 115 < ahead < 125, f"the test's clock hook is not in effect ({ahead:+.0f}s)"
    server = sim(max_running_requests=8, mean_output_tokens=1500, output_sigma=0.2, tokens_per_step=8,
                 step_ms_base=20)
    ids, out = enqueue(tmp_path, "skew", 32, "--batch-size", "4", "--max-tokens", "3000", redis_url=redis_url)
    honest = worker(server, "--prefetch", "2", "--name", "honest", name="honest")
    wait_until(lambda: rconn.hlen(keys.job_leases("skew")) >= 2, 60, "the honest worker holding batches")
    skewed = worker(server, "--prefetch", "2", "--name", "skewed", name="skewed", env=skewed_env)
    wait_until(lambda: rconn.scard(keys.job_done("skew")) == 8, 240, "every batch done")
    for w in (honest, skewed):
        w.signal(signal.SIGTERM)
    for w in (honest, skewed):
        assert w.wait(timeout=60) == 0, w.log()
    redelivered = int(rconn.hget(keys.job_stats("skew"), "redeliveries") or 0)
    assert redelivered == 0, f"{redelivered} healthy batches were redelivered:\n{honest.log()[-2000:]}"
    audit(rconn, "skew", out, ids)
