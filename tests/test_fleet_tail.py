"""The end of a job on a fleet (worker/intake.py, worker/held.py): prompts a worker
holds but has not sent move to a worker with free slots once the queue is empty.

Each test ends with the shared exactly-once audit and counts what the servers generated.
"""

from __future__ import annotations

import os
import re
import signal

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.sim.lengths import prompt_key
from tests.audit import monitor_json
from tests.conftest import post_json, process_state, sim_stats, wait_until
from tests.test_exactly_once import FAST, SLOW, check, enqueue


def generations(*servers: str) -> dict[str, int]:
    """prompt key -> complete generations, over every server."""
    total: dict[str, int] = {}
    for url in servers:
        for key, n in sim_stats(url)["generated_by_key"].items():
            total[key] = total.get(key, 0) + n
    return total


def test_a_worker_joining_when_every_batch_is_held_takes_unsent_prompts(redis_url, rconn, sim, worker, tmp_path):
    slow = sim(max_running_requests=4, **SLOW)
    fast = sim(max_running_requests=8, **FAST)
    ids, out = enqueue(tmp_path, "late", 40, "--batch-size", "20", "--max-tokens", "2000")
    holder = worker(slow, "--burst", "--prefetch", "2", name="holder")
    wait_until(lambda: rconn.hlen(keys.job_leases("late")) == 2 and rq_queue(rconn).count == 0, 60,
               "both batches held, the queue empty")
    late = worker(fast, "--burst", name="late")
    assert late.wait(timeout=180) == 0, late.log()
    assert holder.wait(timeout=180) == 0, holder.log()
    check(rconn, out, "late", ids)
    assert re.search(r"unsent prompts? of batch late/", late.log()), late.log()
    assert sim_stats(fast)["finished_requests"] > 0, "the late worker got no work"
    generated = generations(slow, fast)
    assert sorted(generated.values()) == [1] * len(ids), "a prompt was generated twice (or not at all)"


def test_prompts_of_a_frozen_holder_move_and_the_job_ends_exactly_once(redis_url, rconn, sim, worker, tmp_path):
    slow = sim(max_running_requests=4, **SLOW)
    fast = sim(max_running_requests=16, **FAST)
    ids, out = enqueue(tmp_path, "frzt", 40, "--batch-size", "40", "--max-tokens", "2000")
    frozen = worker(slow, "--prefetch", "1", name="frozen")
    wait_until(lambda: rconn.hlen(keys.batch_results("frzt", "b0000001")) >= 1, 60, "the holder under way")
    os.kill(frozen.pid, signal.SIGSTOP)  # the engine only: its claims and its lease lapse with its heartbeat
    wait_until(lambda: process_state(frozen.pid) == "T", 10, "the holder to stop")
    try:
        recorded_at_freeze = {i.decode() for i in rconn.hkeys(keys.batch_results("frzt", "b0000001"))}
        stats = sim_stats(slow)
        # What the holder sent before it froze is running or waiting on its server, or finished
        # there with its answer still in the holder's socket or its record not yet written: all of
        # it is lost with the holder and may be generated again. Nothing recorded may be.
        lost_at_freeze = (stats["num_running"] + stats["num_waiting"]
                          + sum(stats["generated_by_key"].values()) - len(recorded_at_freeze))
        helper = worker(fast, "--burst", name="helper")
        assert helper.wait(timeout=180) == 0, helper.log()
        rows, _ = check(rconn, out, "frzt", ids)
        before = {r["id"]: r for r in rows}
    finally:
        os.kill(frozen.pid, signal.SIGCONT)
    assert re.search(r"unsent prompts? of batch frzt/b0000001", helper.log()), helper.log()
    wait_until(lambda: "elsewhere: dropping it here" in frozen.log(), 30, "the resumed holder to let go")
    frozen.signal(signal.SIGTERM)
    assert frozen.wait(timeout=60) == 0, frozen.log()
    rows, _ = check(rconn, out, "frzt", ids)
    assert {r["id"]: r for r in rows} == before, "the resumed holder changed a published shard"
    generated = generations(slow, fast)
    twice = {r["id"] for r in rows if generated[prompt_key(r["messages"])] > 1}
    assert not twice & recorded_at_freeze, f"recorded before the freeze, generated again: {twice & recorded_at_freeze}"
    assert len(twice) <= lost_at_freeze, f"{len(twice)} prompts generated twice, {lost_at_freeze} lost at the freeze"


def holder_and_taker(rconn, sim, worker, tmp_path, job: str, *taker_args: str):
    """One batch of 30 held by a burst worker; a second worker that has taken prompts of it.
    Returns (ids, out, holder, taker, the taker's server)."""
    holder_server = sim(max_running_requests=4, **SLOW)
    taker_server = sim(max_running_requests=4, **SLOW)
    ids, out = enqueue(tmp_path, job, 30, "--batch-size", "30", "--max-tokens", "2000")
    holder = worker(holder_server, "--burst", "--prefetch", "1", name="holder")
    wait_until(lambda: rconn.hlen(keys.job_leases(job)) == 1, 60, "the batch held")
    taker = worker(taker_server, *taker_args, name="taker")
    wait_until(lambda: re.search(rf"unsent prompts? of batch {job}/", taker.log()), 60,
               "the second worker to take prompts")
    return ids, out, holder, taker, taker_server


def test_prompts_a_killed_worker_took_go_back_to_their_holder(redis_url, rconn, sim, worker, tmp_path):
    ids, out, holder, taker, _ = holder_and_taker(rconn, sim, worker, tmp_path, "kt")
    taker.kill_tree()  # its claims lapse with its heartbeat; the holder sends those prompts itself
    assert holder.wait(timeout=180) == 0, holder.log()
    check(rconn, out, "kt", ids)


def test_the_monitor_says_when_a_job_is_in_its_tail(redis_url, rconn, sim, worker, tmp_path):
    long = dict(mean_output_tokens=3000, output_sigma=0.2, tokens_per_step=8, step_ms_base=20)  # ~7 s each
    busy_server = sim(max_running_requests=16, **long)
    idle_server = sim(max_running_requests=16, **long)
    ids, out = enqueue(tmp_path, "tl", 6, "--batch-size", "6", "--max-tokens", "6000")
    first = worker(busy_server, "--burst", "--name", "first", name="first")
    wait_until(lambda: rconn.hlen(keys.job_leases("tl")) == 1 and sim_stats(busy_server)["num_running"] == 6, 60,
               "every prompt running on the first worker")
    second = worker(idle_server, "--burst", "--name", "second", name="second")
    # A live worker whose server serves another model cannot run the job: neither its slots nor
    # its row belong to the job's view.
    other = worker(sim(served_model_name="other-model"), "--burst", "--name", "other", name="other")
    wait_until(lambda: rconn.exists(keys.worker_status("other")), 60, "the other model's worker to register")
    # Six requests on 32 slots, nothing left to start: the tail, said as such; the idle worker
    # is not reported as a bottleneck.
    doc = wait_until(lambda: (d := monitor_json(rconn, "tl"))["tail"] and len(d["worker_details"]) >= 2 and d, 60,
                     "the monitor to report the tail", interval=0.5)
    assert sorted(w["name"] for w in doc["worker_details"]) == ["first", "second"], doc["worker_details"]
    # Six were running; on a loaded machine one may finish before the monitor's read.
    assert re.search(r"the last [1-6] requests? run on 1 of 2 workers", doc["tail"]), doc["tail"]
    idle = next(w for w in doc["worker_details"] if w["name"] == "second")
    assert "no_prompts" not in idle["bottleneck_codes"], idle
    assert first.wait(timeout=120) == 0 and second.wait(timeout=120) == 0, first.log() + second.log()
    assert other.wait(timeout=120) == 0, other.log()
    check(rconn, out, "tl", ids)
    assert monitor_json(rconn, "tl")["tail"] is None, "a finished job is not in its tail"


def test_a_worker_whose_server_goes_down_gives_taken_prompts_back_at_once(redis_url, rconn, sim, worker, tmp_path):
    # The taker would wait 600 s for its server before handing anything back: prompts it took
    # must go back to their holder as soon as its server is down, not then.
    ids, out, holder, taker, taker_server = holder_and_taker(rconn, sim, worker, tmp_path, "sd",
                                                             "--server-down-timeout", "600")
    post_json(taker_server + "/sim/faults", {"outage_for": 600})
    assert holder.wait(timeout=180) == 0, holder.log()
    assert "giving" in taker.log() and re.search(r"borrowed prompts? back to their holders", taker.log()), taker.log()
    check(rconn, out, "sd", ids)
