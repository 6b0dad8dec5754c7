"""The output side of #31, on a real folder and a real S3 endpoint (moto's server): a marker is
created once, a shard is never overwritten with other bytes, a batch number is never reused in
a job's folder, and export keeps one record per prompt, the first written, of this job's life."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from genq.core.records import Result, Usage
from genq.output import truth
from genq.output.s3 import S3Store
from genq.output.truth import LocalStore, shard_bytes
from tests.conftest import run_genq, write_prompts
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)

BUCKET = "genq-recover"


def result(pid: str, index: int, batch: str, completion: str = "x", at: float = 1.0) -> Result:
    return Result(id=pid, job="j", batch=batch, index=index, completion=completion, finish_reason="stop",
                  usage=Usage(prompt_tokens=3, completion_tokens=len(completion)), model="m", worker="w",
                  attempts=1, latency_s=0.1, finished_at=at)


def commit(store: truth.Store, results: list[Result]) -> tuple[bytes, object]:
    data = shard_bytes(results, "none")
    outcome = truth.outcome_of(results, [], {r.id: bytes(8) for r in results}, len(results))
    info = truth.commit_shard(store, "j", "b0000001", data, len(results), 2.0, compression="none",
                              incarnation="life1", outcome=outcome)
    return data, info


def check_never_overwritten(store: truth.Store) -> None:
    first = [result(f"p{i}", i, "b0000001") for i in range(4)]
    data, info = commit(store, first)
    assert commit(store, first)[1] == info, "the same bytes again: the same shard, no error"
    for other in (first[:3], [result(f"p{i}", i, "b0000001", "regenerated") for i in range(4)]):
        with pytest.raises(truth.AlreadyWritten) as caught:  # fewer records, or other ones
            commit(store, other)
        assert caught.value.marker.records == 4 and caught.value.marker.sha256
    assert store.read("j/shards/b0000001.jsonl") == data, "the first shard was overwritten"
    marker = truth.read_marker(store, truth.marker_rel("j", "b0000001"))
    assert marker is not None and marker.incarnation == "life1" and marker.prompts == 4
    assert sorted(marker.digests) == ["p0", "p1", "p2", "p3"] and marker.tally == {"w": [4, 12, 4]}

    # A shard left without its marker (a writer died between the two) holding other bytes stays:
    # the next writer's copy goes beside it, and its marker names that copy.
    orphan = shard_bytes([result("q0", 0, "b0000002")], "none")
    store.put("j/shards/b0000002.jsonl", orphan)
    data = shard_bytes([result("q0", 0, "b0000002", "mine")], "none")
    info = truth.commit_shard(store, "j", "b0000002", data, 1, 2.0, compression="none", incarnation="life1",
                              outcome=None)
    assert store.read("j/shards/b0000002.jsonl") == orphan
    name = info.uri.rsplit("/", 1)[-1]
    assert name.startswith("b0000002.") and name.endswith(".jsonl") and name != "b0000002.jsonl"
    assert store.read(f"j/shards/{name}") == data


def test_a_local_shard_is_never_overwritten_with_other_records(tmp_path: Path):
    check_never_overwritten(LocalStore(str(tmp_path / "out")))


def test_an_s3_shard_is_never_overwritten_with_other_records(moto):  # noqa: F811 (the moto fixture)
    moto.client().create_bucket(Bucket=BUCKET)
    check_never_overwritten(S3Store(f"s3://{BUCKET}/prefix", moto.url))


def test_batch_numbers_are_not_reused_when_a_job_is_created_again_in_its_folder(redis_url, rconn, tmp_path):
    """Another life of the job name (other settings) in the same output: its batches are numbered
    after the first life's, so no shard of the first is overwritten, and each export reads its own."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out"
    write_prompts(src, 30)
    run_genq("enqueue", str(src), "--job", "again", "--output", str(out), "--batch-size", "10", "--max-tokens", "50")
    first = json.loads((out / "again" / "job.json").read_text())
    assert first["reserved"] >= 3 and first["inputs"] == [str(src)]
    run_genq("jobs", "delete", "again", "--yes")
    second = run_genq("enqueue", str(src), "--job", "again", "--output", str(out), "--batch-size", "10",
                      "--max-tokens", "20")
    assert ("earlier job of this name, which was deleted (genq jobs delete): this is a new job"
            in second.stdout), second.stdout
    batches = sorted(b.decode() for b in rconn.zrange("genq:job:again:batches", 0, -1))
    assert batches and min(int(b[1:]) for b in batches) > first["reserved"], batches
    record = json.loads((out / "again" / "job.json").read_text())
    assert record["config"]["incarnation"] != first["config"]["incarnation"]
    assert record["config"]["max_tokens"] == 20


def test_export_keeps_the_first_written_result_of_a_prompt(redis_url, tmp_path: Path):
    """A prompt in two shards (an output written by a genq before #31 regenerated it): exported
    once, its earlier result, whatever the batch numbers."""
    store = LocalStore(str(tmp_path / "out"))
    for batch, completion, at in (("b0000001", "second", 9.0), ("b0000002", "first", 5.0)):
        rows = [result("dup", 0, batch, completion, at), result(f"only-{batch}", 1, batch, "x", at)]
        truth.commit_shard(store, "j", batch, shard_bytes(rows, "none"), 2, at, compression="none",
                           incarnation="life1", outcome=None)
    dest = tmp_path / "j.jsonl"
    done = run_genq("export", "--job", "j", "--from", str(tmp_path / "out"), "--to", str(dest))
    lines = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [r["completion"] for r in lines if r["id"] == "dup"] == ["first"], lines
    assert len(lines) == 3 and "dropped 1 duplicate" in done.stdout, done.stdout


def test_catch_up_names_only_the_batches_adopt_marked_done(rconn, tmp_path: Path):
    """ADOPT answers 'gone' for a job whose life in Redis is not the marker's (deleted meanwhile): catch_up
    must not count (nor log) such a batch as marked done; only ADOPT's 1 is an adoption, and recover.adopt says so
    as a bool."""
    from genq.core.ledger import jobs as ledger_jobs
    from genq.core.records import JobConfig, JobRecord
    from genq.ops import recover

    out = tmp_path / "out"
    store = LocalStore(str(out))
    config = JobConfig(name="j", output=str(out), incarnation="life1")
    truth.update_job(store, "j", lambda _: JobRecord(config=config, reserved=1))
    commit(store, [result(f"p{i}", i, "b0000001") for i in range(4)])
    # Redis holds no config of the job (deleted after its caller read it): no life to adopt into.
    assert recover.catch_up(rconn, config) == []
    assert ledger_jobs.done_batches(rconn, "j") == set()
    (marker,) = truth.read_markers(store, "j", {"b0000001"})
    assert recover.adopt(rconn, "j", marker) is False  # not b'gone', which a caller would read as true


# A fresh interpreter reads a job's markers as `genq recover` does (truth.read_markers: 8 threads, each decoding
# ShardMarker for the first time); switching threads every microsecond makes a race there show in a few runs.
READ_MARKERS = """
import sys
sys.setswitchinterval(1e-6)
from genq.output import truth
print(len(truth.read_markers(truth.LocalStore(sys.argv[1]), "j", [f"b{i:07d}" for i in range(1, 17)])))
"""


def test_a_fresh_genq_reads_markers_in_several_threads_without_crashing(tmp_path: Path):
    """genq recover died of SIGSEGV in read_markers (1 run in ~300 of the recover test): msgspec (0.20) builds a
    Struct type's decoding information at its first decode, and another thread decoding the type then can read it
    half built."""
    store = LocalStore(str(tmp_path))
    for n in range(1, 17):
        batch = f"b{n:07d}"
        results = [result(f"p{n}-{i}", i, batch) for i in range(3)]
        outcome = truth.outcome_of(results, [], {r.id: bytes(8) for r in results}, len(results))
        truth.commit_shard(store, "j", batch, shard_bytes(results, "none"), len(results), 2.0, compression="none",
                           incarnation="life1", outcome=outcome)
    for _ in range(30):
        read = subprocess.run([sys.executable, "-c", READ_MARKERS, str(tmp_path)], capture_output=True, text=True,
                              timeout=60)
        assert (read.returncode, read.stdout) == (0, "16\n"), read.stderr[-3000:]


def test_reserve_keeps_a_newer_pin_and_schedule_of_job_json(tmp_path):
    """An enqueue's job.json write (truth.reserve, from what it read at its start) keeps what was written there
    meanwhile at the same settings version: the model a worker pinned, a priority `jobs set` stored."""
    import msgspec

    from genq.core.records import JobConfig, JobRecord, JobSchedule

    store = LocalStore(str(tmp_path))
    base = JobConfig(name="j", output=str(tmp_path), incarnation="i1")
    truth.update_job(store, "j", lambda _: JobRecord(config=msgspec.structs.replace(base, model="M"), reserved=1024,
                                                     schedule=JobSchedule(priority=5, version=2)))
    truth.reserve(store, JobRecord(config=base, reserved=1024), 2048)
    on_disk = truth.read_job(store, "j")
    assert on_disk is not None and on_disk.reserved == 2048
    assert (on_disk.config.model, on_disk.schedule and on_disk.schedule.priority) == ("M", 5), on_disk
