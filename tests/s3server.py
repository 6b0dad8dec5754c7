"""moto's standalone S3 server on loopback, for tests that talk to S3 through boto3.

The server is a real HTTP endpoint in a child process: genq's processes (enqueue,
worker, export) reach it through --s3-endpoint-url exactly as they would reach
MinIO or AWS. It keeps its state in memory, so a restarted server is empty.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.conftest import ROOT, restart_port

# Fake credentials and a region for boto3; short botocore retries so an outage
# shows up in the worker's log quickly (the worker retries the shard itself).
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_MAX_ATTEMPTS": "2",
}
# Never pick up a developer's real AWS setup.
S3_ENV_REMOVED = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3")


class MotoServer:
    def __init__(self, port: int, log_path: Path) -> None:
        self.port = port
        self.log_path = log_path
        self.recording = log_path.with_name("moto-requests.jsonl")  # see record()
        self.popen: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        log = open(self.log_path, "ab")
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**os.environ, "MOTO_RECORDER_FILEPATH": str(self.recording)},
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"moto server exited {self.popen.returncode}:\n{self.log_path.read_text()}")
            try:
                self.client().list_buckets()
                return
            except Exception:
                time.sleep(0.1)
        raise TimeoutError(f"moto server on port {self.port} did not answer within {timeout}s")

    def stop(self) -> None:
        if self.popen is None:
            return
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=10)
        self.popen = None
        # The port is free again once nothing accepts on it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) != 0:
                    return
            time.sleep(0.05)

    def record(self) -> None:
        """From now on moto logs each request it gets (method, URL, headers): read them with recorded()."""
        self.recording.unlink(missing_ok=True)
        urllib.request.urlopen(urllib.request.Request(f"{self.url}/moto-api/recorder/start-recording", method="POST"))

    def recorded(self) -> list[dict]:
        """The requests moto got since record(), in order."""
        return [json.loads(line) for line in self.recording.read_text().splitlines()]

    def client(self) -> Any:
        """A test-side client (its own, not genq's cache), with no retries."""
        return boto3.session.Session().client(
            "s3", endpoint_url=self.url, region_name="us-east-1",
            aws_access_key_id="testing", aws_secret_access_key="testing",
            config=Config(retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=2, read_timeout=10,
                          s3={"addressing_style": "path"}),
        )

    def objects(self, bucket: str, prefix: str = "") -> dict[str, bytes]:
        """key -> body of every object under prefix."""
        s3 = self.client()
        found = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                found[item["Key"]] = s3.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        return found


@pytest.fixture
def s3_env(monkeypatch) -> dict[str, str]:
    """AWS settings for this process and every genq child it starts."""
    for name in S3_ENV_REMOVED:
        monkeypatch.delenv(name, raising=False)
    for name, value in S3_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    return dict(S3_ENV)


@pytest.fixture
def moto(s3_env, tmp_path: Path) -> Iterator[MotoServer]:
    """A running moto S3 server on a free loopback port, stopped after the test."""
    server = MotoServer(restart_port(), tmp_path / "moto.log")
    server.start()
    yield server
    server.stop()
