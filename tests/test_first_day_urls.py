"""The first day on a real fleet (#28): --redis after the subcommand, and every Redis URL form.

Each URL is tried against a private redis-server of its own (a password with the characters
generated passwords hold, an ACL user, a unix socket): it works, or the command says in one
line what is wrong without any part of the password.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

import pytest
import redis

from genq.core import keys
from tests.conftest import ROOT, LocalRedis, descendants, free_port, restart_port, run_genq, wait_until, write_prompts

PASSWORD = "k3J9/x#Q@z:w?p"  # '/', '#', '@', ':' and '?': each broke URL parsing somewhere


def genq(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """genq with no --redis of the suite's: each test names its own URL where it wants one."""
    return subprocess.run([sys.executable, "-m", "genq", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT)


class LockedRedis:
    """A private Redis with a password and an ACL user, both with URL-hostile characters
    (conftest's LocalRedis pings without a password)."""

    def __init__(self, conf: Path, port: int | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="genq-test-redis-")
        self.port = port or free_port()
        self.proc = subprocess.Popen(["redis-server", str(conf), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--dir", self.dir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.client = redis.Redis(port=self.port, password=PASSWORD)
        wait_until(self._pings, 10, "the locked redis-server")

    def _pings(self) -> bool:
        try:
            return bool(self.client.ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def locked_conf(folder: Path) -> Path:
    conf = folder / "redis.conf"
    conf.write_text(f'requirepass "{PASSWORD}"\nuser alice on >{PASSWORD} ~* &* +@all\n')
    return conf


@pytest.fixture(scope="module")
def locked(tmp_path_factory):
    server = LockedRedis(locked_conf(tmp_path_factory.mktemp("locked")))
    yield server
    server.stop()


def test_redis_is_accepted_after_the_subcommand_and_wins_there(locked, tmp_path):
    url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{locked.port}/0"
    src = tmp_path / "p.jsonl"
    write_prompts(src, 3)
    # After the subcommand, even with a different (unreachable) URL before it.
    proc = genq("--redis", "redis://127.0.0.1:1/0", "enqueue", str(src), "--job", "after", "--redis", url)
    assert proc.returncode == 0, proc.stderr
    assert locked.client.exists(keys.job_config("after"))
    proc = genq("jobs", "--redis", url)
    assert proc.returncode == 0 and "after" in proc.stdout, proc.stderr
    # In a subgroup's subcommand too, and named in each command's --help.
    proc = genq("jobs", "delete", "after", "--yes", "--redis", url)
    assert proc.returncode == 0, proc.stderr
    assert not locked.client.exists(keys.job_config("after"))
    worker_help = " ".join(genq("worker", "--help").stdout.split())
    assert "--redis URL" in worker_help
    # The fleet's templates and files are said where they are set, not only in docs/fleet.md.
    assert "{port} and {gpu} substituted" in worker_help and "their .pid files" in worker_help


def test_an_unreachable_redis_given_after_the_subcommand_is_the_one_named():
    # The error named the Redis before the subcommand (here the default) instead of the one tried.
    proc = genq("workers", "--redis", "redis://:sekrit@127.0.0.1:1/0")
    assert proc.returncode == 1, proc.stderr
    assert ("cannot reach Redis at redis://:***@127.0.0.1:1/0" in proc.stderr
            and "sekrit" not in proc.stderr), proc.stderr


@pytest.mark.parametrize("userinfo", [
    PASSWORD,  # as typed: the userinfo is everything before the last '@'
    quote(PASSWORD, safe=""),  # percent-encoded
    f"alice:{PASSWORD}",  # an ACL user
    f"alice:{quote(PASSWORD, safe='')}",
])
def test_every_password_form_connects(locked, userinfo):
    colon = "" if userinfo.startswith("alice") else ":"
    proc = genq("--redis", f"redis://{colon}{userinfo}@127.0.0.1:{locked.port}/0", "jobs")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("url, code, says", [
    ("redis://:{pw}@127.0.0.1:{port}/0", 1, "invalid username-password"),  # a wrong password
    ("redis://:{pw}@127.0.0.1:notaport/0", 2, "port"),
    ("redis://:{pw}@127.0.0.1:{port}/zero", 2, "database 'zero'"),
    ("http://:{pw}@127.0.0.1:{port}/0", 2, "http:// is not a Redis URL scheme"),
    ("127.0.0.1:{port}", 2, "no scheme"),
    ("redis+sentinel://:{pw}@127.0.0.1:{port}", 2, "service"),
])
def test_a_bad_url_is_one_line_without_the_password(locked, url, code, says):
    wrong = "W7/#:x@" + PASSWORD[::-1]
    proc = genq("--redis", url.format(pw=wrong, port=locked.port), "jobs")
    assert proc.returncode == code, proc.stderr
    assert says in proc.stderr.lower() or says in proc.stderr, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for piece in ("W7/", wrong[2:6], PASSWORD[:4], quote(wrong, safe="")[:8]):
        assert piece not in err, (piece, err)


def leaks(text: str) -> list[str]:
    """The pieces of PASSWORD (as typed or percent-encoded) found in text."""
    return [piece for piece in (PASSWORD, PASSWORD[:6], quote(PASSWORD, safe="")[:8]) if piece in text]


@pytest.mark.parametrize("command", ["worker", "monitor"])
def test_a_redis_that_quotes_auth_never_puts_the_password_in_a_long_running_log(command, sim, procs, tmp_path):
    """A Redis that refuses AUTH quotes it, arguments and all ("unknown command 'AUTH', with args beginning
    with: 'alice' '<password>'"): here the Redis restarted with AUTH renamed; a proxy or another server does
    the same. A running worker and monitor say Redis is unreachable, never the password."""
    port = restart_port()
    server = LockedRedis(locked_conf(tmp_path), port)
    url = f"redis://alice:{quote(PASSWORD, safe='')}@127.0.0.1:{port}/0"
    args = ["worker", "--server", sim()] if command == "worker" else ["monitor", "--json", "--interval", "0.5"]
    started = procs([sys.executable, "-m", "genq", *args], name=command, env={"GENQ_REDIS_URL": url})
    wait_until(lambda: ("-> " if command == "worker" else "{") in started.log(), 60, f"the {command} read Redis")
    server.stop()
    renamed = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir",
                                str(tmp_path), "--rename-command", "AUTH", ""], stdout=subprocess.DEVNULL,
                               start_new_session=True)  # it answers, refusing AUTH
    try:
        wait_until(lambda: "unknown command 'AUTH'" in started.log(), 120, f"the {command} to say Redis refused AUTH")
        assert not leaks(started.log()), started.log()[-3000:]
    finally:
        renamed.kill()
        renamed.wait(timeout=10)


def test_a_demo_on_a_redis_with_a_password_keeps_it_out_of_its_childrens_argv(locked, tmp_path):
    """GENQ_REDIS_URL keeps the password out of the process list (docs/security.md): the demo's enqueue and
    workers get it the same way, not as --redis in their argv."""
    url = f"redis://:{quote(PASSWORD, safe='')}@127.0.0.1:{locked.port}/0"
    demo = subprocess.Popen([sys.executable, "-m", "genq", "demo", "--num-gpus", "1", "--prompts", "10",
                             "--mean-output-tokens", "8", "--speed", "10", "--output", str(tmp_path / "demo")],
                            cwd=tmp_path, env={**os.environ, "GENQ_REDIS_URL": url}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen: set[str] = set()
    while demo.poll() is None:
        for pid in descendants(demo.pid):
            with contextlib.suppress(OSError):
                seen.add(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    output = demo.stdout.read() if demo.stdout else ""
    assert demo.returncode == 0, output[-3000:]
    assert any(" worker " in argv for argv in seen), seen  # its workers were seen while they ran
    assert not [argv for argv in seen if leaks(argv)], seen
    assert not leaks(output), output


def test_unix_socket_urls_run_a_job(tmp_path, sim, procs):
    sock = tmp_path / "redis.sock"
    server = LocalRedis("--unixsocket", str(sock), "--unixsocketperm", "700")
    try:
        url = f"unix://{sock}?db=2"
        src = tmp_path / "p.jsonl"
        ids = write_prompts(src, 12)
        out = tmp_path / "out"
        run_genq("enqueue", str(src), "--job", "sock", "--output", str(out), "--batch-size", "4", redis_url=url)
        server_url = sim(mean_output_tokens=20, tokens_per_step=16, step_ms_base=2)
        worker = procs([sys.executable, "-m", "genq", "--redis", url, "worker", "--server", server_url, "--burst"],
                       name="worker")
        assert worker.wait(timeout=120) == 0, worker.log()
        assert redis.Redis(unix_socket_path=str(sock), db=2).scard(keys.job_done("sock")) == 3
        assert len(list((out / "sock" / "shards").glob("*.jsonl"))) == 3 and ids
    finally:
        server.stop()


def test_rediss_against_a_plaintext_redis_fails_within_seconds_saying_why(redis_url):
    plain = redis_url.replace("redis://", "rediss://")
    started = time.monotonic()
    proc = genq("--redis", plain, "jobs", timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 1 and took < 15, (took, proc.stderr)
    assert "TLS" in proc.stderr and "redis://" in proc.stderr, proc.stderr


def test_genq_help_names_every_engine():
    text = genq("--help").stdout
    assert "SGLang" in text and "vLLM" in text and "llama.cpp" in text, text


def test_rediss_against_a_tls_redis_works_with_its_certificate_checked(tmp_path):
    """Timing the handshake (genq/core/redisconn.py) leaves real TLS working, verified against its CA."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                               "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                               "--tls-ca-cert-file", str(cert),
                               "--tls-auth-clients", "no", "--save", "", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}"
        write_prompts(tmp_path / "p.jsonl", 3)
        wait_until(lambda: genq("--redis", url, "jobs").returncode == 0, 10, "the TLS redis-server")
        proc = genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "tls", "--redis", url)
        assert proc.returncode == 0, proc.stderr
        assert "tls" in genq("jobs", "--redis", url).stdout
        import asyncio

        from genq.core.redisconn import connect_async

        async def ping() -> bool:
            client = connect_async(url)
            try:
                return bool(await client.ping())
            finally:
                await client.aclose()

        assert asyncio.run(ping())  # the workers' asyncio client too
    finally:
        server.kill()
        server.wait(timeout=10)
