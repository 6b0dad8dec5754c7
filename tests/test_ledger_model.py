"""The ledger protocol (docs/exactly-once.md, "The protocol") driven by a rule-based state machine.

The real scripts run against the harness's private Redis; the engines are this module's: each does
what a worker engine does at the ledger's boundary, one script call a step (TAKE from RQ's queue,
claim, record, write the shard, release, the lease check after a beat), and the world around them
misbehaves: an engine crashes (its lease lapses; the reconciler queues its batches again), freezes
and wakes with an old lease, a batch is queued again while its holder is slow, Redis is restored from a
snapshot (DUMP/RESTORE of every key) taken some steps before, a second enqueue comes into the job,
the job is deleted and created again, dead letters are requeued, `jobs set` changes the settings, the
job is paused (its holders park their batches at a beat) and resumed.
After every step the invariants are checked; at the end every batch is driven to its shard and the
job must be called finished with one outcome for every prompt of every enqueue.

The scripts are taken from `World.lua` (a name -> text map), so a test can plant a bug in one
(tests/lua_mutants.py: PLANTS) and see the model fail.
"""

from __future__ import annotations

import json
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import redis
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from genq.core import keys, scripts
from genq.core import ledger as ledger_mod
from genq.core.ledger import Reconciler, lease_holder, lease_token
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.figures import job_status
from genq.core.ledger.leasing import end_lease
from genq.core.queueing import load_batch, load_config
from genq.core.records import BatchRef, DeadLetter, JobConfig, Prompt, Result, ShardInfo, Usage, unpack
from genq.ops import control, dlq, recover
from genq.ops.control import set_settings
from genq.ops.recover import outcome_for
from genq.output import truth
from genq.output.truth import open_store, shard_bytes
from genq.producer.enqueue import Enqueuer, RejectsFile, queue_lost
from genq.producer.sources import open_rows, read_prompts
from tests.conftest import REDIS_URL

JOB = "m"
ENGINES = ("e0", "e1", "e2")
LEDGER_SCRIPTS = ("TAKE", "CLAIM", "RECORD", "RELEASE", "UNCLAIM")
# Bounded for `make test-fast` on 2 busy cores; derandomized, with no example database, so CI
# runs the same examples every time.
MODEL = settings(max_examples=60, stateful_step_count=25, derandomize=True, database=None, deadline=None,
                 suppress_health_check=list(HealthCheck), print_blob=False,
                 phases=(Phase.explicit, Phase.generate, Phase.shrink))


class Broken(AssertionError):
    """An invariant of the ledger does not hold."""


@dataclass
class Hold:
    """A batch an engine holds: the lease it was delivered under, and what it has of it."""

    token: str
    config: JobConfig
    prompts: list[Prompt]
    inflight: dict[str, Result] = field(default_factory=dict)  # claimed and generated, not recorded
    written: ShardInfo | None = None  # the shard it wrote, not yet released
    stored: dict[str, bytes] = field(default_factory=dict)  # the results it was written from, as stored
    letters: list[str] = field(default_factory=list)  # the ids of its dead letters


@dataclass
class Engine:
    name: str
    instance: str = ""
    frozen: bool = False
    woke: bool = False  # woken, its lease check not run since: it claims nothing
    away: bool = False  # frozen or Redis restored since its lease check: the check looks further (beat)
    holds: dict[str, Hold] = field(default_factory=dict)


class World:
    """The ledger, its output and the engines, with a check of every invariant."""

    def __init__(self, conn: redis.Redis, root: Path, lua: dict[str, str] | None = None) -> None:
        self.conn, self.root = conn, root
        self.lua = {name: getattr(scripts, name) for name in LEDGER_SCRIPTS} | (lua or {})
        self.out = str(root / "out")
        self.store = open_store(self.out, None)
        self.engines = {name: Engine(name) for name in ENGINES}
        self.enqueues = 0
        self.max_tokens = 100
        self.expected: dict[str, set[str]] = {}  # incarnation -> every prompt of every enqueue of that life
        self.generated: dict[str, int] = {}  # prompt -> generations (prompt ids are never reused)
        self.snapshots: list[list[tuple[bytes, int, bytes]]] = []  # Redis as it was, oldest first
        self.compared = True  # a worker compared Redis with the output since Redis last changed under it
        self.requeued: set[str] = set()  # prompts whose dead letter was requeued: generated again rightly
        self.markers: dict[str, bytes] = {}  # marker file -> its bytes when first seen
        self.sent_with: dict[str, int] = {}  # "prompt completion" -> the settings version it was sent with
        conn.flushdb()
        for engine in self.engines.values():
            self.start(engine)

    # ------------------------------------------------------------------ the job

    def config(self) -> JobConfig | None:
        return load_config(self.conn, JOB)

    def enqueue(self, n: int) -> None:
        """`genq enqueue` of a new input of n prompts into the job (creating it if Redis has none)."""
        self.enqueues += 1
        path = self.root / f"in{self.enqueues}.jsonl"
        ids = [f"q{self.enqueues}p{i}" for i in range(n)]
        path.write_text("".join(json.dumps({"id": i, "prompt": f"say {i}"}) + "\n" for i in ids))
        stored = self.config()
        config = stored or JobConfig(name=JOB, output=self.out, batch_size=2, max_tokens=self.max_tokens,
                                     created_at=time.time(), incarnation=secrets.token_hex(6))
        rejects = RejectsFile(str(self.root / f"in{self.enqueues}.rejects.jsonl"))
        summary = Enqueuer(self.conn, config, create=stored is None, rejects=rejects,
                           input_uri=str(path)).run(open_rows(str(path), endpoint=config.endpoint))
        rejects.close()
        life = (self.config() or config).incarnation
        self.expected.setdefault(life, set()).update(ids)
        assert summary.enqueued == n, summary

    def delete_and_create_again(self, n: int) -> None:
        """`genq jobs delete --force`, then an enqueue with other settings: a new life of the name."""
        control.delete_job(self.conn, control.find_job(self.conn, JOB), again=False)
        self.max_tokens += 1
        self.enqueue(n)

    def jobs_set(self) -> None:
        if self.config() is not None:
            self.max_tokens += 10
            set_settings(self.conn, JOB, {"max_tokens": self.max_tokens})

    def requeue_letters(self) -> None:
        if self.config() is not None:
            letters = dlq.dead_letters(self.conn, JOB)
            dlq.requeue(self.conn, letters)
            self.requeued |= {d.id for d in letters} - {k.decode() for k in self.conn.hkeys(keys.job_dlq(JOB))}

    def compare(self) -> None:
        """What every worker's start and maintenance does: the ledger compared with the output."""
        config = self.config()
        if config is not None:
            recover.catch_up(self.conn, config)
            queue_lost(self.conn, config)
        self.compared = True

    # ------------------------------------------------------------------ Redis misbehaving

    def take_snapshot(self) -> None:
        names = self.conn.keys("*")
        pipe = self.conn.pipeline(transaction=False)
        for k in names:
            pipe.pttl(k)
            pipe.dump(k)
        got = pipe.execute()
        self.snapshots.append([(k, ttl, dumped) for k, ttl, dumped in zip(names, got[0::2], got[1::2])
                               if dumped is not None])

    def restore(self, back: int = 0) -> None:
        """Redis restarted from the snapshot `back` before the latest one: everything written since is
        lost (the later snapshots with it)."""
        if not self.snapshots:
            return
        back = min(back, len(self.snapshots) - 1)
        snapshot = self.snapshots[-1 - back]
        del self.snapshots[len(self.snapshots) - back:]
        pipe = self.conn.pipeline(transaction=False)
        pipe.flushdb()
        for k, ttl, dumped in snapshot:
            pipe.restore(k, max(ttl, 0), dumped)
        pipe.execute()
        for engine in self.engines.values():  # heartbeats write their alive keys again
            engine.away = True  # each one's next lease check sees another run_id
            if engine.instance and not engine.frozen:
                self.conn.set(keys.engine_alive(engine.instance), "1")
        self.compared = False

    # ------------------------------------------------------------------ engines

    def start(self, engine: Engine) -> None:
        """A worker (re)started: a new instance, nothing held."""
        if engine.instance:
            self.conn.delete(keys.engine_alive(engine.instance))
        engine.instance, engine.frozen, engine.woke, engine.holds = f"{engine.name}.{secrets.token_hex(3)}", False, \
            False, {}
        self.conn.set(keys.engine_alive(engine.instance), "1")

    def freeze(self, engine: Engine) -> None:
        """The engine stops running longer than its alive key lives: its lease lapses."""
        engine.frozen = True
        self.conn.delete(keys.engine_alive(engine.instance))

    def wake(self, engine: Engine) -> None:
        """It runs again, with what it held, before its next lease check."""
        engine.frozen, engine.woke, engine.away = False, True, True
        self.conn.set(keys.engine_alive(engine.instance), "1")

    def beat(self, engine: Engine) -> None:
        """A heartbeat and the lease check after it: batches done, of another life or leased
        to another are let go (their claims dropped); after a freeze or a Redis restore, also those the
        output holds (adopted from their markers), and leases Redis says are its own and it does not hold
        are queued again."""
        self.conn.set(keys.engine_alive(engine.instance), "1")
        config = self.config()
        paused = self.conn.exists(keys.job_paused(JOB))
        for batch, hold in list(engine.holds.items()):
            current = lease_token(self.conn.hget(keys.job_leases(JOB), batch))
            done = self.conn.sismember(keys.job_done(JOB), batch)
            if done or current != hold.token or config is None or config.incarnation != hold.config.incarnation:
                self.let_go(engine, batch)
            elif engine.away and (marker := truth.read_marker(self.store, truth.marker_rel(JOB, batch))) is not None \
                    and marker.incarnation == hold.config.incarnation:
                recover.adopt(self.conn, JOB, marker)
                self.let_go(engine, batch)
            elif paused and hold.written is None:  # parked (worker/gate.py): its answers in flight recorded first
                if hold.inflight:
                    self.record(engine, batch, False)
                self.let_go(engine, batch)
                end_lease(self.conn, BatchRef(JOB, batch), hold.token, requeue=False)
        for batch, lease in self.conn.hgetall(keys.job_leases(JOB)).items() if engine.away else []:
            if lease_holder(lease) == engine.instance and batch.decode() not in engine.holds:
                end_lease(self.conn, BatchRef(JOB, batch.decode()), str(lease_token(lease)), requeue=True)
        engine.woke = engine.away = False

    def let_go(self, engine: Engine, batch: str) -> None:
        hold = engine.holds.pop(batch)
        ref = BatchRef(JOB, batch)
        self.run("UNCLAIM", scripts.unclaim_call(ref, engine.instance, hold.config.incarnation, hold.token))

    def run(self, name: str, call: scripts.Call):
        return scripts.evaluate(self.conn, self.lua[name], call)

    def take(self, engine: Engine) -> None:
        """The engine's intake: TAKE the first queued batch, then load it; the output is looked at first."""
        config = self.config()
        if config is None:
            return
        token = secrets.token_hex(4)
        got = self.run("TAKE", scripts.take_call(engine.instance, token, "2026-12-06T00:00:00.000000Z", []))
        if not got:
            return
        batch = got[1].decode()
        marker = truth.read_marker(self.store, truth.marker_rel(JOB, batch))
        if marker is not None and marker.incarnation == config.incarnation:
            recover.adopt(self.conn, JOB, marker)
            return
        source = load_batch(self.conn, JOB, batch)
        if source is None:
            return
        hold = engine.holds.get(batch)
        if hold is not None and hold.config.incarnation == config.incarnation:
            hold.token = token  # taken again while held: the newest lease drives it (worker/batches.py)
            return
        engine.holds[batch] = Hold(token=token, config=config, prompts=read_prompts(source, config))

    def reconcile(self) -> None:
        """A worker's maintenance: batches whose RQ job no live engine carries are queued again
        (confirmed at first sight here; the worker waits STRANDED_CONFIRM_S)."""
        saved = ledger_mod.STRANDED_CONFIRM_S
        ledger_mod.STRANDED_CONFIRM_S = 0
        try:
            Reconciler(self.conn, "model").pass_once(force=True)
        finally:
            ledger_mod.STRANDED_CONFIRM_S = saved

    def deliver(self, engine: Engine, batch: str) -> None:
        """The batch queued again while its holder is slow (the reconciler saw its alive key lapse),
        and taken by `engine`."""
        current = self.conn.hget(keys.job_transport(JOB), batch)
        if self.conn.exists(keys.job_paused(JOB)):
            return  # the reconciler leaves a paused job's batches parked
        if Reconciler(self.conn, "model")._requeue(JOB, batch, current.decode() if current else None):
            self.take(engine)

    def claim(self, engine: Engine, batch: str) -> None:
        """CLAIM every prompt not in flight here, and generate the ones granted."""
        hold = engine.holds[batch]
        ref = BatchRef(JOB, batch)
        ids = [p.id for p in hold.prompts if p.id not in hold.inflight]
        if not ids or engine.woke:  # woken: nothing is claimed before its lease check
            return
        current = lease_token(self.conn.hget(keys.job_leases(JOB), batch))
        answer = self.run("CLAIM", scripts.claim_call(ref, engine.instance, hold.config.incarnation, hold.token, ids))
        if answer in (b"done", b"stale"):
            self.let_go(engine, batch)
            return
        letters = answer[0].decode()
        granted = [i for i, c in zip(ids, letters) if c == "c"]
        if granted and current != hold.token:
            raise Broken(f"CLAIM granted {granted} of {batch} under lease {hold.token}, not its current {current}")
        written = self.written_outcomes()
        by_id = {p.id: p for p in hold.prompts}
        for i in granted:
            if i in written and not (i in self.requeued and written[i].startswith("letter:")):
                raise Broken(f"prompt {i} generated again: its outcome is written ({written[i]})")
            self.generated[i] = self.generated.get(i, 0) + 1
            text = f"{i} by {engine.instance} #{self.generated[i]}"
            self.sent_with[text] = hold.config.settings_version
            hold.inflight[i] = Result(
                id=i, job=JOB, batch=batch, index=by_id[i].index, completion=text, finish_reason="stop",
                usage=Usage(prompt_tokens=3, completion_tokens=len(text)), model="m", worker=engine.instance,
                attempts=1, latency_s=0.1, finished_at=time.time(), settings_version=hold.config.settings_version)

    def record(self, engine: Engine, batch: str, letter: bool) -> None:
        """RECORD what is in flight (the first one as a dead letter if `letter`); first writer wins."""
        hold = engine.holds[batch]
        if not hold.inflight:
            return
        outcomes = list(hold.inflight.values())
        dead = []
        if letter:
            r = outcomes.pop(0)
            prompt = next(p for p in hold.prompts if p.id == r.id)
            dead = [DeadLetter(id=r.id, job=JOB, batch=batch, attempts=1, kind="bad_request", message=r.completion,
                               worker=engine.instance, at=time.time(), prompt=prompt)]
        ids = list(hold.inflight)
        before = self.stored(batch, ids)
        self.run("RECORD", scripts.record_call(JOB, batch, engine.instance, repr(time.time()), outcomes, dead,
                                               hold.config.incarnation))
        after = self.stored(batch, ids)
        for i in ids:
            if before[i] is not None and after[i] != before[i]:
                raise Broken(f"prompt {i}'s outcome was replaced by a second writer: {before[i]} -> {after[i]}")
        hold.inflight.clear()

    def stored(self, batch: str, ids: list[str]) -> dict[str, str | None]:
        results = self.conn.hmget(keys.batch_results(JOB, batch), ids)
        letters = self.conn.hmget(keys.job_dlq(JOB), ids)
        out: dict[str, str | None] = {}
        for i, r, d in zip(ids, results, letters):
            out[i] = unpack(r, Result).completion if r else unpack(d, DeadLetter).message if d else None
        return out

    def write_shard(self, engine: Engine, batch: str) -> None:
        """The shard and its marker, from what Redis holds, once every prompt has its outcome."""
        hold = engine.holds[batch]
        ids = [p.id for p in hold.prompts]
        done = self.conn.sismember(keys.job_done(JOB), batch)
        config = self.config()
        current = lease_token(self.conn.hget(keys.job_leases(JOB), batch))
        if done or config is None or config.incarnation != hold.config.incarnation \
                or not ledger_jobs.batch_exists(self.conn, JOB, batch) or current != hold.token:
            self.let_go(engine, batch)  # a superseded holder writes no shard: the current one does
            return
        found = [(unpack(v, Result), v) for v in self.conn.hvals(keys.batch_results(JOB, batch))]
        results = [r for r, _ in found if r.id in set(ids)]
        letters = [unpack(v, DeadLetter) for v in self.conn.hmget(keys.job_dlq(JOB), ids) if v]
        if set(ids) - {r.id for r in results} - {d.id for d in letters}:
            return  # outcomes missing: claimed again
        at = max([r.finished_at for r in results] + [d.at for d in letters], default=0.0)
        outcome = outcome_for(hold.prompts, results, letters, len(ids))
        try:
            hold.written = truth.commit_shard(self.store, JOB, batch, shard_bytes(results, "none"), len(results), at,
                                              compression="none", incarnation=hold.config.incarnation, outcome=outcome)
            hold.stored, hold.letters = {r.id: v for r, v in found if r.id in set(ids)}, [d.id for d in letters]
        except truth.AlreadyWritten as written:
            recover.adopt(self.conn, JOB, written.marker)
            self.let_go(engine, batch)

    def work(self, engine: Engine, batch: str, letter: bool = False) -> None:
        hold = engine.holds[batch]
        if hold.written is not None:
            self.release(engine, batch)
        elif hold.inflight:
            self.record(engine, batch, letter)
        elif self.missing(batch, hold):
            self.claim(engine, batch)
        else:
            self.write_shard(engine, batch)

    def missing(self, batch: str, hold: Hold) -> bool:
        ids = [p.id for p in hold.prompts]
        return any(v is None for v in self.stored(batch, ids).values())

    def release(self, engine: Engine, batch: str) -> None:
        hold = engine.holds[batch]
        if hold.written is None:
            return
        answer = self.run("RELEASE", scripts.release_call(BatchRef(JOB, batch), hold.written,
                                                          hold.config.incarnation, hold.stored, hold.letters))
        if answer == b"short":  # Redis lost outcomes since they were read: the written shard is the truth
            marker = truth.read_marker(self.store, truth.marker_rel(JOB, batch))
            if marker is not None:
                recover.adopt(self.conn, JOB, marker)
        self.let_go(engine, batch)

    # ------------------------------------------------------------------ what is true

    def written(self) -> list:
        config = self.config()
        incarnation = config.incarnation if config else None
        found = truth.read_markers(self.store, JOB, truth.marker_batches(self.store, JOB))
        return [m for m in found if m.incarnation == incarnation]

    def written_outcomes(self) -> dict[str, str]:
        """Prompt -> its outcome in the output (of the job's current life); a letter requeued
        since gives way to its result. Checks on the way that each written result is its
        prompt's only one and carries the settings it was sent with."""
        out: dict[str, str] = {}
        letters: dict[str, str] = {}
        markers = self.written()
        for m in markers:
            for d in m.dead_letters:
                letters[d.id] = "letter: " + d.message
        for m in markers:
            for line in self.store.read(m.uri.split(self.out + "/", 1)[1]).splitlines():
                r = msgspec.json.decode(line, type=Result)
                if r.id in out:
                    raise Broken(f"prompt {r.id} has two written results: {out[r.id]!r} and {r.completion!r}")
                if self.sent_with.get(r.completion, r.settings_version) != r.settings_version:
                    raise Broken(f"{r.completion!r} was sent with settings {self.sent_with[r.completion]}, "
                                 f"written with {r.settings_version}")
                out[r.id] = r.completion
        return letters | out

    def prompts(self) -> set[str]:
        config = self.config()
        return self.expected.get(config.incarnation, set()) if config else set()

    def status(self) -> str | None:
        facts = ledger_jobs.counts(self.conn, JOB)
        if self.config() is None:
            return None
        completed = sum(int(self.conn.hget(keys.worker_stats(JOB, w.decode()), "done") or 0)
                        for w in self.conn.smembers(keys.job_workers(JOB)))
        return job_status(total=facts.total, finished=completed + facts.dead, batches=facts.batches_total,
                          batches_done=facts.done, paused=False, started=True, failed=facts.dead)

    def check(self) -> None:
        """The invariants, after every step."""
        for rel in truth.marker_batches(self.store, JOB):
            raw = self.store.read(truth.marker_rel(JOB, rel))
            if self.markers.setdefault(rel, raw) != raw:
                raise Broken(f"marker of {rel} changed")
        written = self.written_outcomes()
        status = self.status()
        if status in ("done", "partial") and self.compared:
            dead = {k.decode() for k in self.conn.hkeys(keys.job_dlq(JOB))}
            lacking = sorted(self.prompts() - set(written) - dead)
            if lacking:
                raise Broken(f"job called {status} without an outcome for {lacking}")

    def drain(self) -> None:
        """Every worker compares Redis with the output, then one healthy engine drives every
        unfinished batch to its shard: the job must end called finished, with one outcome for
        every prompt of every enqueue, and nothing written generated again."""
        # The engines wake; what they had in hand ends before their next lease check: a written
        # shard is released, answers in flight are recorded (after a fresh engine, leased every
        # batch meanwhile, recorded its own), then they beat; then every worker compares.
        control.resume(self.conn, JOB)  # the operator's resume: parked batches queued again
        others = [e for e in self.engines.values() if e.name != ENGINES[2]]
        for engine in others:
            if engine.frozen:
                self.wake(engine)
            for batch, hold in list(engine.holds.items()):
                if hold.written is not None:
                    self.release(engine, batch)
        steady = self.engines[ENGINES[2]]  # no rule drives it: a worker started for the end
        for batch in ledger_mod.pending_batches(self.conn, JOB):
            self.deliver(steady, batch)
        for batch in list(steady.holds):
            for _ in range(2):
                if batch in steady.holds:
                    self.work(steady, batch)  # claim, record
        for engine in others:
            for batch, hold in list(engine.holds.items()):
                if hold.inflight:
                    self.record(engine, batch, False)
            self.beat(engine)
        self.compare()
        for _ in range(200):
            pending = ledger_mod.pending_batches(self.conn, JOB)
            if not pending:
                break
            self.deliver(steady, pending[0])
            for batch in list(steady.holds):
                for _ in range(8):
                    if batch in steady.holds:
                        self.work(steady, batch)
        if self.config() is None:
            return
        status = self.status()
        written = self.written_outcomes()
        dead = {k.decode() for k in self.conn.hkeys(keys.job_dlq(JOB))}
        lacking = sorted(self.prompts() - set(written) - dead)
        if status not in ("done", "partial") or lacking:
            raise Broken(f"after draining: the job is {status}, counts {ledger_jobs.counts(self.conn, JOB)}, "
                         f"prompts with no outcome {lacking}")
        self.check()


class LedgerModel(RuleBasedStateMachine):
    lua: dict[str, str] = {}

    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="genq-model-"))
        self.world = World(redis.Redis.from_url(REDIS_URL), self.tmp, self.lua)
        self.world.enqueue(3)

    def teardown(self) -> None:
        try:
            self.world.drain()
        finally:
            self.world.conn.close()
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _engine(self, i: int) -> Engine:
        return self.world.engines[ENGINES[i % len(ENGINES)]]

    def _held(self) -> list[tuple[Engine, str]]:
        """Every (engine, batch) held by an engine that runs."""
        return [(e, b) for e in self.world.engines.values() if not e.frozen for b in sorted(e.holds)]

    @initialize(opening=st.sampled_from(["delivered", "delivered twice", "sent",
                                         "written, then Redis lost its outcomes"]))
    def first_delivery(self, opening: str) -> None:
        """The job's first batch delivered to engine 0, where the races the scripts exist for begin:
        delivered to engine 1 as well before engine 0 sent anything (the reconciler found it
        stranded while engine 0 was slow); or engine 0 sent its prompts; or engine 0 wrote the
        shard and Redis was then restored from before its outcomes were recorded."""
        first = self._engine(0)
        self.world.take(first)
        self.world.take_snapshot()
        for batch in list(first.holds):
            if opening == "delivered twice":
                self.world.deliver(self._engine(1), batch)
            elif opening == "sent":
                self.world.work(first, batch)
            elif opening.startswith("written"):
                for _ in range(3):  # claim, record, write
                    self.world.work(first, batch)
                self.world.restore(1)

    def _elsewhere(self, i: int) -> list[str]:
        """The batches the other driven engine holds, engine i not; none while engine i is frozen."""
        other = self._engine(1 - i)
        return [] if self._engine(i).frozen else sorted(set(other.holds) - set(self._engine(i).holds))

    @precondition(lambda self: bool(self._elsewhere(0) or self._elsewhere(1)))
    @rule()
    def deliver_again(self) -> None:
        """A batch one engine holds delivered to the other too: RQ delivering it again after the
        reconciler found it stranded while its holder was slow."""
        i = 1 if self._elsewhere(1) else 0
        self.world.deliver(self._engine(i), self._elsewhere(i)[0])

    @rule(i=st.integers(0, 1), pick=st.integers(0, 3), letter=st.booleans())
    def work(self, i: int, pick: int, letter: bool) -> None:
        """Engine i's next step with a batch it holds (claim and send, record, write, release), or,
        holding none, a TAKE from the queue."""
        engine = self._engine(i)
        if engine.frozen:
            return
        if engine.holds:
            held = sorted(engine.holds)
            self.world.work(engine, held[pick % len(held)], letter)
        else:
            self.world.take(engine)

    @rule(i=st.integers(0, 1), event=st.sampled_from(["beat", "crash", "freeze or wake"]))
    def engine(self, i: int, event: str) -> None:
        """A heartbeat with its lease check; or the engine crashes (and starts again); or it freezes
        past its lease, or wakes with what it held."""
        engine = self._engine(i)
        if event == "beat":
            if not engine.frozen:
                self.world.beat(engine)
        elif event == "crash":
            self.world.start(engine)
        else:
            (self.world.wake if engine.frozen else self.world.freeze)(engine)

    @rule(back=st.integers(1, 6))
    def restore(self, back: int) -> None:
        """Redis restored from a snapshot taken `back` steps ago (or at the start): everything after it lost."""
        self.world.restore(back)

    @rule(what=st.sampled_from(["compare", "reconcile", "enqueue", "requeue letters", "jobs set",
                                "delete and create again", "pause", "resume"]),
          n=st.integers(1, 3))
    def around(self, what: str, n: int) -> None:
        """A worker's comparison of Redis with the output (its start, its maintenance), or an operator's command."""
        if what == "compare":
            self.world.compare()
        elif what == "reconcile":
            self.world.reconcile()
        elif what == "enqueue":
            self.world.enqueue(n)
        elif what == "requeue letters":
            self.world.requeue_letters()
        elif what == "jobs set":
            self.world.jobs_set()
        elif what == "pause":  # `genq pause --job`: its queued batches parked, its holders park theirs at a beat
            if self.world.config() is not None:
                control.pause(self.world.conn, JOB)
        elif what == "resume":
            control.resume(self.world.conn, JOB)
        else:
            self.world.delete_and_create_again(n)

    @invariant()
    def holds(self) -> None:
        self.world.check()

    @invariant()
    def snapshot(self) -> None:
        """Redis as it stands after every step, for a later restore."""
        self.world.take_snapshot()


# A planted bug is looked for longer; the search stops at the first failure, unshrunk (shrinking
# takes minutes here: `python tests/lua_mutants.py --model` prints the shrunk failure of each).
HUNT = settings(MODEL, max_examples=1000, stateful_step_count=8, phases=(Phase.explicit, Phase.generate))


def run_model(lua: dict[str, str] | None = None, config: settings = MODEL) -> None:
    """The model as a test, with these scripts in place of the real ones."""
    machine = type("Model", (LedgerModel,), {"lua": lua or {}})
    run_state_machine_as_test(machine, settings=config)


def test_the_ledger_keeps_its_invariants() -> None:
    run_model()


@pytest.mark.parametrize("plant", range(3))
def test_each_planted_bug_is_caught(plant: int) -> None:
    from tests.lua_mutants import PLANTS, planted

    name, script, _old, _new = PLANTS[plant]
    with pytest.raises(Broken):
        run_model({script: planted(PLANTS[plant])}, HUNT)


def _world(tmp_path: Path) -> World:
    world = World(redis.Redis.from_url(REDIS_URL), tmp_path)
    world.enqueue(3)  # b0000001 (2 prompts), b0000002 (1)
    return world


def _finish(world: World, *, letter: bool = False) -> None:
    """One engine takes the queue's first batch and drives it to its release (its first outcome a
    dead letter if `letter`)."""
    engine = world.engines[ENGINES[1]]
    world.take(engine)
    for _ in range(8):
        for batch in list(engine.holds):
            world.work(engine, batch, letter)


def test_an_enqueue_that_redis_lost_is_queued_again(tmp_path: Path) -> None:
    """Redis restored from a snapshot taken before a second enqueue into the job, one of whose
    batches was written meanwhile: the written one is adopted, the rest queued again from the
    input its record names; the job is done only with an outcome for every prompt of both."""
    world = _world(tmp_path)
    _finish(world)
    world.take_snapshot()
    world.enqueue(4)  # b..3 and b..4 above the reserved numbers
    _finish(world)  # the first enqueue's second batch
    _finish(world)  # the second enqueue's first batch written and released
    world.restore()
    assert world.status() == "running" and ledger_jobs.counts(world.conn, JOB).total == 3
    world.drain()
    assert world.status() == "done"
    assert sorted(world.written_outcomes()) == sorted(world.prompts())


def test_letters_requeued_and_written_then_lost_with_redis_end_the_job(tmp_path: Path) -> None:
    """Dead letters requeued and written, then Redis restored from before the requeue: the
    requeue's batch is adopted from its marker, its prompts counted once (they were letters),
    and the job ends done instead of running for good."""
    world = _world(tmp_path)
    _finish(world, letter=True)
    _finish(world)
    assert world.status() == "partial"
    world.take_snapshot()
    world.requeue_letters()
    _finish(world)
    assert world.status() == "done"
    world.restore()
    world.drain()
    assert world.status() == "done", ledger_jobs.counts(world.conn, JOB)


def test_a_requeue_that_redis_lost_is_done_again(tmp_path: Path) -> None:
    """Dead letters requeued, then Redis restored from before the requeue (its batch not yet
    written): the letters are back in the DLQ, and the requeue's record in the output has them
    requeued again: the job ends done, not partial."""
    world = _world(tmp_path)
    _finish(world, letter=True)
    _finish(world)
    world.take_snapshot()
    world.requeue_letters()
    world.restore()
    assert world.status() == "partial"
    world.drain()
    assert world.status() == "done", ledger_jobs.counts(world.conn, JOB)


def _worker_completes(world: World, batch: str, hold: Hold, token: str) -> set[str]:
    """The worker's own Batches.write_and_release of the batch held under `token`: the prompts it finds missing."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.worker import batches
    from genq.worker.controller import Running
    from genq.worker.held import HeldBatch, Holdings

    held = HeldBatch(ref=BatchRef(JOB, batch), token=token, config=hold.config, unfinished=set(), prompts=hold.prompts)

    async def complete() -> set[str]:
        conn = aioredis.Redis.from_url(REDIS_URL)
        owner = batches.Batches(conn, world.conn, "w", "w.1", Holdings(), Running())
        try:
            return await owner.write_and_release(held)
        finally:
            owner.close()
            await conn.aclose()

    return asyncio.run(complete())


def test_the_worker_adopts_its_own_shard_when_redis_loses_outcomes_before_its_release(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """The worker's Batches.write_and_release (worker/batches.py), not the model's engine: Redis loses an outcome
    between the shard being written and RELEASE (a rollback), so RELEASE answers 'short'. The written
    shard is the batch's outcome: the batch is marked done from its marker and nothing is sent again."""
    from genq.worker import batches

    world = _world(tmp_path)
    engine = world.engines[ENGINES[1]]
    world.take(engine)
    (batch, hold), = engine.holds.items()
    for _ in range(4):  # claim and record every prompt; no shard yet
        if world.missing(batch, hold) or hold.inflight:
            world.work(engine, batch)
    assert not world.missing(batch, hold)
    lost = hold.prompts[0].id
    real_commit = batches.commit_shard

    def rolled_back(*args, **kwargs):
        """The shard written, then Redis rolled back to before one of its outcomes."""
        info = real_commit(*args, **kwargs)
        world.conn.hdel(keys.batch_results(JOB, batch), lost)
        return info

    monkeypatch.setattr(batches, "commit_shard", rolled_back)
    missing = _worker_completes(world, batch, hold, hold.token)
    assert not missing, f"{sorted(missing)} would be generated again: their shard is written"
    assert world.conn.sismember(keys.job_done(JOB), batch)


def _record(world: World, engine: Engine, batch: str, *, results: list[str] = (), letters: list[str] = ()) -> None:
    """RECORD these of what `engine` has in flight of `batch`: some as results, some as dead letters."""
    hold = engine.holds[batch]
    dead = [DeadLetter(id=i, job=JOB, batch=batch, attempts=1, kind="bad_request", message=hold.inflight[i].completion,
                       worker=engine.instance, at=time.time(), prompt=next(p for p in hold.prompts if p.id == i))
            for i in letters]
    world.run("RECORD", scripts.record_call(JOB, batch, engine.instance, repr(time.time()),
                                            [hold.inflight[i] for i in results], dead, hold.config.incarnation))
    for i in [*results, *letters]:
        del hold.inflight[i]


def test_a_release_after_redis_lost_a_dead_letter_of_the_shard_keeps_it(tmp_path: Path) -> None:
    """The shard is written with a result and a dead letter; Redis is then restored from between the two
    RECORD calls (the result stored, the letter not) and the holder releases: RELEASE must not take the
    shard as every outcome Redis holds (same count of results), or the letter is lost from the DLQ for good
    (the batch done, nothing queues it again) and the job never ends."""
    world = _world(tmp_path)
    engine = world.engines[ENGINES[0]]
    world.take(engine)
    (batch, hold), = engine.holds.items()
    world.work(engine, batch)  # claims both prompts
    first, second = sorted(hold.inflight)
    _record(world, engine, batch, results=[second])
    world.take_snapshot()
    _record(world, engine, batch, letters=[first])
    world.write_shard(engine, batch)
    assert engine.holds[batch].written is not None
    world.restore()  # the letter is gone from Redis, the result is there
    world.release(engine, batch)
    assert world.conn.hexists(keys.job_dlq(JOB), first), "the shard's dead letter is in no DLQ"
    world.drain()
    assert world.status() == "partial", ledger_jobs.counts(world.conn, JOB)


def test_a_release_over_other_outcomes_of_the_same_count_is_refused(tmp_path: Path) -> None:
    """The holder's shard holds its result of one prompt and its letter of the other; Redis is restored to
    before both, and the slow holder it superseded (delivered again while that one was slow, both claimed
    before the restore point) records its late answers the other way round: a letter for the shard's result
    and a result for its letter. Same number of results, other outcomes: RELEASE must refuse the shard (the
    batch is then done from its marker), or the DLQ holds a letter of a prompt whose result is written (a
    requeue generates it again) and lacks the shard's letter."""
    world = _world(tmp_path)
    slow, holder = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(slow)
    (batch, hold), = slow.holds.items()
    world.work(slow, batch)  # the slow holder claims and sends both
    world.deliver(holder, batch)
    world.work(holder, batch)  # the holder claims both under its newer lease
    world.take_snapshot()
    first, second = sorted(hold.inflight)
    _record(world, holder, batch, results=[first], letters=[second])
    world.write_shard(holder, batch)
    assert holder.holds[batch].written is not None
    world.restore()
    _record(world, slow, batch, results=[second], letters=[first])
    world.release(holder, batch)
    dead = {k.decode() for k in world.conn.hkeys(keys.job_dlq(JOB))}
    written = world.written_outcomes()
    assert not written[first].startswith("letter:") and first not in dead, (written, dead)
    assert second in dead, (written, dead)


def test_a_holder_missing_outcomes_of_a_batch_written_elsewhere_adopts_it(tmp_path: Path) -> None:
    """The worker's Batches.write_and_release (worker/batches.py): a holder frozen once it had seen every outcome
    recorded; meanwhile the batch was written by another engine, and Redis was then restored to a state where
    the frozen holder's lease is current again and one outcome is missing. It wakes, reads Redis and finds that
    one missing: the written shard is the batch's outcome, so the batch is done from its marker; sending the
    prompt again would generate a written prompt again."""

    world = _world(tmp_path)
    writer = world.engines[ENGINES[1]]
    world.take(writer)
    (batch, hold), = writer.holds.items()
    for _ in range(3):  # claim, record, write the shard
        world.work(writer, batch)
    assert hold.written is not None and not world.conn.sismember(keys.job_done(JOB), batch)
    world.conn.hdel(keys.batch_results(JOB, batch), hold.prompts[0].id)  # Redis rolled back under it
    frozen = "woken"  # its lease, current in the restored Redis
    world.conn.hset(keys.job_leases(JOB), batch, f"{frozen} w.1")
    missing = _worker_completes(world, batch, hold, frozen)
    assert not missing, f"{sorted(missing)} would be generated again: their shard is written"
    assert world.conn.sismember(keys.job_done(JOB), batch)


def test_a_requeue_after_redis_lost_an_earlier_one_takes_no_written_batch_number(tmp_path: Path) -> None:
    """Dead letters requeued as a new batch, written; Redis then restored from before that requeue (its batch
    counter with it), the written batch adopted from its marker. Another letter requeued then must not get
    the written batch's number: that batch is done (or would be adopted from the other prompts' marker), so
    the requeued prompt would never run, gone from the DLQ, and the job never end."""
    world = _world(tmp_path)
    _finish(world, letter=True)  # b0000001: a result and a letter
    world.take_snapshot()  # b0000002 queued
    world.requeue_letters()
    world.take(world.engines[ENGINES[0]])  # b0000002 taken, and left
    _finish(world)  # the requeue's batch, written
    requeued = sorted(truth.marker_batches(world.store, JOB) - {"b0000001"})
    world.restore()
    world.start(world.engines[ENGINES[0]])
    world.compare()  # the requeue's written batch adopted
    _finish(world, letter=True)  # b0000002: its prompt a letter
    world.requeue_letters()
    world.drain()
    assert world.status() == "done", (requeued, ledger_jobs.counts(world.conn, JOB),
                                      world.conn.zrange(keys.job_batches(JOB), 0, -1))


def test_a_superseded_holder_writes_no_shard_a_rollback_would_leave_behind(tmp_path: Path) -> None:
    """The worker's Batches.write_and_release: holder A is superseded (its batch queued again while it was slow,
    and leased to B, who has not claimed yet), A's answers come and are recorded, and A goes on to write the
    shard. Redis is then restored from between B's lease and A's records: B, holding the current lease, claims
    the prompts and generates them again though their outcomes are written. A superseded holder writes no
    shard (the current holder does, from what Redis holds), so a rollback leaves no marker behind its lease."""

    world = _world(tmp_path)
    slow, other = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(slow)
    (batch, hold), = slow.holds.items()
    world.work(slow, batch)  # A claims and sends both prompts
    world.deliver(other, batch)  # B leased it, not claimed yet
    world.take_snapshot()
    world.work(slow, batch)  # A's answers recorded
    assert not _worker_completes(world, batch, hold, hold.token)
    world.restore()
    world.work(other, batch)  # B claims: Broken if what it generates is written already


def test_a_holder_back_after_a_gap_looks_for_its_batches_in_the_output(tmp_path: Path) -> None:
    """The worker's Batches.check_leases: holder A frozen (or cut off from Redis) past its lease; the batch
    went to B, who wrote and released it; Redis was then restored from before B's lease, so A's lease is the
    current one again and no outcome is stored. A's first lease check after the gap passes: unless it looks
    at the output, A claims the batch's prompts and generates them again, though every outcome is written."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.worker import batches
    from genq.worker.controller import Running
    from genq.worker.held import HeldBatch, Holdings

    world = _world(tmp_path)
    frozen, other = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(frozen)
    (batch, hold), = frozen.holds.items()
    world.take_snapshot()
    world.freeze(frozen)
    world.deliver(other, batch)
    for _ in range(4):  # claim, record, write, release
        if batch in other.holds:
            world.work(other, batch)
    assert truth.read_marker(world.store, truth.marker_rel(JOB, batch)) is not None
    world.restore()
    world.wake(frozen)
    ref = BatchRef(JOB, batch)

    async def check(borrowed: bool) -> bool:
        conn = aioredis.Redis.from_url(REDIS_URL)
        held = Holdings()
        taken = HeldBatch(ref, "" if borrowed else hold.token, hold.config, unfinished={p.id for p in hold.prompts},
                          borrowed=borrowed, prompts=hold.prompts)
        (held.borrowed if borrowed else held)[ref] = taken
        owner = batches.Batches(conn, world.conn, "w", frozen.instance, held, Running())
        try:
            await owner.check_leases()
            return ref in held or ref in held.borrowed
        finally:
            owner.close()
            await conn.aclose()

    assert not asyncio.run(check(borrowed=False)), "still held: its prompts would be claimed and generated again"
    assert world.conn.sismember(keys.job_done(JOB), batch)
    world.restore()  # again: a stealer of its prompts (their claims its own under A's lease) is back too
    assert not asyncio.run(check(borrowed=True)), "still borrowed: its prompts would be sent again"


def test_a_lease_a_rollback_gives_back_to_a_live_engine_that_let_go_is_queued_again(tmp_path: Path) -> None:
    """The worker's Batches.check_leases after a Redis restart: holder A frozen past its lease, the batch queued
    again and leased to B, A wakes and lets it go. Redis is then restored from before B's lease: the lease is A's
    again, its RQ job started under A, who is alive but holds nothing of it, and B lets it go (not its lease).
    The reconciler sees it carried (a live engine, its lease): unless A gives back the leases Redis says it
    holds and it does not, nobody runs the batch for as long as A runs, and the job never ends."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.worker import batches
    from genq.worker.controller import Running
    from genq.worker.held import Holdings

    world = _world(tmp_path)
    a, b = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(a)
    (batch, _), = a.holds.items()
    world.take_snapshot()
    world.freeze(a)
    world.deliver(b, batch)
    world.wake(a)
    world.beat(a)
    world.restore()
    world.beat(b)
    assert batch not in a.holds and batch not in b.holds

    async def check() -> None:
        conn = aioredis.Redis.from_url(REDIS_URL)
        owner = batches.Batches(conn, world.conn, "w", a.instance, Holdings(), Running())
        try:
            await owner.check_leases(restarted=True)
        finally:
            owner.close()
            await conn.aclose()

    asyncio.run(check())
    world.reconcile()
    for _ in range(2):  # the queue's head is the other batch
        world.take(b)
    assert batch in b.holds, "nobody holds the batch, and nothing queues it again while its old holder runs"


def test_prompts_claimed_under_a_lease_their_holder_renewed_are_not_stolen_while_it_sends_them(
        tmp_path: Path) -> None:
    """The worker's Todo.check_claims: holder A claimed its batch's first prompt (not sent yet) under lease L1; the
    batch was queued again (A's alive key lapsed: frozen, or Redis away longer than a lease) and A itself took it again,
    L2 driving it now (Batches.renewed). Claims under L1 are void under L2: an idle engine at the end of the job
    steals them while A sends them too, one generation wasted each. After a beat, every prompt A is about to send
    is claimed under its current lease."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.worker.held import Claims, HeldBatch, Task, Todo

    world = _world(tmp_path)
    a, c = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(a)
    (batch, hold), = a.holds.items()
    ref, ids = BatchRef(JOB, batch), [p.id for p in hold.prompts]

    async def go() -> set[str]:
        conn = aioredis.Redis.from_url(REDIS_URL)
        try:
            held = HeldBatch(ref, hold.token, hold.config, unfinished=set(ids), prompts=hold.prompts)
            todo = Todo(Claims(conn, a.instance), lambda *args: None)
            assert (await todo.claims.claim(held, ids[:1]) or ("",))[0] == "c"  # the next one not claimed yet
            todo.ready.append(Task(hold.prompts[0], held))
            world.deliver(a, batch)  # queued again, and taken again by A: the newest lease drives it
            held.token = a.holds[batch].token
            await todo.check_claims()  # A's next beat
            stolen, _ = await Claims(conn, c.instance).steal(ref, hold.config.incarnation, a.instance, ids[::-1], 9)
            return set(stolen) & {t.prompt.id for t in todo.claimed()}
        finally:
            await conn.aclose()

    assert not asyncio.run(go()), "stolen while its holder sends them too"


def test_results_redis_lost_after_they_were_recorded_are_recorded_again_not_generated(tmp_path: Path,
                                                                                       monkeypatch) -> None:
    """The worker's ResultWriter and Batches: every result of a held batch recorded, then Redis rolled back to before
    one of them (a restart from an older snapshot, a lagging replica promoted) as the shard is about to be built.
    The holder has that result in hand: it is recorded again, not sent to the server again (a GPU-hour twice)."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.core.ledger import leasing
    from genq.worker import batches
    from genq.worker.controller import Running
    from genq.worker.held import HeldBatch, Holdings

    world = _world(tmp_path)
    engine = world.engines[ENGINES[1]]
    world.take(engine)
    (batch, hold), = engine.holds.items()
    ref, lost = BatchRef(JOB, batch), hold.prompts[0].id
    results = [Result(id=p.id, job=JOB, batch=batch, index=p.index, completion=f"{p.id} once", finish_reason="stop",
                      usage=Usage(prompt_tokens=3, completion_tokens=4), model="m", worker=engine.instance,
                      attempts=1, latency_s=0.1, finished_at=time.time(),
                      settings_version=hold.config.settings_version) for p in hold.prompts]
    real = leasing.stored_outcomes

    async def rolled_back(conn, ref_, ids):
        monkeypatch.setattr(leasing, "stored_outcomes", real)  # once
        world.conn.hdel(keys.batch_results(JOB, batch), lost)
        return await real(conn, ref_, ids)

    monkeypatch.setattr(leasing, "stored_outcomes", rolled_back)

    async def go() -> list[str]:
        conn = aioredis.Redis.from_url(REDIS_URL)
        held = Holdings()
        held[ref] = HeldBatch(ref, hold.token, hold.config, unfinished={p.id for p in hold.prompts},
                              prompts=hold.prompts)
        owner = batches.Batches(conn, world.conn, "w", engine.instance, held, Running())
        writer = asyncio.create_task(owner.writer.run())
        try:
            for r in results:
                owner.writer.add_result(r, hold.config.incarnation)
            while ref in held and not owner.todo.waiting:
                await asyncio.sleep(0.05)
            return [t.prompt.id for tasks in owner.todo.waiting.values() for t in tasks]
        finally:
            writer.cancel()
            owner.close()
            await conn.aclose()

    again = asyncio.run(go())
    assert not again, f"{again} would be generated again: this engine recorded their results"
    assert world.conn.sismember(keys.job_done(JOB), batch)


def test_prompts_in_flight_when_their_holder_takes_their_batch_again_are_not_stolen(tmp_path: Path) -> None:
    """The worker's Batches.renewed: holder A sent its batch's first prompt under lease L1; the batch was queued again
    (A's alive key lapsed) and A itself took it again, L2 driving it now. The claim under L1 is void under L2: an
    idle engine at the end of the job steals the prompt while A's request for it is still running."""
    import asyncio

    import redis.asyncio as aioredis

    from genq.worker import batches
    from genq.worker.controller import Running
    from genq.worker.held import Claims, HeldBatch, Holdings, Task

    world = _world(tmp_path)
    a, c = world.engines[ENGINES[0]], world.engines[ENGINES[1]]
    world.take(a)
    (batch, hold), = a.holds.items()
    ref, ids = BatchRef(JOB, batch), [p.id for p in hold.prompts]

    async def go() -> dict[str, int]:
        conn = aioredis.Redis.from_url(REDIS_URL)
        held = Holdings()
        taken = held[ref] = HeldBatch(ref, hold.token, hold.config, unfinished=set(ids), prompts=hold.prompts)
        owner = batches.Batches(conn, world.conn, "w", a.instance, held, Running())
        try:
            assert (await owner.claims.claim(taken, ids[:1]) or ("",))[0] == "c"
            owner.running[Task(hold.prompts[0], taken)] = asyncio.current_task()  # its request is out
            world.deliver(a, batch)  # queued again, and taken again by A
            assert await owner.renewed(ref, a.holds[batch].token, hold.config)
            stolen, _ = await Claims(conn, c.instance).steal(ref, hold.config.incarnation, a.instance, ids[::-1], 9)
            return stolen
        finally:
            owner.close()
            await conn.aclose()

    assert ids[0] not in asyncio.run(go()), "stolen while its holder's request for it runs"
