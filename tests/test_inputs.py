"""Inputs by reference and inline (#15): what Redis holds per batch, a job whose workers
read their batches' line ranges from moto's S3, a changed input dead-lettered rather
than generated from the wrong lines, and a producer killed mid-enqueue then run again."""

from __future__ import annotations

import json
import signal
import subprocess

import pytest

from genq.core import keys
from genq.core.queueing import load_batch
from tests.audit import audit
from tests.conftest import genq_cmd, run_genq, wait_until
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)

BUCKET = "genq-inputs"
FAST_SIM = dict(mean_output_tokens=32, output_sigma=0.5, tokens_per_step=16, step_ms_base=5)


def lines(n: int, start: int = 0) -> tuple[list[str], list[bytes]]:
    ids = [f"p{i:06d}" for i in range(start, start + n)]
    return ids, [json.dumps({"id": pid, "messages": [{"role": "user", "content": f"tell me about {pid}"}],
                             "topic": "ref"}).encode() + b"\n" for pid in ids]


def batch_records(rconn, job: str) -> list:
    return [load_batch(rconn, job, b.decode()) for b in rconn.zrange(keys.job_batches(job), 0, -1)]


def test_reference_job_on_s3_reads_ranges_and_ends_with_one_result_per_prompt(moto, redis_url, rconn, sim, worker,  # noqa: F811
                                                                              tmp_path):
    ids, rows = lines(47)
    # A bad line, a blank line and a repeated line: line numbers and ranges must still hold.
    body = b"".join(rows[:10]) + b"{not json\n" + b"\n" + b"".join(rows[10:30]) + rows[3] + b"".join(rows[30:])
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="in/prompts.jsonl", Body=body)
    out = tmp_path / "out"
    proc = run_genq("enqueue", f"s3://{BUCKET}/in/prompts.jsonl", "--job", "ref", "--batch-size", "10",
                    "--max-tokens", "32", "--output", str(out), "--s3-endpoint-url", moto.url,
                    redis_url=redis_url, check=False)
    assert proc.returncode == 3 and "line 11: invalid JSON" in proc.stderr, proc.stderr
    assert f"queued 47 prompts in 5 batches (by reference to s3://{BUCKET}/in/prompts.jsonl)" in proc.stdout
    assert "skipped 1 repeated line (same id" in proc.stdout
    records = batch_records(rconn, "ref")
    assert all(r.ref is not None and r.prompts == b"" for r in records), "Redis holds references, not prompts"
    assert [r.prompt_ids() for r in records] == [ids[i:i + 10] for i in range(0, 47, 10)]
    assert (records[1].ref.first_line, records[1].ref.last_line) == (13, 22)  # after the bad and the blank line

    server = sim(max_running_requests=8, **FAST_SIM)
    assert worker(server, "--burst").wait(timeout=120) == 0
    found = audit(rconn, "ref", out, ids)
    assert not found.letters
    # What was sent is what the input says, with its line's position for ordered export.
    assert found.results["p000012"]["messages"] == [{"role": "user", "content": "tell me about p000012"}]
    assert found.results["p000012"]["index"] == 14 and found.results["p000012"]["metadata"] == {"topic": "ref"}


def test_changed_or_missing_input_dead_letters_the_batch_and_sends_none_of_it(redis_url, rconn, sim, worker, tmp_path):
    ids, rows = lines(15)
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b"".join(rows))
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(path), "--job", "chg", "--batch-size", "5", "--max-tokens", "32",
                    "--output", str(out), "--input-by-reference", redis_url=redis_url)
    assert f"by reference to {path}" in proc.stdout
    # Line 7 (batch 2) now says something else, same length: the bytes are where they were.
    changed = rows[6].replace(b"tell me about", b"tell me ABOUT")
    path.write_bytes(b"".join(rows[:6]) + changed + b"".join(rows[7:]))

    server = sim(max_running_requests=8, **FAST_SIM)
    assert worker(server, "--burst").wait(timeout=120) == 0
    found = audit(rconn, "chg", out, ids)
    assert sorted(found.letters) == ids[5:10], "the whole batch, and only it"
    for letter in found.letters.values():
        assert letter.kind == "input_changed" and letter.prompt is None and letter.attempts == 0
        assert f"{path} lines 6-10" in letter.message and "changed since it was queued" in letter.message
    assert sorted(found.results) == ids[:5] + ids[10:]
    assert not any("ABOUT" in json.dumps(r) for r in found.rows), "nothing generated from the changed line"

    # A missing input: every batch of the next job is dead-lettered the same way.
    other = tmp_path / "gone.jsonl"
    other.write_bytes(b"".join(lines(3, start=100)[1]))
    run_genq("enqueue", str(other), "--job", "gone", "--max-tokens", "32", "--output", str(out),
             "--input-by-reference", redis_url=redis_url)
    other.unlink()
    assert worker(server, "--burst").wait(timeout=120) == 0
    found = audit(rconn, "gone", out, lines(3, start=100)[0])
    assert {d.kind for d in found.letters.values()} == {"input_changed"} and len(found.letters) == 3
    assert all("is gone" in d.message for d in found.letters.values())
    requeue = run_genq("dlq", "requeue", "--job", "gone", "--all", redis_url=redis_url, check=False)
    assert requeue.returncode == 3 and "does not carry its prompt" in requeue.stderr
    assert all("genq dlq purge --job gone" in d.message for d in found.letters.values())


def test_inline_batches_are_compressed(redis_url, rconn, tmp_path):
    ids, rows = lines(40)
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"".join(rows))
    proc = run_genq("enqueue", str(path), "--job", "inl", "--batch-size", "40", redis_url=redis_url)
    assert "(inline)" in proc.stdout
    (record,) = batch_records(rconn, "inl")
    assert record.ref is None and record.count == 40 and len(record.prompts) < len(b"".join(rows)) / 3
    assert [p.id for p in record.inline_prompts()] == ids
    bad = run_genq("enqueue", str(path) + ".gz", "--job", "inl2", "--input-by-reference", redis_url=redis_url,
                   check=False)
    assert bad.returncode == 1 and "needs an uncompressed JSONL input" in bad.stderr


@pytest.mark.parametrize("mode", ["--input-inline", "--input-by-reference"])
def test_producer_killed_mid_enqueue_then_run_again_queues_each_prompt_once(redis_url, rconn, tmp_path, mode):
    n = 150_000
    ids, rows = lines(n)
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"".join(rows))
    args = ["enqueue", str(path), "--job", "crash", "--batch-size", "100", mode]
    producer = subprocess.Popen(genq_cmd(*args, redis_url=redis_url), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: int(rconn.hget(keys.job_stats("crash"), "total") or 0) > 0, timeout=60,
                   what="the producer's first batches", interval=0.005)
        assert producer.poll() is None, "the producer finished before it could be killed: use a bigger input"
        producer.send_signal(signal.SIGKILL)
    finally:
        producer.kill()
        producer.wait()
    partial = int(rconn.hget(keys.job_stats("crash"), "total"))
    assert 0 < partial < n

    again = run_genq(*args, redis_url=redis_url)
    assert f"skipped {partial:,} prompts already queued" in again.stdout
    queued = [i for r in batch_records(rconn, "crash") for i in r.prompt_ids()]
    assert len(queued) == n and sorted(queued) == ids, "each prompt in exactly one batch"
    assert int(rconn.hget(keys.job_stats("crash"), "total")) == n == rconn.hlen(keys.job_ids("crash"))
    assert rconn.zcard(keys.job_batches("crash")) == int(rconn.hget(keys.job_stats("crash"), "batches"))
