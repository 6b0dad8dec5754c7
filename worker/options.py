"""What `genq worker --server ...` was told: one record, handed to every part of the engine."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit


@dataclass
class WorkerOptions:
    redis_url: str
    server_url: str
    name: str | None = None
    host: str | None = None
    gpu: int | None = None
    gpu_bandwidth: float | None = None  # bytes/s, --gpu-bandwidth: the decode bound's, where NVML has none
    model_bytes: float | None = None  # --model-bytes: the weights, where the server does not publish them
    concurrency: int | None = None  # None: auto, from the server's capacity
    burst: bool = False
    loops: int = 2  # --prefetch: batches held at least, the current one and the next (worker/intake.py)
    stream: bool = True
    request_timeout: float = 3600.0
    stall_timeout: float = 300.0
    server_down_timeout: float = 300.0
    server_start_timeout: float | None = None  # None: wait for the server forever (not with --burst)
    server_crash_limit: int = 3  # a prompt in flight during this many server crashes is dead-lettered
    grace_period: float = 60.0
    retry_backoff: float = 1.0
    retry_backoff_max: float = 60.0
    max_attempts: int | None = None  # overrides the job's setting


def default_worker_name(host: str, gpu: int | None, server_url: str) -> str:
    if gpu is not None:
        return f"{host}.gpu{gpu}"
    port = server_url.rstrip("/").rsplit(":", 1)[-1]
    return f"{host}.{port}" if port.isdigit() else host


def server_url_problem(url: str) -> str | None:
    """Why `url` cannot be a server's address, or None (without http://, 127.0.0.1:30000 reads as scheme and path)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        return f"{url!r} has no http:// or https:// in front: give e.g. http://{url.split('://')[-1]}"
    if not parts.hostname:
        return f"{url!r} names no host: give e.g. http://127.0.0.1:30000"
    try:
        _ = parts.port  # raises for a port out of range or not a number
    except ValueError as exc:
        return f"{url!r}: {exc}"
    if parts.path.rstrip("/").endswith("/v1"):  # an OpenAI base_url; /health is at the root
        return f"{url!r} ends in /v1: give the server's root, e.g. {parts.scheme}://{parts.netloc} (genq adds /v1/...)"
    return None


def name_problem(name: str, option: str) -> str | None:
    """Why `name` (given as `option`) cannot name a worker, or None: it names its Redis connection (RQ's doing),
    and Redis refuses a space or non-printable ASCII there."""
    if name and all("!" <= c <= "~" for c in name):
        return None
    return (f"{option} {name!r}: a worker name may hold only the characters ! to ~ (printable ASCII, no spaces), "
            "as a Redis client name")
