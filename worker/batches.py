"""The life of every batch this engine holds, from TAKE (worker/intake.py) to its end; one owner, `Batches`.

    taken --load--> arrived --admitted (worker/gate.py)--> sending --every prompt has an outcome-->
      completing --shard written, RELEASE--> done      (outcomes lost from Redis: sending again)
      |--lease no longer ours (done elsewhere, leased again, job gone)--> let go
      |--handed back (stopping, server gone or changed model, input unreadable)--> queued
      |--its job blocked or paused--> parked (lease ended, no RQ job: `genq resume --job` queues it)

The newest lease drives a batch (docs/exactly-once.md). A shard is built from what Redis recorded, never from
memory (every holder builds the same bytes), once Redis holds every prompt's outcome; RELEASE checks it again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis

from genq.core import scripts
from genq.core.ledger import fleet, leasing
from genq.core.records import BatchRef, BatchSource, DeadLetter, JobConfig, Prompt, Result, unpack, with_prompt
from genq.core.timings import LEASE_CHECK_STALE_S
from genq.core.waits import retrying
from genq.core.words import plural
from genq.ops.recover import adopt_if_written, adopt_marker, outcome_for, written_marker
from genq.output.truth import AlreadyWritten, commit_shard, open_store, shard_bytes
from genq.producer.sources import InputChanged, read_prompts
from genq.worker.controller import Running
from genq.worker.held import Claims, HeldBatch, Holdings, Task, Todo
from genq.worker.results import ResultWriter
from genq.worker.server import Failure

log = logging.getLogger("genq.worker")

LOAD_TRIES = 4  # reads of a batch's input (S3, a shared path) before the batch is handed back
SHARD_THREADS = 4
SHORT_TRIES = 3  # RELEASE refusing a shard that is not every stored result, this often in a row: let go


class Batches:
    def __init__(self, conn: aioredis.Redis, sync_conn: redis.Redis, worker: str, instance: str, held: Holdings,
                 running: Running, backoff: tuple[float, float] = (1.0, 60.0)) -> None:
        self.conn, self.sync_conn = conn, sync_conn  # sync: RQ's enqueue (the hand-back)
        self.worker, self.instance, self.held, self.running = worker, instance, held, running
        self.claims = Claims(conn, instance)
        self.writer = ResultWriter(conn, worker, self)  # tells on_written
        self.todo = Todo(self.claims, self.on_written)
        self.arrived: asyncio.Queue[tuple[HeldBatch, list[Prompt]]] = asyncio.Queue()  # the gate admits them
        self.completed = self.handed_back = 0
        self.completions: set[asyncio.Task[None]] = set()
        # Shards that cannot be written now (disk full, S3 down), and why: retried; nothing new of their jobs taken.
        self.unwritten: dict[BatchRef, str] = {}
        self._backoff = backoff  # worker --retry-backoff, --retry-backoff-max
        self.written_again = asyncio.Event()  # a shard written after failing: the intake looks again now
        self._pool = ThreadPoolExecutor(SHARD_THREADS, thread_name_prefix="genq-shard")
        self._release = conn.register_script(scripts.RELEASE)
        self._leases_checked_at = float("-inf")  # the last lease check that ran whole (monotonic)

    async def renewed(self, ref: BatchRef, token: str, config: JobConfig | None) -> bool:
        """A batch taken again while held: True if `token`, the newest lease, now drives it. Its prompts in flight
        are claimed under it: their claims under the older lease are void, an idle engine would steal them."""
        current = self.held.get(ref)
        if current is None or current.dropped:
            return False
        if config is not None and current.config.incarnation == config.incarnation:
            log.debug("batch %s taken again; lease %s replaces %s", ref, token, current.token)
            current.token = token
            await self.claims.claim(current, [t.prompt.id for t in self.running if t.batch is current])
            return True
        current.dropped = True  # a batch of a deleted job under the same name: nothing more of it is sent
        return False

    async def load(self, token: str, ref: BatchRef, config: JobConfig | None) -> None:
        """A batch TAKE leased here (`config` None: its job is gone): what Redis recorded of it is not sent again."""
        raw = await leasing.batch_record(self.conn, ref)
        if config is None or raw is None:
            return  # the job was deleted meanwhile: its lease goes with it
        if await adopt_if_written(self.conn, config, ref):  # written before Redis lost it
            return
        source = unpack(raw, BatchSource)
        ids = source.prompt_ids()
        finished = await leasing.outcome_ids(self.conn, ref, ids, transaction=True)
        unfinished = {i for i in ids if i not in finished}
        prompts, changed = [], None
        try:  # finished ones too: the shard joins each result with its prompt
            prompts = await self._read(source, config)
        except InputChanged as exc:
            changed = (f"{exc}. To run them: restore the input (or fix it), `genq dlq purge --job {ref.job}`, "
                       "enqueue it again")
        except Exception as exc:  # the input is unreachable (S3 down): another try, later or elsewhere
            log.warning("batch %s: cannot read its input (%s: %s); handing it back", ref, type(exc).__name__, exc)
            await self.hand_back(ref, token)
            return
        held = self.held[ref] = HeldBatch(ref, token, config, unfinished=unfinished, prompts=prompts, ids=ids)
        if finished:
            log.info("batch %s: %d of %s already done, not regenerating them", ref, len(finished),
                     plural(len(ids), "prompt"))
        if changed is not None and unfinished:
            log.error("batch %s: %s; its %d unfinished prompts go to the dead-letter queue", ref, changed,
                      len(unfinished))
            for prompt_id in sorted(unfinished):
                self.writer.add_dead(DeadLetter(id=prompt_id, job=ref.job, batch=ref.batch, attempts=0,
                                                kind="input_changed", message=changed, worker=self.worker,
                                                at=time.time()), config.incarnation)
            return
        self.arrived.put_nowait((held, [p for p in prompts if p.id in unfinished]))

    async def _read(self, source: BatchSource, config: JobConfig) -> list[Prompt]:
        for attempt in range(LOAD_TRIES - 1):
            try:
                return await asyncio.to_thread(read_prompts, source, config)
            except InputChanged:
                raise
            except Exception as exc:
                log.warning("batch %s/%s: reading its input failed (%s: %s); retrying", source.job, source.id,
                            type(exc).__name__, exc)
                await asyncio.sleep(min(0.5 * 2 ** attempt, 8))
        return await asyncio.to_thread(read_prompts, source, config)

    def send(self, held: HeldBatch, prompts: list[Prompt]) -> None:
        """An admitted batch's prompts go to dispatch; those borrowed of it before are the lease's now."""
        borrowed = self.held.borrowed.pop(held.ref, None)
        adopted = set() if borrowed is None else self.todo.adopt(borrowed, held, iter(self.running))
        self.todo.add(held, [p for p in prompts if p.id not in adopted])

    def dead(self, task: Task, failure: Failure) -> None:
        held, attempts = task.batch, task.lost + task.attempts
        log.warning("prompt %s/%s to the dead-letter queue after %d attempt(s): %s%s: %s", held.ref.job,
                    task.prompt.id, attempts, failure.kind, f" {failure.status}" if failure.status else "",
                    failure.message)
        self.writer.add_dead(DeadLetter(
            id=task.prompt.id, job=held.ref.job, batch=held.ref.batch, attempts=attempts, kind=failure.kind,
            message=failure.message, worker=self.worker, at=time.time(), status=failure.status, prompt=task.prompt,
        ), held.config.incarnation)

    def drop(self, held: HeldBatch, *, cancel: bool) -> list[str]:
        """Send nothing more of it (`cancel`: requests in flight stop); the ids claimed here and not sent."""
        held.dropped = True
        unsent = self.todo.remove_batch(held)
        if cancel:
            for task, aio in list(self.running.items()):
                if task.batch is held:
                    aio.cancel()
        return unsent

    def on_written(self, job: str, batch: str, ids: list[str], results: list[Result] | None = None) -> None:
        """Outcomes recorded, by this engine (its `results`) or (lent prompts) another one."""
        ref = BatchRef(job, batch)
        held = self.held.get(ref)
        if held is None:  # borrowed prompts (worker/intake.py): their holder writes the shard
            if (borrowed := self.held.borrowed.get(ref)) is not None:
                borrowed.unfinished.difference_update(ids)
                if not borrowed.unfinished:
                    self.held.borrowed.pop(ref)
            return
        held.unfinished.difference_update(ids)
        held.recorded.update((r.id, r) for r in results or [])
        if not held.unfinished and not held.completing and not held.dropped:
            held.completing = True
            task = asyncio.create_task(self._complete(held))
            self.completions.add(task)
            task.add_done_callback(self.completions.discard)

    async def _complete(self, held: HeldBatch) -> None:
        missing = await self.write_and_release(held)
        if not missing:
            self.held.forget(held)
            self.todo.wake.set()
            return
        # Outcomes lost from Redis (a rollback): results recorded here are recorded again; the rest sent again.
        held.completing = False
        again = [held.recorded[i] for i in missing if i in held.recorded]
        missing -= {r.id for r in again}
        log.warning("batch %s: %s no outcome in Redis (lost from it?): %d recorded again from memory, %d sent again",
                    held.ref, plural(len(missing) + len(again), "prompt has", "prompts have"), len(again), len(missing))
        held.unfinished |= {r.id for r in again}
        for result in again:
            self.writer.add_result(result, held.config.incarnation)
        if not missing:
            return
        if not held.prompts:  # its input could not be read: the next delivery dead-letters them again
            self.drop(held, cancel=True)
            await retrying(functools.partial(self.hand_back, held.ref, held.token), f"handing back {held.ref}")
            self.held.forget(held)
            return
        held.unfinished |= missing
        self.todo.add(held, [p for p in held.prompts if p.id in missing])

    async def write_and_release(self, held: HeldBatch) -> set[str]:
        """Write the shard and release the batch once Redis holds every prompt's outcome; else those without one."""
        ref = held.ref
        for _ in range(SHORT_TRIES):
            recorded = await retrying(lambda: self._recorded(held), f"reading batch {ref}")
            if recorded is None:
                return set()
            # Outcomes gone (a rollback) before or while the shard was built: a shard written meanwhile (by any
            # holder) is the batch's outcome, and none of its prompts is generated again.
            if recorded.missing:
                return set() if await self._adopt_written(held) else recorded.missing
            released = await self._write(held, recorded)
            if released != "short":
                self.completed += released == 1
                return set()
            if await self._adopt_written(held):
                return set()
            log.warning("batch %s: Redis changed while its shard was written; reading it again", ref)
        # Never marked done short: the batch is let go, and the reconciler queues it again.
        log.error("batch %s: Redis never held exactly the shard's results; letting the batch go", ref)
        return set()

    async def _adopt_written(self, held: HeldBatch) -> bool:
        """True if the output holds the batch's marker of this life (the batch then marked done from it)."""
        try:
            marker = await asyncio.get_running_loop().run_in_executor(self._pool, written_marker, held.config,
                                                                      held.ref)
        except Exception as exc:  # the output unreachable now: read Redis again instead
            log.warning("batch %s: cannot read its marker (%s: %s)", held.ref, type(exc).__name__, exc)
            return False
        if marker is None:
            return False
        adopting = functools.partial(adopt_marker, self.conn, held.ref, marker)
        self.completed += bool(await retrying(adopting, f"adopting batch {held.ref}"))
        return True

    async def _write(self, held: HeldBatch, recorded: _Recorded) -> int | str:
        """The shard, then RELEASE's answer (genq/core/scripts/release.lua)."""
        ref, results, letters, config = held.ref, recorded.results, recorded.letters, held.config
        at = max([r.finished_at for r in results] + [d.at for d in letters], default=0.0)  # the same for every writer
        loop = asyncio.get_running_loop()
        data = await loop.run_in_executor(self._pool, shard_bytes, results, config.compression)
        write = functools.partial(commit_shard, open_store(config.output, config.s3_endpoint_url), ref.job, ref.batch,
                                  data, len(results), at, compression=config.compression,
                                  incarnation=config.incarnation,
                                  outcome=outcome_for(held.prompts, results, letters, recorded.size))
        backoff, backoff_max = self._backoff
        try:
            while True:
                try:
                    info = await loop.run_in_executor(self._pool, write)
                    break
                except AlreadyWritten as written:  # the output's shard of this batch stands
                    adopting = functools.partial(adopt_marker, self.conn, ref, written.marker)
                    return int(await retrying(adopting, f"adopting batch {ref}"))
                except Exception as exc:  # the output's own errors (disk full, S3 down): keep trying
                    self.unwritten[ref] = str(exc) or type(exc).__name__
                    log.warning("batch %s: writing shard failed (%s: %s); results stay in Redis, retrying in %.2gs",
                                ref, type(exc).__name__, exc, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, backoff_max)
        finally:
            if self.unwritten.pop(ref, None) is not None:
                self.written_again.set()
        call = scripts.release_call(ref, info, config.incarnation, recorded.stored, [d.id for d in letters])
        answer = await retrying(lambda: self._release(*call), f"releasing batch {ref}")
        return answer.decode() if isinstance(answer, bytes) else int(answer)

    async def _recorded(self, held: HeldBatch) -> _Recorded | None:
        """What Redis recorded of the batch, in one transaction; None once it is done, its job gone, or its
        lease not this holder's."""
        ref = held.ref
        by_id = {p.id: p for p in held.prompts}
        ids = list(by_id) or held.ids
        now = await leasing.stored_outcomes(self.conn, ref, ids)
        if now.done or not now.record or not now.config:
            return None
        if unpack(now.config, JobConfig).incarnation != held.config.incarnation:
            return None  # the job was deleted and enqueued again: nothing of this one is written
        if now.lease != held.token:
            # The current holder writes it: a superseded holder's shard could outlive, in a Redis restored from
            # before these outcomes, the lease that then generates its prompts again.
            log.info("batch %s was leased again elsewhere: its holder writes the shard, not this engine", ref)
            return None
        wanted = set(ids)
        found = [(r, v) for r, v in ((unpack(v, Result), v) for v in now.results) if r.id in wanted]
        stored = {r.id: v for r, v in found}
        results = [with_prompt(r, by_id[r.id]) if r.id in by_id else r for r, _ in found]
        letters = [unpack(v, DeadLetter) for v in now.letters if v is not None]
        return _Recorded(results, letters, len(ids), wanted - set(stored) - {d.id for d in letters}, stored)

    def unwritten_jobs(self) -> frozenset[str]:
        return frozenset(ref.job for ref in self.unwritten)

    def unwritten_note(self) -> str | None:
        """What the worker's status says of shards it cannot write: the cause first (`genq workers` cuts at 60)."""
        if not self.unwritten:
            return None
        why = next(reversed(self.unwritten.values()))
        return (f"cannot write shards: {why} ({plural(len(self.unwritten), 'batch', 'batches')}; "
                "their results stay in Redis, retrying; taking no new batch of their jobs)")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def check_leases(self, restarted: bool = False) -> None:
        """After each heartbeat: let go of batches leased elsewhere (requests in flight finish) or of jobs gone.
        After a gap longer than a lease survives or a Redis restart (`restarted`), a batch still ours is looked
        for in the output too: it may have been leased elsewhere and written, then Redis restored from before."""
        away = restarted or time.monotonic() - self._leases_checked_at > LEASE_CHECK_STALE_S
        mine = [h for h in self.held.values() if not h.dropped and not h.completing]
        states = await leasing.lease_states(self.conn, [h.ref for h in mine]) if mine else []
        for held, (incarnation, done, token) in zip(mine, states):
            gone = written = incarnation != held.config.incarnation
            if gone:
                log.info("batch %s: its job was deleted (or enqueued again as a new job): dropping it", held.ref)
            elif done or token != held.token:
                log.info("batch %s %s elsewhere: dropping it here", held.ref,
                         "was completed" if done else "was leased again")
            elif away and (written := await adopt_if_written(self.conn, held.config, held.ref)):
                log.info("batch %s was written to the output while this engine was away: dropping it", held.ref)
            else:
                continue
            unsent = self.drop(held, cancel=written)
            self.held.forget(held)
            await self.claims.unclaim(held, unsent)
        for borrowed in [b for b in self.held.borrowed.values() if away and not b.dropped]:  # the same, for them
            if await adopt_if_written(self.conn, borrowed.config, borrowed.ref):
                log.info("batch %s was written to the output while this engine was away: its borrowed prompts "
                         "are not sent", borrowed.ref)
                self.drop(borrowed, cancel=True)
                self.held.forget(borrowed)
        # Leases Redis says are this engine's and it does not hold (a restored Redis, or a lagging replica promoted,
        # gives back one it let go of since): queued again, else the reconciler counts them carried by this engine.
        for ref, token in await leasing.leases_of(self.conn, self.instance) if away else []:
            if ref not in self.held and await self.hand_back(ref, token):
                log.info("batch %s: leased to this engine in a restored Redis, not held here: queued again", ref)
        await self.todo.check_claims()
        self._leases_checked_at = time.monotonic()
        for held in list(self.held.values()):  # completes any whose every outcome is recorded
            self.on_written(held.ref.job, held.ref.batch, [])

    async def hand_back(self, ref: BatchRef, token: str) -> bool:
        """Queue the batch again, at the front; False if it was done or no longer ours."""
        return await asyncio.to_thread(leasing.end_lease, self.sync_conn, ref, token, requeue=True) is not None

    async def hand_back_all(self, why: str) -> None:
        await self.give_back_borrowed(why)
        given = await self._let_go([h for h in self.held.values() if not h.completing], cancel=True, requeue=True)
        self.handed_back += len(given)
        if given:
            log.info("%s: handed back %s (%s)", why, plural(len(given), "batch", "batches"), ", ".join(given))

    async def give_back_borrowed(self, why: str) -> None:
        """Borrowed prompts go back to their holders (what was recorded stays); idle workers hear."""
        borrowed = list(self.held.borrowed.values())
        if not borrowed:
            return
        log.info("%s: giving %s back to their holders", why,
                 plural(sum(len(b.unfinished) for b in borrowed), "borrowed prompt"))
        await self._let_go(borrowed, cancel=True, requeue=True)
        try:
            await fleet.wake_for_work(self.conn)
        except (redis.RedisError, OSError) as exc:
            log.debug("wake-up not sent: %s", exc)

    async def let_go_job(self, job: str, *, cancel: bool, requeue: bool) -> list[str]:
        """The job's batches parked (leases ended, no RQ job) or, `requeue`, back to the queue's front, its borrowed
        prompts to their holders; the batches let go. Those completing or dropped are left out: a let-go under way
        (a paused job's park waiting on its requests in flight) ends them, and a second must not wait on them."""
        return await self._let_go([h for table in (self.held.borrowed, self.held) for h in table.values()
                                   if h.ref.job == job and not h.completing and not h.dropped],
                                  cancel=cancel, requeue=requeue)

    async def _let_go(self, batches: list[HeldBatch], *, cancel: bool, requeue: bool) -> list[str]:
        """Send nothing more of these batches, write what was recorded, drop their claims and end each lease
        (`requeue`: to the queue's front, else parked); the batches whose lease it ended."""
        for batch in batches:
            self.drop(batch, cancel=cancel)
        while any(t.batch in batches for t in self.running):
            await asyncio.sleep(0.05)
        await self.writer.wait_idle()  # what was recorded is written: it stays
        ended = []
        for h in batches:
            if h.completing:
                continue  # the flush above finished it
            await retrying(functools.partial(self.claims.unclaim, h), f"releasing claims of {h.ref}")
            if not h.borrowed:
                end = functools.partial(asyncio.to_thread, leasing.end_lease, self.sync_conn, h.ref, h.token,
                                        requeue=requeue)
                if (how := await retrying(end, f"ending the lease of {h.ref}")) == "queued" and not requeue:
                    log.info("batch %s: its job was resumed while its requests finished: queued again, not parked",
                             h.ref)
                elif how is not None:
                    ended.append(str(h.ref))
            self.held.forget(h)
        self.todo.wake.set()
        return ended


@dataclass
class _Recorded:
    results: list[Result]
    letters: list[DeadLetter]
    size: int  # the batch's prompt count
    missing: set[str]  # prompts of the batch with no outcome in Redis
    stored: dict[str, bytes]  # the results as stored (id -> packed): RELEASE checks Redis still holds these
