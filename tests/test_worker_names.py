"""A worker name Redis would refuse as a client name is bad usage, said at once, not a worker that never works."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import free_port, genq_cmd

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("args, option", [
    (("--server", "URL", "--name", "gpu 0"), "--name"),
    (("--server", "URL", "--host", "my host"), "--host"),  # the default name is HOST.PORT
    (("--gpus", "0", "--server-url", "URL", "--name", "gpu 0"), "--name"),
    (("--gpus", "0", "--server-url", "URL", "--host", "my\thost"), "--host"),
])
def test_a_name_redis_would_refuse_is_bad_usage_at_once(redis_url, tmp_path, args, option):
    url = f"http://127.0.0.1:{free_port()}"  # nothing answers there: a worker that starts waits for it
    argv = genq_cmd("worker", *[url if a == "URL" else a for a in args], "--burst", "--server-start-timeout", "5")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, cwd=tmp_path)  # --gpus: its genq-logs
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{args}: still running after 30 s\n{exc.stderr}") from None
    assert proc.returncode == 2, (args, proc.returncode, proc.stderr[-2000:])
    assert option in proc.stderr and "! to ~" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_name_of_printable_characters_is_taken(redis_url):
    url = f"http://127.0.0.1:{free_port()}"
    proc = subprocess.run(genq_cmd("worker", "--server", url, "--name", "gpu#0@rack-1:a", "--burst",
                                   "--server-start-timeout", "1"), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "did not answer" in proc.stderr, proc.stderr[-2000:]
