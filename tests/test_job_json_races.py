"""OUTPUT/JOB/job.json has several writers (`jobs set`, `pause --job`, a worker pinning `--model auto`, enqueue's
reserve). Each changes its own fields of the record as it is when written: two at once lose neither's change, and
a job rebuilt from job.json after FLUSHALL comes back with both (docs/recovery.md). The race is made certain: the
first writer's job.json write waits until the second writer is done (or 2 s, where it holds the file)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import redis
import redis.asyncio as aioredis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import load_config
from genq.ops import control, recover
from genq.output import truth
from tests.conftest import run_genq, write_prompts
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e


def gate_first_write(monkeypatch, arrived: threading.Event, second_done: threading.Event) -> None:
    """Thread "first"'s first job.json write says it is there, then waits for the second writer (at most 2 s)."""
    held = set()

    def gated(base: type) -> type:
        def put(self, rel: str, data: bytes, **conditions: str) -> None:
            if rel.endswith(truth.JOB_FILE) and threading.current_thread().name == "first" and not held:
                held.add(rel)
                arrived.set()
                second_done.wait(2)
            base.put(self, rel, data, **conditions)
        return type(f"Gated{base.__name__}", (base,), {"put": put})

    opened = truth.open_store
    monkeypatch.setattr(truth, "open_store", lambda output, endpoint_url=None: gated(type(
        store := opened(output, endpoint_url)))(*((store.root,) if isinstance(store, truth.LocalStore)
                                                  else (store.uri_root, endpoint_url))))


def race(monkeypatch, first, second, gate=gate_first_write) -> None:
    arrived, done = threading.Event(), threading.Event()
    gate(monkeypatch, arrived, done)
    errors: list[BaseException] = []

    def run(fn, name: str) -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 (said by the test)
            errors.append(exc)
        finally:
            if name == "second":
                done.set()

    a = threading.Thread(target=run, args=(first, "first"), name="first")
    a.start()
    arrived.wait(30)  # the first has read job.json and is about to write it
    b = threading.Thread(target=run, args=(second, "second"), name="second")
    b.start()
    a.join()
    b.join()
    assert not errors, errors


def make_job(url: str, tmp_path, output: str, *extra: str) -> None:
    src = tmp_path / "in.jsonl"
    write_prompts(src, 20)
    run_genq("enqueue", str(src), "--job", "rj", "--output", output, "--batch-size", "10", "--max-tokens", "64",
             *extra, redis_url=url)


def rebuilt_after_flushall(conn: redis.Redis, output: str, endpoint: str | None = None) -> recover.Recovery:
    conn.flushall()
    return recover.recover(conn, "rj", output, endpoint)


def pin_and_set(monkeypatch, redis_url: str, rconn: redis.Redis, output: str, endpoint: str | None) -> None:
    async def pin() -> None:
        aconn = aioredis.Redis.from_url(redis_url)
        await ledger_jobs.pin_model(aconn, "rj", "m1", "auto")
        await aconn.aclose()

    asyncio.run(pin())
    pinned = load_config(rconn, "rj")
    race(monkeypatch, lambda: control.keep_pin(pinned),
         lambda: control.set_settings(rconn, "rj", {"max_tokens": 20}))
    back = rebuilt_after_flushall(rconn, output, endpoint).config
    assert (back.model, back.max_tokens, back.settings_version) == ("m1", 20, 2), back


def test_a_pin_and_a_jobs_set_at_once_both_reach_job_json(monkeypatch, redis_url, rconn, tmp_path):
    out = str(tmp_path / "out")
    make_job(redis_url, tmp_path, out, "--model", "auto")
    pin_and_set(monkeypatch, redis_url, rconn, out, None)


def test_on_s3_a_pin_and_a_jobs_set_at_once_both_reach_job_json(monkeypatch, redis_url, rconn, moto, tmp_path):  # noqa: F811
    moto.client().create_bucket(Bucket="races")
    make_job(redis_url, tmp_path, "s3://races/out", "--model", "auto", "--s3-endpoint-url", moto.url)
    pin_and_set(monkeypatch, redis_url, rconn, "s3://races/out", moto.url)


def test_a_pause_while_an_enqueue_reserves_is_kept(monkeypatch, redis_url, rconn, tmp_path):
    out = str(tmp_path / "out")
    make_job(redis_url, tmp_path, out)
    store = truth.open_store(out)
    record = truth.read_job(store, "rj")
    race(monkeypatch, lambda: truth.reserve(truth.open_store(out), record, 5000),
         lambda: control.pause(rconn, "rj"))
    on_disk = truth.read_job(store, "rj")
    assert (on_disk.paused, on_disk.reserved) == (True, 5000), on_disk
    rebuilt_after_flushall(rconn, out)
    assert ledger_jobs.jobs_now(rconn, ["rj"])[0].paused


def test_jobs_set_settings_and_schedule_at_once_both_reach_job_json(monkeypatch, redis_url, rconn, tmp_path):
    out = str(tmp_path / "out")
    make_job(redis_url, tmp_path, out)
    race(monkeypatch, lambda: control.set_schedule(rconn, "rj", 5, None),
         lambda: control.set_settings(rconn, "rj", {"max_tokens": 20}))
    back = rebuilt_after_flushall(rconn, out)
    assert (back.config.max_tokens, back.config.settings_version) == (20, 2), back.config
    assert back.record.schedule is not None and back.record.schedule.priority == 5, back.record.schedule


def gate_first_pause(monkeypatch, arrived: threading.Event, second_done: threading.Event) -> None:
    """Thread "first" (a `pause --job`) waits for the second writer as it looks its job up to number the pause."""
    looked_up = control.load_config

    def held(conn: redis.Redis, job: str):
        if threading.current_thread().name == "first" and not arrived.is_set():
            arrived.set()
            second_done.wait(30)
        return looked_up(conn, job)

    monkeypatch.setattr(control, "load_config", held)


def test_a_pause_and_a_resume_at_once_leave_redis_and_job_json_agreeing(monkeypatch, redis_url, rconn, tmp_path):
    """Each `pause --job` and `resume --job` numbers its change (the schedule's version) with its change in Redis:
    job.json keeps the highest, so Redis and job.json agree, and a job rebuilt after FLUSHALL is in Redis's state."""
    out = str(tmp_path / "out")
    make_job(redis_url, tmp_path, out)
    race(monkeypatch, lambda: control.pause(rconn, "rj"), lambda: control.resume(rconn, "rj"), gate_first_pause)
    now, on_disk = ledger_jobs.jobs_now(rconn, ["rj"])[0], truth.read_job(truth.open_store(out), "rj")
    assert (now.paused, now.schedule.version) == (on_disk.paused, on_disk.schedule.version), (now, on_disk)
    rebuilt_after_flushall(rconn, out)
    assert ledger_jobs.jobs_now(rconn, ["rj"])[0].paused is now.paused
