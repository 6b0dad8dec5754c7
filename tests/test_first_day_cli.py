"""The first day on a real fleet (#28): what the commands say, and the ones a user expects.

A burst worker on a dead port, bad job names (exit 2), counts in words ("1 batch"), a
whitespace-only input, the 'stream' message, `dlq --help`; `genq status JOB ID`,
`genq enqueue --dry-run`, and enqueue's percent and ETA on a big file.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

from genq.core import keys
from tests.conftest import free_port, genq_cmd, run_genq, run_genq_on_a_tty, wait_until, write_prompts
from tests.test_fleet import free_ports

FAST = dict(step_ms_base=2, step_ms_per_req=0, tokens_per_step=16, mean_output_tokens=24, output_sigma=0.5)


def test_a_burst_worker_on_a_dead_port_says_so_finally_within_a_minute(redis_url):
    dead = f"http://127.0.0.1:{free_port()}"
    started = time.monotonic()
    proc = subprocess.run(genq_cmd("worker", "--server", dead, "--burst"), capture_output=True, text=True, timeout=90)
    took = time.monotonic() - started
    assert proc.returncode == 1 and took < 60, (took, proc.stderr[-2000:])
    assert "did not answer within 30s" in proc.stderr and "--server-start-timeout" in proc.stderr, proc.stderr[-2000:]
    # Said at once too, not only at the end.
    assert proc.stderr.index("waiting for server") < proc.stderr.index("did not answer")


def test_a_bad_job_name_is_bad_usage_everywhere(redis_url, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 1)
    for args in (("enqueue", str(tmp_path / "p.jsonl"), "--job", "bad/name"),
                 ("monitor", "--once", "--job", "bad/name"),
                 ("pause", "--job", "bad/name"), ("status", "bad/name", "p00000")):
        proc = run_genq(*args, check=False)
        assert proc.returncode == 2 and "invalid job name 'bad/name'" in proc.stderr, (args, proc.stderr)


def test_counts_are_in_words_and_an_input_of_blank_lines_is_called_that(redis_url, tmp_path):
    write_prompts(tmp_path / "one.jsonl", 1)
    out = run_genq("enqueue", str(tmp_path / "one.jsonl"), "--job", "one").stdout
    assert "queued 1 prompt in 1 batch (" in out, out
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n   \n\t\n")
    proc = run_genq("enqueue", str(blank), "--job", "blank", check=False)
    assert proc.returncode == 1 and "holds only blank lines" in proc.stderr and "it is empty" not in proc.stderr
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert "(it is empty)" in run_genq("enqueue", str(empty), "--job", "empty", check=False).stderr


def test_a_job_of_one_prompt_is_counted_in_words_to_the_end(redis_url, tmp_path, sim, worker):
    """The worker's exit line, its dead letters, the monitor's shard line and a repeated line
    each counted once: "1 batch completed", not "1 batches"."""
    src = tmp_path / "one.jsonl"
    write_prompts(src, 1)
    src.write_text(src.read_text() * 2)  # the same line twice: one repeated line
    out = run_genq("enqueue", str(src), "--job", "one", "--output", str(tmp_path / "out")).stdout
    assert "skipped 1 repeated line (" in out, out
    proc = worker(sim(**FAST), "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    assert "exited: 1 batch completed, 0 handed back" in proc.log(), proc.log()[-2000:]
    shown = run_genq("monitor", "--job", "one", "--once").stdout
    assert "1 record)" in shown and "1 records" not in shown, shown


def test_the_stream_message_names_the_switch_that_exists_and_dlq_help_counts_right(redis_url, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 1)
    proc = run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "s", "--extra-body", '{"stream": false}',
                    check=False)
    assert "'stream' cannot be set here" in proc.stderr and "--no-stream" in proc.stderr, proc.stderr
    assert "always streams" not in proc.stderr
    text = run_genq("dlq", "--help").stdout
    kinds = [k for k in ("prompts ", "batch_failed ", "server_crash ") if k in text]
    assert "Three kinds of entries" in text and len(kinds) == 3, text


def test_dry_run_checks_everything_says_what_a_real_run_does_and_writes_nothing(redis_url, rconn, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 30)
    lines = src.read_text().splitlines()
    with open(src, "a") as f:
        f.write("{not json\n")  # line 31: rejected
        f.write(lines[0] + "\n")  # line 32: a repeated line, skipped
        f.write(lines[1].replace("prompt number 1", "other content") + "\n")  # line 33: same id, other content
    args = ("enqueue", str(src), "--job", "dry", "--output", str(tmp_path / "out"), "--batch-size", "8")
    proc = run_genq(*args, "--dry-run", check=False)
    assert proc.returncode == 3, proc.stderr
    assert ("30 prompts would be queued in 4 batches" in proc.stdout
            and "1 repeated line would be skipped" in proc.stdout
            and "2 lines rejected" in proc.stdout), proc.stdout
    assert ("line 31: invalid JSON" in proc.stderr
            and "line 33: duplicate id 'p00001' with different content" in proc.stderr)
    assert rconn.dbsize() == 0 and not (tmp_path / "out").exists()
    # The real run does what the dry run said.
    real = run_genq(*args, check=False)
    assert real.returncode == 3 and "queued 30 prompts in 4 batches" in real.stdout, real.stdout
    assert "skipped 1 repeated line" in real.stdout and "rejected 2 lines" in real.stderr, (real.stdout, real.stderr)
    # Into the existing job: settings that contradict it are refused as a real enqueue refuses them...
    proc = run_genq("enqueue", str(src), "--job", "dry", "--batch-size", "9", "--dry-run", check=False)
    assert proc.returncode == 1 and "already exists with other settings" in proc.stderr, proc.stderr
    # ...and ids already queued are counted, nothing written.
    keys_before = {k: rconn.dump(k) for k in rconn.keys("*")}
    proc = run_genq("enqueue", str(src), "--job", "dry", "--dry-run", check=False)
    assert "0 prompts would be queued in 0 batches" in proc.stdout and "30 prompts already queued" in proc.stdout
    assert {k: rconn.dump(k) for k in rconn.keys("*")} == keys_before


def test_status_tells_the_fate_of_one_prompt(redis_url, rconn, tmp_path, sim, worker):
    from tests.test_dlq import SMALL_CONTEXT, write_mixed

    _, long_ids = write_mixed(tmp_path / "p.jsonl", 12, long_every=6)
    out = tmp_path / "out"
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "fate", "--output", str(out), "--batch-size", "4",
             "--max-tokens", "16")

    def fate(pid: str) -> dict:
        return json.loads(run_genq("status", "fate", pid, "--json").stdout)

    assert fate("p00000") == {"state": "queued", "batch": "b0000001", "why": "its batch waits for a worker"}
    proc = run_genq("status", "fate", "nosuch", check=False)
    assert proc.returncode == 1 and "no prompt with id 'nosuch'" in proc.stderr
    assert worker(sim(context_length=SMALL_CONTEXT, **FAST), "--burst").wait(90) == 0
    done = fate("p00000")
    assert done["state"] == "done" and done["record"]["id"] == "p00000" and done["record"]["completion"], done
    assert str(out) in done["why"]
    dead = fate(long_ids[0])
    assert dead["state"] == "dead-lettered" and dead["letter"]["kind"] == "bad_request", dead
    text = run_genq("status", "fate", long_ids[0]).stdout
    assert text.startswith(f"fate {long_ids[0]}: dead-lettered") and "bad_request after" in text, text
    assert rconn.scard(keys.job_done("fate")) == 3


def test_status_finds_a_written_prompt_whatever_its_id_holds(redis_url, tmp_path, sim, worker):
    """An id is any string: one JSON escapes in the shard (a quote, a backslash, a tab) is found there too."""
    ids = ['say "hi"', "back\\slash", "tab\there", "a/b c", "ünï-✓"]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": "hi"}) + "\n" for i in ids))
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "odd", "--output", str(tmp_path / "out"))
    assert worker(sim(**FAST), "--burst").wait(90) == 0
    for pid in ids:
        fate = json.loads(run_genq("status", "odd", pid, "--json").stdout)
        assert fate["state"] == "done" and fate["record"]["id"] == pid, (pid, fate)


def test_enqueue_shows_percent_and_eta_on_a_big_file(redis_url, tmp_path):
    src = tmp_path / "big.jsonl"
    write_prompts(src, 60_000)
    returncode, _, text = run_genq_on_a_tty("enqueue", str(src), "--job", "big", "--batch-size", "1000")
    assert returncode == 0, text
    assert "% of " in text and "MiB, ETA " in text, text[-2000:]
    assert "100.0% of" in text, text[-500:]


def test_status_says_sending_and_held_while_a_worker_runs(redis_url, rconn, tmp_path, sim, worker):
    write_prompts(tmp_path / "p.jsonl", 8)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "slow", "--batch-size", "4", "--max-tokens", "400",
             "--output", str(tmp_path / "out"))
    url = sim(max_running_requests=1, step_ms_base=1000, step_ms_per_req=0, tokens_per_step=1, mean_output_tokens=200,
              output_sigma=0.1)
    w = worker(url, "--concurrency", "1", "--name", "slow-w")

    batches = [[f"p{i:05d}" for i in range(first, first + 4)] for first in (0, 4)]

    def states(batch: list[str]) -> dict[str, str]:
        return {pid: json.loads(run_genq("status", "slow", pid, "--json").stdout)["state"]
                for pid in batch}

    def sending_batch() -> dict[str, str] | None:
        # Either batch may go first: both are leased, and whichever the engine got first is sent
        # first (seen under load: the second). The four of a batch are asked one after another
        # while the worker starts: until their batch is leased, queued.
        for batch in batches:
            if (s := states(batch)) and "sending" in s.values() and "queued" not in s.values():
                return s
        return None

    # A look is eight CLI runs, seconds each on a loaded machine (at 40 s a request, one was done by the
    # end of a look at load 11): the state it waits for lasts the first request's 200 s.
    found = wait_until(sending_batch, 150, "a prompt being sent, its batch held")
    # One request at a time (200 s each): none done yet; those not claimed wait in the worker holding the batch.
    assert set(found.values()) <= {"sending", "held"}, found
    engine = json.loads(run_genq("status", "slow", next(p for p, s in found.items() if s == "sending"), "--json")
                        .stdout)["holder"]
    assert engine.startswith("slow-w") and " " not in engine, engine  # the engine, not its lease's token
    # Killed, its engine's liveness lapses: its lease and claims hold nothing, and no prompt of its batch is
    # said to be held or sent by it (the reconciler queues the batch again).
    w.kill_tree()
    wait_until(lambda: not rconn.exists(keys.engine_alive(engine)), 60, "the killed engine's liveness to lapse")
    for pid in found:
        fate = json.loads(run_genq("status", "slow", pid, "--json").stdout)
        assert fate["state"] == "queued" and engine in fate["why"] and "gone" in fate["why"], fate


def test_a_launch_that_cannot_run_here_is_said_at_once_and_a_failing_server_says_why(tmp_path, redis_url):
    """`python -m sglang.launch_server ...` where that python has no sglang (a CPU box): one line at once,
    not 10 restarts per GPU; a server that exits with an error: its log's last line in the warning."""
    out = run_genq("worker", "--gpus", "0,1,2,3", "--log-dir", str(tmp_path / "l1"), "--launch",
                   f"{sys.executable} -m genq_no_such_engine.launch_server --model-path M --port {{port}}",
                   check=False, timeout=60)
    assert out.returncode == 1, out.stderr
    assert f"{sys.executable} has no module 'genq_no_such_engine'" in out.stderr, out.stderr
    assert "genq sim --port {port}" in out.stderr and "restart" not in out.stderr, out.stderr
    out = run_genq("worker", "--gpus", "0", "--base-port", str(free_ports(1)), "--log-dir", str(tmp_path / "l2"),
                   "--launch", "nosuch-genq-server --port {port}", check=False, timeout=60)
    assert out.returncode == 1 and "'nosuch-genq-server' is not a command on this machine's PATH" in out.stderr, \
        out.stderr
    out = run_genq("worker", "--gpus", "0", "--base-port", str(free_ports(1)), "--log-dir", str(tmp_path / "l3"),
                   "--max-restarts", "1", "--launch", f"{sys.executable} -c \"raise SystemExit('no model M here')\"",
                   check=False, timeout=120)
    assert out.returncode == 1, out.stderr
    assert "exited with status 1 (its log ends: no model M here); restart 1/1" in out.stderr, out.stderr


def test_a_fleet_takes_redis_after_the_subcommand(tmp_path, redis_url):
    """`genq worker --gpus ... --redis URL`: the fleet forwarded the shared options the operator gave
    to each GPU's worker and tripped over --redis, which a subcommand takes but does not hold."""
    out = run_genq("worker", "--gpus", "0", "--base-port", str(free_ports(1)), "--log-dir", str(tmp_path / "l"),
                   "--launch", "nosuch-genq-server --port {port}", "--redis", redis_url, check=False, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "'nosuch-genq-server' is not a command on this machine's PATH" in out.stderr, out.stderr
