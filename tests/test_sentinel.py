"""Redis Sentinel: genq through redis+sentinel:// URLs, the master failed over mid-job.

genq waits for a replica to confirm each write on a Sentinel URL (genq/core/redisconn.py):
without that, the old master's last writes are lost in a failover (seen here: a whole job run
on the old master after SENTINEL FAILOVER, 13 of its 16 batches unknown to the new one). So
the killed master is restarted, as its supervisor would: until it is the new master's replica,
writes wait. It comes back as the new master's replica, as a supervisor set up per Redis's advice
restarts a master without persistence: back as an empty master, the Sentinel would take it for a
replica of the new master (it is listed as one since the switch) and could promote it, and every
replica would then resync from the empty server (seen here once at down-after 1,000 ms, the same
as Sentinel's ping period: the new master was marked down a second after the switch, failed over
to the restarted empty `a`, and the job was gone).

Real Debian redis-sentinel (one sentinel, quorum 1), one master and one replica, all on
free loopback ports; a real `genq sim`, a real burst worker and the
genq commands all given the Sentinel URL. The master is failed over while a job runs
(SENTINEL FAILOVER; SIGKILL of the master): the job finishes exactly once (tests/audit.py)
on the new master, nothing lost.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from genq.core import keys
from genq.core.redisconn import connect, connect_async, describe_error
from tests.audit import audit
from tests.conftest import free_port, run_genq, sim_stats, wait_until, write_prompts

pytestmark = pytest.mark.skipif(shutil.which("redis-sentinel") is None,
                                reason="needs redis-sentinel (apt-get install redis-sentinel)")

SERVICE = "mymaster"
FAST = dict(max_running_requests=16, mean_output_tokens=120, output_sigma=0.8, tokens_per_step=16, step_ms_base=8)


class SentinelSet:
    """A master, a replica of it, and one sentinel watching them: private, loopback, in a tmp dir."""

    def __init__(self, replicas: dict[str, int] | None = None, password: str | None = None,
                 renamed_info: str | None = None) -> None:
        """replicas: name -> replica-priority (lower is promoted first); default one replica, b. password:
        the sentinel's own (requirepass). renamed_info: INFO's name on the servers (as some managed Redis)."""
        self.extra = ("--rename-command", "INFO", renamed_info) if renamed_info else ()
        self.dir = Path(tempfile.mkdtemp(prefix="genq-test-sentinel-"))
        self.procs: dict[str, subprocess.Popen] = {}
        self.replicas = replicas or {"b": 100}
        self.ports = {name: free_port() for name in ("a", *self.replicas)}
        self._server("a")
        for name, priority in self.replicas.items():
            self._server(name, "--replicaof", "127.0.0.1", str(self.ports["a"]), "--replica-priority", str(priority),
                         "--enable-debug-command", "local")  # DEBUG SLEEP: a replica made to lag
        self.sentinel_port = free_port()
        conf = self.dir / "sentinel.conf"
        conf.write_text(
            f"port {self.sentinel_port}\nbind 127.0.0.1\ndir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {self.ports['a']} 1\n"
            f"sentinel down-after-milliseconds {SERVICE} 2000\n"
            f"sentinel failover-timeout {SERVICE} 10000\n" + (f"requirepass {password}\n" if password else "")
            + (f"sentinel rename-command {SERVICE} INFO {renamed_info}\n" if renamed_info else ""))
        self.procs["sentinel"] = subprocess.Popen(["redis-sentinel", str(conf)],
                                                  stdout=open(self.dir / "sentinel.log", "ab"),
                                                  stderr=subprocess.STDOUT, start_new_session=True)
        self.sentinel = redis.Redis(port=self.sentinel_port, socket_connect_timeout=1, decode_responses=True,
                                    password=password)
        self.url = f"redis+sentinel://127.0.0.1:{self.sentinel_port}/{SERVICE}/0" + (
            f"?sentinel_password={password}" if password else "")
        wait_until(self._replica_known, 30, "the sentinel seeing the master and its synced replicas")

    def _server(self, name: str, *extra: str) -> None:
        self.procs[name] = subprocess.Popen(
            ["redis-server", "--port", str(self.ports[name]), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--dbfilename", f"{name}.rdb", *self.extra, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)

    def restart_as_replica(self, name: str, of: str) -> None:
        self._server(name, "--replicaof", "127.0.0.1", str(self.ports[of]))

    def sentinel_log(self) -> str:
        return (self.dir / "sentinel.log").read_text()[-3000:]

    def _replica_known(self) -> bool:
        try:
            replicas = self.sentinel.sentinel_slaves(SERVICE)
        except redis.RedisError:
            return False
        return sum(r.get("master-link-status") == "ok" for r in replicas) == len(self.replicas)

    def master_port(self) -> int:
        # (redis-py 6.4's sentinel_get_master_addr_by_name fails on a plain client: asked raw)
        return int(self.sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)[1])

    def direct(self, name: str) -> redis.Redis:
        return redis.Redis(port=self.ports[name], socket_connect_timeout=1)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def sentinel_set():
    s = SentinelSet()
    yield s
    s.stop()


def _run_job(sentinel_set: SentinelSet, sim, procs, tmp_path: Path, job: str, fail_over, promoted: str = "b",
             workers: int = 1) -> dict:
    servers = [sim(**FAST) for _ in range(workers)]
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 400)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "25", "--max-tokens", "400",
             redis_url=sentinel_set.url)
    master = sentinel_set.direct("a")
    assert master.zcard(keys.job_batches(job)) == 16  # the Sentinel URL reached the master
    started = [procs([sys.executable, "-m", "genq", "worker", "--server", server, "--burst", "--redis",
                      sentinel_set.url], name="worker") for server in servers]
    wait_until(lambda: master.scard(keys.job_done(job)) >= 3, 120, "3 batches done before the failover")
    fail_over()
    wait_until(lambda: sentinel_set.master_port() == sentinel_set.ports[promoted], 60, "the replica promoted")
    if sentinel_set.procs["a"].poll() is not None:  # killed: it comes back (as a supervisor restarts it)
        sentinel_set.restart_as_replica("a", of=promoted)
    for worker in started:
        assert worker.wait(timeout=300) == 0, worker.log() + sentinel_set.sentinel_log()
        assert "Traceback" not in worker.log(), worker.log()
    new_master = sentinel_set.direct(promoted)
    assert new_master.scard(keys.job_done(job)) == 16, started[0].log()[-6000:] + sentinel_set.sentinel_log()
    found = audit(new_master, job, out, ids)
    assert not found.letters and len(found.results) == 400
    # The commands follow the new master through the same URL.
    jobs = run_genq("jobs", "--redis", sentinel_set.url).stdout
    assert job in jobs and "done" in jobs, jobs
    generated: Counter[str] = Counter()
    for server in servers:
        generated.update(sim_stats(server)["generated_by_key"])
    print(f"{job}: {generated.total()} requests for 400 prompts")
    return generated


def test_a_job_finishes_exactly_once_through_a_sentinel_failover(sentinel_set, sim, procs, tmp_path):
    def fail_over() -> None:
        assert sentinel_set.sentinel.execute_command("SENTINEL", "FAILOVER", SERVICE) == "OK"

    _run_job(sentinel_set, sim, procs, tmp_path, "failover", fail_over)


def test_a_job_finishes_exactly_once_when_the_master_is_killed(sentinel_set, sim, procs, tmp_path):
    def kill_master() -> None:
        sentinel_set.procs["a"].send_signal(signal.SIGKILL)
        sentinel_set.procs["a"].wait(timeout=10)

    _run_job(sentinel_set, sim, procs, tmp_path, "killed", kill_master)


def test_every_command_reads_a_sentinel_url(sentinel_set):
    client = connect(sentinel_set.url)
    client.set("k", "v")
    assert sentinel_set.direct("a").get("k") == b"v"
    time.sleep(0.2)
    assert sentinel_set.direct("b").get("k") == b"v"  # replicated: this is the master the sentinel names
    # ?wait_replicas=0: no WAIT after writes (a plain client; the last writes may be lost in a failover).
    from genq.core.redisconn import ReplicatedRedis

    assert isinstance(client, ReplicatedRedis) and not isinstance(connect(sentinel_set.url + "?wait_replicas=0"),
                                                                   ReplicatedRedis)
    # With its one replica gone, a write is refused after the wait instead of being taken alone.
    sentinel_set.procs["b"].kill()
    sentinel_set.procs["b"].wait(timeout=10)
    time.sleep(1.5)
    with pytest.raises(redis.ConnectionError, match="replica"):
        connect(sentinel_set.url).set("k", "lost?")
    # A service the sentinel does not know: one line naming it, exit 1.
    proc = run_genq("jobs", redis_url=sentinel_set.url.replace(SERVICE, "nosuch"), check=False)
    assert proc.returncode == 1 and "nosuch" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    # A sentinel that refuses the password, or none answering: the sentinel and its error, not a client's repr.
    for url, says in ((sentinel_set.url + "?sentinel_password=S3cret", "AUTH"),
                      (sentinel_set.url.replace(str(sentinel_set.sentinel_port), str(free_port())), "refused")):
        with pytest.raises(redis.ConnectionError) as caught:
            connect(url).ping()
        said = describe_error(url, caught.value)
        assert says in said and "S3cret" not in said and "redis.client" not in said and len(said) < 300, said


# ---------------------------------------------------------------- two replicas, the preferred one lagging

FILLER = 48 << 20  # bytes written before the lagging replica's last writes: more than the sockets between hold


@pytest.fixture
def two_replicas():
    s = SentinelSet({"b": 100, "c": 10})  # Sentinel promotes c first, in sync or not
    yield s
    s.stop()


def lag_then_kill_master(s: SentinelSet, sleep_s: float = 3.0):
    """Replica c stops reading its link (DEBUG SLEEP) behind a write larger than the sockets hold, so what
    the master takes next stays in the master's buffer for c; the returned function kills the master
    while c still sleeps (all that buffer lost with it) and waits for Sentinel to promote c."""
    sleeper = threading.Thread(target=lambda: s.direct("c").execute_command("DEBUG", "SLEEP", str(sleep_s)))
    sleeper.start()
    time.sleep(0.3)
    s.direct("a").set("genq-test:filler", b"x" * FILLER)
    started = time.monotonic()

    def kill() -> None:
        time.sleep(max(0.0, sleep_s - 1.0 - (time.monotonic() - started)))
        s.procs["a"].send_signal(signal.SIGKILL)
        s.procs["a"].wait(timeout=10)
        sleeper.join()
        wait_until(lambda: s.master_port() == s.ports["c"], 60, "Sentinel promoting the lagging replica c")

    return kill


def test_a_write_that_returned_is_on_a_lagging_replica_that_is_then_promoted(two_replicas):
    s = two_replicas
    client = connect(s.url)
    client.set("genq-test:before", "1")
    kill = lag_then_kill_master(s)
    outcome: list[object] = []

    def write() -> None:
        try:
            outcome.append(client.set("genq-test:acked", "1"))
        except redis.RedisError as exc:  # not confirmed: the caller knows it may be lost, and sends it again
            outcome.append(exc)

    writer = threading.Thread(target=write)
    writer.start()
    time.sleep(0.5)
    returned_before_the_kill = bool(outcome)
    kill()
    writer.join(timeout=120)
    promoted = s.direct("c")
    assert promoted.get("genq-test:before") == b"1"
    if outcome and outcome[0] is True:  # confirmed: every replica Sentinel could promote has it
        assert promoted.get("genq-test:acked") == b"1", (
            f"the write returned {'before' if returned_before_the_kill else 'after'} the master died and the "
            f"promoted replica lacks it")
    assert not returned_before_the_kill, "a write returned while a replica Sentinel could promote lacked it"


def test_a_job_loses_nothing_when_a_lagging_replica_is_promoted(two_replicas, sim, procs, tmp_path):
    """Two replicas, the one Sentinel prefers lagging (the set-up docs/operations.md suggests), two
    workers: the master killed while it lags, it is promoted; every write genq was told had landed is
    on it. The commands run while no master answers say so in one line (exit 1) or wait for the new one."""
    s = two_replicas
    src = tmp_path / "more.jsonl"
    write_prompts(src, 20, start=1000)
    said: dict[str, subprocess.CompletedProcess] = {}
    commands = {"monitor": ("monitor", "--once"), "workers": ("workers",),
                "enqueue": ("enqueue", str(src), "--job", "more", "--output", str(tmp_path / "more"))}

    def fail_over() -> None:
        kill = lag_then_kill_master(s)
        killer = threading.Thread(target=kill)
        killer.start()
        wait_until(lambda: s.procs["a"].poll() is not None, 30, "the master killed")
        runs = [threading.Thread(target=lambda k=k, a=a: said.update({k: run_genq(*a, redis_url=s.url, check=False)}))
                for k, a in commands.items()]
        for run in runs:
            run.start()
        for thread in (*runs, killer):
            thread.join()

    generated = _run_job(s, sim, procs, tmp_path, "lagging", fail_over, promoted="c", workers=2)
    assert len(generated) >= 400, len(generated)  # (another worker may send a borrowed prompt again: never written)
    for name, done in said.items():
        lines = done.stderr.strip().splitlines()
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (name, done.stderr)
        assert done.returncode == 0 or len(lines) == 1, (name, done.stderr)


def test_a_worker_that_loses_every_sentinel_never_logs_the_sentinel_password(sim, procs, tmp_path):
    s = SentinelSet(password="S3ntinelPw")
    try:
        src = tmp_path / "p.jsonl"
        write_prompts(src, 40)
        run_genq("enqueue", str(src), "--job", "lost", "--output", str(tmp_path / "out"), redis_url=s.url)
        server = sim(max_running_requests=4, mean_output_tokens=400, tokens_per_step=4, step_ms_base=50)
        worker = procs([sys.executable, "-m", "genq", "worker", "--server", server, "--redis", s.url], name="worker")
        wait_until(lambda: "-> " in worker.log(), 60, "the worker started")
        for name in ("sentinel", "a"):  # no master, and no sentinel to name another: it reconnects, and fails
            s.procs[name].kill()
            s.procs[name].wait(timeout=10)
        wait_until(lambda: "heartbeat:" in worker.log(), 60, "the worker to say Redis is away")
        assert "S3ntinelPw" not in worker.log(), worker.log()[-3000:]
    finally:
        s.stop()


def test_writes_wait_for_a_replica_where_info_is_renamed():
    """INFO renamed (Sentinel told so): the online replicas cannot be counted; a write waits for ?wait_replicas."""
    s = SentinelSet(renamed_info="GENQINFO")
    try:
        connect(s.url).set("genq-test:k", "v")
        asyncio.run(connect_async(s.url).set("genq-test:a", "v"))  # a worker's client
        assert s.direct("b").mget("genq-test:k", "genq-test:a") == [b"v", b"v"]  # WAIT returned: on the replica
    finally:
        s.stop()
