"""The Lua scripts (genq/core/scripts/): each one's header names every KEYS and ARGV it reads, the
pieces are included once, Redis compiles every script, and each `*_call` builds as many keys as
its header names."""

from __future__ import annotations

import re

import pytest

from genq.core import scripts
from genq.core.records import BatchRef, DeadLetter, ShardInfo, ShardMarker

SCRIPTS = sorted(p.stem for p in scripts.HERE.glob("*.lua") if not p.stem.startswith("_"))
REF = BatchRef("j", "b0000001")
CALLS = {
    "count_shards": scripts.count_shards_call("j"),
    "release": scripts.release_call(REF, ShardInfo(batch=REF.batch, uri="u", records=1, bytes=2, at=3.0), "",
                                    {"p1": b"r"}, ["p2"]),
    "adopt": scripts.adopt_call("j", ShardMarker(batch=REF.batch, uri="u", records=1, bytes=2, at=3.0, dead_letters=[
        DeadLetter(id="p1", job="j", batch=REF.batch, attempts=1, kind="bad_request", message="m", worker="w",
                   at=1.0)]),
        ShardInfo(batch=REF.batch, uri="u", records=1, bytes=2, at=3.0)),
    "lookup_ids": scripts.ids_call("j", [("p1", b"12345678")]),
    "claim_ids": scripts.ids_call("j", [("p1", b"12345678")], [REF.batch]),
    "reorder": scripts.reorder_call("q", ["a", "b"]),
    "queue_head": scripts.queue_head_call("q"),
    "fleet_share": scripts.fleet_share_call("inst", 3, {"j": 2}),
    "take": scripts.take_call("inst", "tok", "now", ["other"]),
    "record": scripts.record_call("j", REF.batch, "w", "1.0", [], [], ""),
    "claim": scripts.claim_call(REF, "inst", "", "tok", ["p1"]),
    "steal": scripts.steal_call(REF, "inst", "", "holder", ["p1"], 1),
    "unclaim": scripts.unclaim_call(REF, "inst", "", "tok", ["p1"]),
}


def named(kind: str, head: str) -> set[int]:
    """The KEYS or ARGV positions a header names: `KEYS[3] =` and ranges `KEYS[1..7]`."""
    found = {int(n) for n in re.findall(rf"-- {kind}\[(\d+)\] =", head)}
    for a, b in re.findall(rf"{kind}\[(\d+)\.\.(\d+)\]", head):
        found.update(range(int(a), int(b) + 1))
    return found


@pytest.mark.parametrize("name", SCRIPTS)
def test_each_header_names_what_its_script_reads(name: str) -> None:
    lines = scripts.load(name).splitlines()  # pieces expanded, their headers with them
    head = "\n".join(line for line in lines if line.startswith("--"))
    code = "\n".join(line for line in lines if not line.startswith("--"))
    assert "-- Returns" in head, name
    for kind in ("KEYS", "ARGV"):
        used = {int(n) for n in re.findall(rf"{kind}\[(\d+)\]", code)}
        assert used <= named(kind, head), (name, kind, sorted(used - named(kind, head)))
    script_keys, _ = CALLS[name]
    assert len(script_keys) == max(named("KEYS", head), default=0), name


def test_pieces_are_expanded_once() -> None:
    assert scripts.CLAIM.count("local function incarnation_ok(") == 1
    assert scripts.ADOPT.count("local function count_shards(") == 1
    for name in SCRIPTS:
        assert not re.search(r"^-- #include", scripts.load(name), re.M), name
    assert set(CALLS) == set(SCRIPTS)


def test_the_shard_totals_are_the_fields_the_monitor_reads() -> None:
    for text in (scripts.COUNT_SHARDS, scripts.RELEASE, scripts.ADOPT):
        assert f"'{scripts.SHARD_RECORDS}'" in text and f"'{scripts.SHARD_BYTES}'" in text


def test_rqs_keys_are_where_rq_reads_them(rconn) -> None:
    """TAKE, RELEASE and ADOPT write RQ's own keys; RQ must read them there (`rq info`)."""
    from rq.suspension import WORKERS_SUSPENDED

    from genq.core import keys
    from genq.core.queueing import rq_queue

    queue = rq_queue(rconn)
    assert (keys.RQ_QUEUE, keys.RQ_STARTED, keys.RQ_SUSPENDED) == (queue.key, queue.started_job_registry.key,
                                                                    WORKERS_SUSPENDED)
    assert queue.job_class.key_for("x") == scripts.RQ_JOB_PREFIX + "x"


def test_redis_compiles_every_script(rconn) -> None:
    for name in SCRIPTS:
        assert rconn.script_load(scripts.load(name)), name
