"""The tests and `genq demo` never touch a Redis they did not start (#12 item 6).

A Redis on 127.0.0.1:6379 may be somebody's production: keys are put in db 0
and db 15 there, a real test file and the demo run, and the keys must be as
they were. If nothing answers on 6379 the test starts a redis-server there and
stops it afterwards.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator

import pytest
import redis

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.redisconn import free_port
from tests import zygote
from tests.conftest import ROOT, genq_cmd, wait_http, wait_until

HOST = "127.0.0.1"
# The Redis to leave alone. Another port only to check these tests against a scratch
# server (e.g. with a conftest broken on purpose), never to skip the real check.
PORT = int(os.environ.get("GENQ_GUARDED_REDIS_PORT", "6379"))


def _answers(port: int) -> bool:
    try:
        return bool(redis.Redis(host=HOST, port=port, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture
def sentinels() -> Iterator[dict[int, dict[str, str]]]:
    """Keys of our own (unique names) in db 0 and db 15 of the Redis on 6379; removed afterwards."""
    started = None
    folder = None
    if not _answers(PORT):
        if shutil.which("redis-server") is None:
            pytest.skip("no Redis on 6379 and no redis-server to start one")
        folder = tempfile.mkdtemp(prefix="genq-test-6379-")
        started = subprocess.Popen(["redis-server", "--port", str(PORT), "--bind", HOST, "--save", "",
                                    "--appendonly", "no", "--dir", folder],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
        wait_until(lambda: _answers(PORT) or started.poll() is not None, 10, "redis-server on 6379")
        if started.poll() is not None:
            pytest.skip("port 6379 is taken by something that is not Redis")
    tag = uuid.uuid4().hex
    values = {db: {f"genq-harness-test:{tag}:{name}": f"{db}-{name}" for name in ("a", "genq:jobs")} for db in (0, 15)}
    conns = {db: redis.Redis(host=HOST, port=PORT, db=db) for db in values}
    for db, pairs in values.items():
        conns[db].mset(pairs)
    try:
        yield values
    finally:
        for db, pairs in values.items():
            conns[db].delete(*pairs)
            conns[db].close()
        if started is not None:
            started.terminate()
            started.wait(timeout=10)
            shutil.rmtree(folder, ignore_errors=True)


def _intact(values: dict[int, dict[str, str]]) -> None:
    for db, pairs in values.items():
        conn = redis.Redis(host=HOST, port=PORT, db=db, decode_responses=True)
        assert conn.mget(list(pairs)) == list(pairs.values()), f"keys in db {db} of {HOST}:{PORT} were changed"
        assert all(conn.ttl(k) == -1 for k in pairs)


def _genq_keys(db: int) -> set[bytes]:
    conn = redis.Redis(host=HOST, port=PORT, db=db)
    return set(conn.scan_iter(match="genq:*")) | set(conn.scan_iter(match="rq:*"))


def test_the_test_suite_leaves_the_redis_on_6379_alone(sentinels):
    before = _genq_keys(15)
    # GENQ_REDIS_URL points at db 15 of 6379: code that fell back to it instead of the
    # suite's private Redis would write there and be caught.
    env = {**os.environ, "GENQ_REDIS_URL": f"redis://{HOST}:{PORT}/15"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_producer.py"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"\d+ passed", proc.stdout)
    _intact(sentinels)
    assert _genq_keys(15) == before


def test_demo_runs_on_a_private_redis_and_stops_it(sentinels, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    args = [sys.executable, "-m", "genq", "demo", "--num-gpus", "1", "--prompts", "20", "--mean-output-tokens", "8",
            "--speed", "10", "--output", str(tmp_path / "demo")]
    proc = subprocess.run(args, cwd=tmp_path, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    private = re.search(r"private redis-server at redis://127\.0\.0\.1:(\d+)/0", proc.stdout)
    assert private, proc.stdout
    assert "20 results for 20 prompts" in proc.stdout
    job = re.search(r"job (demo-\d{8}-\d{6}): queued", proc.stdout).group(1)
    _intact(sentinels)
    assert not any(job.encode() in k for db in (0, 15) for k in _genq_keys(db))
    assert not _answers(int(private.group(1))), "the demo's redis-server is still running"


def test_demo_on_a_given_redis_removes_its_job_afterwards(redis_url, rconn, tmp_path):
    proc = subprocess.run(genq_cmd("demo", "--num-gpus", "1", "--prompts", "10", "--mean-output-tokens", "8",
                                   "--speed", "10", "--output", str(tmp_path / "demo"), redis_url=redis_url),
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "removed the demo's job" in proc.stdout
    assert not list(rconn.scan_iter(match="genq:job:*")) and not rconn.smembers(keys.JOBS)
    assert rq_queue(rconn).count == 0 and not list(rconn.scan_iter(match="rq:job:*"))


def test_a_genq_forked_by_the_tests_answers_as_a_fresh_interpreter_does(redis_url, tmp_path):
    """tests/zygote.py forks genq commands from one interpreter that imported genq: each must
    answer exactly as `python -m genq` started afresh does (output, errors, exit code)."""
    (tmp_path / "bad.jsonl").write_text('{"id": "a", "prompt": "x"}\nnot json\n')
    for args in (["jobs", "list"], ["enqueue", str(tmp_path / "bad.jsonl"), "--job", "j", "--dry-run"],
                 ["enqueue", str(tmp_path / "missing.jsonl"), "--job", "j"], ["--help"], ["no-such-command"]):
        fresh = zygote.run(genq_cmd(*args, redis_url=redis_url), cwd=tmp_path, timeout=120, fork=False)
        forked = zygote.run(genq_cmd(*args, redis_url=redis_url), cwd=tmp_path, timeout=120, fork=True)
        assert (forked.returncode, forked.stdout, forked.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert fresh.returncode == 2 and "no-such-command" in fresh.stderr


def test_a_genq_killed_by_a_fatal_signal_says_where_it_was(tmp_path):
    """A segfault (a C library's bug) ends genq with the Python traceback of every thread on stderr, not silently:
    a fresh `genq` as a user starts it, and one forked from the tests' zygote."""
    for fork in (False, True):
        port, log = free_port(), tmp_path / f"sim-forked-{fork}.log"
        args = [sys.executable, "-m", "genq", "sim", "--port", str(port)]
        if fork:
            proc = zygote.Forked(args, cwd=tmp_path, env=dict(os.environ), stdout=str(log))
        else:
            with open(log, "wb") as out:
                proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        try:
            wait_http(f"http://127.0.0.1:{port}/v1/models", want=None)
            proc.send_signal(signal.SIGSEGV)
            assert proc.wait(timeout=30) == -signal.SIGSEGV
        finally:
            proc.kill()
        said = log.read_text(errors="replace")
        assert "Fatal Python error: Segmentation fault" in said and "most recent call first" in said, said
    closed = subprocess.run(["sh", "-c", '"$0" -m genq --help 2>&-', sys.executable], capture_output=True, timeout=60)
    assert closed.returncode == 0 and b"Usage:" in closed.stdout  # with no stderr to write to, it still runs
