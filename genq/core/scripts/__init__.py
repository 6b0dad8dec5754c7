"""Every Lua script of genq, loaded from the .lua files beside this module (each one's header names
its KEYS, ARGV and answer; `-- #include PIECE` inserts _PIECE.lua), and each script's KEYS and ARGV
built in a `*_call` function next to it."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from genq.core import keys, records
from genq.core.records import BatchRef, DeadLetter, Result, ShardInfo, ShardMarker, batch_id, batch_number, pack

HERE = Path(__file__).resolve().parent
_INCLUDE = re.compile(r"^-- #include (\w+)$", re.MULTILINE)

Call = tuple[list[str], list[Any]]  # a script's KEYS and ARGV


def evaluate(conn: Any, script: str, call: Call) -> Any:
    """EVAL on any redis-py client or pipeline, sync or async (the answer, or its awaitable)."""
    script_keys, args = call
    return conn.eval(script, len(script_keys), *script_keys, *args)


def lua_list(items: Iterable[bytes | str | int]) -> bytes:
    """Many values in one script argument: a msgpack array32 of str32 for cmsgpack.unpack (never bin, which
    cmsgpack cannot read: ints go as their decimal text)."""
    raws = [i if isinstance(i, bytes) else str(i).encode() for i in items]
    body = b"".join(b"\xdb" + len(r).to_bytes(4, "big") + r for r in raws)
    return b"\xdd" + len(raws).to_bytes(4, "big") + body


def load(name: str) -> str:
    """NAME.lua with its `-- #include` lines expanded."""
    return _INCLUDE.sub(lambda m: load("_" + m.group(1)), (HERE / f"{name}.lua").read_text())


RQ_JOB_PREFIX = "rq:job:"  # RQ's job hash prefix
RQ_EXECUTION = "genq"  # the execution id of genq's entries in RQ's started registry ("RQID:genq")
JOB_SLOT, BATCH_SLOT = "{job}", "{batch}"  # where TAKE puts names into key templates
# Totals of the written shards in keys.job_stats, kept by RELEASE and ADOPT (_shard_totals.lua).
SHARD_RECORDS = "shard_records"  # sum of ShardInfo.records
SHARD_BYTES = "shard_bytes"  # sum of ShardInfo.bytes

TAKE = load("take")
TAKE_SCAN = 500  # queued RQ jobs TAKE looks at, at most, for one of a job it may run
TAKE_KEPT_S = 600  # what an engine took last is kept this long (a resent TAKE answers it again)


def take_call(instance: str, token: str, now: str, skip: Iterable[str]) -> Call:
    templates = [keys.job_done(JOB_SLOT), keys.batch(JOB_SLOT, BATCH_SLOT), keys.job_transport(JOB_SLOT),
                 keys.job_leases(JOB_SLOT)]
    return ([keys.RQ_QUEUE, keys.RQ_STARTED, keys.RQ_SUSPENDED, keys.engine_took(instance)],
            [instance, token, now, TAKE_SCAN, RQ_EXECUTION, RQ_JOB_PREFIX, *templates, TAKE_KEPT_S, *skip])


COUNT_SHARDS = load("count_shards")


def count_shards_call(job: str) -> Call:
    return [keys.job_shards(job), keys.job_stats(job)], []


RELEASE = load("release")


def release_call(ref: BatchRef, info: ShardInfo, incarnation: str, stored: Mapping[str, bytes],
                 letters: Iterable[str]) -> Call:
    """stored: the shard's results as read from keys.batch_results (id -> stored bytes); letters: its dead
    letters' ids. RELEASE refuses the shard unless Redis holds exactly these."""
    ids = sorted(stored)
    return ([keys.job_done(ref.job), keys.job_shards(ref.job), keys.batch_results(ref.job, ref.batch),
             keys.batch(ref.job, ref.batch), keys.job_leases(ref.job), keys.job_transport(ref.job),
             keys.job_stats(ref.job), keys.batch_claims(ref.job, ref.batch), keys.job_config(ref.job),
             keys.batch_tries(ref.job, ref.batch), keys.RQ_STARTED, keys.job_dlq(ref.job)],
            [ref.batch, pack(info), info.records, info.bytes, incarnation, RQ_JOB_PREFIX, RQ_EXECUTION,
             lua_list(ids), lua_list(len(stored[i]) for i in ids), lua_list(letters)])


ADOPT = load("adopt")


def adopt_call(job: str, marker: ShardMarker, info: ShardInfo) -> Call:
    b = marker.batch
    script_keys = [keys.job_done(job), keys.job_shards(job), keys.batch_results(job, b), keys.batch(job, b),
                   keys.job_leases(job), keys.job_transport(job), keys.job_stats(job), keys.batch_claims(job, b),
                   keys.job_hist(job), keys.job_dlq(job), keys.job_workers(job), keys.job_batches(job),
                   keys.job_ids(job), keys.job_config(job), keys.batch_tries(job, b), keys.RQ_STARTED]
    # Hex, as the digests: Redis's cmsgpack cannot read msgpack bin (a letter's packed bytes).
    letters = [[d.id, pack(d).hex(), d.worker] for d in marker.dead_letters]
    args = [b, pack(info), RQ_JOB_PREFIX, RQ_EXECUTION, marker.records, marker.bytes,
            keys.worker_stats(job, ""), pack(marker.tally), pack(marker.hist), pack(letters), pack(marker.digests),
            batch_number(b), marker.incarnation]
    return script_keys, args


LOOKUP_IDS = load("lookup_ids")
CLAIM_IDS = load("claim_ids")


def ids_call(job: str, digests: Iterable[tuple[str, bytes]], batches: Iterable[str] | None = None) -> Call:
    """LOOKUP_IDS's: (id, 8-byte content digest) pairs; CLAIM_IDS's: those and each id's batch."""
    pairs = list(digests)
    ids, values = zip(*pairs) if pairs else ((), ())
    if any(len(v) != 8 for v in values):
        raise ValueError("keys.job_ids digests are 8 bytes")
    if batches is not None:
        values = tuple(v + batch_number(b).to_bytes(4, "big") for v, b in zip(values, batches, strict=True))
    return [keys.job_ids(job)], [pack(list(ids)), b"".join(values)]


def indexed_batch(value: bytes) -> str | None:
    """The batch keys.job_ids names for an id; None in an older genq's entry (a digest alone)."""
    return batch_id(int.from_bytes(value[8:], "big")) if len(value) == 12 else None


REORDER = load("reorder")


def reorder_call(queue_key: str, wanted: list[str]) -> Call:
    return [queue_key], list(wanted)


QUEUE_HEAD = load("queue_head")


def queue_head_call(queue_key: str) -> Call:
    return [queue_key], [RQ_JOB_PREFIX]


FLEET_SHARE = load("fleet_share")


def fleet_share_call(instance: str, fresh_s: int, mine: dict[str, int]) -> Call:
    """This engine's prompts per job (claimed or in flight; 0: none now)."""
    return [keys.job_share(job) for job in mine], [instance, fresh_s, *mine.values()]


RECORD = load("record")


def record_call(job: str, batch: str, worker: str, now: str, results: list[Result],
                dead: list[DeadLetter], incarnation: str) -> Call:
    flat: list = []
    for r in results:
        flat += [r.id, pack(records.without_prompt(r)), r.usage.prompt_tokens, r.usage.completion_tokens,
                 records.length_bucket(r.usage.completion_tokens)]
    letters = [item for d in dead for item in (d.id, pack(d))]
    # The job's elapsed time and rate run from the first request, not from the first answer.
    sent = min([r.finished_at - r.latency_s for r in results if r.finished_at] + [float(now)])
    return ([keys.batch_results(job, batch), keys.job_done(job), keys.worker_stats(job, worker), keys.job_hist(job),
             keys.job_dlq(job), keys.job_workers(job), keys.batch_claims(job, batch), keys.job_config(job),
             keys.batch(job, batch)],
            [batch, worker, now, incarnation, lua_list(flat), lua_list(letters), repr(sent)])


CLAIM = load("claim")
STEAL = load("steal")
UNCLAIM = load("unclaim")
# A claim's owner is alive while ALIVE_PREFIX .. owner .. ALIVE_SUFFIX exists.
ALIVE_PREFIX, ALIVE_SUFFIX = keys.engine_alive("\0").split("\0")


def _claim_common(ref: BatchRef, me: str, incarnation: str) -> Call:
    """KEYS[1..7] and ARGV[1..5] of CLAIM and STEAL (_claim_helpers.lua)."""
    return ([keys.batch_claims(ref.job, ref.batch), keys.batch_results(ref.job, ref.batch), keys.job_dlq(ref.job),
             keys.job_done(ref.job), keys.job_leases(ref.job), keys.job_config(ref.job),
             keys.batch_tries(ref.job, ref.batch)],
            [ref.batch, me, ALIVE_PREFIX, ALIVE_SUFFIX, incarnation])


def claim_call(ref: BatchRef, me: str, incarnation: str, token: str, ids: list[str]) -> Call:
    script_keys, args = _claim_common(ref, me, incarnation)
    return script_keys, [*args, token, lua_list(ids)]


def steal_call(ref: BatchRef, me: str, incarnation: str, holder: str, ids_back_first: list[str], n: int) -> Call:
    script_keys, args = _claim_common(ref, me, incarnation)
    return [*script_keys, keys.engine_alive(holder)], [*args, n, len(ids_back_first), *ids_back_first]


def unclaim_call(ref: BatchRef, me: str, incarnation: str, token: str, ids: Iterable[str] = ()) -> Call:
    return ([keys.batch_claims(ref.job, ref.batch), keys.job_config(ref.job), keys.job_leases(ref.job)],
            [me, incarnation, token, ref.batch, *ids])
