"""genq enqueue: batches in Redis and RQ, idempotent re-runs, rejects with line numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import msgspec
import pytest

from genq.core import keys
from genq.core.queueing import rq_queue
from genq.core.records import Rejected
from tests.conftest import batch_prompts, run_genq, write_prompts


def test_enqueue_batches_prompts_into_rq_jobs(redis_url, rconn, tmp_path):
    src = tmp_path / "prompts.jsonl"
    ids = write_prompts(src, 10, extra={"source": "unit"})
    out = run_genq("enqueue", str(src), "--job", "j1", "--batch-size", "4", "--max-tokens", "64",
                   "--output", str(tmp_path / "out"), redis_url=redis_url)
    assert "queued 10 prompts in 3 batches" in out.stdout
    queue = rq_queue(rconn)
    assert queue.count == 3
    batch_ids = [b.decode() for b in rconn.zrange(keys.job_batches("j1"), 0, -1)]
    batches = [batch_prompts(rconn, "j1", bid) for bid in batch_ids]
    assert [len(b) for b in batches] == [4, 4, 2]
    assert [p.id for b in batches for p in b] == ids
    assert batches[0][0].metadata == {"source": "unit"}
    # RQ carries references, not prompts.
    assert {tuple(j.args) for j in queue.get_jobs()} == {("j1", bid) for bid in batch_ids}
    assert int(rconn.hget(keys.job_stats("j1"), "total")) == 10
    info = subprocess.run([sys.executable, "-m", "rq.cli", "info", "-u", redis_url],
                          capture_output=True, text=True)
    assert "genq" in info.stdout and "3" in info.stdout


def test_reenqueue_is_idempotent_and_adds_only_new_ids(redis_url, rconn, tmp_path):
    src = tmp_path / "prompts.jsonl"
    write_prompts(src, 6)
    run_genq("enqueue", str(src), "--job", "j2", "--batch-size", "4", redis_url=redis_url)
    again = run_genq("enqueue", str(src), "--job", "j2", redis_url=redis_url)
    assert "queued 0 prompts" in again.stdout
    assert "skipped 6 prompts already queued or done" in again.stdout
    more = tmp_path / "more.jsonl"
    write_prompts(more, 8)  # p00000..p00007: six known, two new
    third = run_genq("enqueue", str(more), "--job", "j2", redis_url=redis_url)
    assert "queued 2 prompts in 1 batch " in third.stdout
    assert rq_queue(rconn).count == 3
    assert int(rconn.hget(keys.job_stats("j2"), "total")) == 8


def test_malformed_lines_are_reported_kept_aside_and_do_not_stop_valid_ones(redis_url, rconn, tmp_path):
    good = {"id": "ok1", "messages": [{"role": "user", "content": "hi"}]}
    lines = [
        json.dumps(good),                                                    # 1 ok
        "{not json",                                                         # 2 invalid JSON
        json.dumps({"id": "m", "messages": []}),                             # 3 empty messages
        json.dumps({"id": "n"}),                                             # 4 missing messages
        json.dumps({"id": 3.5, "prompt": "x"}),                              # 5 wrong id type
        json.dumps({"id": "ok1", "messages": [{"role": "user", "content": "other"}]}),  # 6 dup id, new content
        json.dumps({"id": "big", "prompt": "x" * (5 * 1024 * 1024)}),         # 7 huge line
        json.dumps({"prompt": "no id given", "topic": "t"}),                 # 8 ok, hashed id
        json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                    "body": {"model": "x", "messages": [{"role": "user", "content": "hey"}], "max_tokens": 7}}),  # 9 ok
        "",                                                                  # blank: ignored
        json.dumps({"id": "s", "messages": [{"role": "user", "content": "a"}], "sampling": 3}),  # 11 bad sampling
    ]
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(lines) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "j3", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3, proc.stderr
    assert "queued 3 prompts" in proc.stdout
    rejects_path = tmp_path / "out" / "j3" / "rejects" / "mixed.rejects.jsonl"
    rejects = [msgspec.json.decode(line, type=Rejected) for line in rejects_path.read_bytes().splitlines()]
    by_line = {r.line: r.reason for r in rejects}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 11]
    assert "invalid JSON" in by_line[2]
    assert "non-empty list" in by_line[3]
    assert "missing 'messages'" in by_line[4]
    assert "'id' must be a string or an integer" in by_line[5]
    assert "duplicate id 'ok1' with different content" in by_line[6]
    assert {r.line: r.text for r in rejects}[6] == lines[5]  # the whole line, not only the id
    assert "over the" in by_line[7]
    assert "'sampling' must be an object" in by_line[11]
    assert "line 2: invalid JSON" in proc.stderr
    prompts = {p.id: p for p in batch_prompts(rconn, "j3", "b0000001")}
    assert set(prompts) == {"ok1", "r1", next(i for i in prompts if i not in ("ok1", "r1"))}
    assert prompts["r1"].custom_id == "r1" and prompts["r1"].sampling == {"max_tokens": 7}
    hashed = next(p for i, p in prompts.items() if i not in ("ok1", "r1"))
    assert hashed.metadata == {"topic": "t"} and len(hashed.id) == 16


def test_config_conflict_is_refused_with_the_setting_named(redis_url, tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 2)
    run_genq("enqueue", str(src), "--job", "j4", "--max-tokens", "100", redis_url=redis_url)
    proc = run_genq("enqueue", str(src), "--job", "j4", "--max-tokens", "200", redis_url=redis_url, check=False)
    assert proc.returncode == 1
    assert "--max-tokens 200 (job has 100)" in proc.stderr


def test_redis_password_is_masked_in_errors(tmp_path):
    src = tmp_path / "p.jsonl"
    write_prompts(src, 1)
    proc = run_genq("enqueue", str(src), "--job", "j5",
                    redis_url="redis://user:s3cret@127.0.0.1:1/0", check=False)
    assert proc.returncode == 1
    assert "s3cret" not in proc.stdout + proc.stderr
    assert "redis://user:***@127.0.0.1:1/0" in proc.stderr


def test_rejects_are_written_as_they_are_found_in_line_order(rconn, tmp_path):
    """The rejects file grows while the input is read (the producer does not hold every reject
    until the end: an input of mostly bad lines would not fit), and still comes out sorted by
    line, a duplicate id found in Redis a group later included."""
    from genq.core.records import JobConfig
    from genq.producer.enqueue import Enqueuer, RejectsFile
    from genq.producer.sources import jsonl_rows

    n, seen_while_reading = 60_000, []
    path = tmp_path / "rejects" / "in.rejects.jsonl"

    def lines():
        for i in range(1, n + 1):
            if i % 10 == 0:
                yield b"{bad\n"
            elif i == 40_001:  # the id of line 1 again, other content: queued earlier, found in Redis
                yield json.dumps({"id": "p1", "prompt": "other"}).encode() + b"\n"
            else:
                yield json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}).encode() + b"\n"
            if i == n:
                partial = path.with_name(path.name + ".partial")
                seen_while_reading.extend(partial.read_bytes().splitlines() if partial.exists() else [])

    rejects = RejectsFile(str(path))
    config = JobConfig(name="streamed", output=str(tmp_path / "out"), batch_size=100)
    summary = Enqueuer(rconn, config, create=True, rejects=rejects).run(jsonl_rows(lines(), config.endpoint))
    rejects.close()
    assert len(seen_while_reading) >= 1_000  # rejects of early lines were on disk before the last line was read
    written = [msgspec.json.decode(line, type=Rejected) for line in path.read_bytes().splitlines()]
    assert summary.rejected == rejects.count == len(written) == n // 10 + 1
    assert [r.line for r in written] == sorted(r.line for r in written)
    assert "duplicate id 'p1'" in next(r.reason for r in written if r.line == 40_001)
    assert [r.line for r in rejects.first] == [r.line for r in written[:len(rejects.first)]]
    assert not path.with_name(path.name + ".partial").exists()
    assert summary.enqueued == n - n // 10 - 1


def test_a_dry_run_counts_what_the_real_enqueue_then_does_and_writes_nothing(rconn, tmp_path):
    """The dry run is the real enqueue with its claims held in memory: a repeat or an other-content
    line of an id far up the input (groups apart) is counted as the real run counts it."""
    from genq.core.records import JobConfig
    from genq.producer.enqueue import Enqueuer, RejectsFile
    from genq.producer.sources import jsonl_rows

    lines = [json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}).encode() + b"\n" for i in range(100)]
    lines += [lines[0], lines[1], json.dumps({"id": "p2", "prompt": "other"}).encode() + b"\n", b"{bad\n"]
    config = JobConfig(name="same", output=str(tmp_path / "out"), batch_size=3)

    def summary(dry_run: bool) -> tuple[int, ...]:
        rejects = RejectsFile(None if dry_run else str(tmp_path / "rejects.jsonl"))
        got = Enqueuer(rconn, config, create=True, rejects=rejects, dry_run=dry_run).run(
            jsonl_rows(lines, config.endpoint))
        rejects.close()
        return got.enqueued, got.batches, got.skipped_existing, got.skipped_duplicate, got.rejected

    dry = summary(dry_run=True)
    assert rconn.dbsize() == 0 and not (tmp_path / "out").exists()
    assert dry == summary(dry_run=False) == (100, 34, 2, 0, 2)


def test_dry_run_checks_rows_for_the_jobs_endpoint_as_the_real_enqueue_does(redis_url, tmp_path):
    """A 'prompt' row in a chat job is queued as one user message: a dry run of the same input again
    finds it queued (same content), and a 'messages' row for a completions job is rejected in the
    dry run as in the real one."""
    src = tmp_path / "prompts.jsonl"
    src.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"say {i}"}) + "\n" for i in range(3)))
    run_genq("enqueue", str(src), "--job", "conv", "--output", str(tmp_path / "out"), redis_url=redis_url)
    dry = run_genq("enqueue", str(src), "--job", "conv", "--dry-run", redis_url=redis_url, check=False)
    assert (dry.returncode == 0
            and "3 prompts already queued or done would be skipped" in dry.stdout), dry.stdout + dry.stderr

    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"id": "c1", "messages": [{"role": "user", "content": "hi"}]}) + "\n"
                     + json.dumps({"id": "c2", "prompt": "hi"}) + "\n")
    args = ("enqueue", str(chats), "--job", "comp", "--endpoint", "completions", "--output", str(tmp_path / "out"))
    dry = run_genq(*args, "--dry-run", redis_url=redis_url, check=False)
    assert dry.returncode == 3 and "1 prompt would be queued" in dry.stdout, dry.stdout + dry.stderr
    assert "line 1: has 'messages' but the job uses --endpoint completions" in dry.stderr
    real = run_genq(*args, redis_url=redis_url, check=False)
    assert real.returncode == 3 and "queued 1 prompt in 1 batch" in real.stdout


@pytest.mark.parametrize("mode", ["--input-inline", "--input-by-reference"])
def test_a_byte_order_mark_and_crlf_line_ends_lose_no_line(redis_url, rconn, tmp_path, mode):
    """Editors on Windows save UTF-8 with a byte order mark and CRLF: the first line is a row like the
    others (it was rejected as invalid JSON), also when a worker reads it back by reference."""
    src = tmp_path / "bom.jsonl"
    rows = [{"id": f"w{i}", "messages": [{"role": "user", "content": f"hi {i}"}]} for i in range(3)]
    src.write_bytes(b"\xef\xbb\xbf" + b"".join(json.dumps(r).encode() + b"\r\n" for r in rows))
    proc = run_genq("enqueue", str(src), "--job", "bom", "--output", str(tmp_path / "out"), mode,
                    redis_url=redis_url, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [(p.id, p.messages) for p in batch_prompts(rconn, "bom", "b0000001")] == \
        [(r["id"], r["messages"]) for r in rows]


def test_an_openai_batch_lines_other_fields_are_its_metadata(redis_url, rconn, tmp_path):
    """Fields beside custom_id, method, url and body are carried to the record as a plain row's are,
    not dropped."""
    src = tmp_path / "oai.jsonl"
    src.write_text(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "topic": "t",
                               "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}) + "\n")
    run_genq("enqueue", str(src), "--job", "oaimeta", "--output", str(tmp_path / "out"), redis_url=redis_url)
    (prompt,) = batch_prompts(rconn, "oaimeta", "b0000001")
    assert (prompt.custom_id, prompt.metadata) == ("r1", {"topic": "t"})


def test_an_integer_too_large_to_queue_rejects_its_line_only(redis_url, rconn, tmp_path):
    """Redis holds prompts as msgpack, whose integers are 64-bit: a larger one (a seed, a metadata id)
    rejected its whole enqueue with a traceback; now its line is rejected, named, and the rest queued."""
    src = tmp_path / "big.jsonl"
    src.write_text("\n".join([
        json.dumps({"id": "ok", "prompt": "hi", "sampling": {"seed": 2**64 - 1}}),
        json.dumps({"id": "seed", "prompt": "hi", "sampling": {"seed": 2**64}}),
        json.dumps({"id": "meta", "prompt": "hi", "row": -(2**63) - 1}),
    ]) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "big", "--output", str(tmp_path / "out"), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3 and "Traceback" not in proc.stderr, proc.stdout + proc.stderr
    assert "line 2: has an integer outside" in proc.stderr and "line 3: has an integer outside" in proc.stderr
    assert [p.id for p in batch_prompts(rconn, "big", "b0000001")] == ["ok"]
    proc = run_genq("enqueue", str(src), "--job", "big2", "--extra-body", '{"seed": 18446744073709551616}',
                    "--output", str(tmp_path / "out"), redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "--extra-body has an integer outside" in proc.stderr


def test_request_fields_at_a_rows_top_level_are_named_as_not_sent(redis_url, rconn, tmp_path):
    """A row's top-level fields are its metadata, request field names too (docs/input-output.md): kept,
    never sent. A user who wrote max_tokens there is told, in one line, where request fields go."""
    src = tmp_path / "top.jsonl"
    src.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": "hi", "max_tokens": 9, "topic": "x"})
                             for i in range(3)) + "\n" + json.dumps({"id": "u", "prompt": "hi", "user": "u1"}) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "top", "--output", str(tmp_path / "out"), redis_url=redis_url)
    assert 'not sent: max_tokens (3 rows); to send them, put them under "sampling"' in proc.stdout, proc.stdout
    prompts = batch_prompts(rconn, "top", "b0000001")
    assert [(p.metadata, p.sampling) for p in prompts[:1]] == [({"max_tokens": 9, "topic": "x"}, None)]
