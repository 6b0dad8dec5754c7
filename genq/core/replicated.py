"""Clients whose writes are on a replica before they return (Redis WAIT): Sentinel URLs use them.

Redis replicates asynchronously. When Sentinel fails a master over, whatever the old master
took after its replica stopped copying is gone: with SENTINEL FAILOVER the old master goes on
taking writes until Sentinel turns it into a replica, and in a test a whole 400-prompt job ran
in that window (its shards written, the new master knowing 3 batches of 16 done). So on a
Sentinel URL each write (a command, a script, a pipeline) is followed on the same connection
by WAIT: a write no replica confirms within WAIT_TIMEOUT_MS raises ReplicaLag, a
ConnectionError, so redis-py's retry, and genq's own above it, send it again once Sentinel
names the master (the old master's copy is discarded when it becomes a replica). genq's
writes are already safe to repeat: they are retried after any lost connection.

The price: one round trip more per write, and no writes while no replica is in sync (a
Sentinel URL with ?wait_replicas=0 turns this off and accepts losing the last writes).
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio as aioredis
import redis.asyncio.client as aioclient
import redis.client

WAIT_TIMEOUT_MS = 2000

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


def _check(acked: Any, want: int) -> None:
    if int(acked) < want:
        raise ReplicaLag(f"{acked} of {want} replica(s) confirmed a write within {WAIT_TIMEOUT_MS} ms "
                         "(the master may be failing over): it is sent again to the master Sentinel names")


def _wait(conn: Any, want: int) -> None:
    conn.send_command("WAIT", want, WAIT_TIMEOUT_MS)
    _check(conn.read_response(), want)


async def _wait_async(conn: Any, want: int) -> None:
    await conn.send_command("WAIT", want, WAIT_TIMEOUT_MS)
    _check(await conn.read_response(), want)


def _writes(commands: Any) -> bool:
    return any(_is_write(args[0]) for args, _options in commands)


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
