"""Operator controls end to end: pause/resume, drain, live concurrency, the fleet view, jobs.

Real Redis, real `genq sim` servers, real `genq worker` processes; the CLI is run as
`python -m genq ...` subprocesses exactly as an operator would.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from rq import suspension

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.records import BatchRef, Control, WorkerStatus, pack, unpack
from genq.core.redisconn import connect
from genq.ops import control
from tests.conftest import REDIS_URL, post_json, read_results, run_genq, sim_stats, wait_until, write_prompts

# Slow enough that a job of a few hundred prompts lasts seconds, fast enough for CI.
SLOW_SIM = dict(max_running_requests=4, step_ms_base=25, step_ms_per_req=0, tokens_per_step=8,
                mean_output_tokens=48, output_sigma=0.3)





def workers_json() -> dict[str, dict]:
    """`genq workers --json`, as the operator sees it (a subprocess: use it for assertions)."""
    return {w["name"]: w for w in json.loads(run_genq("workers", "--json").stdout)}


def jobs_json() -> dict[str, dict]:
    return {j["name"]: j for j in json.loads(run_genq("jobs", "--json").stdout)}


def job_now(job: str) -> control.JobRow:
    """The same figures as `genq jobs`, read in-process: cheap enough to poll."""
    conn = connect(REDIS_URL)
    try:
        return control.job_rows(conn, [job])[0]
    finally:
        conn.close()


def worker_now(name: str) -> control.WorkerRow | None:
    conn = connect(REDIS_URL)
    try:
        return {r.name: r for r in control.fleet(conn)}.get(name)
    finally:
        conn.close()





def heartbeats_pass(rconn, name: str, count: int = 3) -> None:
    """Wait until worker `name` has written `count` more heartbeats (it reads its controls after each).

    The window in which "nothing happens" is measured in the worker's own loop turns, not in
    seconds: a worker slowed down by a busy machine gets the same number of chances to misbehave.
    """
    def beat() -> float:
        return unpack(rconn.get(keys.worker_status(name)), WorkerStatus).heartbeat_at

    seen = {beat()}
    first = max(seen)

    def more() -> bool:
        seen.add(beat())
        return sum(1 for at in seen if at > first) >= count

    wait_until(more, 60, f"{count} more heartbeats of {name}", interval=0.05)


def received(stats: dict) -> int:
    """Requests the sim has accepted so far (finished, aborted, running or waiting)."""
    return stats["finished_requests"] + stats["aborted_requests"] + stats["num_running"] + stats["num_waiting"]


def enqueue(tmp_path: Path, job: str, n: int, batch_size: int = 10, start: int = 0) -> list[str]:
    ids = write_prompts(tmp_path / f"{job}.jsonl", n, start=start)
    run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"),
             "--batch-size", str(batch_size), "--max-tokens", "64")
    return ids


def assert_exactly_once(tmp_path: Path, job: str, ids: list[str]) -> list[dict]:
    rows = read_results(tmp_path / "out", job)
    got = [r["id"] for r in rows]
    assert len(got) == len(set(got)), "a prompt has more than one result"
    assert sorted(got) == sorted(ids)
    return rows


def test_pause_stops_new_requests_and_resume_completes(tmp_path, redis_url, rconn, sim, worker):
    url = sim(**SLOW_SIM)
    ids = enqueue(tmp_path, "pz", 100)
    w = worker(url, "--name", "pz-worker")
    wait_until(lambda: job_now("pz").done >= 20, what="20 prompts done")

    out = run_genq("pause")
    assert "paused all jobs" in out.stdout
    assert rconn.exists(keys.PAUSED) and suspension.is_suspended(rconn)
    wait_until(lambda: worker_now("pz-worker").state == "paused", timeout=60, what="the worker to see the pause")
    # In-flight requests finish; then nothing new arrives at the server.
    wait_until(lambda: (s := sim_stats(url))["num_running"] == 0 and s["num_waiting"] == 0, timeout=60,
               what="the server to finish its in-flight requests")
    # The last answers are recorded a moment after the server sent them (seen: 30 done, then 31).
    heartbeats_pass(rconn, "pz-worker", 1)
    before = sim_stats(url)
    done_before = job_now("pz").done
    heartbeats_pass(rconn, "pz-worker")
    after = sim_stats(url)
    assert received(after) == received(before), "requests were sent while paused"
    assert after["generated_tokens"] == before["generated_tokens"]
    assert after["aborted_requests"] == 0, "in-flight requests were cut instead of finishing"
    row = jobs_json()["pz"]
    assert row["done"] == done_before < 100 and row["state"] == "paused" and row["paused"]
    assert workers_json()["pz-worker"]["state"] == "paused"

    out = run_genq("resume")
    assert "resumed all jobs" in out.stdout
    assert not rconn.exists(keys.PAUSED) and not suspension.is_suspended(rconn)
    wait_until(lambda: job_now("pz").state == "done", timeout=180, what="the job to complete")
    assert_exactly_once(tmp_path, "pz", ids)
    assert w.alive()


def test_pause_one_job(tmp_path, redis_url, rconn, sim, worker):
    url = sim(**SLOW_SIM)
    ids = enqueue(tmp_path, "one", 80)
    worker(url, "--name", "job-pauser")
    wait_until(lambda: job_now("one").done >= 20, what="20 prompts done")

    run_genq("pause", "--job", "one")
    assert rconn.exists(keys.job_paused("one")) and not rconn.exists(keys.PAUSED)
    assert not suspension.is_suspended(rconn)
    # Its in-flight requests finish, then its batches are parked: the worker holds nothing of it,
    # its slots are free for other jobs (#26), and the paused job's batches are out of RQ's queue.
    wait_until(lambda: worker_now("job-pauser").state == "idle" and not worker_now("job-pauser").batches,
               timeout=60, what="the worker to park the paused job's batches")
    wait_until(lambda: sim_stats(url)["num_running"] == 0, timeout=60, what="in-flight requests to finish")
    assert sim_stats(url)["aborted_requests"] == 0, "in-flight requests were cut instead of finishing"
    assert rconn.hlen(keys.job_leases("one")) == 0 and rq_queue(rconn).count == 0
    done = job_now("one").done
    before = received(sim_stats(url))
    heartbeats_pass(rconn, "job-pauser")
    assert received(sim_stats(url)) == before, "requests were sent for a paused job"
    row = jobs_json()["one"]
    assert row["done"] == done < 80 and row["paused"] and row["state"] == "paused"

    bad = run_genq("pause", "--job", "nosuch", check=False)
    assert bad.returncode == 1 and "no job named 'nosuch'" in bad.stderr

    run_genq("resume", "--job", "one")
    assert not rconn.exists(keys.job_paused("one"))
    wait_until(lambda: job_now("one").state == "done", timeout=180, what="the job to complete")
    assert_exactly_once(tmp_path, "one", ids)


def test_drain_one_worker_while_another_keeps_going(tmp_path, redis_url, sim, worker):
    # A's server is ten times slower (4 slots, 1.5 s a request): A alone cannot finish the job within
    # the drain's own 60 s timeout, however slowly this machine runs the CLI.
    url_a, url_b = sim(**{**SLOW_SIM, "step_ms_base": 250}), sim(**SLOW_SIM)
    ids = enqueue(tmp_path, "dr", 240)
    a = worker(url_a, "--name", "drain-a", "--host", "host-a")
    b = worker(url_b, "--name", "drain-b", "--host", "host-b")
    wait_until(lambda: job_now("dr").done >= 20, what="20 prompts done")
    assert {"drain-a", "drain-b"} <= set(workers_json())

    # B's server is down while A drains, so the job cannot finish behind the drain's back however
    # slowly this machine runs the CLI; B holds its prompts (an outage burns no attempts).
    post_json(url_b + "/sim/faults", {"outage_for": 600})
    out = run_genq("drain", "--worker", "drain-a", "--wait", "--timeout", "60")
    assert "draining 1 worker(s): drain-a" in out.stdout
    assert "all drained: drain-a stopped" in out.stdout
    assert a.wait(timeout=20) == 0, a.log()
    stopped_at = time.time()
    assert b.alive()
    assert job_now("dr").done < 240, "the job ended before the drain could be seen to matter"
    post_json(url_b + "/sim/faults", {"outage_for": 0})  # B's server is back: B finishes the job

    wait_until(lambda: job_now("dr").state == "done", timeout=180, what="the job to complete")
    rows = assert_exactly_once(tmp_path, "dr", ids)
    assert {r["worker"] for r in rows} == {"drain-a", "drain-b"}
    # After the drain, only drain-b produced results.
    late = {r["worker"] for r in rows if r["finished_at"] > stopped_at}
    assert late == {"drain-b"}
    job = jobs_json()["dr"]
    assert (job["total"], job["done"], job["failed"], job["remaining"]) == (240, 240, 0, 0)

    view = workers_json()
    assert view["drain-a"]["state"] == "stopped" and view["drain-b"]["state"] in ("busy", "idle")
    # --prune forgets the stopped worker, keeps the live one.
    pruned = run_genq("workers", "--prune")
    assert "forgot 1 stopped/lost worker(s): drain-a" in pruned.stdout
    assert set(workers_json()) == {"drain-b"}

    # Draining a worker that is not live is refused with the names that exist.
    bad = run_genq("drain", "--worker", "drain-a", check=False)
    assert bad.returncode == 1 and "no worker named 'drain-a'" in bad.stderr and "drain-b" in bad.stderr
    bad = run_genq("drain", check=False)
    assert bad.returncode == 2 and "exactly one of --worker NAME, --host HOST or --all" in bad.stderr
    run_genq("drain", "--host", "host-b")
    assert b.wait(timeout=20) == 0


def test_concurrency_cap_is_live(tmp_path, redis_url, rconn, sim, worker):
    url = sim(max_running_requests=32, step_ms_base=20, tokens_per_step=8, mean_output_tokens=64)
    worker(url, "--name", "capped")
    wait_until(lambda: (w := worker_now("capped")) and w.state == "idle", what="the worker to come up")
    assert workers_json()["capped"]["target"] > 3

    out = run_genq("concurrency", "--worker", "capped", "3")
    assert "cap 3" in out.stdout
    assert unpack(rconn.get(keys.worker_control("capped")), Control) == Control(concurrency=3)
    wait_until(lambda: worker_now("capped").cap == 3, what="the cap to be applied")
    w = workers_json()["capped"]
    assert w["target"] == 3

    # While capped, a job runs with never more than 3 requests at the server.
    ids = enqueue(tmp_path, "cap", 40)
    wait_until(lambda: job_now("cap").state == "done", timeout=60, what="the job to complete")
    assert 0 < sim_stats(url)["max_running"] <= 3  # the sim's own peak: sampling can miss every request
    assert_exactly_once(tmp_path, "cap", ids)

    run_genq("concurrency", "--all", "auto")
    assert unpack(rconn.get(keys.worker_control("capped")), Control) == Control(concurrency=None)
    wait_until(lambda: worker_now("capped").cap is None, what="the cap to be lifted")
    bad = run_genq("concurrency", "--all", "lots", check=False)
    assert bad.returncode == 2 and "neither 'auto' nor a whole number" in bad.stderr


def test_control_record_keeps_the_other_field(redis_url, rconn):
    conn = connect(redis_url)
    control.update_control(conn, "w1", concurrency=7)
    control.update_control(conn, "w1", drain=True)
    assert unpack(rconn.get(keys.worker_control("w1")), Control) == Control(drain=True, concurrency=7)
    control.update_control(conn, "w1", concurrency=None)
    assert unpack(rconn.get(keys.worker_control("w1")), Control) == Control(drain=True, concurrency=None)
    conn.close()


def test_workers_view_shows_lost_and_prunes(redis_url, rconn):
    now = time.time()
    rconn.sadd(keys.WORKERS, "gone.gpu0", "old.gpu1", "live.gpu2")
    # gone.gpu0: in the set, no status (its TTL expired) -> lost
    rconn.set(keys.worker_status("old.gpu1"), pack(WorkerStatus(
        name="old.gpu1", host="old", pid=1, server="http://x:1", state="stopped", started_at=now - 60,
        heartbeat_at=now - 30, gpu="1")))
    rconn.set(keys.worker_status("live.gpu2"), pack(WorkerStatus(
        name="live.gpu2", host="live", pid=2, server="http://x:2", state="busy", started_at=now - 60,
        heartbeat_at=now + 3600, gpu="2", in_flight=5, concurrency_target=8, batches=[BatchRef("j", "b0000001")],
        tok_per_s=123.0)),
        ex=3600)  # live: the status key exists, its beat not overdue (silent after 4 s) over slow CLI calls
    # A drain is done once the worker has stopped: the same drain again (a script's) is not an error.
    again = run_genq("drain", "--worker", "old.gpu1", "--worker", "gone.gpu0", check=False)
    assert again.returncode == 0 and "old.gpu1 is stopped already: nothing to drain" in again.stdout, again.stderr
    assert "gone.gpu0 is lost already" in again.stdout and not rconn.exists(keys.worker_control("old.gpu1"))
    view = workers_json()
    assert view["gone.gpu0"]["state"] == "lost" and view["gone.gpu0"]["host"] is None
    assert view["old.gpu1"]["state"] == "stopped"
    live = view["live.gpu2"]
    assert (live["state"], live["in_flight"], live["target"], live["batches"], live["host"]) == (
        "busy", 5, 8, ["j/b0000001"], "live")

    table = run_genq("workers").stdout
    assert "lost" in table and "5/8" in table and "b0000001" in table
    assert "3 workers: 1 busy, 1 lost, 1 stopped" in table

    bad = run_genq("concurrency", "--worker", "gone.gpu0", "4", check=False)
    assert bad.returncode == 1 and "gone.gpu0' is lost" in bad.stderr

    run_genq("workers", "--prune")
    assert {m.decode() for m in rconn.smembers(keys.WORKERS)} == {"live.gpu2"}
    assert not rconn.exists(keys.worker_status("old.gpu1"))


def test_empty_views(redis_url):
    assert "no workers have registered" in run_genq("workers").stdout
    assert "no jobs" in run_genq("jobs").stdout
    done = run_genq("drain", "--all", check=False)  # none running: drained already, as a script asks again
    assert done.returncode == 0 and "no live workers: nothing to drain" in done.stdout, done.stderr
    bad = run_genq("drain", "--all", "--timeout", "5", check=False)  # no wait to give up on: not silently ignored
    assert bad.returncode == 2 and "--timeout" in bad.stderr and "--wait" in bad.stderr, bad.stderr


def test_redis_password_is_masked_when_unreachable():
    out = run_genq("workers", redis_url="redis://user:hunter2@127.0.0.1:1/0", check=False)
    assert out.returncode == 1
    assert "hunter2" not in out.stderr and "user:***@127.0.0.1:1" in out.stderr


def test_a_worker_drained_while_everything_is_paused_hands_its_batches_back_and_exits(tmp_path, redis_url, sim,
                                                                                        worker):
    """Pause all, then drain a machine to take it away: its held batches cannot finish while paused, so they
    go back to the queue once its requests in flight are done, and it exits; after the resume another
    worker finishes the job, each prompt once."""
    url = sim(**SLOW_SIM)
    ids = enqueue(tmp_path, "pd", 120)
    a = worker(url, "--name", "pd-a")
    wait_until(lambda: job_now("pd").done >= 10, what="10 prompts done")
    run_genq("pause")
    wait_until(lambda: worker_now("pd-a").state == "paused", timeout=60, what="the worker to see the pause")
    held = len(worker_now("pd-a").batches)
    out = run_genq("drain", "--worker", "pd-a", "--wait", "--timeout", "90", check=False)
    assert out.returncode == 0 and "all drained: pd-a stopped" in out.stdout, (held, out.stdout, out.stderr)
    assert a.wait(timeout=30) == 0, a.log()
    assert job_now("pd").done < 120
    run_genq("resume")
    worker(url, "--name", "pd-b")
    wait_until(lambda: job_now("pd").state == "done", timeout=180, what="the job to complete")
    assert_exactly_once(tmp_path, "pd", ids)


def test_a_resume_while_a_worker_waits_to_park_the_job_queues_its_batch_at_once(tmp_path, redis_url, rconn, sim,
                                                                                 worker):
    """`genq pause --job J` then `genq resume --job J` while the worker waits for J's requests in flight (it
    parks J's batch once they finish): the batch goes back to the queue then, not parked for a resume that
    already came (left to the reconciler's stranded-batch pass, 20-40 s later, counted as a redelivery)."""
    url = sim(max_running_requests=4, step_ms_base=100, step_ms_per_req=0, tokens_per_step=1,
              mean_output_tokens=150, output_sigma=0.05)
    ids = enqueue(tmp_path, "pr", 8, batch_size=8)
    w = worker(url, "--name", "pr-w")
    wait_until(lambda: sim_stats(url)["num_running"] == 4, timeout=60, what="4 requests in flight")
    run_genq("pause", "--job", "pr")
    wait_until(lambda: "paused: pr" in w.log(), timeout=60, what="the worker to see the pause")
    heartbeats_pass(rconn, "pr-w", 2)  # it waits for its 4 requests (15 s each) before parking the batch
    assert sim_stats(url)["num_running"] > 0, "the requests ended before the resume: nothing was tried"
    run_genq("resume", "--job", "pr")
    wait_until(lambda: job_now("pr").state == "done", timeout=180, what="the job to complete")
    assert_exactly_once(tmp_path, "pr", ids)
    assert int(rconn.hget(keys.job_stats("pr"), "redeliveries") or 0) == 0, w.log()
    assert "wait for `genq resume --job pr`" not in w.log().split("resumed: pr", 1)[-1], w.log()


def test_a_resume_refused_by_a_full_redis_changes_nothing(tmp_path, redis_url, rconn):
    """`genq resume` Redis refuses (full) says so in one line and changes nothing: not the job's pause lifted
    with its parked batches left to the reconciler (20-40 s later) behind an error, nor the fleet's pause
    without RQ's suspension. Once Redis takes writes, `genq resume --job` queues the parked batches at once."""
    enqueue(tmp_path, "rf", 30)  # 3 batches, queued
    paused = run_genq("pause", "--job", "rf")  # no worker: all 3 parked at once
    assert rq_queue(rconn).count == 0
    # A job's pause parks its batches (out of RQ's queue and off the workers): its line says so.
    assert "parked" in paused.stdout and "stay held" not in paused.stdout, paused.stdout

    def full(*args: str) -> None:
        rconn.config_set("maxmemory", 1)
        try:
            refused = run_genq(*args, check=False)
        finally:
            rconn.config_set("maxmemory", 0)
        assert refused.returncode == 1 and "Redis is full" in refused.stderr, (args, refused.stderr)
        assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr

    full("resume", "--job", "rf")
    full("pause")
    assert rconn.exists(keys.job_paused("rf")) and rq_queue(rconn).count == 0
    assert not rconn.exists(keys.PAUSED) and not suspension.is_suspended(rconn)
    run_genq("pause")
    full("resume")
    assert rconn.exists(keys.PAUSED) and suspension.is_suspended(rconn)
    said = run_genq("resume", "--job", "rf").stdout
    assert "3 parked batches queued again" in said and rq_queue(rconn).count == 3, said
    assert not rconn.exists(keys.job_paused("rf"))
    run_genq("resume")
    assert not rconn.exists(keys.PAUSED) and not suspension.is_suspended(rconn)


def test_jobs_shows_paths_and_server_messages_with_brackets_as_they_are(tmp_path, redis_url, rconn):
    """`genq jobs` prints an output path and a block's server message as written: rich markup in them is
    text (a message with "[/body/n]" crashed the command; "[bold]" vanished from a path)."""
    from genq.core.records import JobBlock

    write_prompts(tmp_path / "p.jsonl", 5)
    out = str(tmp_path / "[bold]run[/]")
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "brk", "--output", out)
    message = "field [/body/n] must be [b]<=1[/b]"
    rconn.set(keys.job_blocked("brk"), pack(JobBlock(reason="brake", message=message, worker="w", at=time.time(),
                                                     status=400, failures=5, outcomes=5, prompts=5)))
    shown = run_genq("jobs", check=False)
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert out in shown.stdout and message in shown.stdout, shown.stdout


def test_a_worker_named_twice_is_steered_once(redis_url, rconn):
    now = time.time()
    rconn.sadd(keys.WORKERS, "w.gpu0")
    rconn.set(keys.worker_status("w.gpu0"), pack(WorkerStatus(
        name="w.gpu0", host="h", pid=1, server="http://x:1", state="busy", started_at=now, heartbeat_at=now)), ex=3600)
    twice = ("--worker", "w.gpu0", "--worker", "w.gpu0")
    assert run_genq("drain", *twice).stdout == "draining 1 worker(s): w.gpu0\n"
    assert run_genq("concurrency", *twice, "4").stdout == "concurrency cap 4 for 1 worker(s): w.gpu0\n"


def test_a_drain_is_for_the_life_it_was_sent_to_not_the_next_under_that_name(tmp_path, redis_url, rconn, sim,
                                                                             worker):
    """A worker SIGKILLed while draining leaves its Control record (drain=True) behind; the worker started
    next under that --name is another life: it takes work, it does not drain at once."""
    rconn.set(keys.worker_control("again"), pack(Control(drain=True, concurrency=2)))  # what the killed one left
    ids = enqueue(tmp_path, "life", 300)
    w = worker(sim(**SLOW_SIM), "--name", "again", "--burst")
    assert w.wait(timeout=120) == 0, w.log()
    assert "drain requested" not in w.log() and "concurrency cap now" not in w.log(), w.log()
    assert_exactly_once(tmp_path, "life", ids)


def test_an_empty_model_name_is_refused_as_bad_usage(tmp_path, redis_url):
    """No server serves the model "" (nor " m"): a job sent with it would wait for ever; refused, nothing stored."""
    src = tmp_path / "m.jsonl"
    write_prompts(src, 2)
    run_genq("enqueue", str(src), "--job", "m", "--output", str(tmp_path / "out"))
    for args in (("jobs", "set", "m", "--model", ""), ("jobs", "set", "m", "--model", " m"),
                 ("enqueue", str(src), "--job", "m2", "--model", "", "--output", str(tmp_path / "out"))):
        proc = run_genq(*args, check=False)
        assert proc.returncode == 2 and "--model" in proc.stderr, (args, proc.stdout, proc.stderr)
    assert jobs_json()["m"]["settings_version"] == 1 and "m2" not in jobs_json()


def test_a_resume_of_what_is_not_paused_says_so(tmp_path, redis_url):
    enqueue(tmp_path, "np", 2)
    assert run_genq("resume", "--job", "np").stdout == "job np was neither paused nor blocked: nothing to resume\n"
    assert run_genq("resume").stdout == "the fleet was not paused (genq pause): nothing to resume\n"
    run_genq("pause", "--job", "np")
    assert run_genq("resume", "--job", "np").stdout.startswith("resumed job np")


def test_ctrl_c_at_a_confirmation_is_an_interruption(tmp_path, redis_url, rconn):
    """Exit 130 as README "Exit status" says, not 1 or "Aborted!"; nothing deleted."""
    import signal
    import subprocess

    from tests.conftest import WORKDIR, genq_cmd

    enqueue(tmp_path, "ask", 2)
    proc = subprocess.Popen(genq_cmd("jobs", "delete", "ask"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=WORKDIR)
    said = b""
    while not said.endswith(b"[y/N]: "):
        said += proc.stdout.read(1) or b"(ended)"
        assert not said.endswith(b"(ended)"), said
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and b"interrupted: nothing deleted" in err and b"Aborted" not in err, err
    assert "ask" in jobs_json()


def test_drain_wait_does_not_call_a_worker_that_died_drained(redis_url, rconn):
    import subprocess

    from tests.conftest import WORKDIR, genq_cmd

    now = time.time()
    rconn.sadd(keys.WORKERS, "doomed")
    rconn.set(keys.worker_status("doomed"), pack(WorkerStatus(
        name="doomed", host="h", pid=1, server="http://x:1", state="busy", started_at=now, heartbeat_at=now + 3600,
        batches=[BatchRef("j", "b0000001")])), ex=3600)
    proc = subprocess.Popen(genq_cmd("drain", "--worker", "doomed", "--wait", "--timeout", "300"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=WORKDIR)
    assert proc.stdout.readline() == "draining 1 worker(s): doomed\n"
    rconn.delete(keys.worker_status("doomed"))  # it died: its record expires, it is lost
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and "all drained" not in out, out
    assert "doomed lost (it died before it drained: its batches run elsewhere)" in out, out


def test_steering_a_silent_worker_says_it_may_never_act_on_it(redis_url, rconn):
    now = time.time()
    rconn.sadd(keys.WORKERS, "quiet")
    rconn.set(keys.worker_status("quiet"), pack(WorkerStatus(
        name="quiet", host="h", pid=1, server="http://x:1", state="busy", started_at=now - 60,
        heartbeat_at=now - 30)), ex=3600)
    out = run_genq("concurrency", "--worker", "quiet", "4")
    assert out.stdout == "concurrency cap 4 for 1 worker(s): quiet\n", out.stdout
    assert re.search(r"quiet is silent \(no heartbeat for \d+[smh]\)", out.stderr) and "wakes" in out.stderr, out.stderr
