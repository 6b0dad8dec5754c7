"""Redis's memory as genq needs it: never evicting, and said plainly when full.

genq keeps its working state in Redis (leases, claims, the outcomes of batches not yet written),
so it needs `maxmemory-policy noeviction`: under any other policy a Redis that fills deletes keys
to make room, an engine's alive key first under the volatile-* ones (ElastiCache's default is
volatile-lru), and prompts look abandoned and are sent again. With noeviction a full Redis
refuses writes instead (and, inside MULTI, every command): genq waits until it has room, as it
waits out an outage, and says which of the two it is (docs/operations.md, "Redis's memory").
"""

from __future__ import annotations

from typing import Any

import redis

FULL = "Redis is full"
SAFE_POLICY = "noeviction"
# How a full Redis words its refusal (server.c, "-OOM command not allowed when used memory >
# 'maxmemory'"): redis-py raises OutOfMemoryError, but inside a pipeline or a script's error the
# class can be another ResponseError with these words.
_REFUSAL = "used memory > 'maxmemory'"
HOW_TO_FIX = "raise its maxmemory or free memory"


def is_full(exc: BaseException | None) -> bool:
    """Redis refused a command because its memory is at maxmemory: this error, or the one it was
    raised from (a MULTI refused while queueing ends in EXECABORT, the refusal its context)."""
    while exc is not None:
        if isinstance(exc, redis.OutOfMemoryError) or _REFUSAL in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def trouble(exc: BaseException) -> str:
    """What a failed Redis call means, in the words of a log line: full, or unreachable."""
    return f"{FULL} (it refuses writes: {HOW_TO_FIX})" if is_full(exc) else "Redis unreachable"


def memory_note(info: dict[str, Any]) -> str | None:
    """What `INFO memory` tells a user of genq to act on, or None."""
    policy = info.get("maxmemory_policy", SAFE_POLICY)
    policy = policy.decode() if isinstance(policy, bytes) else str(policy)
    maxmemory, used = int(info.get("maxmemory", 0)), int(info.get("used_memory", 0))
    if policy != SAFE_POLICY and maxmemory:  # maxmemory 0: no limit, nothing is ever evicted
        return (f"Redis's maxmemory-policy {policy} lets it delete genq's keys when it fills (leases, claims, "
                f"outcomes not yet written: prompts would be sent again); set maxmemory-policy {SAFE_POLICY}")
    if maxmemory and used > maxmemory:
        return (f"{FULL}: it uses {used:,} bytes, over its maxmemory of {maxmemory:,}, and refuses writes; "
                f"the workers wait for room ({HOW_TO_FIX})")
    return None


def memory_note_of(conn: redis.Redis) -> str | None:
    """memory_note of this Redis; None where INFO is not allowed (some managed Redis rename it)."""
    try:
        return memory_note(conn.info("memory"))
    except redis.ResponseError:
        return None
