"""The job's current settings survive Redis losing them: `genq jobs set` is written to OUTPUT/JOB/job.json
before Redis, and whatever brings a job back from its output (genq recover, the same enqueue again, a worker
catching up) takes the settings of the latest `jobs set` from there."""

from __future__ import annotations

import json

import pytest
import redis

from tests.conftest import genq_cmd, run_genq, write_prompts
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)
from tests.test_recover import FAST, generated, lost_redis, wait_done, written_records  # noqa: F401

pytestmark = pytest.mark.e2e
N = 60


def enqueue_args(src, out, max_tokens: int) -> tuple[str, ...]:
    return ("enqueue", str(src), "--job", "st", "--output", str(out), "--batch-size", "10",
            "--max-tokens", str(max_tokens))


def config_of(url: str) -> dict:
    return json.loads(run_genq("jobs", "show", "st", "--json", redis_url=url).stdout)["config"]


def burst(procs, url: str, server: str) -> None:
    proc = procs(genq_cmd("worker", "--server", server, "--burst", redis_url=url), name="burst")
    assert proc.wait(timeout=120) == 0, proc.log()


def shortened(url: str, note: str = "shorter") -> None:
    run_genq("jobs", "set", "st", "--max-tokens", "20", "--note", note, redis_url=url)


def at_current_settings(config: dict) -> None:
    assert (config["max_tokens"], config.get("settings_version", 1)) == (20, 2), config
    assert [(c["version"], c["changed"], c["previous"], c.get("note")) for c in config.get("settings_history", [])] == [
        (2, {"max_tokens": 20}, {"max_tokens": 64}, "shorter")], config["settings_history"]


def test_recover_after_an_empty_restart_brings_the_job_back_at_its_current_settings(
        lost_redis, sim, procs, tmp_path):  # noqa: F811
    server = sim(**FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    shortened(lost_redis.url)
    lost_redis.kill()
    lost_redis.start(empty=True)

    run_genq("recover", "--job", "st", "--output", str(out), redis_url=lost_redis.url)
    at_current_settings(config_of(lost_redis.url))
    burst(procs, lost_redis.url, server)
    records = written_records(out, "st")
    assert sorted(records) == sorted(ids)
    assert {r["settings_version"] for r in records.values()} == {2}
    assert max(r["usage"]["completion_tokens"] for r in records.values()) <= 20


def test_the_same_enqueue_at_the_current_settings_is_the_same_job(lost_redis, sim, procs, tmp_path):  # noqa: F811
    server = sim(**FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    ids = write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    shortened(lost_redis.url)
    burst(procs, lost_redis.url, server)
    first = config_of(lost_redis.url)["incarnation"]
    written = written_records(out, "st")
    assert sorted(written) == sorted(ids) and generated(server) == N
    lost_redis.kill()
    lost_redis.start(empty=True)

    again = run_genq(*enqueue_args(src, out, 20), redis_url=lost_redis.url)
    config = config_of(lost_redis.url)
    assert config["incarnation"] == first, again.stdout + again.stderr
    at_current_settings(config)
    assert wait_done(lost_redis.url, "st", timeout=30)["completed"] == N
    assert written_records(out, "st") == written and generated(server) == N  # nothing generated again


def test_a_snapshot_from_before_jobs_set_takes_the_settings_from_the_output(lost_redis, tmp_path):  # noqa: F811
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    lost_redis.snapshot()
    shortened(lost_redis.url)
    lost_redis.kill()
    lost_redis.start(empty=False)  # the job as it was before `jobs set`
    assert config_of(lost_redis.url).get("settings_version", 1) == 1

    run_genq("recover", "--job", "st", redis_url=lost_redis.url)
    at_current_settings(config_of(lost_redis.url))
    # and the output still says so (nothing wrote the older settings back)
    on_disk = json.loads((out / "st" / "job.json").read_text())["config"]
    assert (on_disk["max_tokens"], on_disk.get("settings_version", 1)) == (20, 2)


def test_jobs_set_where_the_output_cannot_be_written_changes_nothing(redis_url, tmp_path):
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    (out / "st").rename(tmp_path / "elsewhere")
    (out / "st").write_text("not a folder")  # job.json cannot be written under it
    proc = run_genq("jobs", "set", "st", "--max-tokens", "20", "--priority", "5", redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "cannot write" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    shown = json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)
    assert (shown["config"]["max_tokens"], shown["row"]["priority"]) == (64, 0), "it said nothing was changed"


def test_a_running_worker_takes_the_settings_back_after_a_snapshot_from_before_jobs_set(  # noqa: F811
        lost_redis, sim, procs, tmp_path):  # noqa: F811
    from tests.conftest import wait_until
    from tests.test_recover import start_worker

    server = sim(**FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    start_worker(procs, lost_redis.url, server, "w1")
    wait_done(lost_redis.url, "st", timeout=60)
    lost_redis.snapshot()
    shortened(lost_redis.url)
    lost_redis.kill()
    lost_redis.start(empty=False)  # the job as it was before `jobs set`; the worker's maintenance sees a restart
    wait_until(lambda: config_of(lost_redis.url).get("settings_version", 1) == 2, 90,
               "the worker taking job.json's settings back into Redis", interval=1)
    at_current_settings(config_of(lost_redis.url))


def test_on_s3_jobs_set_is_in_job_json_and_recover_takes_it(lost_redis, moto, tmp_path):  # noqa: F811
    moto.client().create_bucket(Bucket="settings")
    src, out = tmp_path / "in.jsonl", "s3://settings/out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), "--s3-endpoint-url", moto.url, redis_url=lost_redis.url)
    shortened(lost_redis.url)
    run_genq("jobs", "set", "st", "--priority", "6", "--weight", "2", redis_url=lost_redis.url)
    on_s3 = json.loads(moto.objects("settings", "out/st/job.json")["out/st/job.json"])["config"]
    assert (on_s3["max_tokens"], on_s3.get("settings_version", 1)) == (20, 2)
    redis.Redis.from_url(lost_redis.url).flushall()

    run_genq("recover", "--job", "st", "--output", out, "--s3-endpoint-url", moto.url, redis_url=lost_redis.url)
    at_current_settings(config_of(lost_redis.url))
    assert schedule_of(lost_redis.url) == (6, 2.0)


def test_jobs_set_refused_by_a_full_redis_changes_nothing(redis_url, rconn, tmp_path):
    """A `jobs set` Redis refuses (full) says so and leaves job.json as it was: the change is not taken up
    later from the output behind the operator's back (a worker's catch-up would store it in Redis)."""
    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    write_prompts(src, 5)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    rconn.config_set("maxmemory", 1)
    try:
        refused = run_genq("jobs", "set", "st", "--max-tokens", "20", redis_url=redis_url, check=False)
    finally:
        rconn.config_set("maxmemory", 0)
    assert refused.returncode == 1 and "Redis is full" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    on_disk = json.loads((out / "st" / "job.json").read_text())["config"]
    assert (on_disk["max_tokens"], on_disk.get("settings_version", 1)) == (64, 1), on_disk
    shortened(redis_url)
    on_disk = json.loads((out / "st" / "job.json").read_text())["config"]
    assert (on_disk["max_tokens"], on_disk.get("settings_version", 1)) == (20, 2), on_disk
    assert config_of(redis_url)["max_tokens"] == 20


def schedule_of(url: str) -> tuple[int, float]:
    row = json.loads(run_genq("jobs", "show", "st", "--json", redis_url=url).stdout)["row"]
    return row["priority"], row["weight"]


def test_priority_and_weight_come_back_with_the_job_after_a_flushall(redis_url, rconn, tmp_path):
    """job.json keeps the job's priority and weight (docs/scheduling.md): recover and the same enqueue again
    bring them back, as they bring back its settings."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), "--priority", "3", "--weight", "2", redis_url=redis_url)
    run_genq("jobs", "set", "st", "--priority", "7", redis_url=redis_url)
    rconn.flushall()
    run_genq("recover", "--job", "st", "--output", str(out), redis_url=redis_url)
    assert schedule_of(redis_url) == (7, 2.0), "recover brought the job back at priority 0, weight 1"
    run_genq("jobs", "set", "st", "--weight", "0.5", redis_url=redis_url)
    rconn.flushall()
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)  # the same enqueue again takes the job up
    assert schedule_of(redis_url) == (7, 0.5)


def test_a_snapshot_from_before_a_priority_change_takes_it_from_the_output(lost_redis, tmp_path):  # noqa: F811
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    lost_redis.snapshot()
    run_genq("jobs", "set", "st", "--priority", "9", "--weight", "3", redis_url=lost_redis.url)
    lost_redis.kill()
    lost_redis.start(empty=False)  # the job as it was before the change
    assert schedule_of(lost_redis.url) == (0, 1.0)
    run_genq("recover", "--job", "st", redis_url=lost_redis.url)
    assert schedule_of(lost_redis.url) == (9, 3.0)


def test_a_priority_change_refused_changes_nothing(redis_url, rconn, tmp_path):
    """Redis refusing writes, or job.json unwritable: the change is refused whole, job.json as it was (a later
    catch-up would otherwise take it up behind the operator's back)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, 5)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    before = (out / "st" / "job.json").read_bytes()
    rconn.config_set("maxmemory", 1)
    try:
        refused = run_genq("jobs", "set", "st", "--priority", "4", redis_url=redis_url, check=False)
    finally:
        rconn.config_set("maxmemory", 0)
    assert refused.returncode == 1 and "Redis is full" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert (out / "st" / "job.json").read_bytes() == before
    (out / "st").rename(tmp_path / "elsewhere")
    (out / "st").write_text("not a folder")  # job.json cannot be written under it
    refused = run_genq("jobs", "set", "st", "--priority", "4", redis_url=redis_url, check=False)
    assert refused.returncode == 1 and "cannot write" in refused.stderr, refused.stderr
    assert "Traceback" not in refused.stderr
    assert schedule_of(redis_url) == (0, 1.0), "it said nothing was changed"


def test_a_pinned_model_comes_back_with_the_job(redis_url, rconn, sim, procs, tmp_path):
    """`--model auto` pinned by the first worker is the job's model (docs/fidelity.md): job.json keeps it, so a
    job recovered after a FLUSHALL is not pinned again by a server of another model; the same enqueue
    (model auto) still takes the job up."""
    server = sim(**FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    burst(procs, redis_url, server)
    pinned = config_of(redis_url)["model"]
    assert pinned != "auto"
    rconn.flushall()
    run_genq("recover", "--job", "st", "--output", str(out), redis_url=redis_url)
    assert config_of(redis_url).get("model", "auto") == pinned, "the pin was lost with Redis"
    incarnation = config_of(redis_url)["incarnation"]
    rconn.flushall()
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    assert (config_of(redis_url).get("model"), config_of(redis_url)["incarnation"]) == (pinned, incarnation)


def test_a_paused_job_comes_back_paused(redis_url, rconn, tmp_path):
    """`genq pause --job` is kept in job.json: a job rebuilt after a FLUSHALL does not start running behind the
    operator's back; `genq resume --job` is kept too."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    run_genq("pause", "--job", "st", redis_url=redis_url)
    rconn.flushall()
    recovered = run_genq("recover", "--job", "st", "--output", str(out), redis_url=redis_url)
    row = json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)["row"]
    assert row["paused"], "the job came back running"
    assert "genq resume --job st" in recovered.stdout, recovered.stdout
    run_genq("resume", "--job", "st", redis_url=redis_url)
    rconn.flushall()
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)  # the same enqueue again takes the job up
    assert not json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)["row"]["paused"]
    (out / "st").rename(tmp_path / "elsewhere")
    (out / "st").write_text("not a folder")  # job.json cannot be written: the pause is taken all the same
    paused = run_genq("pause", "--job", "st", redis_url=redis_url)
    assert "paused in Redis, but" in paused.stderr and "Traceback" not in paused.stderr, paused.stderr
    assert len(paused.stderr.strip().splitlines()) == 1, paused.stderr
    assert json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)["row"]["paused"]


def test_a_pause_job_could_not_write_reaches_job_json_once_it_can(redis_url, rconn, tmp_path):
    """`genq pause --job` where job.json cannot be written stays in force, and the catch-up (recover's, every
    worker's maintenance pass) or the next `jobs set --priority` writes it there once it can: a job rebuilt after
    a FLUSHALL comes back paused. The same for `resume --job`."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    for verb, paused, then in (("pause", True, ("recover", "--job", "st")),
                               ("resume", False, ("jobs", "set", "st", "--priority", "2"))):
        (out / "st").rename(tmp_path / "elsewhere")
        (out / "st").write_text("not a folder")
        run_genq(verb, "--job", "st", redis_url=redis_url)
        (out / "st").unlink()
        (tmp_path / "elsewhere").rename(out / "st")  # the output is back
        run_genq(*then, redis_url=redis_url)
        on_disk = json.loads((out / "st" / "job.json").read_text())
        assert on_disk.get("paused", False) is paused, (verb, then, on_disk)
        assert json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)["row"][
            "paused"] is paused, (verb, then)
    rconn.flushall()
    run_genq("recover", "--job", "st", "--output", str(out), redis_url=redis_url)
    assert not json.loads(run_genq("jobs", "show", "st", "--json", redis_url=redis_url).stdout)["row"]["paused"]


def test_the_same_enqueue_with_a_priority_after_a_flushall_sets_it(redis_url, rconn, sim, procs, tmp_path):
    """A finished job Redis lost, taken up by the same enqueue with --priority: nothing is queued, and the
    priority asked for is stored all the same (the job existed: it was not created by this enqueue)."""
    server = sim(**FAST)
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=redis_url)
    burst(procs, redis_url, server)
    rconn.flushall()
    again = run_genq(*enqueue_args(src, out, 64), "--priority", "9", redis_url=redis_url)
    assert "queued 0 prompts" in again.stdout, again.stdout
    assert schedule_of(redis_url) == (9, 1.0), again.stdout


def test_a_snapshot_from_before_pause_job_takes_the_pause_back_from_job_json(lost_redis, tmp_path):  # noqa: F811
    """job.json's pause is versioned with the schedule: a Redis restored from before `pause --job` is paused
    again by recover (and every worker's maintenance pass), and one from before a `resume --job` resumed."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, N)
    run_genq(*enqueue_args(src, out, 64), redis_url=lost_redis.url)
    for verb, paused in (("pause", True), ("resume", False)):
        lost_redis.snapshot()
        run_genq(verb, "--job", "st", redis_url=lost_redis.url)
        lost_redis.kill()
        lost_redis.start(empty=False)  # the job as it was before the pause (the resume)
        assert json.loads(run_genq("jobs", "show", "st", "--json", redis_url=lost_redis.url).stdout)["row"][
            "paused"] is not paused
        run_genq("recover", "--job", "st", redis_url=lost_redis.url)
        row = json.loads(run_genq("jobs", "show", "st", "--json", redis_url=lost_redis.url).stdout)["row"]
        assert row["paused"] is paused, (verb, row)
