"""genq worker against a real `genq sim` and real Redis: results, crash recovery, rq info."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.sim.lengths import prompt_key
from tests.conftest import read_results, run_genq, sim_stats, wait_until, write_prompts

FAST_SIM = dict(mean_output_tokens=64, output_sigma=1.0, tokens_per_step=16, step_ms_base=5)








def test_burst_worker_completes_job_with_one_result_per_id(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=8, **FAST_SIM)
    src = tmp_path / "prompts.jsonl"
    ids = write_prompts(src, 120, extra={"lang": "en"})
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "e2e", "--batch-size", "25", "--max-tokens", "300",
             "--output", str(out), "--extra-body", '{"chat_template_kwargs": {"enable_thinking": true}}',
             redis_url=redis_url)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    rows = read_results(out, "e2e")
    assert sorted(r["id"] for r in rows) == ids
    row = rows[0]
    assert row["metadata"] == {"lang": "en"}
    assert row["messages"][0]["content"].startswith("prompt number")
    assert row["finish_reason"] in ("stop", "length")
    assert row["usage"]["completion_tokens"] > 0 and row["usage"]["prompt_tokens"] > 0
    assert row["reasoning_content"], "thinking was enabled: the sim separates reasoning"
    assert row["model"] == "genq-sim/Sim-8B" and row["attempts"] == 1 and row["worker"]
    # Every prompt was generated exactly once.
    generated = sim_stats(server)["generated_by_key"]
    assert sum(generated.values()) == 120
    assert len(list((out / "e2e" / "manifest").glob("*.json"))) == 5
    assert rconn.scard(keys.job_done("e2e")) == 5
    assert rq_queue(rconn).count == 0
    # Counters the monitor reads equal the results on disk.
    stats = rconn.hgetall(keys.worker_stats("e2e", row["worker"]))
    assert int(stats[b"done"]) == 120
    assert int(stats[b"out_tok"]) == sum(r["usage"]["completion_tokens"] for r in rows)


def test_rq_info_shows_queue_and_workers_truthfully(redis_url, sim, worker, tmp_path):
    server = sim(max_running_requests=4, mean_output_tokens=2000, output_sigma=0.1, tokens_per_step=8,
                 step_ms_base=20)
    src = tmp_path / "p.jsonl"
    write_prompts(src, 40)
    run_genq("enqueue", str(src), "--job", "info", "--batch-size", "10", "--output", str(tmp_path / "o"),
             redis_url=redis_url)

    def rq_info() -> str:
        return subprocess.run([sys.executable, "-m", "rq.cli", "info", "-u", redis_url],
                              capture_output=True, text=True).stdout

    assert "genq         |████ 4" in rq_info()
    proc = worker(server, "--prefetch", "2")
    def info_showing(needle: str):
        text = rq_info()
        return text if needle in text else None

    text = wait_until(lambda: info_showing("1 workers"), 30, "the engine in rq info")
    assert re.search(r"\b[123] executing", text), text  # the batches it holds: --prefetch 2, a third while tails drain
    assert re.search(r"\): (idle|busy) genq", text), text
    proc.signal(signal.SIGTERM)
    wait_until(lambda: "finishing held batches" in proc.log(), 10, "the first signal to be seen")
    proc.signal(signal.SIGTERM)  # second signal: hand back at once
    assert proc.wait(timeout=60) == 0, proc.log()
    log = proc.log()
    assert "cold shut down" not in log.lower(), "RQ's cold shutdown reached the loops"
    assert "exited: 0 batches completed, 2 handed back" in log, "the worker must say it exited and how"
    text = wait_until(lambda: info_showing("0 workers"), 30, "workers gone from rq info")
    assert "0 executing" in text
    assert "genq         |████ 4" in text, "handed-back batches are queued again"


def test_killed_worker_batch_finishes_on_restart_without_regenerating(redis_url, rconn, sim, worker, tmp_path):
    server = sim(max_running_requests=6, mean_output_tokens=400, output_sigma=1.0, tokens_per_step=16,
                 step_ms_base=10)
    src = tmp_path / "p.jsonl"
    ids = write_prompts(src, 60)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "crash", "--batch-size", "60", "--max-tokens", "2000",
             "--output", str(out), redis_url=redis_url)
    first = worker(server, name="first")
    results_key = keys.batch_results("crash", "b0000001")
    wait_until(lambda: rconn.hlen(results_key) >= 15, 60, "15 recorded results")
    first.signal(signal.SIGKILL)  # the whole worker: one process
    first.wait(timeout=10)
    finished_before = {k.decode() for k in rconn.hkeys(results_key)}
    assert 15 <= len(finished_before) < 60
    # Its RQ job stays "started" by a loop whose engine no longer heartbeats; the
    # ledger still says the batch is not done, so the next worker's reconciler queues it again.
    second = worker(server, "--burst", name="second")
    assert second.wait(timeout=120) == 0, second.log()
    rows = read_results(out, "crash")
    assert sorted(r["id"] for r in rows) == ids, "exactly one result per prompt"
    generated = sim_stats(server)["generated_by_key"]
    content = {r["id"]: r["messages"] for r in rows}
    for pid in finished_before:
        assert generated[prompt_key(content[pid])] == 1, f"{pid} finished before the kill and was regenerated"
    assert "already done, not regenerating them" in second.log()
    assert "had no live RQ job" in second.log()


def test_burst_worker_gives_up_on_a_server_that_never_answers(redis_url, tmp_path):
    """A typo'd port used to wait forever after one INFO line, even with --burst."""
    from tests.conftest import free_port, genq_cmd

    port = free_port()  # nothing listens there
    started = subprocess.run(genq_cmd("worker", "--server", f"http://127.0.0.1:{port}", "--burst",
                                      "--server-start-timeout", "3", redis_url=redis_url),
                             capture_output=True, text=True, timeout=60)
    assert started.returncode == 1, started.stderr
    err = started.stderr
    assert f"server http://127.0.0.1:{port} did not answer within 3s (--server-start-timeout)" in err
    assert err.count("waiting for server") >= 1 and "so far" in err
