"""A server's capacity learned from its /metrics when it does not tell it (vLLM), exactly.

vLLM reports its running count after each step's finished requests left and before the
next admission (make_stats() in update_from_output()): while requests wait for a slot
the count is the capacity less the requests that just finished, so it dips by a few on
most looks. The controller is tested as a pure unit on such sequences, then end to end:
a real `genq worker` against `genq sim --flavor vllm` (which reports its counts the same
way, with vLLM's num_requests_waiting_by_reason) on real Redis.
"""

from __future__ import annotations

import math
import random
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from genq.core import keys
from genq.core.records import WorkerStatus, unpack
from genq.worker.controller import (
    LEARN_LOOK_S,
    LOOK_S,
    SETTLE_LOOKS,
    UNKNOWN_CAPACITY_START,
    ConcurrencyController,
    headroom,
)
from genq.worker.engines import Metrics, metrics_from_text
from tests.conftest import run_genq, wait_until, write_prompts


def poisson(rng: random.Random, mean: float) -> int:
    limit, k, p = math.exp(-mean), 0, rng.random()
    while p > limit:
        k, p = k + 1, p * rng.random()
    return k


def vllm_look(rng: random.Random, capacity: int, in_flight: int, finishing: float) -> Metrics:
    """One look at vLLM holding in_flight requests: `finishing` of those running end per
    step on average (Poisson) and have left when it reports; the waiting ones are
    admitted only by its next step."""
    ended = poisson(rng, finishing)
    running = max(0, min(in_flight, capacity) - ended)
    waiting = max(0, in_flight - capacity)
    return Metrics(running=running, waiting=waiting, waiting_capacity=waiting, kv_usage=0.05)


@pytest.mark.parametrize("capacity", [16, 128, 256])
def test_capacity_is_exact_although_most_looks_see_a_few_just_finished(capacity: int) -> None:
    rng = random.Random(capacity)
    c = ConcurrencyController(None)
    looks = 0
    # About 1.5 requests finish per step: 78 % of the looks see fewer running than fit.
    while looks < 80 and c.learned != capacity:
        c.observe(vllm_look(rng, capacity, c.target, 1.5), in_flight=c.target, backlog=10_000)
        looks += 1
    assert c.learned == capacity, f"learned {c.learned} after {looks} looks"
    assert c.target == capacity + headroom(capacity)
    # Later looks, as noisy, never change what is known.
    for _ in range(200):
        c.observe(vllm_look(rng, capacity, c.target, 1.5), in_flight=c.target, backlog=10_000)
    assert (c.learned, c.target) == (capacity, capacity + headroom(capacity))


def test_a_rising_count_is_a_server_still_admitting_not_its_capacity() -> None:
    """vLLM admits within a token budget per step: requests wait while slots are free."""
    c = ConcurrencyController(None)
    for running in (20, 40, 60, 80, 100, 120):
        c.observe(Metrics(running=running, waiting=144 - running, waiting_capacity=144 - running), 144, 1000)
        assert c.learned is None, f"learned {c.learned} while the count still rose"
    c.observe(Metrics(running=127, waiting=17, waiting_capacity=17), 144, 1000)
    c.observe(Metrics(running=126, waiting=18, waiting_capacity=18), 144, 1000)
    assert c.learned is None
    c.observe(Metrics(running=125, waiting=19, waiting_capacity=19), 144, 1000)
    assert c.learned == 127, "the highest count, once no higher came for three looks"
    c.observe(Metrics(running=128, waiting=13, waiting_capacity=13), c.target, 1000)
    c.observe(Metrics(running=126, waiting=15, waiting_capacity=15), c.target, 1000)
    c.observe(Metrics(running=127, waiting=14, waiting_capacity=14), c.target, 1000)
    assert c.learned == 128 and c.target == 128 + headroom(128), "a higher count later raises it"


def test_requests_deferred_for_other_reasons_teach_nothing() -> None:
    """vLLM's deferred requests (LoRA budget, KV transfer, blocked) wait with slots free."""
    c = ConcurrencyController(None)
    for _ in range(10):
        c.observe(Metrics(running=40, waiting=24, waiting_capacity=0), UNKNOWN_CAPACITY_START, 1000)
    assert c.learned is None
    # A server without the breakdown: its waiting count is all there is.
    g = ConcurrencyController(None)
    for _ in range(3):
        g.observe(Metrics(running=40, waiting=24), UNKNOWN_CAPACITY_START, 1000)
    assert g.learned == 40


def test_a_count_above_the_learned_capacity_raises_it_at_once() -> None:
    c = ConcurrencyController(None)
    for _ in range(3):
        c.observe(Metrics(running=60, waiting=4, waiting_capacity=4), 64, 1000)
    assert c.learned == 60 and c.target == 66
    c.observe(Metrics(running=66, waiting=0, waiting_capacity=0), 66, 1000)
    assert c.learned == 66 and c.target == 66 + headroom(66) and c.reason == "raised: learned server capacity 66"


def test_growth_waits_until_what_was_sent_reached_the_server() -> None:
    c = ConcurrencyController(None)
    c.observe(Metrics(running=20, waiting=0), in_flight=UNKNOWN_CAPACITY_START, backlog=1000)
    assert c.target == UNKNOWN_CAPACITY_START, "44 of ours are not at the server yet: no sign of idle slots"
    c.observe(Metrics(running=64, waiting=0), in_flight=UNKNOWN_CAPACITY_START, backlog=1000)
    assert c.target == 96


def test_looks_are_frequent_only_while_learning() -> None:
    told = ConcurrencyController(32)
    told.observe(Metrics(running=32, waiting=3), 35, 1000)
    assert told.look_interval_s == LOOK_S
    c = ConcurrencyController(None)
    c.observe(Metrics(running=10, waiting=0), 10, backlog=0)
    assert c.look_interval_s == LOOK_S, "nothing held back: nothing to fill, nothing to learn"
    c.observe(Metrics(running=50, waiting=14, waiting_capacity=14), 64, backlog=500)
    assert c.look_interval_s == LEARN_LOOK_S
    for _ in range(2):
        c.observe(Metrics(running=50, waiting=14, waiting_capacity=14), 64, backlog=500)
    assert c.learned == 50 and c.look_interval_s == LEARN_LOOK_S, "a while longer, for an exact count"
    for _ in range(SETTLE_LOOKS):
        c.observe(Metrics(running=49, waiting=6, waiting_capacity=6), 55, backlog=500)
    assert c.look_interval_s == LOOK_S
    c.set_capacity(None)  # rediscovered after an outage: maybe another server
    assert c.learned is None and c.slots is None


def test_vllm_metrics_page_waiting_by_reason() -> None:
    page = """# HELP vllm:num_requests_waiting_by_reason Number of waiting requests by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 128.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 20.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 15.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 5.0
"""
    m = metrics_from_text(page)
    assert (m.running, m.waiting, m.waiting_capacity) == (128.0, 20.0, 15.0)
    assert metrics_from_text(page.replace('reason="capacity"', 'reason="other"')).waiting_capacity is None


# ---------------------------------------------------------------- end to end: genq sim --flavor vllm

# ~60 steps a request: at 128 slots about 2 finish per step (7 of 8 looks see a dip), at 16
# about 0.3. Whole answers (--no-stream): the test is about the controller, not the CPU.
JITTER_SIM = dict(flavor="vllm", step_ms_base=10, step_ms_per_req=0, tokens_per_step=1, mean_output_tokens=60,
                  output_sigma=0.5)


def sample_sim(url: str, stop: threading.Event, seen: list[tuple[float, float]]) -> None:
    while not stop.wait(0.05):
        try:
            with urllib.request.urlopen(url + "/metrics", timeout=2) as resp:
                m = metrics_from_text(resp.read().decode())
        except OSError:
            continue
        seen.append((m.running or 0.0, m.waiting_capacity or 0.0))


@pytest.mark.parametrize("capacity,n", [(16, 300), (128, 2500)])
def test_worker_learns_the_exact_capacity_of_a_vllm_sim(capacity: int, n: int, tmp_path: Path, redis_url, rconn,
                                                       sim, worker) -> None:
    url = sim(max_running_requests=capacity, **JITTER_SIM)
    write_prompts(tmp_path / "p.jsonl", n)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "cap", "--output", str(tmp_path / "out"),
             "--batch-size", "100", "--max-tokens", "400", redis_url=redis_url)
    stop, seen = threading.Event(), []
    sampler = threading.Thread(target=sample_sim, args=(url, stop, seen), daemon=True)
    sampler.start()
    started = time.monotonic()
    proc = worker(url, "--name", "cap-w", "--burst", "--no-stream")
    try:
        def learned() -> WorkerStatus | None:
            raw = rconn.get(keys.worker_status("cap-w"))
            status = unpack(raw, WorkerStatus) if raw else None
            return status if status and status.server_capacity == capacity else None

        status = wait_until(learned, 60, f"the worker to learn capacity {capacity}")
        took = time.monotonic() - started
        assert status.concurrency_target == capacity + headroom(capacity)
        assert proc.wait(120) == 0, proc.log()[-3000:]
    finally:
        stop.set()
        sampler.join()
    log = proc.log()
    learned_lines = [line for line in log.splitlines() if "learned server capacity" in line]
    assert learned_lines and learned_lines[-1].endswith(f"learned server capacity {capacity})"), learned_lines
    assert not [line for line in learned_lines if f"capacity {capacity + 1}" in line]
    # The sim showed what vLLM shows: a running count below capacity while requests waited.
    full = [r for r, w in seen if w > 0]
    assert full and min(full) < capacity and max(full) == capacity, sorted(set(full))[:10]
    print(f"capacity {capacity} learned {took:.1f} s after the worker started; lines {learned_lines}")
