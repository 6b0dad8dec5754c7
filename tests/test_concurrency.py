"""Concurrency from the server's capacity, adaptive control from /metrics, live changes.

The controller's rules are tested as a pure unit on synthetic Metrics; the worker
is tested end to end against a real `genq sim` and real Redis: the target it
derives from the sim's --max-running-requests, a command-line cap, a live cap
written to its control key while a job runs (no restart), and batches taken
beyond --prefetch while held ones drain their long tails.
No timing assertions: performance is measured in bench/saturation.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from genq.core import keys
from genq.core.records import Control, WorkerStatus, pack, unpack
from genq.worker.controller import GENTLE_CHECKS, UNKNOWN_CAPACITY_START, ConcurrencyController, headroom
from genq.worker.engines import Metrics, capacity_from_info, metrics_from_text
from tests.conftest import read_results, run_genq, sim_stats, write_prompts

# ---------------------------------------------------------------- controller, pure unit


def test_target_starts_from_capacity_plus_a_small_queue():
    c = ConcurrencyController(37)
    assert headroom(37) == 4
    assert c.target == 41 and c.cap is None
    assert ConcurrencyController(8).target == 8 + headroom(8) == 10
    unknown = ConcurrencyController(None)
    assert unknown.target == UNKNOWN_CAPACITY_START
    unknown.set_capacity(20)  # the server told us later (e.g. after an outage)
    assert unknown.target == 22


def test_command_line_cap_and_live_cap():
    c = ConcurrencyController(37, cap=16)
    assert c.target == 16 and c.cap == 16 and c.live_cap is None
    c.set_cap(4)  # genq concurrency W 4
    assert c.target == 4 and c.cap == 4 and c.live_cap == 4
    c.set_cap(64)  # a live cap may also lift the command line's
    assert c.target == 41, "never above the automatic target"
    c.set_cap(None)  # genq concurrency W auto: back to how the worker was started
    assert c.target == 16 and c.live_cap is None
    free = ConcurrencyController(37)
    free.set_cap(3)
    free.set_cap(0)
    assert free.target == 41 and free.cap is None


def test_raises_only_when_slots_idle_and_prompts_are_held_back():
    c = ConcurrencyController(37)
    idle = Metrics(running=30, waiting=0, kv_usage=0.4)
    c.observe(idle, in_flight=41, backlog=0)  # nothing held back: the batch tail, not us
    assert c.target == 41
    c.observe(Metrics(running=30, waiting=0, kv_usage=0.95), in_flight=41, backlog=500)
    assert c.target == 41, "KV cache nearly full: the memory keeps slots empty, not the worker"
    c.observe(Metrics(running=37, waiting=4, kv_usage=0.4), in_flight=41, backlog=500)
    assert c.target == 41, "slots full and a queue: nothing to fix"
    c.observe(idle, in_flight=41, backlog=500)
    assert c.target == 41 + 7 and c.reason.startswith("raised")
    capped = ConcurrencyController(37, cap=10)
    capped.observe(Metrics(running=10, waiting=0), in_flight=10, backlog=500)
    assert capped.auto == 41 and capped.target == 10, "a cap is not a reason to raise the automatic target"


def test_a_raise_is_kept_while_the_queue_holds_only_what_it_added():
    """After a wave of answers that ended together the server shows idle slots and the target rises;
    the queue then holds what the raise added, which is its point. Lowering the target for that
    would leave more in flight than the target until they are answered (vLLM, 128 slots: 163 in
    flight of a 141 target for ~30 s). A queue beyond it, another client's, still lowers it."""
    c = ConcurrencyController(128)
    c.observe(Metrics(running=13, waiting=0, kv_usage=0.3), in_flight=141, backlog=500)
    assert c.target == 141 + 115 and c.reason.startswith("raised")
    for _ in range(10):
        c.observe(Metrics(running=128, waiting=128, kv_usage=0.3), in_flight=256, backlog=500)
    assert c.target == 256, "the queue holds what the raise added: kept"
    for waiting in (150, 155, 160):  # others' requests join the queue, past ours and a headroom (141)
        c.observe(Metrics(running=128, waiting=waiting, kv_usage=0.3), in_flight=256, backlog=500)
    assert c.target == 141 and c.reason == "lowered: server queue growing"


def test_lowers_on_retractions_then_raises_gently():
    c = ConcurrencyController(37)
    c.observe(Metrics(running=37, waiting=4, kv_usage=0.99, retractions_total=0), 41, 500)
    assert c.target == 41, "the first counter value is only a baseline"
    c.observe(Metrics(running=30, waiting=11, kv_usage=0.99, retractions_total=6), 41, 500)
    assert c.target == 41 - 4 and c.reason.startswith("lowered: KV")
    c.observe(Metrics(running=28, waiting=9, kv_usage=0.99, retractions_total=9), 37, 500)
    assert c.target == 37 - 3
    # Memory freed: slots idle again, but the way back up is additive for a while.
    c.observe(Metrics(running=20, waiting=0, kv_usage=0.5, retractions_total=9), 34, 500)
    assert c.target == 35
    for _ in range(GENTLE_CHECKS):
        c.observe(Metrics(running=37, waiting=3, kv_usage=0.8, retractions_total=9), c.target, 500)
    c.observe(Metrics(running=30, waiting=0, kv_usage=0.5, retractions_total=9), c.target, 500)
    assert c.target == 35 + 7, "after the gentle period a raise refills every idle slot"
    # Older SGLang only has the gauge.
    g = ConcurrencyController(37)
    g.observe(Metrics(running=37, waiting=4, kv_usage=0.99, retracted=2), 41, 500)
    assert g.target < 41


def test_unknown_capacity_grows_until_the_queue_fills_then_settles():
    c = ConcurrencyController(None)  # vLLM: no capacity endpoint
    target = c.target
    c.observe(Metrics(running=64, waiting=0, kv_usage=0.2), in_flight=target, backlog=10_000)
    assert c.target > target, "an empty server queue with prompts held back: grow"
    looks = 0
    while c.target < 400 and looks < 50:
        looks += 1
        c.observe(Metrics(running=min(c.target, 256), waiting=max(0, c.target - 256), kv_usage=0.3),
                  in_flight=c.target, backlog=10_000)
        if c.learned:
            break
    assert c.learned == 256, "requests wait while memory is free: what runs is the slot limit"
    assert c.slots == 256
    assert c.target == 256 + headroom(256), "once known, only the refill headroom waits in the server"
    assert c.reason == "lowered: learned server capacity 256"


def test_capacity_is_learned_only_once_running_holds_still():
    """While a server ramps up (vLLM admits by a token budget per step) requests wait
    with slots still free: a running count that still moves is no capacity."""
    c = ConcurrencyController(None)
    for running in (10, 30, 50):
        c.observe(Metrics(running=running, waiting=64 - running, kv_usage=0.1), in_flight=64, backlog=1000)
    assert c.learned is None and c.target == UNKNOWN_CAPACITY_START
    for _ in range(3):
        c.observe(Metrics(running=60, waiting=4, kv_usage=0.1), in_flight=64, backlog=1000)
    assert c.learned == 60 and c.target == 60 + headroom(60), "known: the capacity and its refill headroom"
    # A larger count later (a slot freed by a KV limit, say) raises what is known.
    for _ in range(3):
        c.observe(Metrics(running=62, waiting=4, kv_usage=0.1), in_flight=c.target, backlog=1000)
    assert c.learned == 62 and c.slots == 62
    told = ConcurrencyController(8)
    assert told.slots == 8 and told.learned is None


def test_many_waiting_for_a_learned_capacity_lowers_at_once():
    c = ConcurrencyController(None)  # starts at 64 against an 8-slot server
    for _ in range(3):
        c.observe(Metrics(running=8, waiting=56), in_flight=64, backlog=1000)
    assert c.learned == 8 and c.target == 8 + headroom(8) == 10


def test_metrics_pages_of_sglang_and_vllm():
    sglang = """# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m",dp_rank="0"} 30.0
sglang:num_running_reqs{model_name="m",dp_rank="1"} 7.0
sglang:num_queue_reqs{model_name="m",dp_rank="0"} 2.0
sglang:num_queue_reqs{model_name="m",dp_rank="1"} 1.0
sglang:token_usage{model_name="m",dp_rank="0"} 0.41
sglang:token_usage{model_name="m",dp_rank="1"} 0.93
sglang:num_retracted_requests_total{model_name="m"} 12.0
sglang:num_retracted_requests_created{model_name="m"} 1.7e9
"""
    m = metrics_from_text(sglang)
    assert (m.running, m.waiting, m.kv_usage, m.retractions_total) == (37.0, 3.0, 0.93, 12.0)
    vllm = """vllm:num_requests_running{engine="0",model_name="m"} 200.0
vllm:num_requests_waiting{engine="0",model_name="m"} 17.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0 1700000000000
"""
    m = metrics_from_text(vllm)
    assert (m.running, m.waiting, m.kv_usage, m.retractions_total) == (200.0, 17.0, 0.5, 3.0)
    assert metrics_from_text("").running is None


def test_capacity_from_server_info():
    info = {"max_running_requests": 48, "internal_states": [
        {"effective_max_running_requests_per_dp": 20}, {"effective_max_running_requests_per_dp": 17}]}
    assert capacity_from_info(info) == 37, "the effective per-rank values win over the configured one"
    assert capacity_from_info({"max_running_requests": 48, "internal_states": [{}]}) == 48
    assert capacity_from_info({"max_running_requests": None}) is None


# ---------------------------------------------------------------- worker against genq sim


def status(rconn, name: str) -> WorkerStatus | None:
    raw = rconn.get(keys.worker_status(name))
    return unpack(raw, WorkerStatus) if raw else None


def wait_for(predicate, timeout: float, what: str, proc=None):
    """conftest.wait_until, failing at once with the worker's log if the worker exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        if proc is not None and not proc.alive():
            raise AssertionError(f"worker exited while waiting for {what}:\n{proc.log()[-3000:]}")
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}"
                         + (f"\n{proc.log()[-3000:]}" if proc is not None else ""))


# These workers never finish their job: at the end of a test they hand it back at once.
QUICK_STOP = ("--grace-period", "0")
# Requests of about a second (50 steps of 20 ms), so slots stay busy for the whole test.
SLOW_SIM = dict(step_ms_base=20, step_ms_per_req=0, tokens_per_step=4, mean_output_tokens=200, output_sigma=0.3)


def enqueue(tmp_path: Path, redis_url: str, n: int, job: str = "conc", batch_size: int = 50) -> None:
    src = tmp_path / f"{job}.jsonl"
    write_prompts(src, n)
    run_genq("enqueue", str(src), "--job", job, "--batch-size", str(batch_size), "--max-tokens", "1000",
             "--output", str(tmp_path / "out"), redis_url=redis_url)


def test_auto_concurrency_from_sim_capacity(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=12, **SLOW_SIM)
    enqueue(tmp_path, redis_url, 300)
    proc = worker(server, "--name", "auto-w", *QUICK_STOP)
    # The first heartbeat comes before any look at /metrics: the target as derived.
    first = wait_for(lambda: (s := status(rconn, "auto-w")) and s.server_capacity is not None and s, 20,
                       "the first heartbeat", proc)
    assert first.server_capacity == 12
    assert first.concurrency_target == 12 + headroom(12) == 14
    assert first.concurrency_limit is None
    # Later the controller may raise it if it ever sees slots idle; never lower here.
    st = wait_for(lambda: (s := status(rconn, "auto-w")) and s.in_flight >= 14 and s.server_running is not None
                    and s, 20, "the worker to fill its window", proc)
    assert st.concurrency_target >= 14
    # The sim's slots are all busy and its queue holds the headroom.
    stats = wait_for(lambda: (s := sim_stats(server))["num_running"] == 12 and s["num_waiting"] >= 1 and s,
                       10, "all 12 sim slots busy with a waiting queue", proc)
    assert stats["num_running"] + stats["num_waiting"] <= 14


def test_command_line_cap_survives_control_reads(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=12, **SLOW_SIM)
    enqueue(tmp_path, redis_url, 300)
    proc = worker(server, "--name", "capped-w", "--concurrency", "5", *QUICK_STOP)
    wait_for(lambda: sim_stats(server)["num_running"] == 5, 20, "5 running requests", proc)
    first = wait_for(lambda: status(rconn, "capped-w"), 20, "the first heartbeat", proc)
    # Two more heartbeats, each of which reads the (absent) control key.
    for _ in range(2):
        seen = first.heartbeat_at
        first = wait_for(lambda seen=seen: (s := status(rconn, "capped-w")) and s.heartbeat_at > seen and s,
                         20, "a later heartbeat", proc)
    st = status(rconn, "capped-w")
    assert (st.concurrency_target, st.concurrency_limit) == (5, 5)
    s = sim_stats(server)
    assert s["num_running"] + s["num_waiting"] <= 5


def test_live_concurrency_change_without_restart(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=12, **SLOW_SIM)
    enqueue(tmp_path, redis_url, 400)
    proc = worker(server, "--name", "live-w", *QUICK_STOP)
    before = wait_for(lambda: (s := status(rconn, "live-w")) and s.in_flight >= 14 and s, 20,
                        "a full window of 14", proc)

    rconn.set(keys.worker_control("live-w"), pack(Control(concurrency=3)))
    wait_for(lambda: (s := status(rconn, "live-w")) and s.concurrency_limit == 3 and s.in_flight <= 3,
               15, "in flight to fall to the live cap of 3", proc)
    wait_for(lambda: (s := sim_stats(server))["num_running"] + s["num_waiting"] <= 3, 10,
               "the sim to run at most 3", proc)
    mid = status(rconn, "live-w")
    assert mid.concurrency_target == 3 and mid.done > before.done, "still working, at the lower cap"

    rconn.set(keys.worker_control("live-w"), pack(Control(concurrency=None)))  # genq concurrency ... auto
    after = wait_for(lambda: (s := status(rconn, "live-w")) and s.concurrency_limit is None
                       and s.in_flight >= 14 and s, 15, "the window back to 14", proc)
    wait_for(lambda: sim_stats(server)["num_running"] == 12, 10, "all sim slots busy again", proc)
    assert proc.alive()
    assert (after.pid, after.started_at) == (before.pid, before.started_at), "same process: no restart"
    assert after.concurrency_target >= 14


def test_more_batches_taken_while_held_ones_drain_long_tails(redis_url, rconn, sim, worker, tmp_path):
    """Each batch of 10 has one long prompt and nine short ones. With --prefetch 2 and
    nothing more, two tails would leave the server's other slots empty; the worker
    must hold more batches while the queue still has some."""
    server = sim(max_running_requests=4, step_ms_base=10, step_ms_per_req=0, tokens_per_step=8,
                 mean_output_tokens=100_000, output_sigma=0)
    src = tmp_path / "tails.jsonl"
    with open(src, "w") as f:
        for i in range(100):
            # The sim's natural length is huge; max_tokens sets each prompt's length.
            tokens = 2400 if i % 10 == 0 else 8
            f.write(json.dumps({"id": f"t{i:03d}", "messages": [{"role": "user", "content": f"tail {i}"}],
                                "sampling": {"max_tokens": tokens}}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "tails", "--batch-size", "10", "--output", str(out),
             redis_url=redis_url)
    proc = worker(server, "--name", "tails-w", "--burst", "--prefetch", "2")
    held_max = 0
    busy_while_held = False
    deadline = time.monotonic() + 90
    while proc.alive() and time.monotonic() < deadline:
        st = status(rconn, "tails-w")
        if st is not None:
            held_max = max(held_max, len(st.batches))
            if len(st.batches) > 2 and sim_stats(server)["num_running"] == 4:
                busy_while_held = True
        time.sleep(0.2)
    assert proc.wait(timeout=30) == 0, proc.log()[-3000:]
    assert held_max > 2, f"held at most {held_max} batches: slots would idle behind two tails"
    assert busy_while_held, "every sim slot busy while tails were held"
    rows = read_results(out, "tails")
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    assert sum(sim_stats(server)["generated_by_key"].values()) == 100, "each prompt generated once"


def test_sim_metrics_page_is_understood(sim):
    """The controller reads the sim's real /metrics page (what the worker polls)."""
    import asyncio

    from genq.worker.server import ServerClient

    server = sim(max_running_requests=6, **SLOW_SIM)

    async def look() -> tuple:
        client = ServerClient(server)
        try:
            info = await client.discover()
            return info, await client.metrics()
        finally:
            await client.close()

    info, m = asyncio.run(look())
    assert info.capacity == 6 and info.has_metrics and info.flavor == "sglang"
    assert (m.running, m.waiting) == (0.0, 0.0) and m.kv_usage is not None


# ---------------------------------------------------------------- answers, typed fast path and fallback


def feed_all(events: list[bytes]):
    from genq.worker.server import Progress, StreamSink

    progress = Progress()
    state = StreamSink("m", progress)
    for payload in events:
        failure = state.feed(payload)
        if failure is not None:
            return failure, progress
        if state.done:
            break
    return (state.completion() if state.done else None), progress


def test_stream_events_are_read_like_sglang_and_vllm_send_them():
    chunk = {"id": "r1", "object": "chat.completion.chunk", "model": "served", "choices": []}

    def ev(**fields) -> bytes:
        return json.dumps({**chunk, **fields}).encode()

    usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8, "reasoning_tokens": 1}
    done, progress = feed_all([
        ev(choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]),
        ev(choices=[{"index": 0, "delta": {"reasoning_content": "think "}}], usage={**usage, "completion_tokens": 1}),
        ev(choices=[{"index": 0, "delta": {"reasoning": "more ", "content": "Hi"}}]),  # vLLM's field name
        ev(choices=[{"index": 0, "delta": {}, "finish_reason": "stop", "matched_stop": 151645}], usage=usage),
        b"[DONE]",
    ])
    first = done.choices[0]
    assert (first.completion, first.reasoning_content, first.finish_reason) == ("Hi", "think more ", "stop")
    assert (done.usage.prompt_tokens, done.usage.completion_tokens, done.usage.reasoning_tokens) == (5, 3, 1)
    assert (done.model, done.response_id, progress.tokens) == ("served", "r1", 3)
    # Without usage stats the events are counted; a field of another type takes the generic path.
    done, progress = feed_all([ev(choices=[{"delta": {"content": "a"}}]),
                               ev(choices=[{"delta": {"content": ["odd", "parts"]}, "finish_reason": "length"}]),
                               ev(choices=[{"delta": {"content": "b"}}]), b"[DONE]"])
    assert (done.choices[0].completion, done.choices[0].finish_reason, progress.tokens) == ("ab", "length", 3)
    failure, _ = feed_all([ev(choices=[{"delta": {"content": "a"}}]),
                           json.dumps({"error": {"message": "boom", "code": 500}}).encode()])
    assert (failure.kind, failure.message, failure.status) == ("server_error", "boom", 500)
    # SGLang's code 400 on an error event after output is no verdict on the prompt: retried.
    sglang_error = json.dumps({"error": {"object": "error", "message": "boom", "type": "BadRequestError",
                                         "param": None, "code": 400}}).encode()
    failure, _ = feed_all([ev(choices=[{"delta": {"content": "a"}}]), sglang_error])
    assert (failure.kind, failure.status, failure.retryable) == ("server_error", 400, True)
    failure, _ = feed_all([sglang_error])  # before any output: a rejected request, as a 400 answer is
    assert (failure.kind, failure.retryable) == ("bad_request", False)
    failure, _ = feed_all([b"[1, 2]"])
    assert failure.kind == "protocol"


def test_whole_answers_typed_and_generic():
    from genq.worker.server import Completion, Failure, parse_completion_bytes

    sglang = {"id": "c1", "object": "chat.completion", "model": "served", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "Hello", "reasoning_content": "hmm", "tool_calls": None},
        "finish_reason": "length"}], "usage": {"prompt_tokens": 7, "completion_tokens": 9,
                                                "completion_tokens_details": {"reasoning_tokens": 4}}}
    c = parse_completion_bytes(json.dumps(sglang).encode(), "m")
    assert isinstance(c, Completion)
    first = c.choices[0]
    assert (first.completion, first.reasoning_content, first.finish_reason, c.model, c.response_id) == \
        ("Hello", "hmm", "length", "served", "c1")
    assert (c.usage.prompt_tokens, c.usage.completion_tokens, c.usage.reasoning_tokens) == (7, 9, 4)
    text = {"id": "c2", "choices": [{"index": 0, "text": "plain", "finish_reason": "stop"}]}
    assert parse_completion_bytes(json.dumps(text).encode(), "m").choices[0].completion == "plain"
    flat_error = {"object": "error", "message": "The input (9 tokens) is longer than...", "type": "BadRequestError",
                  "param": None, "code": 400}
    f = parse_completion_bytes(json.dumps(flat_error).encode(), "m")
    assert isinstance(f, Failure) and (f.kind, f.status, f.retryable) == ("bad_request", 400, False)
    nested = {"error": {"message": "model not found", "code": 404}}
    f = parse_completion_bytes(json.dumps(nested).encode(), "m")
    assert isinstance(f, Failure) and f.message == "model not found"
    odd = {"choices": [{"message": {"content": [{"type": "text", "text": "x"}]}, "finish_reason": "stop"}]}
    assert isinstance(parse_completion_bytes(json.dumps(odd).encode(), "m"), Completion)


def test_in_flight_stays_within_the_target_through_waves(redis_url, rconn, sim, worker, tmp_path):
    """Answers of one length end in the same step, a wave at a time: the server's next figures show
    its slots empty while the worker still counts those answers, on their way back, or their
    successors, on their way in. Those slots are not idle: raising the target for them sends more
    than the server runs, lowered again once they queue, and in flight stays above the target
    shown until they are answered (vLLM, 128 slots: 163 in flight of a 141 target for ~30 s)."""
    server = sim(max_running_requests=16, step_ms_base=40, step_ms_per_req=0, tokens_per_step=4,
                 mean_output_tokens=20, output_sigma=0, flavor="vllm")
    enqueue(tmp_path, redis_url, 3000, batch_size=64)
    proc = worker(server, "--name", "wave-w", *QUICK_STOP)
    # It starts at 64 against 16 slots: once learned, the start drains to the target.
    wait_for(lambda: (s := status(rconn, "wave-w")) and s.server_capacity == 16
             and s.sequences <= s.concurrency_target, 30, "the capacity learned and in flight within it", proc)
    seen, over = [], []
    deadline = time.monotonic() + 20  # about 80 waves of 0.2 s
    while time.monotonic() < deadline:
        st = status(rconn, "wave-w")
        seen.append((st.sequences, st.concurrency_target))
        if st.sequences > st.concurrency_target:
            over.append(seen[-1])
        time.sleep(0.05)
    assert not over, f"in flight above the target shown: {over[:10]} ({proc.log()[-2000:]})"
