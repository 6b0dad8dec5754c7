"""A Redis that answers but will not take genq's writes, and one that would drop genq's keys
(docs/operations.md, "When Redis refuses writes").

Three refusals, each waited out like an outage and named with what fixes it: full (maxmemory under
noeviction: "OOM ..."), no disk (its last RDB or AOF write failed: "MISCONF ..."), replica (read-only
after a failover: "READONLY ..."). And the policy: genq's working state must never be evicted, so
Redis needs `maxmemory-policy noeviction`; under volatile-* the engines' alive keys go first and
their prompts would be sent again.
"""

from __future__ import annotations

from typing import Any

import msgspec
import redis

SAFE_POLICY = "noeviction"
FULL = "Redis is full"
NO_DISK = "Redis cannot save to disk"
REPLICA = "Redis is a read-only replica"
# What a RedisNote is about: the three refusals, and a policy that would evict genq's keys.
NOTE_REASONS = ("full", "no_disk", "replica", "evicting_policy")


class RedisNote(msgspec.Struct, frozen=True):
    """What Redis's state or settings mean for genq, for a user to act on: said by `genq enqueue`, a
    worker's start and the monitor (its views, and the gauge genq_redis_warning{reason})."""
    reason: str  # one of NOTE_REASONS
    text: str
# (the error class redis-py raises, words of Redis's reply, what it means, what fixes it). Inside a
# pipeline, or as the context of EXECABORT, the refusal can come as another ResponseError: the
# words find it there (server.c's shared.oomerr, shared.bgsaveerr, shared.roslaveerr).
_REFUSALS: tuple[tuple[type[Exception] | None, str, str, str], ...] = (
    (redis.OutOfMemoryError, "used memory > 'maxmemory'", FULL,
     "it refuses writes: raise its maxmemory or free memory"),
    (None, "MISCONF", NO_DISK,
     "its last snapshot or AOF write failed and it refuses writes: free its disk (see its log)"),
    (redis.ReadOnlyError, "read only replica", REPLICA,
     "point genq at the primary, or use a redis+sentinel:// URL"),
)


def refusal(exc: BaseException | None) -> tuple[str, str] | None:
    """(what, fix) when Redis refused a write for one of the reasons above: this error, or one it
    was raised from or during (a MULTI refused while queueing ends in EXECABORT)."""
    while exc is not None:
        for cls, words, what, fix in _REFUSALS:
            if (cls is not None and isinstance(exc, cls)) or words in str(exc):
                return what, fix
        exc = exc.__cause__ or exc.__context__
    return None


def trouble(exc: BaseException, otherwise: str = "Redis unreachable") -> str:
    """What a failed Redis call means, in the words of a log line: a refusal named with its fix,
    else `otherwise`."""
    found = refusal(exc)
    return f"{found[0]} ({found[1]})" if found else otherwise


def in_words(exc: BaseException) -> str:
    """A failed write in a log line: a refusal named with its fix (not Redis's text, which quotes
    the script's sha), anything else as Redis said it."""
    return trouble(exc, f"{type(exc).__name__}: {exc}")


def redis_note(info: dict[str, Any]) -> RedisNote | None:
    """What `INFO` (its default sections) tells a user of genq to act on, or None."""
    def text(name: str, default: str = "") -> str:
        value = info.get(name, default)
        return value.decode() if isinstance(value, bytes) else str(value)

    maxmemory, used = int(info.get("maxmemory", 0)), int(info.get("used_memory", 0))
    if text("role", "master") != "master":
        return RedisNote("replica", f"{REPLICA}: it refuses writes; {_REFUSALS[2][3]}")
    if text("rdb_last_bgsave_status", "ok") != "ok" or text("aof_last_write_status", "ok") != "ok":
        return RedisNote("no_disk", f"{NO_DISK}: {_REFUSALS[1][3]}; the workers wait")
    if maxmemory and used > maxmemory:
        return RedisNote("full", f"{FULL}: it uses {used:,} bytes, over its maxmemory of {maxmemory:,}, and "
                         f"refuses writes; the workers wait for room (raise its maxmemory or free memory)")
    policy = text("maxmemory_policy", SAFE_POLICY)
    if policy != SAFE_POLICY and maxmemory:  # maxmemory 0: no limit, nothing is ever evicted
        return RedisNote("evicting_policy",
                         f"Redis's maxmemory-policy {policy} lets it delete genq's keys when it fills (leases, "
                         f"claims, outcomes not yet written: prompts would be sent again); "
                         f"set maxmemory-policy {SAFE_POLICY}")
    return None


def redis_note_of(conn: redis.Redis) -> RedisNote | None:
    """redis_note of this Redis; None where INFO is not allowed (some managed Redis rename it)."""
    try:
        return redis_note(conn.info())
    except redis.ResponseError:
        return None
