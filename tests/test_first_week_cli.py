"""A new user's first week (tried from a fresh clone with the README, the docs and --help only):
what each command says and how it exits when Redis refuses, when Ctrl-C stops an enqueue, when
a job's name is used again, when an option is given without its scheme, and where its files go.
"""

from __future__ import annotations

import os
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from genq.cli.worker import ByteSize
from genq.core.redisconn import LocalRedis
from tests.conftest import run_genq, write_prompts

pytestmark = pytest.mark.e2e  # every test here runs the CLI


@pytest.fixture(scope="module")
def private_redis() -> Iterator[LocalRedis]:
    with LocalRedis() as server:
        yield server


class _HTTP(socketserver.BaseRequestHandler):
    """Answers whatever it is sent as an HTTP server answers a request it cannot parse."""

    def handle(self) -> None:
        self.request.recv(65536)
        self.request.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    """An address that answers, but HTTP, not Redis (a metrics port, an inference server)."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _HTTP)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()


CONTROL_COMMANDS = [("workers",), ("workers", "--json"), ("jobs",), ("jobs", "--json"), ("pause",),
                    ("resume",), ("drain", "--all"), ("concurrency", "4", "--all"), ("jobs", "delete", "x", "-y"),
                    ("jobs", "show", "x"), ("status", "x", "p1"), ("dlq", "list", "--job", "x"), ("monitor", "--once"),
                    ("export", "--job", "x", "--to", "x.jsonl")]


@pytest.mark.parametrize("where", ["db 99", "http"])
def test_a_refusing_redis_is_one_line_and_exit_1_for_every_command(where, private_redis, http_port):
    url = (private_redis.url.rsplit("/", 1)[0] + "/99" if where == "db 99" else f"redis://127.0.0.1:{http_port}/0")
    said = "DB index is out of range" if where == "db 99" else "Protocol Error"
    for args in CONTROL_COMMANDS:
        proc = run_genq(*args, redis_url=url, check=False, timeout=60)
        assert proc.returncode == 1, (args, proc.returncode, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (args, proc.stderr[-3000:])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("Error: ") and said in lines[0], (args, proc.stderr)


@pytest.mark.parametrize("server", ["127.0.0.1:31000", "localhost:31000", "tcp://127.0.0.1:31000", "http://:31000",
                                    "http://127.0.0.1:31000/v1"])  # an OpenAI base_url: genq adds /v1/... itself
def test_a_server_without_its_scheme_is_bad_usage_before_anything_is_written(server, redis_url, rconn):
    proc = run_genq("worker", "--server", server, "--burst", redis_url=redis_url, check=False, timeout=60)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "--server" in proc.stderr and "http://" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert rconn.keys("*") == [], rconn.keys("*")  # no worker row, nothing to --prune


def test_export_of_an_unfinished_job_exits_3_with_its_note(redis_url, rconn, tmp_path):
    from genq.core.queueing import load_config
    from genq.output.truth import LocalStore, commit_shard, shard_bytes
    from tests.test_export import result

    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    write_prompts(src, 20)
    run_genq("enqueue", str(src), "--job", "half", "--output", str(out), "--batch-size", "10", redis_url=redis_url)
    incarnation = load_config(rconn, "half").incarnation
    commit_shard(LocalStore(str(out)), "half", "b0000001", shard_bytes(
        [result(f"p{i:05d}", i, "b0000001", job="half") for i in range(10)], "none"), 10, 0.0, compression="none",
                 incarnation=incarnation, outcome=None)
    proc = run_genq("export", "--job", "half", "--to", str(tmp_path / "half.jsonl"), redis_url=redis_url, check=False)
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "wrote 10 records" in proc.stdout and "not in this export yet" in proc.stderr, proc.stderr
    assert len((tmp_path / "half.jsonl").read_text().splitlines()) == 10


def test_output_and_export_files_have_the_umasks_mode_not_0600(redis_url, sim, worker, tmp_path):
    """Teammates read a job's files: each is created as open() would create it (0666 less the
    umask; 027 here, so 0640), not with mkstemp's 0600."""
    old = os.umask(0o027)
    try:
        src, out = tmp_path / "p.jsonl", tmp_path / "out"
        write_prompts(src, 20)
        with src.open("a") as f:
            f.write("not json\n")  # a rejects file too
        run_genq("enqueue", str(src), "--job", "modes", "--output", str(out), "--batch-size", "10",
                 "--max-tokens", "16", redis_url=redis_url, check=False)
        proc = worker(sim(mean_output_tokens=8, output_sigma=0.5, tokens_per_step=16, step_ms_base=2), "--burst")
        assert proc.wait(timeout=120) == 0, proc.log()
        for fmt in ("jsonl", "parquet"):
            run_genq("export", "--job", "modes", "--to", str(tmp_path / f"modes.{fmt}"), redis_url=redis_url)
    finally:
        os.umask(old)
    made = ([p for p in (out / "modes").rglob("*") if p.is_file()]
            + [tmp_path / "modes.jsonl", tmp_path / "modes.parquet"])
    kinds = {p.parent.name for p in made}
    assert {"shards", "manifest", "rejects", "modes"} <= kinds, made  # modes/job.json is in "modes"
    modes = {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in made}
    assert set(modes.values()) == {"0o640"}, modes


def test_enable_thinking_at_the_top_of_extra_body_points_at_chat_template_kwargs(redis_url, rconn, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 3)
    proc = run_genq("enqueue", str(src), "--job", "think", "--extra-body", '{"enable_thinking": true}',
                    redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert '{"chat_template_kwargs": {"enable_thinking": true}}' in proc.stderr, proc.stderr
    assert rconn.keys("*") == []
    # Said that way, it is taken.
    run_genq("enqueue", str(src), "--job", "think",
             "--extra-body", '{"chat_template_kwargs": {"enable_thinking": true}}',
             "--output", str(tmp_path / "out"), redis_url=redis_url)


def test_parquet_columns_besides_id_and_messages_reach_the_record_as_metadata(redis_url, rconn, sim, worker, tmp_path):
    """As a JSONL line's extra keys do: every other column, whatever its type, in the record's
    metadata; a "prompt" column beside the messages too (it was dropped)."""
    import datetime

    import pyarrow as pa
    import pyarrow.parquet as pq

    from tests.conftest import batch_prompts, read_results

    when = datetime.datetime(2026, 12, 1, 12, 0, tzinfo=datetime.UTC)
    rows = [{"id": f"q{i}", "messages": [{"role": "user", "content": f"think about {i}"}], "source": "gsm8k",
             "difficulty": i, "score": i / 2, "tags": ["math", f"t{i}"], "extra": {"k": i}, "created": when,
             "prompt": f"the problem as one string {i}"} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    out = tmp_path / "out"
    run_genq("enqueue", str(tmp_path / "t.parquet"), "--job", "pqmeta", "--output", str(out), "--max-tokens", "16",
             redis_url=redis_url)
    expected = {f"q{i}": {"source": "gsm8k", "difficulty": i, "score": i / 2, "tags": ["math", f"t{i}"],
                          "extra": {"k": i}, "prompt": f"the problem as one string {i}"} for i in range(6)}
    queued = {p.id: p.metadata for p in batch_prompts(rconn, "pqmeta", "b0000001")}
    assert {k: {f: v for f, v in m.items() if f != "created"} for k, m in queued.items()} == expected, queued
    assert all(m.get("created") for m in queued.values()), queued
    proc = worker(sim(mean_output_tokens=8, output_sigma=0.5, tokens_per_step=16, step_ms_base=2), "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    written = {r["id"]: r["metadata"] for r in read_results(out, "pqmeta")}
    assert {k: {f: v for f, v in m.items() if f != "created"} for k, m in written.items()} == expected, written
    assert {m["created"] for m in written.values()} == {"2026-12-01T12:00:00Z"}, written


def test_ctrl_c_during_enqueue_exits_130_says_what_the_job_holds_and_the_same_command_completes_it(
        redis_url, rconn, tmp_path):
    import signal
    import subprocess

    from genq.core.ledger.jobs import counts
    from tests.conftest import WORKDIR, genq_cmd, wait_until

    n = 100_000  # the Ctrl-C lands after 8,192 of them (load 1, 2026-12-06): the rest is margin
    src = tmp_path / "big.jsonl"
    with src.open("w") as f:
        f.writelines(f'{{"id": "r{i}", "prompt": "q{i}"}}\n' for i in range(n))
    args = ("enqueue", str(src), "--job", "big", "--output", str(tmp_path / "out"), "--batch-size", "512")
    proc = subprocess.Popen(genq_cmd(*args, redis_url=redis_url), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=WORKDIR)
    wait_until(lambda: counts(rconn, "big").total > 0 or proc.poll() is not None, 60, "the first batches queued")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    held = counts(rconn, "big").total
    assert proc.returncode == 130, (proc.returncode, out, err[-2000:])
    assert 0 < held < n, held
    assert "Aborted!" not in err and "Traceback" not in err, err[-2000:]
    assert f"job big holds {held:,} prompts now" in err and "run the same command again" in err, err
    again = run_genq(*args, redis_url=redis_url, timeout=300)
    assert f"skipped {held:,} prompts already queued" in again.stdout, again.stdout
    assert counts(rconn, "big").total == n  # each prompt once


def test_a_finished_jobs_name_is_not_silently_added_to_and_a_deleted_ones_starts_a_new_life(
        redis_url, rconn, sim, worker, tmp_path):
    """New prompts under a done job's name are refused without --add (the same input again is
    fine: nothing new); --dry-run says what the name is; after `jobs delete` the name is a new
    job, not the old one taken up from its job.json, unless `genq recover` is asked."""
    import json

    from genq.core.ledger.jobs import counts

    first, more, out = tmp_path / "first.jsonl", tmp_path / "more.jsonl", tmp_path / "out"
    write_prompts(first, 10)
    write_prompts(more, 5, start=10)
    common = ("--job", "fin", "--output", str(out), "--max-tokens", "16", "--batch-size", "5")
    run_genq("enqueue", str(first), *common, redis_url=redis_url)
    url = sim(mean_output_tokens=8, output_sigma=0.5, tokens_per_step=16, step_ms_base=2)
    assert worker(url, "--burst").wait(timeout=120) == 0

    dry = run_genq("enqueue", str(more), *common, "--dry-run", redis_url=redis_url, check=False)
    assert dry.returncode == 1, (dry.stdout, dry.stderr)
    assert "an existing job, done, 10 prompts" in dry.stdout and "a new job" not in dry.stdout, dry.stdout
    assert "would be refused" in dry.stderr and "--add" in dry.stderr, dry.stderr
    refused = run_genq("enqueue", str(more), *common, redis_url=redis_url, check=False)
    assert refused.returncode == 1 and "job fin is done" in refused.stderr and "--add" in refused.stderr, refused.stderr
    assert counts(rconn, "fin").total == 10
    same = run_genq("enqueue", str(first), *common, redis_url=redis_url)  # nothing new: fine, as ever
    assert "skipped 10 prompts already queued or done" in same.stdout, same.stdout
    run_genq("enqueue", str(more), *common, "--add", redis_url=redis_url)
    assert counts(rconn, "fin").total == 15
    assert worker(url, "--burst").wait(timeout=120) == 0

    deleted = run_genq("jobs", "delete", "fin", "-y", redis_url=redis_url)
    assert "the name fin is free for a new job" in deleted.stdout, deleted.stdout
    assert json.loads((out / "fin" / "job.json").read_text())["deleted_at"] > 0
    # genq recover, asked, brings the old job back whole.
    back = run_genq("recover", "--job", "fin", "--output", str(out), redis_url=redis_url)
    assert ("created again from" in back.stdout
            and "3 batches written in the output marked done" in back.stdout), back.stdout
    assert "deleted_at" not in json.loads((out / "fin" / "job.json").read_text())
    # Redis has the job now: an --output other than its own is a mistake said, not silently ignored.
    other = run_genq("recover", "--job", "fin", "--output", str(tmp_path / "elsewhere"), redis_url=redis_url,
                     check=False)
    assert other.returncode == 1 and str(out) in other.stderr and "elsewhere" in other.stderr, other.stderr
    assert run_genq("recover", "--job", "fin", "--output", f"{out}/", redis_url=redis_url).returncode == 0
    row = next(r for r in json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout) if r["name"] == "fin")
    assert (row["state"], row["total"], row["done"]) == ("done", 15, 15), row

    run_genq("jobs", "delete", "fin", "-y", redis_url=redis_url)
    dry = run_genq("enqueue", str(first), *common, "--dry-run", redis_url=redis_url)
    assert "a new job;" in dry.stdout and "earlier job of this name (deleted)" in dry.stdout, dry.stdout
    assert "10 prompts would be queued" in dry.stdout, dry.stdout
    again = run_genq("enqueue", str(first), *common, redis_url=redis_url)
    assert "created again" not in again.stdout and "which was deleted" in again.stdout, again.stdout
    assert "queued 10 prompts" in again.stdout, again.stdout
    row = next(r for r in json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout) if r["name"] == "fin")
    assert (row["state"], row["total"], row["done"]) == ("queued", 10, 0), row


def test_pause_job_takes_its_queued_batches_out_whole_and_resume_queues_them_again(redis_url, rconn, tmp_path):
    """genq pause --job deletes the RQ jobs it takes out of the queue itself, without RQ's delete
    (seven status reads a job); nothing of them is left, the other job's stay, resume queues all."""
    from genq.core.queueing import carried, fetch_rq_jobs, rq_queue

    for job in ("a", "b"):
        write_prompts(tmp_path / f"{job}.jsonl", 200)
        run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(tmp_path / "out"),
                 "--batch-size", "10", redis_url=redis_url)

    def queued() -> dict[str, int]:
        jobs = fetch_rq_jobs(rconn, rq_queue(rconn).get_job_ids())
        return {j: sum(1 for r in jobs if r is not None and carried(r)[0] == j) for j in ("a", "b")}

    assert queued() == {"a": 20, "b": 20}
    rq_keys = {k for k in rconn.keys("rq:job:*") if b":" not in k[len("rq:job:"):]}
    run_genq("pause", "--job", "a", redis_url=redis_url)
    assert queued() == {"a": 0, "b": 20}
    left = {k for k in rconn.keys("rq:job:*") if b":" not in k[len("rq:job:"):]}
    assert len(left) == 20 and left < rq_keys, len(left)
    assert not any(rconn.exists(k + b":dependents") for k in rq_keys - left)
    said = run_genq("resume", "--job", "a", redis_url=redis_url).stdout
    assert "20 parked batches queued again" in said, said
    assert queued() == {"a": 20, "b": 20}


def test_the_clis_names_agree_and_the_old_ones_still_work(redis_url, rconn, tmp_path):
    """--job everywhere (beside the positional JOB), export's --output (--from, documented, kept and
    left out of --help), monitor's --metrics, -y on both deletions, --log-level in any case, and
    `genq --help`'s summaries whole phrases."""
    listing = run_genq("--help", redis_url=redis_url).stdout.split("Commands:")[1]
    assert "..." not in listing and listing.count("\n") >= 15, listing
    for group in ("jobs", "dlq"):
        sub = run_genq(group, "--help", redis_url=redis_url).stdout.split("Commands:")[1]
        assert "..." not in sub, sub

    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    write_prompts(src, 4)
    run_genq("enqueue", str(src), "--job", "names", "--output", str(out), redis_url=redis_url)
    for args in (("jobs", "show", "names"), ("jobs", "show", "--job", "names")):
        assert "names" in run_genq(*args, redis_url=redis_url).stdout
    run_genq("jobs", "set", "--job", "names", "--priority", "3", redis_url=redis_url)
    assert "priority" in run_genq("jobs", "show", "--job", "names", redis_url=redis_url).stdout
    assert "queued" in run_genq("status", "--job", "names", "p00001", redis_url=redis_url).stdout
    assert "queued" in run_genq("status", "names", "p00001", redis_url=redis_url).stdout
    both = run_genq("jobs", "show", "names", "--job", "other", redis_url=redis_url, check=False)
    assert both.returncode == 2 and "two jobs given" in both.stderr, both.stderr

    from genq.output.truth import LocalStore, commit_shard, shard_bytes
    from tests.test_export import result

    commit_shard(LocalStore(str(out)), "names", "b0000001", shard_bytes([result("p00000", 0, "b0000001", job="names")],
                                                                        "none"), 1, 0.0, compression="none",
                 incarnation="", outcome=None)
    for option in ("--output", "--from"):
        done = run_genq("export", "--job", "names", option, str(out), "--to", str(tmp_path / f"x{option}.jsonl"),
                        redis_url=redis_url, check=False)
        # returncode 3: partial
        assert done.returncode == 3 and "wrote 1 record" in done.stdout, (option, done.stdout, done.stderr)
    export_help = run_genq("export", "--help", redis_url=redis_url).stdout
    assert "--output OUTPUT" in export_help and "--from" not in export_help, export_help
    monitor_help = run_genq("monitor", "--help", redis_url=redis_url).stdout
    assert "--metrics [HOST]:PORT" in monitor_help and "--serve" not in monitor_help, monitor_help
    bad = run_genq("monitor", "--metrics", "nonsense", redis_url=redis_url, check=False)
    assert bad.returncode == 2 and "--metrics 'nonsense': expected [HOST]:PORT" in bad.stderr, bad.stderr

    level = run_genq("worker", "--log-level", "INFO", redis_url=redis_url, check=False)
    assert (level.returncode == 2 and "--log-level" not in level.stderr
            and "give either --server" in level.stderr), level.stderr

    purge = run_genq("dlq", "purge", "--job", "names", "-y", redis_url=redis_url, check=False)
    assert purge.returncode == 0 and "No such option" not in purge.stderr, purge.stderr
    gone = run_genq("jobs", "delete", "--job", "names", "-y", redis_url=redis_url)
    assert "removed job names" in gone.stdout, gone.stdout


def test_dry_run_says_a_job_redis_lost_would_be_created_again_from_its_output(redis_url, rconn, tmp_path):
    src, out = tmp_path / "p.jsonl", tmp_path / "out"
    write_prompts(src, 6)
    common = ("--job", "lost", "--output", str(out), "--batch-size", "3")
    run_genq("enqueue", str(src), *common, redis_url=redis_url)
    rconn.flushall()  # Redis lost the job; OUTPUT/lost/job.json remains
    dry = run_genq("enqueue", str(src), *common, "--dry-run", redis_url=redis_url)
    assert "(not in Redis, but" in dry.stdout and "it would be created again from there" in dry.stdout, dry.stdout
    assert "a new job" not in dry.stdout and rconn.keys("*") == [], dry.stdout
    again = run_genq("enqueue", str(src), *common, redis_url=redis_url)
    assert "job created again from its output" in again.stdout, again.stdout


def test_demo_takes_the_redis_given_after_the_subcommand(tmp_path):
    """`genq demo --redis URL` (README) uses that Redis, as `genq --redis URL demo` does: --keep is
    allowed with it, and a Redis that does not answer is said (exit 1), not the private one used."""
    env = {k: v for k, v in os.environ.items() if k != "GENQ_REDIS_URL"}
    proc = subprocess.run([sys.executable, "-m", "genq", "demo", "--redis", "redis://127.0.0.1:1/0", "--keep",
                           "--output", str(tmp_path / "d")], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "--keep needs" not in proc.stderr, proc.stderr


EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
BAD_VALUES = [  # (command, the option its one line names)
    (("sim", "--port", "99999"), "--port"),
    (("sim", "--port", "-5"), "--port"),
    (("enqueue", str(EXAMPLE), "--job", "j", "--output", "gs://bucket/out"), "--output"),
    (("export", "--job", "j", "--to", "http://host/x.jsonl"), "--to"),
    (("export", "--job", "j", "--to", ""), "--to"),  # was taken as the current folder, written as /j.jsonl
    (("export", "--job", "j", "--to", "x.jsonl", "--errors", "gs://b/e.jsonl"), "--errors"),  # was not checked
    (("enqueue", str(EXAMPLE), "--job", "j", "--output", ""), "--output"),
    (("enqueue", "", "--job", "j"), "INPUT"),  # was exit 1, "input file not found: "
    (("enqueue", "gs://b/in.jsonl", "--job", "j"), "INPUT"),  # was the current folder, silently
    (("recover", "--job", "j", "--output", ""), "--output"),
    (("jobs", "set", "j", "--max-attempts", "1000"), "--max-attempts"),  # as enqueue's and the worker's: 1..100
    (("concurrency", "99999999999999999999", "--all"), "VALUE"),  # was msgpack's OverflowError, with workers
    (("enqueue", str(EXAMPLE), "--job", "j", "--max-tokens", "9" * 20), "--max-tokens"),  # was msgpack's traceback
    (("enqueue", str(EXAMPLE), "--job", "j", "--priority", "9" * 20), "--priority"),
    (("jobs", "set", "j", "--priority", "9" * 20), "--priority"),
    (("dlq", "requeue", "--all", "--max-tokens", "9" * 20), "--max-tokens"),
    (("enqueue", str(EXAMPLE), "--job", "j", "--weight", "nan"), "--weight"),  # was queued, then exit 1
    (("enqueue", str(EXAMPLE), "--job", "j", "--temperature", "inf"), "--temperature"),
    (("jobs", "set", "j", "--weight", "nan"), "--weight"),  # was a traceback for a job that exists
    (("monitor", "--metrics", "abc"), "--metrics"),
    (("monitor", "--web", "127.0.0.1:port"), "--web"),
    (("worker", "--gpus", "0,x", "--launch", "genq sim --port {port}"), "--gpus"),
    (("worker", "--gpus", "0", "--server-url", "http://x/{nope}"), "--server-url"),  # was exit 1
    # nan passes every comparison of a range: it was taken (a worker with requests that never time out)
    (("worker", "--server", "http://127.0.0.1:1", "--server-start-timeout", "1", "--request-timeout", "nan"),
     "--request-timeout"),
    (("monitor", "--interval", "nan"), "--interval"),
    (("sim", "--port", "0", "--error-rate", "nan"), "--error-rate"),  # was a sim that never erred
    (("sim", "--port", "0", "--startup-delay", "inf"), "--startup-delay"),  # was a sim that never came up
    (("drain", "--all", "--wait", "--timeout", "nan"), "--timeout"),
    (("demo", "--prompts", "1", "--num-gpus", "1", "--speed", "nan"), "--speed"),
    (("demo", "--prompts", "1", "--num-gpus", "1", "--speed", "inf"), "--speed"),
    # a first retry delay longer than the longest: each retry was taken at --retry-backoff-max, silently
    (("worker", "--server", "http://127.0.0.1:1", "--burst", "--server-start-timeout", "1", "--retry-backoff", "10",
      "--retry-backoff-max", "5"), "--retry-backoff 10.0 is more than --retry-backoff-max 5.0"),
    (("worker", "--gpus", "0,x", "--retry-backoff", "90"), "--retry-backoff 90.0 is more than --retry-backoff-max"),
]


@pytest.mark.parametrize("args,option", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_naming_its_option_exit_2_and_nothing_written(args, option, redis_url, rconn,
                                                                              tmp_path):
    """A typo in an option is bad usage (README: exit 2), said before anything starts: not a traceback
    (sim's port), not a local folder named `gs:` that workers fill in their own working directories."""
    proc = run_genq(*args, redis_url=redis_url, check=False, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = [line for line in proc.stderr.splitlines() if line.startswith("Error")]
    assert "Traceback" not in proc.stderr and len(lines) == 1 and option in lines[0], proc.stderr[-3000:]
    assert rconn.keys("genq:job*") == [] and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def _float_options() -> list[tuple[str, click.Option]]:
    from genq.cli import cli

    def walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Option]]:
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, (click.types.FloatParamType, ByteSize)):
                yield f"{path} {param.opts[0]}", param
        ctx = click.Context(command)
        for name in getattr(command, "list_commands", lambda _: [])(ctx):
            yield from walk(command.get_command(ctx, name), f"{path} {name}".strip())  # type: ignore[attr-defined]

    return list(walk(cli, ""))


@pytest.mark.parametrize("name,option", _float_options(), ids=[name for name, _ in _float_options()])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
def test_no_float_option_takes_nan_or_inf(name, option, value):
    """nan passes every comparison of a range and inf every lower bound: no option (a timeout, a rate, a
    speed, a size) is either, each is refused as bad usage naming its option."""
    with pytest.raises(click.BadParameter) as refused:
        option.type.convert(value, option, click.Context(click.Command("x")))
    assert option.opts[0] in refused.value.format_message() or refused.value.param is option


def test_export_of_a_job_with_no_shard_yet_names_the_option_that_exists(redis_url, rconn, tmp_path):
    write_prompts(tmp_path / "p.jsonl", 3)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "early", "--output", str(tmp_path / "out"),
             redis_url=redis_url)
    proc = run_genq("export", "--job", "early", "--to", str(tmp_path / "e.jsonl"), redis_url=redis_url, check=False)
    assert proc.returncode == 1 and "no shards to export" in proc.stderr, proc.stderr
    assert "--output" in proc.stderr and "--from" not in proc.stderr, proc.stderr  # --from is hidden from --help


def test_a_concurrency_cap_too_large_to_store_is_bad_usage():
    """A live worker's cap is stored as msgpack (64-bit): a bigger number was a traceback from genq concurrency."""
    from genq.cli import concurrency

    with pytest.raises(ValueError, match="is not a cap"):
        concurrency("99999999999999999999")
