"""Redis connections and URL masking (URLs may carry passwords and TLS)."""

from __future__ import annotations

import os
from urllib.parse import urlsplit

import redis
import redis.asyncio as aioredis

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ENV_VAR = "GENQ_REDIS_URL"


def resolve_url(url: str | None) -> str:
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


def mask_url(url: str) -> str:
    """The URL with every password replaced by ***, whatever form it takes.

    redis://user:secret@h:6379/0, redis://:secret@h, redis://secret@h (redis-py reads a
    lone userinfo as the password), rediss://..., unix://user:secret@/path.sock, and
    ?password=secret in the query (redis-py honours it for every scheme).
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"***@{hostport}"
    query = "&".join(_mask_param(p) for p in parts.query.split("&")) if parts.query else parts.query
    if netloc == parts.netloc and query == parts.query:
        return url
    # Assembled by hand: urlunsplit drops the empty host of unix:///path.
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def _mask_param(param: str) -> str:
    name, eq, _ = param.partition("=")
    return f"{name}=***" if eq and name.lower() == "password" else param


def connect(url: str) -> redis.Redis:
    """A sync client: RQ and the CLI use this one. Raw bytes, no decoding."""
    return redis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def connect_async(url: str) -> aioredis.Redis:
    return aioredis.Redis.from_url(url, health_check_interval=30, socket_keepalive=True)


def describe_error(url: str, exc: Exception) -> str:
    return f"cannot reach Redis at {mask_url(url)}: {exc}"
