"""The dispatcher's in-flight window against its claims (worker/dispatch.py), with a server and
a Redis that answer when the test says: which request ends, and what a CLAIM call returns."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from genq.core.records import BatchRef, Choice, JobConfig, Prompt, Usage
from genq.worker.controller import Running
from genq.worker.dispatch import Dispatcher, claim_ahead, claim_step
from genq.worker.held import HeldBatch, Todo
from genq.worker.options import WorkerOptions
from genq.worker.server import Completion, Failure

TARGET = 8


class Server:
    """Each request waits until the test ends it."""

    def __init__(self, n: int = 1) -> None:
        self.waiting: dict[str, asyncio.Future[None]] = {}
        self.n = n  # choices a request gets (the request's n)

    async def generate(self, endpoint: str, body: dict, progress: object) -> Completion:
        prompt = body["prompt"]
        self.waiting[prompt] = asyncio.get_running_loop().create_future()
        await self.waiting[prompt]
        return Completion([Choice(i, "ok", "stop") for i in range(self.n)], Usage(1, 1), "m", None)

    def end(self) -> None:
        prompt = next(p for p, f in self.waiting.items() if not f.done())
        self.waiting[prompt].set_result(None)


class Claims:
    """CLAIM claims every prompt asked for; each call is recorded with what was in flight then."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (prompts asked for, sequences in flight)
        self.in_flight = lambda: 0

    async def claim(self, held: HeldBatch, ids: list[str]) -> tuple[str, dict[int, int]]:
        self.calls.append((len(ids), self.in_flight()))
        return "c" * len(ids), {}


def todo_of(held: HeldBatch, n: int, claims: Claims) -> Todo:
    """The held batch's n prompts, none claimed yet."""
    todo = Todo(claims, lambda *a: None)  # type: ignore[arg-type]
    todo.add(held, [Prompt(id=f"p{i}", index=i, prompt=f"p{i}") for i in range(n)])
    return todo


def server_up() -> SimpleNamespace:
    """The watch of a server that is up and serves model m."""
    return SimpleNamespace(down=False, failing=False, failed_at=0.0, outages=0, model="m",
                           is_down=lambda: asyncio.sleep(0, False))


def open_gate() -> SimpleNamespace:
    """Nothing paused or blocked, the leases just checked, nothing braked."""
    return SimpleNamespace(paused_all=False, leases_fresh=lambda: True, why_not=lambda job: None,
                           succeeded=lambda task: None)


def dispatcher(server: Server, todo: Todo) -> Dispatcher:
    """A dispatcher of TARGET slots over `todo`, recording nothing, braking nothing."""
    batches = SimpleNamespace(todo=todo, running=Running(), dead=None, writer=SimpleNamespace(
        worker="w", add_result=lambda result, incarnation: None))
    watch = server_up()
    watch.controller, watch.stopping = SimpleNamespace(target=TARGET), SimpleNamespace(requested=0)
    return Dispatcher(WorkerOptions(redis_url="", server_url="", stream=False), server,  # type: ignore[arg-type]
                      batches, watch, open_gate())  # type: ignore[arg-type]


async def settle() -> None:
    """Lets the dispatcher act on what just happened: no real I/O here, so a few loop turns."""
    for _ in range(20):
        await asyncio.sleep(0)


def test_claims_are_taken_ahead_while_the_window_is_full():
    """A slot that frees is refilled from prompts claimed ahead, and the next group is claimed
    while some are left: the window never waits on a CLAIM round trip while the batch has
    prompts left. The claims were taken only once a slot was free (the claim's condition was
    that a request could be sent now), so the prompts claimed ahead ran out every few ends and
    the next request waited for a CLAIM."""
    held = HeldBatch(BatchRef("j", "b0000001"), "t", JobConfig(name="j", output="/tmp", model="m"), set())
    claims = Claims()
    server = Server()
    group, slack = claim_ahead(TARGET), claim_step(TARGET)

    async def go() -> None:
        d = dispatcher(server, todo_of(held, 40, claims))
        claims.in_flight = lambda: d.running.sequences
        runner = asyncio.create_task(d.run())
        d.wake.set()
        await settle()
        assert d.running.sequences == TARGET and slack <= len(d.todo.ready) <= group + slack
        for _ in range(4 * group):
            server.end()
            await settle()
            assert d.running.sequences == TARGET  # refilled at once
            assert slack <= len(d.todo.ready) <= group + slack, claims.calls  # and claimed ahead again
        # After the first, each claim a whole group, taken with the window full.
        assert claims.calls[1:] == [(group, TARGET)] * 4, claims.calls
        runner.cancel()
        for aio in list(d.running.values()):
            aio.cancel()
        await asyncio.gather(runner, *d.running.values(), return_exceptions=True)

    asyncio.run(go())


@pytest.mark.parametrize("n", [4, 16])
def test_claims_count_sequences_when_each_prompt_asks_for_n_samples(n: int):
    """With n = 4 each prompt is 4 sequences on the server: what is claimed beyond the window is
    at most claim_ahead + claim_step sequences, not that many prompts. The old rule subtracted
    sequences in flight from a count of prompts: with an empty window it claimed 11 prompts
    (44 sequences) at a target of 8, prompts an idle worker could have stolen at a job's end.
    A prompt of more sequences than the target (n = 16) is still sent, one at a time."""
    config = JobConfig(name="j", output="/tmp", model="m", extra_body={"n": n})
    held = HeldBatch(BatchRef("j", "b0000001"), "t", config, set())
    claims = Claims()
    server = Server(n)
    bound = max(n, TARGET + claim_ahead(TARGET) + claim_step(TARGET))  # sequences in flight + claimed ahead
    window = -(-TARGET // n) * n  # whole prompts up to the target: 2 of 4, or 1 of 16

    async def go() -> None:
        d = dispatcher(server, todo_of(held, 40, claims))
        runner = asyncio.create_task(d.run())
        d.wake.set()
        await settle()
        for _ in range(6):
            assert d.running.sequences == window, claims.calls
            held_here = d.running.sequences + n * (len(d.todo.ready) + len(d.todo.suspects))
            assert held_here <= bound, (held_here, claims.calls)
            server.end()
            await settle()
        runner.cancel()
        for aio in list(d.running.values()):
            aio.cancel()
        await asyncio.gather(runner, *d.running.values(), return_exceptions=True)

    asyncio.run(go())


@pytest.mark.parametrize("status, message", [(429, "Too Many Requests"), (503, "The request queue is full.")])
def test_a_prompt_refused_as_too_many_is_never_dead_lettered(status: int, message: str):
    """429 and 503 say the server is too busy, not that the prompt is wrong: a prompt refused so more
    often than its attempts allow, while the server answers the others, is retried until it is
    answered, each try counted in its record, and the refusals spend none of its --max-attempts (a 500
    after them is its first failure). It was dead-lettered as a server_error at its last attempt: the
    others' answers read as evidence against it."""
    held = HeldBatch(BatchRef("j", "b0000001"), "t", JobConfig(name="j", output="/tmp", model="m", max_attempts=2),
                     set())
    failures = [Failure("server_error", message, status)] * 5 + [Failure("server_error", "Internal", 500)]
    results: dict[str, int] = {}
    dead: list[tuple[str, Failure]] = []

    class Busy:
        async def generate(self, endpoint: str, body: dict, progress: object) -> Completion | Failure:
            await asyncio.sleep(0.001)
            if body["prompt"] == "p0" and failures:
                return failures.pop(0)
            return Completion([Choice(0, "ok", "stop")], Usage(1, 1), "m", None)

    async def go() -> None:
        d = dispatcher(Busy(), todo_of(held, 20, Claims()))  # type: ignore[arg-type]
        d.opts.retry_backoff, d.opts.retry_backoff_max = 0.01, 0.02
        d.writer.add_result = lambda result, incarnation: results.__setitem__(result.id, result.attempts)
        d.batches.dead = lambda task, failure: dead.append((task.prompt.id, failure))
        runner = asyncio.create_task(d.run())
        d.wake.set()
        async with asyncio.timeout(10):
            while len(results) + len(dead) < 20:
                await asyncio.sleep(0.01)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)

    asyncio.run(go())
    assert not dead, dead
    assert results["p0"] == 7, results


@pytest.mark.parametrize("asked, waited", [(5.0, 5.0), (3600.0, 20.0)])
def test_a_retry_after_is_waited_for_up_to_the_backoffs_cap(asked: float, waited: float):
    """A 503 (or 429) with Retry-After: the retry is due no sooner than the server asked, and no later
    than --retry-backoff-max (20 s here) however long it asked. It was due at the backoff (0.01 s here)."""
    held = HeldBatch(BatchRef("j", "b0000001"), "t", JobConfig(name="j", output="/tmp", model="m"), set())

    class Busy:
        async def generate(self, endpoint: str, body: dict, progress: object) -> Failure:
            return Failure("server_error", "The request queue is full.", 503, retry_after=asked)

    async def go() -> float:
        d = dispatcher(Busy(), todo_of(held, 1, Claims()))  # type: ignore[arg-type]
        d.opts.retry_backoff, d.opts.retry_backoff_max = 0.01, 20.0
        sent = asyncio.get_running_loop().time()
        runner = asyncio.create_task(d.run())
        d.wake.set()
        async with asyncio.timeout(10):
            while not d.todo.delayed:
                await asyncio.sleep(0.01)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        return d.todo.delayed[0][0] - sent

    delay = asyncio.run(go())
    assert waited <= delay <= waited * 1.5 + 1, delay


def test_requests_failing_while_the_server_is_up_are_told_in_a_warning_now_and_then(caplog):
    """Every request answered 500 while /health is fine: the prompts are retried (no evidence against any),
    and the operator reads one WARNING line naming the server, the status and its message, not one a
    request. Nothing above DEBUG was logged: the worker looked idle while its server failed everything."""
    held = HeldBatch(BatchRef("j", "b0000001"), "t", JobConfig(name="j", output="/tmp", model="m"), set())
    calls = []

    class Failing:
        async def generate(self, endpoint: str, body: dict, progress: object) -> Failure:
            await asyncio.sleep(0.001)
            calls.append(body["prompt"])
            return Failure("server_error", "Internal server error (simulated)", 500)

    async def go() -> None:
        d = dispatcher(Failing(), todo_of(held, 10, Claims()))  # type: ignore[arg-type]
        d.opts.retry_backoff, d.opts.retry_backoff_max, d.opts.server_url = 0.001, 0.002, "http://gpu7:30000"
        runner = asyncio.create_task(d.run())
        d.wake.set()
        async with asyncio.timeout(10):
            while len(calls) < 50:
                await asyncio.sleep(0.01)
        runner.cancel()
        for aio in list(d.running.values()):
            aio.cancel()
        await asyncio.gather(runner, *d.running.values(), return_exceptions=True)

    with caplog.at_level("DEBUG", logger="genq.worker"):
        asyncio.run(go())
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert all(s in warnings[0] for s in ("http://gpu7:30000", "500", "Internal server error (simulated)")), warnings
    assert "\n" not in warnings[0]
