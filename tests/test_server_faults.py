"""One server's fault costs no good prompt and does not hold up the others.

Real processes: a private redis-server, `genq sim` servers (their fault switches, and a real
restart: the process killed and another started on its port with other options), `genq worker`,
and the shared exactly-once audit (tests/audit.py) at the end of each test.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from pathlib import Path

import pytest

from genq.core import keys
from genq.core.records import WorkerStatus, unpack
from tests.audit import audit
from tests.conftest import enqueue, post_json, run_genq, sim_stats, wait_until

FAST = dict(mean_output_tokens=24, output_sigma=0.5, tokens_per_step=16, step_ms_base=2, max_running_requests=8)
# About 2 s a request, 4 at a time: a 20-prompt batch takes 10 s on it.
SLOW = dict(mean_output_tokens=400, output_sigma=0.2, tokens_per_step=8, step_ms_base=40, step_ms_per_req=0,
            max_running_requests=4)


def status_of(rconn, name: str) -> WorkerStatus | None:
    raw = rconn.get(keys.worker_status(name))
    return unpack(raw, WorkerStatus) if raw else None


def worker_name(url: str) -> str:
    """A worker's default name: the host and its server's port."""
    return f"{socket.gethostname()}.{url.rsplit(':', 1)[1]}"


def test_a_dead_servers_prompts_go_to_the_other_server(redis_url, rconn, sim, worker, tmp_path):
    """kill -9 of one of two servers while its worker holds a batch: within tens of seconds (not the
    --server-down-timeout of 300 s) the other worker takes its prompts and the job is written whole; the
    dead server's worker says server_down with no figures of the server it no longer has."""
    slow = sim(**SLOW)
    fast = sim(**FAST)
    ids, out = enqueue(tmp_path, redis_url, "dead", 40, "--batch-size", "20", "--max-tokens", "600")
    holder = worker(slow, "--prefetch", "1", name="holder")
    name = worker_name(slow)
    wait_until(lambda: (s := status_of(rconn, name)) and s.in_flight >= 4, 30, "the slow server busy with a batch")
    sim.procs[slow].kill_tree()  # kill -9: connections reset, the port closed
    other = worker(fast, "--burst", "--prefetch", "1", name="other")
    assert other.wait(timeout=60) == 0, other.log() + holder.log()
    found = audit(rconn, "dead", out, ids)
    assert not found.letters
    status = status_of(rconn, name)
    assert status is not None and status.state == "server_down", status
    assert status.server_running is None and status.server_token_usage is None, status
    holder.signal(signal.SIGTERM)
    assert holder.wait(timeout=30) == 0, holder.log()


def test_a_server_answering_500_to_everything_costs_no_prompt(redis_url, rconn, sim, worker, tmp_path):
    """Every request answered 500 while /health says 200, long enough for every prompt to run out of
    attempts: no prompt is dead-lettered (nothing on this server succeeds, so nothing says it is the
    prompt); once the server answers again the job is written whole."""
    url = sim(error_rate=1.0, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "e500", 30, "--batch-size", "15", "--max-tokens", "64",
                       "--max-attempts", "3")
    proc = worker(url, "--burst", "--retry-backoff", "0.05")
    name = worker_name(url)
    wait_until(lambda: (s := status_of(rconn, name)) and s.errors >= 3 * len(ids), 30,
               "every prompt failed as often as its attempts allow")
    post_json(url + "/sim/faults", {"error_rate": 0.0})
    assert proc.wait(timeout=60) == 0, proc.log()
    # Said to the operator in one line, not one a request (they were DEBUG only).
    said = [line for line in proc.log().splitlines() if "failed while it is up" in line]
    assert len(said) == 1 and "HTTP 500" in said[0] and "Internal server error (simulated)" in said[0], said
    found = audit(rconn, "e500", out, ids)
    assert not found.letters, {k: v.message for k, v in found.letters.items()}


# About 0.8 s a request (64 tokens at most), 4 at a time.
MEDIUM = dict(mean_output_tokens=100, output_sigma=0.3, tokens_per_step=8, step_ms_base=100, step_ms_per_req=0,
              max_running_requests=4)


def restart(sim, url: str, **options) -> None:
    """The server process killed and another started on its port, with these options. Down for
    half a second, as long as genq sim's own start takes (a real server takes tens of seconds): the
    tests fork their sims from a warm interpreter (tests/zygote.py), quicker than any restart."""
    sim.procs[url].kill_tree()
    time.sleep(0.5)
    sim(port=int(url.rsplit(":", 1)[1]), **options)


def mixed_prompts(path: Path, n: int) -> list[str]:
    """n prompts, every other one about 130 tokens long (the sim's count), the rest about 5."""
    ids = []
    with open(path, "w") as f:
        for i in range(n):
            ids.append(pid := f"p{i:05d}")
            text = f"prompt number {i}" + (" word" * 100 if i % 2 else "")
            f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": text}]}) + "\n")
    return ids


@pytest.mark.parametrize("context", [50, 100])
def test_a_server_restarted_with_a_smaller_context_costs_no_prompt(context, redis_url, rconn, sim, worker, tmp_path):
    """One of two servers restarted for a few seconds with a smaller context (50: no prompt of the job
    fits; 100: the short ones do, the long ones not), then as it was. Its worker notices before sending
    to it again and waits for it: the job is never blocked, no prompt is dead-lettered, the other
    server goes on, and every prompt is written once."""
    a, b = sim(**MEDIUM), sim(**MEDIUM)
    src = tmp_path / "mixed.jsonl"
    ids = mixed_prompts(src, 48)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "ctx", "--output", str(out), "--batch-size", "10", "--max-tokens", "64",
             redis_url=redis_url)
    wa = worker(a, "--prefetch", "1", name="a")
    wb = worker(b, "--burst", "--prefetch", "1", name="b")
    wait_until(lambda: (s := status_of(rconn, worker_name(a))) and s.done >= 4, 60, "the first server working")
    restart(sim, a, context_length=context, **MEDIUM)
    time.sleep(5)
    restart(sim, a, **MEDIUM)
    assert wb.wait(timeout=120) == 0, wb.log() + wa.log()
    assert not rconn.exists(keys.job_blocked("ctx")), rconn.get(keys.job_blocked("ctx"))
    found = audit(rconn, "ctx", out, ids)
    assert not found.letters, {k: v.message for k, v in found.letters.items()}
    assert "its context is" in wa.log(), wa.log()


def test_a_server_restarted_with_another_model_answers_nothing_of_the_job(redis_url, rconn, sim, worker, tmp_path):
    """One of two servers restarted mid-job serving another model (the sim, like SGLang, answers under
    whatever model name a request asks for): its worker notices before sending to it again and hands its
    batches back; the new model generates nothing of the job, the other server writes it whole."""
    a, b = sim(**MEDIUM), sim(**FAST)
    ids, out = enqueue(tmp_path, redis_url, "model", 60, "--batch-size", "10", "--max-tokens", "64")
    wa = worker(a, "--prefetch", "1", name="a")
    wait_until(lambda: (s := status_of(rconn, worker_name(a))) and s.done >= 2, 60, "the first server working")
    restart(sim, a, served_model_name="other-model", **MEDIUM)
    wb = worker(b, "--burst", "--prefetch", "1", name="b")
    assert wb.wait(timeout=120) == 0, wb.log() + wa.log()
    found = audit(rconn, "model", out, ids)
    assert not found.letters
    assert sim_stats(a)["generation_requests"] == 0, "the other model generated prompts of the job"
    assert "serves model other-model now" in wa.log(), wa.log()


def test_resume_reads_the_context_of_a_server_restarted_meanwhile(redis_url, rconn, sim, worker, tmp_path):
    """Blocked by the preflight (max_tokens over the context), the server restarted with a larger one,
    then `genq resume --job`: the preflight reads the server again and the job runs."""
    url = sim(context_length=1000, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "pre", 20, "--batch-size", "10", "--max-tokens", "2000")
    proc = worker(url, name="w")
    wait_until(lambda: rconn.exists(keys.job_blocked("pre")), 30, "the job blocked by the preflight")
    restart(sim, url, context_length=4096, **FAST)
    run_genq("resume", "--job", "pre", redis_url=redis_url)
    # Within seconds: the batches the resume queued are taken and sent, not parked again by a worker
    # that has not read the lift yet and left for the reconciler (10 s and more later).
    wait_until(lambda: rconn.scard(keys.job_done("pre")) == 2 or rconn.exists(keys.job_blocked("pre")), 8,
               "the job done, or blocked again")
    assert not rconn.exists(keys.job_blocked("pre")), proc.log()
    audit(rconn, "pre", out, ids)


def test_a_server_restarted_with_another_model_while_idle_answers_nothing(redis_url, rconn, sim, worker, tmp_path):
    """A restart while nothing is in flight shows no failure: the worker looks at its server again
    before its first request after a quiet spell, so a job for the old model sent after the restart
    gets nothing from the new one."""
    url = sim(**FAST)
    first, out = enqueue(tmp_path, redis_url, "before", 5, "--max-tokens", "16")
    proc = worker(url, name="w")
    wait_until(lambda: rconn.scard(keys.job_done("before")) == 1, 30, "the first job done")
    restart(sim, url, served_model_name="other-model", **FAST)
    enqueue(tmp_path, redis_url, "after", 10, "--max-tokens", "16", "--model", "genq-sim/Sim-8B")
    wait_until(lambda: "handing its batches back" in proc.log() or sim_stats(url)["generation_requests"], 30,
               "the worker noticing, or the new model answering")
    assert sim_stats(url)["generation_requests"] == 0, proc.log()
    # Handed back once, by the watch, then left queued for a server of its model: not taken and handed
    # back again (its skip list is read again under the new model, tests/test_model_change.py), nor in
    # a loop, a new RQ job each time.
    carriers = set()
    for _ in range(30):
        carriers.add(rconn.hget(keys.job_transport("after"), "b0000001"))
        time.sleep(0.05)
    assert len(carriers) <= 2, f"the batch went back to the queue {len(carriers)} times in 1.5 s\n{proc.log()}"


def test_a_stream_held_open_after_its_done_is_recorded_once(redis_url, rconn, sim, worker, tmp_path):
    """Each stream's body never ends after its `data: [DONE]` (the connection held open): the answer is whole,
    recorded once, its connection closed. It was cancelled by the stall watchdog and generated again."""
    url = sim(**FAST)
    post_json(url + "/sim/faults", {"hold_open": True})
    ids, out = enqueue(tmp_path, redis_url, "held", 6, "--batch-size", "6", "--max-tokens", "16")
    proc = worker(url, "--burst", "--stall-timeout", "2", "--server-down-timeout", "4", "--retry-backoff", "0.05")
    assert proc.wait(timeout=60) == 0, proc.log()
    found = audit(rconn, "held", out, ids)
    assert not found.letters, {k: v.message for k, v in found.letters.items()}
    assert sim_stats(url)["generation_requests"] == len(ids), proc.log()


def test_every_prompt_in_flight_through_an_outage_counts_a_server_crash(redis_url, rconn, sim, worker, tmp_path):
    """An outage drops every request in flight: each of their prompts counts a server crash, not only those
    still in flight when the worker saw it down (--server-crash-limit 1: each is a dead letter)."""
    url = sim(**{**SLOW, "max_running_requests": 18})
    ids, out = enqueue(tmp_path, redis_url, "crash", 40, "--batch-size", "40", "--max-tokens", "600")
    proc = worker(url, "--burst", "--server-crash-limit", "1")
    wait_until(lambda: (s := status_of(rconn, worker_name(url))) and s.in_flight >= 12, 30, "requests in flight")
    post_json(url + "/sim/faults", {"outage_for": 3})
    assert proc.wait(timeout=120) == 0, proc.log()
    dropped = sim_stats(url)["aborted_requests"]
    found = audit(rconn, "crash", out, ids)
    assert dropped >= 12 and len(found.letters) >= dropped, (dropped, len(found.letters), proc.log())
    assert {v.kind for v in found.letters.values()} == {"server_crash"}, found.letters
    # Said as it is: it said "0 in flight counted a server crash" (the others' failures came before its check).
    down = [line for line in proc.log().splitlines() if " is down: " in line]
    assert down and "each prompt in flight counts a server crash (--server-crash-limit)" in down[0], down


def test_a_server_failing_everything_past_its_down_timeout_hands_back_and_letters_nothing(
        redis_url, rconn, sim, worker, tmp_path):
    """Every request answered 500 while /health says 200 for longer than --server-down-timeout: no prompt is
    dead-lettered (nothing it sent was answered: no evidence against any prompt); the worker says its server
    is failing, with its answer, in one WARNING line, and its batches go back to the queue; once a request
    succeeds again the job is written whole. They were dead-lettered at --max-attempts."""
    url = sim(error_rate=1.0, **FAST)
    ids, out = enqueue(tmp_path, redis_url, "fail", 20, "--batch-size", "10", "--max-tokens", "64",
                       "--max-attempts", "2")
    proc = worker(url, "--burst", "--retry-backoff", "0.05", "--server-down-timeout", "2")
    wait_until(lambda: "handed back" in proc.log() or rconn.exists(keys.job_dlq("fail")), 60, "batches handed back")
    post_json(url + "/sim/faults", {"error_rate": 0.0})
    assert proc.wait(timeout=120) == 0, proc.log()
    found = audit(rconn, "fail", out, ids)
    assert not found.letters, {k: v.message for k, v in found.letters.items()}
    said = [line for line in proc.log().splitlines() if " is failing: " in line]
    assert said and "HTTP 500" in said[0] and "--server-down-timeout" in said[0], said
    assert "is back after" not in proc.log() and "tried again (it was failing)" in proc.log()  # only a retry
