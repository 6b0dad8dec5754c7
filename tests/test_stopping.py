"""worker/engine.py's StopNow on its own: told to stop now, the shutdown goes on while Redis answers, and
no longer than STOP_NOW_MAX_S; a Redis that does not answer ends it at the next look
(tests/test_eo_stop_now.py runs the whole worker against a stopped and a frozen Redis)."""

from __future__ import annotations

import asyncio
import time

import pytest

from genq.worker import engine as stopping
from genq.worker.engine import StopNow
from genq.worker.held import Holdings


class FakeRedis:
    def __init__(self, answers: bool | None) -> None:
        self.answers = answers  # None: never answers (frozen)
        self.pings = 0

    async def ping(self) -> bool:
        self.pings += 1
        if self.answers is None:
            await asyncio.sleep(3600)
        if not self.answers:
            raise ConnectionError("refused")
        return True


class FakeWriter:
    pending = 0


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("STOP_NOW_S", 0.2), ("STOP_NOW_MAX_S", 1.0), ("PING_S", 0.1), ("LOOK_S", 0.02)):
        monkeypatch.setattr(stopping, name, value)
    monkeypatch.setattr(StopNow, "_exit_now", lambda self: None)  # the backstop would end the test process


def run(answers: bool | None, finish_s: float) -> tuple[StopNow, float, bool]:
    """Told to stop now at once; the shutdown takes finish_s. (stopper, seconds taken, finished)"""
    finished = []

    async def finish() -> None:
        await asyncio.sleep(finish_s)
        finished.append(True)

    async def main() -> tuple[StopNow, float]:
        stopper = StopNow(FakeRedis(answers), "w", Holdings(), FakeWriter())  # type: ignore[arg-type]
        stopper.start()
        began = time.monotonic()
        await stopper.run(finish())
        return stopper, time.monotonic() - began

    stopper, took = asyncio.run(main())
    return stopper, took, bool(finished)


@pytest.mark.parametrize("answers", [False, None], ids=["refused", "frozen"])
def test_a_redis_that_does_not_answer_ends_the_shutdown_at_the_first_look(answers):
    stopper, took, finished = run(answers, finish_s=30)
    assert not finished and stopper.without_redis
    assert 0.2 <= took < 0.8


def test_while_redis_answers_the_shutdown_goes_on_to_its_end():
    stopper, took, finished = run(True, finish_s=0.7)
    assert finished and not stopper.without_redis
    assert stopper.conn.pings >= 2  # asked at 0.2 s and 0.4 s at least


def test_a_shutdown_that_never_ends_stops_at_the_cap_even_while_redis_answers():
    stopper, took, finished = run(True, finish_s=30)
    assert not finished and stopper.without_redis
    assert 1.0 <= took < 1.8


def test_not_told_to_stop_now_it_waits_for_the_shutdown():
    async def main() -> bool:
        done = []

        async def finish() -> None:
            await asyncio.sleep(0.5)
            done.append(True)

        stopper = StopNow(FakeRedis(False), "w", Holdings(), FakeWriter())  # type: ignore[arg-type]
        await stopper.run(finish())
        return bool(done) and not stopper.without_redis

    assert asyncio.run(main())
