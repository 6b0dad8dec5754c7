"""Redis connections: every genq process (sims aside) connects here, so every URL form works alike
and never shows its password; a Sentinel URL's writes wait for replicas; Redis's refusals are named
with their fix; and a redis-server of genq's own (LocalRedis) for the demo, tests and benchmarks.

    redis://[[user]:password@]host[:6379][/db][?option=value...]
    rediss://...                                    TLS (the handshake times out like a connect)
    unix://[[user]:password@]/path/redis.sock[?db=N]
    redis+sentinel://[[user]:password@]host[:26379][,host2[:port]...]/service[/db][?sentinel_password=...]

The userinfo is everything before the last '@', split at its first ':', so a password may hold '/',
'#', '?', ':' or '@' as typed; percent-encoding works too, and a literal '%' is written %25.

A failover loses what the old master took after its replicas stopped copying, so on a Sentinel URL
each write is followed by WAIT for every online replica, at least ?wait_replicas=N (default 1; 0:
off); a write not confirmed in WAIT_TIMEOUT_MS raises ReplicaLag, a ConnectionError: genq's writes
are safe to repeat, on the master Sentinel names by then.

Refusals (each waited out like an outage): full (maxmemory under noeviction: "OOM"), no disk (its
last RDB or AOF write failed: "MISCONF"), replica ("READONLY"). genq's state must never be evicted:
Redis needs `maxmemory-policy noeviction` (docs/operations.md, "When Redis refuses writes").
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, Any
from urllib.parse import parse_qsl, quote, unquote

import msgspec
import redis
import redis.asyncio as aioredis
import redis.asyncio.client as aioclient
import redis.asyncio.sentinel as aiosentinel
import redis.client
import redis.sentinel

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ENV_VAR = "GENQ_REDIS_URL"
SENTINEL_SCHEME = "redis+sentinel"
SCHEMES = ("redis", "rediss", "unix", SENTINEL_SCHEME)
SENTINEL_PORT = 26379
# A connect, and a TLS handshake, that takes longer than this is not going to succeed: say so
# (the OS default is minutes for a connect, and forever for a handshake with a plaintext Redis).
CONNECT_TIMEOUT_S = 5.0
SECRET_PARAMS = ("password", "sentinel_password")
log = logging.getLogger("genq.redis")
FORMS = "redis://host:6379/0, rediss://..., unix:///path/redis.sock, redis+sentinel://host:26379/service/0"


class BadRedisURL(ValueError):
    """A URL genq cannot use; the message is one line and never holds the password."""


def resolve_url(url: str | None) -> str:
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


@dataclass(frozen=True)
class _Parts:
    scheme: str
    user: str | None  # decoded; None: no userinfo at all
    password: str | None  # decoded; None: no ':' in the userinfo
    rest: str  # after the userinfo: host[:port][/path][?query] (or /path for unix)

    def userinfo(self, masked: bool = False) -> str:
        if self.user is None:
            return ""
        user = quote(self.user, safe="")
        if self.password is None:  # redis-py reads a lone userinfo as the password: mask it
            return "***@" if masked else f"{user}@"
        return f"{user}:{'***' if masked else quote(self.password, safe='')}@"


def _split(url: str) -> _Parts:
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BadRedisURL(f"the Redis URL has no scheme: use one of {FORMS}")
    scheme = scheme.lower()
    user = password = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        raw_user, colon, raw_password = userinfo.partition(":")
        user = unquote(raw_user)
        password = unquote(raw_password) if colon else None
    return _Parts(scheme, user, password, rest)


def _mask_query(rest: str) -> str:
    head, q, query = rest.partition("?")
    if not q:
        return rest
    params = []
    for param in query.split("&"):
        name, eq, _ = param.partition("=")
        params.append(f"{name}=***" if eq and name.lower() in SECRET_PARAMS else param)
    return f"{head}?{'&'.join(params)}"


def mask_url(url: str) -> str:
    """The URL with every password replaced by ***, whatever form it takes."""
    try:
        parts = _split(url)
    except BadRedisURL:
        return "(a Redis URL without a scheme)"
    masked = f"{parts.scheme}://{parts.userinfo(masked=True)}{_mask_query(parts.rest)}"
    # Unchanged URLs come back exactly as given (scheme case and all).
    return url if "***" not in masked and parts.user is None else masked


def _secrets(parts: _Parts) -> list[str]:
    found = [s for s in (parts.user if parts.password is None else None, parts.password) if s]
    for name, value in parse_qsl(parts.rest.partition("?")[2]):
        if name.lower() in SECRET_PARAMS and value:
            found.append(value)
    return found + [quote(s, safe="") for s in found]


def scrub(text: str, url: str) -> str:
    """text with every password of url (raw or encoded) replaced by *** (for library messages)."""
    try:
        secrets = _secrets(_split(url))
    except BadRedisURL:
        return text
    for secret in sorted(secrets, key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class _TimedSSLConnection(redis.SSLConnection):
    """redis-py times the TCP connect but not the TLS handshake after it (the socket is in
    blocking mode by then): rediss:// against a plaintext Redis waited forever."""

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        wrapped = super()._wrap_socket_with_ssl(sock)
        wrapped.settimeout(self.socket_timeout)
        return wrapped


@dataclass(frozen=True)
class Target:
    """What a URL says to connect to: a plain (or TLS, or unix) Redis, or a Sentinel service."""

    url: str  # normalized: userinfo percent-encoded, as redis-py's from_url reads it
    scheme: str
    sentinels: list[tuple[str, int]] = field(default_factory=list)
    service: str = ""
    db: int = 0
    master_kwargs: dict[str, Any] = field(default_factory=dict)  # credentials and options for the master
    sentinel_kwargs: dict[str, Any] = field(default_factory=dict)
    wait_replicas: int = 1  # Sentinel only: replicas that must have each write (ReplicatedRedis)


def _defaults(scheme: str) -> dict[str, Any]:
    kw: dict[str, Any] = {"health_check_interval": 30, "socket_connect_timeout": CONNECT_TIMEOUT_S}
    if scheme != "unix":  # a unix socket has no TCP keepalive (redis-py refuses the option)
        kw["socket_keepalive"] = True
    return kw


def _bad(url: str, why: str) -> BadRedisURL:
    return BadRedisURL(f"bad Redis URL {mask_url(url)}: {scrub(why, url)}")


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, _, tail = text[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise _bad(url, "a Sentinel address has no host")
    if not port_text:
        return host, SENTINEL_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise _bad(url, f"the Sentinel port {port_text!r} is not a port number")
    return host, int(port_text)


def _sentinel_target(url: str, parts: _Parts) -> Target:
    head, _, query = parts.rest.partition("?")
    hosts, _, path = head.partition("/")
    names = [p for p in path.split("/") if p]
    if not hosts or not names or len(names) > 2:
        raise _bad(url, "a Sentinel URL is redis+sentinel://host:26379[,host2:port]/service[/db]")
    if len(names) == 2 and not names[1].isdigit():
        raise _bad(url, f"the database {names[1]!r} is not a number")
    options = dict(parse_qsl(query))
    sentinel_password = options.pop("sentinel_password", None)
    wait_replicas = options.pop("wait_replicas", "1")
    if not wait_replicas.isdigit():
        raise _bad(url, f"wait_replicas={wait_replicas!r} is not a whole number (0 turns waiting off)")
    try:  # redis-py's own reading (and typing) of the other options, on a URL of the same shape
        extra = redis.connection.parse_url("redis://h/?" + "&".join(f"{k}={quote(v)}" for k, v in options.items()))
    except ValueError as exc:
        raise _bad(url, str(exc)) from None
    extra.pop("host", None)
    master: dict[str, Any] = {**_defaults("redis"), **extra}
    if parts.user is not None:  # a lone userinfo is the password, as redis-py reads it
        master["password"] = parts.user if parts.password is None else parts.password
        if parts.password is not None and parts.user:
            master["username"] = parts.user
    sentinel_kwargs: dict[str, Any] = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": CONNECT_TIMEOUT_S}
    if sentinel_password:
        sentinel_kwargs["password"] = sentinel_password
    return Target(url=url, scheme=parts.scheme, sentinels=[_host_port(h, url) for h in hosts.split(",")],
                  service=unquote(names[0]), db=int(names[1]) if len(names) == 2 else 0,
                  master_kwargs=master, sentinel_kwargs=sentinel_kwargs, wait_replicas=int(wait_replicas))


def parse(url: str) -> Target:
    """The URL checked and read; BadRedisURL (one line, no password) where it cannot be used."""
    parts = _split(url)
    if parts.scheme not in SCHEMES:
        raise BadRedisURL(f"{parts.scheme}:// is not a Redis URL scheme: use one of {FORMS}")
    if parts.scheme == SENTINEL_SCHEME:
        return _sentinel_target(url, parts)
    normalized = f"{parts.scheme}://{parts.userinfo()}{parts.rest}"
    try:
        kwargs = redis.connection.parse_url(normalized)
    except ValueError as exc:
        raise _bad(url, str(exc)) from None
    path = parts.rest.partition("?")[0]
    if parts.scheme == "unix" and not kwargs.get("path"):
        raise _bad(url, "unix:// needs the socket's path, as in unix:///run/redis/redis.sock")
    if parts.scheme != "unix":
        if not kwargs.get("host"):
            raise _bad(url, "no host")
        db_text = path.partition("/")[2].strip("/")
        if db_text and not db_text.isdigit():
            raise _bad(url, f"the database {db_text!r} is not a number")
    return Target(url=normalized, scheme=parts.scheme)


def connect(url: str) -> redis.Redis:
    """A sync client: RQ and the CLI use this one. Raw bytes, no decoding."""
    target = parse(url)
    if target.sentinels:
        manager = redis.sentinel.Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs)
        pool = redis.sentinel.SentinelConnectionPool(target.service, manager, is_master=True, db=target.db,
                                                     **target.master_kwargs)
        if not target.wait_replicas:
            return redis.Redis.from_pool(pool)
        client = ReplicatedRedis(connection_pool=pool, wait_replicas=target.wait_replicas)
        client.auto_close_connection_pool = True  # as from_pool: the client owns its pool
        return client
    extra: dict[str, Any] = {"connection_class": _TimedSSLConnection} if target.scheme == "rediss" else {}
    return redis.Redis.from_url(target.url, **_defaults(target.scheme), **extra)


def connect_async(url: str) -> aioredis.Redis:
    """An asyncio client (asyncio's TLS handshake is inside redis-py's connect timeout)."""
    target = parse(url)
    if target.sentinels:
        manager = aiosentinel.Sentinel(target.sentinels, sentinel_kwargs=target.sentinel_kwargs)
        pool = aiosentinel.SentinelConnectionPool(target.service, manager, is_master=True, db=target.db,
                                                  **target.master_kwargs)
        if not target.wait_replicas:
            return aioredis.Redis.from_pool(pool)
        aclient = AsyncReplicatedRedis(connection_pool=pool, wait_replicas=target.wait_replicas)
        aclient.auto_close_connection_pool = True
        return aclient
    return aioredis.Redis.from_url(target.url, **_defaults(target.scheme))


def describe_error(url: str, exc: Exception) -> str:
    why = scrub(str(exc), url)
    if isinstance(exc, redis.TimeoutError) and url.lower().startswith("rediss://"):
        why += f" (no TLS handshake within {CONNECT_TIMEOUT_S:g}s: if this Redis does not speak TLS, use redis://)"
    if found := refusal(exc):  # not `why`: redis-py's words quote the refused command, arguments and all
        return f"{found[0]} (Redis at {mask_url(url)}): {found[1]}"
    if isinstance(exc, redis.ResponseError):  # Redis answered: it refused a command (or a script failed)
        return f"Redis at {mask_url(url)} refused a command: {why}"
    return f"cannot reach Redis at {mask_url(url)}: {why}"


# --------------------------------------------------------------------------- WAIT after writes (Sentinel)
WAIT_TIMEOUT_MS = 2000
REPLICAS_EVERY_S = 1.0  # how stale a connection's count of online replicas may be

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
    def __init__(self, *args: Any, wait_replicas: int) -> None:
        super().__init__(*args)
        self.wait_replicas = wait_replicas

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
    def __init__(self, *args: Any, wait_replicas: int) -> None:
        super().__init__(*args)
        self.wait_replicas = wait_replicas

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
    """A client whose writes are on `wait_replicas` replicas (at least) before they return."""

    def __init__(self, *args: Any, wait_replicas: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_replicas = wait_replicas

    def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        result = super()._send_command_parse_response(conn, command_name, *args, **options)
        if _is_write(command_name):
            _wait(conn, self.wait_replicas)
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        return ReplicatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint,
                                  wait_replicas=self.wait_replicas)


class AsyncReplicatedRedis(aioredis.Redis):
    def __init__(self, *args: Any, wait_replicas: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.wait_replicas = wait_replicas

    async def _send_command_parse_response(self, conn: Any, command_name: Any, *args: Any, **options: Any) -> Any:
        result = await super()._send_command_parse_response(conn, command_name, *args, **options)
        if _is_write(command_name):
            await _wait_async(conn, self.wait_replicas)
        return result

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Any:
        return AsyncReplicatedPipeline(self.connection_pool, self.response_callbacks, transaction, shard_hint,
                                       wait_replicas=self.wait_replicas)


# --------------------------------------------------------------------------- what Redis refuses
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


# --------------------------------------------------------------------------- a Redis of genq's own
# For the demo, the tests and the benchmarks: 127.0.0.1 only, nothing kept on disk, its folder removed
# at stop, in a session of its own (a Ctrl-C meant for the caller does not kill it first). A Redis
# genq did not start is never touched.
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
