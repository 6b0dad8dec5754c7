"""A redis-server of genq's own on a free loopback port (the demo's, the tests', the benchmarks'):
127.0.0.1 only, nothing kept on disk, its temporary folder removed at stop, in a session of its own
(a Ctrl-C meant for the caller does not kill it first). A Redis genq did not start is never touched.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from typing import IO

import redis


def free_port() -> int:
    """A loopback TCP port free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """Starts at construction and answers PING before it returns; `stop()` (or `with`) ends it.
    `extra`: redis-server arguments after the defaults (e.g. "--maxmemory", "1mb"); `log`: its output."""

    def __init__(self, *extra: str, db: int = 0, log: IO[bytes] | int = subprocess.DEVNULL,
                 start_timeout_s: float = 10.0) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="genq-redis-")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/{db}"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *extra],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.conn = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"a private redis-server on port {self.port} did not start")
            time.sleep(0.05)

    def _answers(self) -> bool:
        try:
            return bool(self.conn.ping())
        except redis.ConnectionError:
            return False

    def used_memory(self) -> int:
        return int(self.conn.info("memory")["used_memory"])

    def stop(self) -> None:
        self.conn.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalRedis:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
