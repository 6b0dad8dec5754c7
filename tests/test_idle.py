"""An idle worker waits instead of polling (worker/heartbeat.py, issue #29): real Redis, real
`genq worker` against `genq sim`, counted by Redis itself (INFO commandstats)."""

from __future__ import annotations

import asyncio
import signal
import time
from types import SimpleNamespace

import redis.asyncio as aioredis

from genq.core import keys
from genq.core.ledger import lease_holder
from genq.core.records import WorkerStatus, unpack
from genq.worker.heartbeat import IDLE_AFTER_S, IDLE_BEAT_S, IDLE_MAINTENANCE_S, WAKE_READ_S, IdlePace, WakeListener
from genq.worker.held import Holdings
from genq.worker.intake import CLOSED_POLL_S
from tests.conftest import run_genq, wait_until, write_prompts
from tests.test_model_change import engine_parts, queue_job

FAST_SIM = dict(mean_output_tokens=16, output_sigma=0.5, tokens_per_step=16, step_ms_base=5)
# One whole period of every idle loop (beats and RQ beats 20 s, looks 30 s, maintenance 60 s): each
# periodic command counted in proportion, the average rate, not a window that happens to hold a turn.
SPAN_S = IDLE_MAINTENANCE_S


def commands(rconn) -> int:
    """Commands Redis has run since the last CONFIG RESETSTAT, less that one. The INFO that reads
    them is not in its own figures; the worker's own INFOs (its output watch) are counted."""
    stats = rconn.info("commandstats")
    return sum(v["calls"] for k, v in stats.items() if k != "cmdstat_config|resetstat")


def idle_worker(rconn, sim, worker):
    server = sim(max_running_requests=8, **FAST_SIM)
    proc = worker(server, "--name", "idler")
    wait_until(lambda: rconn.get(keys.worker_status("idler")) is not None, timeout=30, what="first heartbeat")
    time.sleep(IDLE_AFTER_S + 3)  # past its start-up, and idle
    return proc


def asleep(rconn, *names: str, quiet_s: float = 5.0) -> float:
    """Waits until each worker's heartbeat has been quiet `quiet_s` (busy, it beats every second): the idle
    pace, its heartbeat and its stealer asleep until woken. Returns the latest of their last beats: the
    next is IDLE_BEAT_S after it."""
    def last_beat(name: str) -> float:
        raw = rconn.get(keys.worker_status(name))
        return float("inf") if raw is None else unpack(raw, WorkerStatus).heartbeat_at

    wait_until(lambda: all(time.time() - last_beat(n) >= quiet_s for n in names),
               timeout=IDLE_AFTER_S + IDLE_BEAT_S + 30, interval=0.05,
               what=f"the idle pace of {', '.join(names)} (heartbeats spaced out)")
    return max(last_beat(n) for n in names)


def test_an_idle_worker_issues_under_one_redis_command_a_second(redis_url, rconn, sim, worker):
    proc = idle_worker(rconn, sim, worker)
    rconn.config_resetstat()
    time.sleep(SPAN_S)
    per_s = commands(rconn) / SPAN_S
    print(f"an idle worker: {per_s:.2f} Redis commands a second over {SPAN_S:.0f} s")
    assert proc.alive, proc.log()
    status = unpack(rconn.get(keys.worker_status("idler")), WorkerStatus)
    assert status.state == "idle" and time.time() - status.heartbeat_at <= IDLE_BEAT_S + 3
    assert per_s <= 1.0, f"{per_s:.2f} commands a second: {rconn.info('commandstats')}"
    # And a stop is not held up by the intake's long wait between looks at the queue.
    started = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.log()
    assert time.monotonic() - started < 10, proc.log()


def test_an_idle_worker_takes_a_job_enqueued_while_it_waits_within_2s(redis_url, rconn, sim, worker, tmp_path):
    idle_worker(rconn, sim, worker)
    asleep(rconn, "idler")
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, 20)
    run_genq("enqueue", str(src), "--job", "wake", "--batch-size", "10", "--max-tokens", "16",
             "--output", str(tmp_path / "out"), redis_url=redis_url)
    enqueued = time.monotonic()
    wait_until(lambda: int(rconn.hget(keys.worker_stats("wake", "idler"), "done") or 0) > 0, timeout=30,
               interval=0.05, what="the first result")
    took = time.monotonic() - enqueued
    assert took < 2.0, f"first result {took:.2f}s after the enqueue"


def test_an_idle_worker_sees_pause_and_drain_within_seconds_not_at_its_next_idle_beat(redis_url, rconn, sim, worker):
    proc = worker(sim(max_running_requests=8, **FAST_SIM), "--name", "idler")
    wait_until(lambda: rconn.get(keys.worker_status("idler")) is not None, timeout=30, what="first heartbeat")

    def state() -> str:
        return unpack(rconn.get(keys.worker_status("idler")), WorkerStatus).state

    beat = asleep(rconn, "idler", quiet_s=1.5)
    run_genq("pause", redis_url=redis_url)
    wait_until(lambda: state() == "paused", timeout=IDLE_BEAT_S + 10, interval=0.1, what="the worker paused")
    assert time.time() - beat < IDLE_BEAT_S / 2, "a pause waited for the idle worker's next beat"
    run_genq("resume", redis_url=redis_url)
    wait_until(lambda: state() == "idle", timeout=IDLE_BEAT_S + 10, interval=0.1, what="the worker resumed")
    beat = asleep(rconn, "idler", quiet_s=1.5)
    run_genq("drain", "--worker", "idler", redis_url=redis_url)
    assert proc.wait(timeout=IDLE_BEAT_S + 30) == 0, proc.log()
    assert time.time() - beat < IDLE_BEAT_S / 2, "a drain waited for the idle worker's next beat"


def test_an_idle_worker_takes_stealable_prompts_within_3s_of_their_lease(redis_url, rconn, sim, worker, tmp_path):
    """Two idle workers, their heartbeats asleep; a job of one batch comes: one takes it and holds
    prompts it has not sent, the queue empty. It says so (WAKE on genq:wake), and the other
    claims some from the back of the batch within seconds, not at its next idle look."""
    slow = dict(max_running_requests=2, mean_output_tokens=200, output_sigma=0.1, tokens_per_step=4, step_ms_base=20)
    for name in ("wa", "wb"):  # --grace-period 0: stopped at the end holding the batch, at once
        worker(sim(**slow), "--name", name, "--grace-period", "0")
    wait_until(lambda: all(rconn.get(keys.worker_status(n)) for n in ("wa", "wb")), timeout=30, what="heartbeats")
    asleep(rconn, "wa", "wb")
    assert rconn.pubsub_numsub(keys.WAKE) == [(keys.WAKE.encode(), 2)], "both idle workers listen for WAKE"
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, 60)
    run_genq("enqueue", str(src), "--job", "tail", "--batch-size", "60", "--max-tokens", "400",
             "--output", str(tmp_path / "out"), redis_url=redis_url)
    lease = wait_until(lambda: rconn.hget(keys.job_leases("tail"), "b0000001"), timeout=30, interval=0.02,
                       what="a lease of the job's batch")
    leased = time.monotonic()
    holder = lease_holder(lease)
    assert holder is not None
    other = "wb." if holder.startswith("wa.") else "wa."
    claims = keys.batch_claims("tail", "b0000001")
    wait_until(lambda: any(v.startswith(other.encode()) for v in rconn.hvals(claims)), timeout=20, interval=0.05,
               what="a claim of the idle worker (prompts it took from the holder's batch)")
    took = time.monotonic() - leased
    assert took < 3.0, f"the idle worker took prompts {took:.2f}s after the holder's lease"


def test_a_burst_worker_listening_for_wake_exits_when_its_job_is_done(redis_url, rconn, sim, worker, tmp_path):
    """The WAKE listener (a thread with a blocking read of a second at most) holds no exit up:
    an asyncio pubsub read cancelled in the engine's task group once hung a --burst worker."""
    server = sim(max_running_requests=8, **FAST_SIM)
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, 40)
    run_genq("enqueue", str(src), "--job", "burst", "--batch-size", "10", "--max-tokens", "16",
             "--output", str(tmp_path / "out"), redis_url=redis_url)
    proc = worker(server, "--burst", "--name", "burster")
    wait_until(lambda: rconn.pubsub_numsub(keys.WAKE) == [(keys.WAKE.encode(), 1)], timeout=30,
               what="the burst worker subscribed to WAKE")
    wait_until(lambda: rconn.scard(keys.job_done("burst")) == 4, timeout=60, what="every batch done")
    done = time.monotonic()
    assert proc.wait(timeout=30) == 0, proc.log()
    assert time.monotonic() - done < 15, proc.log()
    assert rconn.pubsub_numsub(keys.WAKE) == [(keys.WAKE.encode(), 0)]


def test_a_stealer_woken_as_it_is_stopped_stops():
    """The stealer's nap, cancelled in the loop turn in which a WAKE sets `woken`, ends its task:
    asyncio.wait_for on Python 3.11 swallowed such a cancel (it returned the result), the stealer
    napped on, and the engine's TaskGroup waited for it for ever: a --burst worker that had said
    'every batch of every job is done; exiting' ran on (seen in bench/fleet_scale.py's real run)."""
    pace = IdlePace(Holdings(), SimpleNamespace(running={}, unsent=0))

    async def go() -> bool:
        async def stealer() -> None:
            while True:
                await pace.nap(0.5)

        task = asyncio.create_task(stealer())
        await asyncio.sleep(0.05)  # napping
        pace.woken.set()  # a WAKE message, and the stop, in one turn of the loop
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=3)
        if task not in done:
            task.cancel()  # and again: the test must end either way
            await asyncio.wait({task}, timeout=3)
        return task in done and task.cancelled()

    assert asyncio.run(go()), "the stealer's task went on after it was cancelled"


def test_a_stealer_woken_early_waits_without_holding_the_loop():
    """A WAKE that comes less than WOKEN_LOOK_S into the stealer's nap is acted on at WOKEN_LOOK_S;
    meanwhile the engine's other tasks run. The nap spun instead (its wait on the event, already
    set, returned at once, without yielding), so the dispatcher sat still for up to a second
    each time a busy engine heard its own WAKE (announce) with the window full: requests ended
    at the server were read late and the next ones started late (test_fidelity's n-samples test)."""
    pace = IdlePace(Holdings(), SimpleNamespace(running={"busy": 1}, unsent=0))

    async def go() -> list[str]:
        order: list[str] = []

        async def stealer() -> None:
            assert await pace.nap(5.0), "a WAKE ends the nap"
            order.append("nap")

        async def dispatcher() -> None:
            await asyncio.sleep(0.05)  # far less than WOKEN_LOOK_S
            order.append("dispatcher")

        pace.woken.set()  # a WAKE as the nap starts
        await asyncio.gather(stealer(), dispatcher())
        return order

    assert asyncio.run(go()) == ["dispatcher", "nap"]


def test_the_wake_listener_stops_within_one_read(redis_url):
    """A stopping worker joins the WAKE listener's thread, which ends after its current read: every
    worker's exit waited up to a second for it (a --burst worker's last step, each SIGTERM)."""
    pace = IdlePace(Holdings(), SimpleNamespace(running={}, unsent=0))
    loop = asyncio.new_event_loop()
    listener = WakeListener(redis_url, pace, loop)
    try:
        listener.start()
        time.sleep(0.3)  # subscribed, and a read under way
        started = time.monotonic()
        listener.stop()
        took = time.monotonic() - started
    finally:
        loop.close()
    assert took < WAKE_READ_S + 0.4, f"the listener took {took:.2f}s to stop"


class _Closed:
    """The dispatcher as the intake reads it: whether it takes work (each look counted), its wake, the watch."""

    def __init__(self, watch) -> None:
        self.watch, self.wake = watch, asyncio.Event()
        self.open, self.looks = False, 0

    def accepting(self) -> bool:
        self.looks += 1
        return self.open


def test_an_intake_taking_nothing_waits_for_the_wake_and_takes_at_once_when_woken(redis_url, rconn, tmp_path):
    """Paused (or draining, stopping, its server down), an idle engine's intake waits on the dispatcher's wake,
    which whatever ends that sets, and looks again CLOSED_POLL_S later at the latest. It looked every 50 ms
    (FULL_POLL_S), 20 wake-ups a second on every idle GPU host. Resumed and woken, it takes the queued batch
    at once."""
    queue_job(rconn, "j", tmp_path / "out")

    async def scenario() -> tuple[int, float, int]:
        conn = aioredis.Redis.from_url(redis_url)
        held, batches, watch, intake = engine_parts(conn, rconn, redis_url)
        intake.dispatcher = dispatcher = _Closed(watch)  # type: ignore[assignment]
        run = asyncio.create_task(intake.run())
        try:
            await asyncio.sleep(2.0)
            looks = dispatcher.looks
            dispatcher.open = True  # resumed: the heartbeat's read of the controls sets the wake
            dispatcher.wake.set()
            woken = time.monotonic()
            while not held and time.monotonic() - woken < 5:
                await asyncio.sleep(0.01)
            return looks, time.monotonic() - woken, len(held)
        finally:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            batches.close()
            await conn.aclose()

    looks, took, taken = asyncio.run(scenario())
    assert looks <= 2.0 / CLOSED_POLL_S + 2, f"{looks} looks in 2 s while taking nothing"
    assert taken == 1 and took < 0.5, f"{taken} batch taken {took:.2f}s after the wake"
