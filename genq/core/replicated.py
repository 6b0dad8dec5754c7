"""Clients whose writes are on a replica before they return (Redis WAIT): Sentinel URLs use them.

Redis replicates asynchronously, so a failover loses what the old master took after its replicas
stopped copying (a whole job can run in that window). On a Sentinel URL each write (a command, a
script, a pipeline) is followed on its connection by WAIT for every replica the master streams to
(INFO replication's online ones, counted at most once a second per connection), at least
?wait_replicas=N (default 1): Sentinel may promote any of them, a lagging one too. A write not
confirmed within WAIT_TIMEOUT_MS raises ReplicaLag, a ConnectionError, so it is retried (on the
master Sentinel names by then); genq's writes are safe to repeat. The price: a round trip more per
write, writes as slow as the slowest replica; ?wait_replicas=0 turns it off.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.client as aioclient
import redis.client

WAIT_TIMEOUT_MS = 2000
REPLICAS_EVERY_S = 1.0  # how stale a connection's count of online replicas may be

log = logging.getLogger("genq.redis")

# Commands that change nothing: no WAIT after them. Anything else is taken as a write.
READS = frozenset(
    b"GET MGET GETRANGE STRLEN EXISTS TYPE TTL PTTL KEYS SCAN DBSIZE RANDOMKEY OBJECT DUMP "
    b"HGET HMGET HGETALL HKEYS HVALS HLEN HEXISTS HSTRLEN HSCAN HRANDFIELD "
    b"SMEMBERS SISMEMBER SMISMEMBER SCARD SSCAN SRANDMEMBER SINTER SUNION SDIFF "
    b"ZRANGE ZRANGEBYSCORE ZREVRANGE ZREVRANGEBYSCORE ZRANGEBYLEX ZSCORE ZMSCORE ZCARD ZCOUNT "
    b"ZRANK ZREVRANK ZSCAN ZLEXCOUNT LRANGE LLEN LINDEX LPOS XRANGE XREVRANGE XLEN XINFO "
    b"BITCOUNT GETBIT PFCOUNT EVALSHA_RO EVAL_RO FCALL_RO "
    b"PING ECHO INFO TIME ROLE CLIENT SELECT WAIT COMMAND CONFIG MEMORY LASTSAVE SENTINEL".split())


class ReplicaLag(redis.ConnectionError):
    """No replica confirmed a write in time: the master may be failing over."""


def _is_write(name: Any) -> bool:
    text = name if isinstance(name, bytes) else str(name).encode()
    return text.split(b" ")[0].upper() not in READS


def _writes(commands: Any) -> bool:
    return any(_is_write(args[0]) for args, _options in commands)


def online_replicas(info: Any) -> int:
    """The replicas a master streams to, from its INFO replication (state=online)."""
    return (info.decode() if isinstance(info, bytes) else str(info)).count("state=online")


def _stale(conn: Any) -> bool:
    counted = getattr(conn, "genq_replicas", None)
    return counted is None or time.monotonic() - counted[0] >= REPLICAS_EVERY_S


def _check(conn: Any, acked: Any, want: int) -> None:
    if int(acked) < want:
        conn.genq_replicas = None  # counted again before the next write: one may have left
        message = (f"{acked} of {want} replica(s) confirmed a write within {WAIT_TIMEOUT_MS} ms (one lags, or the "
                   "master is failing over): it is sent again, to the master Sentinel names")
        log.warning("%s", message)
        raise ReplicaLag(message)


def _wait(conn: Any, least: int) -> None:
    if _stale(conn):
        conn.send_command("INFO", "replication")
        conn.genq_replicas = (time.monotonic(), online_replicas(conn.read_response()))
    want = max(least, conn.genq_replicas[1])
    conn.send_command("WAIT", want, WAIT_TIMEOUT_MS)
    _check(conn, conn.read_response(), want)


async def _wait_async(conn: Any, least: int) -> None:
    if _stale(conn):
        await conn.send_command("INFO", "replication")
        conn.genq_replicas = (time.monotonic(), online_replicas(await conn.read_response()))
    want = max(least, conn.genq_replicas[1])
    await conn.send_command("WAIT", want, WAIT_TIMEOUT_MS)
    _check(conn, await conn.read_response(), want)


class ReplicatedPipeline(redis.client.Pipeline):
    wait_replicas = 1

    def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        result = super()._execute_transaction(connection, commands, raise_on_error)
        if _writes(commands):
            _wait(connection, self.wait_replicas)
        return result

    def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        result = super()._execute_pipeline(connection, commands, raise_on_error)
        if _writes(commands):
            _wait(connection, self.wait_replicas)
        return result


class AsyncReplicatedPipeline(aioclient.Pipeline):
    wait_replicas = 1

    async def _execute_transaction(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        result = await super()._execute_transaction(connection, commands, raise_on_error)
        if _writes(commands):
            await _wait_async(connection, self.wait_replicas)
        return result

    async def _execute_pipeline(self, connection: Any, commands: Any, raise_on_error: bool) -> Any:
        result = await super()._execute_pipeline(connection, commands, raise_on_error)
        if _writes(commands):
            await _wait_async(connection, self.wait_replicas)
        return result


class ReplicatedRedis(redis.Redis):
    wait_replicas = 1

    def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        result = super()._send_command_parse_response(conn, command_name, *args, **options)
        if _is_write(command_name):
            _wait(conn, self.wait_replicas)
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = ReplicatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.wait_replicas = self.wait_replicas
        return pipe


class AsyncReplicatedRedis(aioredis.Redis):
    wait_replicas = 1

    async def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        result = await super()._send_command_parse_response(conn, command_name, *args, **options)
        if _is_write(command_name):
            await _wait_async(conn, self.wait_replicas)
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = AsyncReplicatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.wait_replicas = self.wait_replicas
        return pipe
