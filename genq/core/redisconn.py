"""Redis connections: every URL form (docs/operations.md) works alike and never shows its password; a
Sentinel URL's writes wait for replicas; Redis's refusals are named with their fix; and LocalRedis, a
redis-server of genq's own for the demo, tests and benchmarks."""

from __future__ import annotations

import logging
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any
from urllib.parse import parse_qsl, quote, unquote, urlencode

import msgspec
import redis
import redis.asyncio as aioredis
import redis.asyncio.client as aioclient
import redis.asyncio.sentinel as aiosentinel
import redis.client
import redis.sentinel

DEFAULT_URL = "redis://127.0.0.1:6379/0"
ENV_VAR = "GENQ_REDIS_URL"
SCHEMES = ("redis", "rediss", "unix", "redis+sentinel")
# The OS waits minutes for a connect, and forever for a TLS handshake with a plaintext Redis.
CONNECT_TIMEOUT_S = 5.0
SECRET_PARAMS = ("password", "sentinel_password")
FORMS = "redis://host:6379/0, rediss://..., unix:///path/redis.sock, redis+sentinel://host:26379/service/0"
log = logging.getLogger("genq.redis")


class BadRedisURL(ValueError):
    """A URL genq cannot use; the message is one line and never holds the password."""


def resolve_url(url: str | None) -> str:
    return url or os.environ.get(ENV_VAR) or DEFAULT_URL


def _split(url: str) -> tuple[str, str | None, str | None, str]:
    """(scheme, user, password, rest): user None without userinfo, password None without ':' in it."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise BadRedisURL(f"the Redis URL has no scheme: use one of {FORMS}")
    user = password = None
    if "@" in rest:
        userinfo, _, rest = rest.rpartition("@")
        raw_user, colon, raw_password = userinfo.partition(":")
        user, password = unquote(raw_user), unquote(raw_password) if colon else None
    return scheme.lower(), user, password, rest


def _userinfo(user: str | None, password: str | None, masked: bool = False) -> str:
    if user is None:
        return ""
    if password is None:  # redis-py reads a lone userinfo as the password: mask it
        return "***@" if masked else f"{quote(user, safe='')}@"
    return f"{quote(user, safe='')}:{'***' if masked else quote(password, safe='')}@"


def mask_url(url: str) -> str:
    """The URL with every password replaced by ***, whatever form it takes."""
    try:
        scheme, user, password, rest = _split(url)
    except BadRedisURL:
        return "(a Redis URL without a scheme)"
    head, q, query = rest.partition("?")
    params = [f"{p.partition('=')[0]}=***" if "=" in p and p.partition("=")[0].lower() in SECRET_PARAMS else p
              for p in query.split("&")]
    masked = f"{scheme}://{_userinfo(user, password, masked=True)}{head}{q}{'&'.join(params)}"
    return url if "***" not in masked and user is None else masked  # unchanged: exactly as given


def scrub(text: str, url: str) -> str:
    """text with every password of url (raw or encoded) replaced by *** (for library messages)."""
    try:
        _, user, password, rest = _split(url)
    except BadRedisURL:
        return text
    found = [s for s in (user if password is None else None, password) if s]
    found += [v for k, v in parse_qsl(rest.partition("?")[2]) if k.lower() in SECRET_PARAMS and v]
    for secret in sorted(found + [quote(s, safe="") for s in found], key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


class _TimedSSLConnection(redis.SSLConnection):
    """redis-py times the TCP connect but not the TLS handshake after it: time that too."""

    def _wrap_socket_with_ssl(self, sock: Any) -> Any:
        sock.settimeout(self.socket_connect_timeout)
        wrapped = super()._wrap_socket_with_ssl(sock)
        wrapped.settimeout(self.socket_timeout)
        return wrapped


def _on_connect(conn: Any) -> None:
    try:
        conn.on_connect()  # AUTH first: no PING before it
    except redis.RedisError as exc:
        raise type(exc)(str(exc).replace(conn.password, "***")) from None


async def _on_connect_async(conn: Any) -> None:
    try:
        await conn.on_connect()
    except redis.RedisError as exc:
        raise type(exc)(str(exc).replace(conn.password, "***")) from None


def _unquoted(aio: bool, password: str | None) -> dict[str, Any]:
    """redis-py's connect step (AUTH, SELECT), its errors with *** for the password: a server that refuses AUTH
    (renamed, or not Redis) quotes it, arguments and all, into every log line, message and record."""
    return {"redis_connect_func": _on_connect_async if aio else _on_connect} if password else {}


def _defaults(scheme: str) -> dict[str, Any]:
    keepalive = {} if scheme == "unix" else {"socket_keepalive": True}  # redis-py refuses it on a unix socket
    return {"health_check_interval": 30, "socket_connect_timeout": CONNECT_TIMEOUT_S, **keepalive}


def _bad(url: str, why: str) -> BadRedisURL:
    return BadRedisURL(f"bad Redis URL {mask_url(url)}: {scrub(why, url)}")


def _options(url: str, form: str) -> dict[str, Any]:
    """redis-py's own reading (and typing) of a URL of that form, or BadRedisURL naming `url`."""
    try:
        return redis.connection.parse_url(form)
    except ValueError as exc:
        raise _bad(url, str(exc)) from None


def _host_port(text: str, url: str) -> tuple[str, int]:
    if text.startswith("["):  # [::1]:26379
        host, _, port = text[1:].partition("]")
        port = port[1:] if port.startswith(":") else ""
    else:
        host, _, port = text.partition(":")
    if not host:
        raise _bad(url, "a Sentinel address has no host")
    if port and (not port.isdigit() or not 0 < int(port) < 65536):
        raise _bad(url, f"the Sentinel port {port!r} is not a port number")
    return host, int(port or 26379)


def parse(url: str) -> Callable[[bool], Any]:
    """The URL checked and read, as its client's maker (given True: an asyncio client); BadRedisURL (one
    line, no password) where it cannot be used."""
    scheme, user, password, rest = _split(url)
    if scheme not in SCHEMES:
        raise BadRedisURL(f"{scheme}:// is not a Redis URL scheme: use one of {FORMS}")
    head, _, query = rest.partition("?")
    if scheme != "redis+sentinel":
        normalized = f"{scheme}://{_userinfo(user, password)}{rest}"
        kwargs = _options(url, normalized)
        db = head.partition("/")[2].strip("/")
        if scheme == "unix" and not kwargs.get("path"):
            raise _bad(url, "unix:// needs the socket's path, as in unix:///run/redis/redis.sock")
        if scheme != "unix" and not kwargs.get("host"):
            raise _bad(url, "no host")
        if scheme != "unix" and db and not db.isdigit():
            raise _bad(url, f"the database {db!r} is not a number")
        # A sync client's TLS handshake is timed here; an asyncio client's is inside its connect timeout.
        tls = {"connection_class": _TimedSSLConnection} if scheme == "rediss" else {}
        return lambda aio: (aioredis.Redis if aio else redis.Redis).from_url(
            normalized, **_defaults(scheme), **_unquoted(aio, kwargs.get("password")), **({} if aio else tls))
    hosts, _, path = head.partition("/")
    names = [p for p in path.split("/") if p]
    if not hosts or not names or len(names) > 2:
        raise _bad(url, "a Sentinel URL is redis+sentinel://host:26379[,host2:port]/service[/db]")
    if len(names) == 2 and not names[1].isdigit():
        raise _bad(url, f"the database {names[1]!r} is not a number")
    options = dict(parse_qsl(query))
    sentinel_password, wait = options.pop("sentinel_password", None), options.pop("wait_replicas", "1")
    if not wait.isdigit():
        raise _bad(url, f"wait_replicas={wait!r} is not a whole number (0 turns waiting off)")
    master = {**_defaults("redis"), **_options(url, "redis://h/?" + urlencode(options))}
    master.pop("host", None)
    if user is not None:  # a lone userinfo is the password, as redis-py reads it
        master["password"] = user if password is None else password
        if password is not None and user:
            master["username"] = user
    sentinel_kwargs = {"socket_connect_timeout": CONNECT_TIMEOUT_S, "socket_timeout": CONNECT_TIMEOUT_S,
                       **({"password": sentinel_password} if sentinel_password else {})}
    sentinels = [_host_port(h, url) for h in hosts.split(",")]
    service, number, replicas = unquote(names[0]), int(names[1]) if len(names) == 2 else 0, int(wait)

    def sentinel_client(aio: bool) -> Any:
        sentinel = aiosentinel if aio else redis.sentinel
        manager = (_AsyncSentinel if aio else _Sentinel)(
            sentinels, sentinel_kwargs={**sentinel_kwargs, **_unquoted(aio, sentinel_password)})
        pool = sentinel.SentinelConnectionPool(service, manager, is_master=True, db=number, **master,
                                               **_unquoted(aio, master.get("password")))
        if not replicas:
            return (aioredis.Redis if aio else redis.Redis).from_pool(pool)
        client = (AsyncReplicatedRedis if aio else ReplicatedRedis)(connection_pool=pool)
        client.auto_close_connection_pool = True  # as from_pool: the client owns its pool
        client.wait_replicas = replicas
        return client

    return sentinel_client


# redis-py's MasterNotFoundError quotes each sentinel's client (its repr: settings, sentinel_password and all),
# then its error: it is said as `sentinel host:port: error` instead, in every message and log line.
_SENTINEL_ERROR = re.compile(r"<redis\.[\w.]*Redis\(.*?host=([^,]*),port=(\d+).*?\)>\)>\)> - \w+\((['\"])(.*?)\3\)")


def _plain(exc: Exception) -> Exception:
    return type(exc)(_SENTINEL_ERROR.sub(r"sentinel \1:\2: \4", str(exc)))


class _Sentinel(redis.sentinel.Sentinel):
    def discover_master(self, service_name: str) -> Any:
        try:
            return super().discover_master(service_name)
        except redis.sentinel.MasterNotFoundError as exc:
            raise _plain(exc) from None


class _AsyncSentinel(aiosentinel.Sentinel):
    async def discover_master(self, service_name: str) -> Any:
        try:
            return await super().discover_master(service_name)
        except aiosentinel.MasterNotFoundError as exc:
            raise _plain(exc) from None


def connect(url: str) -> redis.Redis:
    """A sync client (RQ and the CLI): raw bytes, no decoding."""
    return parse(url)(False)


def connect_async(url: str) -> aioredis.Redis:
    return parse(url)(True)


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
# A failover loses what the old master took after its replicas stopped copying: on a Sentinel URL each
# write is followed by WAIT for every online replica, at least ?wait_replicas=N (default 1; 0: off). A write
# not confirmed in WAIT_TIMEOUT_MS raises ReplicaLag, a ConnectionError: genq's writes are safe to repeat.
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


def online_replicas(info: Any) -> int:
    """The replicas a master streams to, from its INFO replication (state=online)."""
    return (info.decode() if isinstance(info, bytes) else str(info)).count("state=online")


def _stale(conn: Any) -> bool:
    """Whether the connection's count of online replicas must be read again (INFO replication)."""
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
        try:
            conn.genq_replicas = (time.monotonic(), online_replicas(conn.read_response()))
        except redis.ResponseError:  # INFO not allowed (renamed): the replicas cannot be counted, at least `least`
            conn.genq_replicas = (time.monotonic(), 0)
    conn.send_command("WAIT", want := max(least, conn.genq_replicas[1]), WAIT_TIMEOUT_MS)
    _check(conn, conn.read_response(), want)


async def _wait_async(conn: Any, least: int) -> None:
    if _stale(conn):
        await conn.send_command("INFO", "replication")
        try:
            conn.genq_replicas = (time.monotonic(), online_replicas(await conn.read_response()))
        except redis.ResponseError:
            conn.genq_replicas = (time.monotonic(), 0)
    await conn.send_command("WAIT", want := max(least, conn.genq_replicas[1]), WAIT_TIMEOUT_MS)
    _check(conn, await conn.read_response(), want)


def _writes(args: Any, pipeline: bool) -> bool:
    """Whether a client's command (args: name, arguments) or a pipeline's commands (args[0]) change anything."""
    names = [command[0] for command, _ in args[0]] if pipeline else args[:1]
    return any((n if isinstance(n, bytes) else str(n).encode()).split(b" ")[0].upper() not in READS for n in names)


def _waits(step: Any, pipeline: bool = False) -> Any:
    """A client's or pipeline's send step, followed by WAIT where one of its commands writes."""
    def run(self: Any, conn: Any, *args: Any, **options: Any) -> Any:
        result = step(self, conn, *args, **options)
        if _writes(args, pipeline):
            _wait(conn, self.wait_replicas)
        return result
    return run


def _waits_async(step: Any, pipeline: bool = False) -> Any:
    async def run(self: Any, conn: Any, *args: Any, **options: Any) -> Any:
        result = await step(self, conn, *args, **options)
        if _writes(args, pipeline):
            await _wait_async(conn, self.wait_replicas)
        return result
    return run


class ReplicatedPipeline(redis.client.Pipeline):
    _execute_transaction = _waits(redis.client.Pipeline._execute_transaction, pipeline=True)
    _execute_pipeline = _waits(redis.client.Pipeline._execute_pipeline, pipeline=True)


class AsyncReplicatedPipeline(aioclient.Pipeline):
    _execute_transaction = _waits_async(aioclient.Pipeline._execute_transaction, pipeline=True)
    _execute_pipeline = _waits_async(aioclient.Pipeline._execute_pipeline, pipeline=True)


class _Replicated:
    """A client whose writes are on `wait_replicas` replicas (at least) before they return."""

    wait_replicas = 1
    pipeline_class: Any

    def pipeline(self: Any, transaction: bool = True, shard_hint: Any = None) -> Any:
        pipe = self.pipeline_class(self.connection_pool, self.response_callbacks, transaction, shard_hint)
        pipe.wait_replicas = self.wait_replicas
        return pipe


class ReplicatedRedis(_Replicated, redis.Redis):
    pipeline_class = ReplicatedPipeline
    _send_command_parse_response = _waits(redis.Redis._send_command_parse_response)


class AsyncReplicatedRedis(_Replicated, aioredis.Redis):
    pipeline_class = AsyncReplicatedPipeline
    _send_command_parse_response = _waits_async(aioredis.Redis._send_command_parse_response)


# --------------------------------------------------------------------------- what Redis refuses
# genq's state must never be evicted: Redis needs `maxmemory-policy noeviction` (docs/operations.md).
SAFE_POLICY = "noeviction"
FULL = "Redis is full"
NO_DISK = "Redis cannot save to disk"
REPLICA = "Redis is a read-only replica"
NOTE_REASONS = ("full", "no_disk", "replica", "evicting_policy")
FULL_FIX = "it refuses writes: raise its maxmemory or free memory"
NO_DISK_FIX = "its last snapshot or AOF write failed and it refuses writes: free its disk (see its log)"
REPLICA_FIX = "point genq at the primary, or use a redis+sentinel:// URL"


class RedisNote(msgspec.Struct, frozen=True):
    """What Redis's state or settings mean for genq, for a user to act on (`genq enqueue`, a worker's
    start, the monitor and its gauge genq_redis_warning{reason})."""

    reason: str  # one of NOTE_REASONS
    text: str


# (error class, words of Redis's reply, what, fix). In a pipeline, or as EXECABORT's context, a refusal
# comes as another ResponseError: the words find it there (server.c's oomerr, bgsaveerr, roslaveerr).
_REFUSALS: tuple[tuple[type[Exception] | None, str, str, str], ...] = (
    (redis.OutOfMemoryError, "used memory > 'maxmemory'", FULL, FULL_FIX),
    (None, "MISCONF", NO_DISK, NO_DISK_FIX),
    (redis.ReadOnlyError, "read only replica", REPLICA, REPLICA_FIX),
)


def refusal(exc: BaseException | None) -> tuple[str, str] | None:
    """(what, fix) when Redis refused a write: this error, or one it was raised from or during."""
    while exc is not None:
        for cls, words, what, fix in _REFUSALS:
            if (cls is not None and isinstance(exc, cls)) or words in str(exc):
                return what, fix
        exc = exc.__cause__ or exc.__context__
    return None


def in_words(exc: BaseException, otherwise: str | None = None) -> str:
    """A failed Redis call in a log line: a refusal named with its fix (not Redis's text, which quotes the
    sha), else `otherwise`, else the error."""
    found = refusal(exc)
    return f"{found[0]} ({found[1]})" if found else otherwise or f"{type(exc).__name__}: {exc}"


def redis_note(info: dict[str, Any]) -> RedisNote | None:
    """What `INFO` (its default sections, as redis-py parses them: str values) tells a user of genq to act on."""
    maxmemory, used = int(info.get("maxmemory", 0)), int(info.get("used_memory", 0))
    policy = info.get("maxmemory_policy", SAFE_POLICY)
    if info.get("role", "master") != "master":
        return RedisNote("replica", f"{REPLICA}: it refuses writes; {REPLICA_FIX}")
    if info.get("rdb_last_bgsave_status", "ok") != "ok" or info.get("aof_last_write_status", "ok") != "ok":
        return RedisNote("no_disk", f"{NO_DISK}: {NO_DISK_FIX}; the workers wait")
    if maxmemory and used > maxmemory:
        return RedisNote("full", f"{FULL}: it uses {used:,} bytes, over its maxmemory of {maxmemory:,}, and "
                         f"refuses writes; the workers wait for room (raise its maxmemory or free memory)")
    if policy != SAFE_POLICY and maxmemory:  # maxmemory 0: no limit, nothing is ever evicted
        return RedisNote("evicting_policy", f"Redis's maxmemory-policy {policy} lets it delete genq's keys when it "
                         "fills (leases, claims, outcomes not yet written: prompts would be sent again); "
                         f"set maxmemory-policy {SAFE_POLICY}")
    return None


def redis_note_of(conn: redis.Redis) -> RedisNote | None:
    """redis_note of this Redis; None where INFO is not allowed (some managed Redis rename it)."""
    try:
        return redis_note(conn.info())
    except redis.ResponseError:
        return None


# --------------------------------------------------------------------------- a Redis of genq's own
def free_port() -> int:
    """A loopback TCP port free at the moment of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalRedis:
    """A private redis-server: 127.0.0.1 only, nothing kept on disk, in its own session (a Ctrl-C meant
    for the caller does not kill it first); answers PING when constructed; `stop()` (or `with`) ends it
    and removes its folder. `extra`: redis-server arguments after the defaults."""

    def __init__(self, *extra: str, db: int = 0, log: IO[bytes] | int = subprocess.DEVNULL) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.dir, self.port = tempfile.mkdtemp(prefix="genq-redis-"), free_port()
        self.url = f"redis://127.0.0.1:{self.port}/{db}"
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, *extra], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.conn = redis.Redis.from_url(self.url, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
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
