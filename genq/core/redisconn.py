"""Redis connections and URL masking (URLs may carry passwords and TLS)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ENV_VAR = "GENQ_REDIS_URL"


def resolve_url(url: str | None) -> str:
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


def mask_url(url: str) -> str:
    """redis://user:secret@host:6379/0 -> redis://user:***@host:6379/0"""
    parts = urlsplit(url)
    if parts.password is None and "@" not in parts.netloc:
        return url
    userinfo, _, hostport = parts.netloc.rpartition("@")
    user = userinfo.split(":", 1)[0] if ":" in userinfo else ""
    masked = f"{user}:***@{hostport}" if user else f"***@{hostport}"
    return urlunsplit((parts.scheme, masked, parts.path, parts.query, parts.fragment))


def connect(url: str) -> redis.Redis:
    """A sync client: RQ and the CLI use this one. Raw bytes, no decoding."""
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def connect_async(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def describe_error(url: str, exc: Exception) -> str:
    return f"cannot reach Redis at {mask_url(url)}: {exc}"
