"""S3 through moto's standalone server on loopback: inputs, the shard sink, its
manifest, an S3 outage in the middle of a job, and export from S3."""

from __future__ import annotations

import gzip
import io
import json
import os
import re

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from genq.core import keys
from genq.core.queueing import load_config
from genq.core.records import JobRecord, ShardInfo, unpack
from tests.conftest import batch_prompts, run_genq, wait_until
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)

BUCKET = "genq-test"
FAST_SIM = dict(mean_output_tokens=48, output_sigma=0.5, tokens_per_step=16, step_ms_base=5)


def prompt_lines(n: int, start: int = 0) -> tuple[list[str], bytes]:
    ids = [f"p{i:05d}" for i in range(start, start + n)]
    data = b"".join(
        json.dumps({"id": pid, "messages": [{"role": "user", "content": f"prompt {pid}"}], "topic": "s3"}).encode()
        + b"\n" for pid in ids)
    return ids, data





def shard_records(body: bytes, key: str) -> list[dict]:
    if key.endswith(".gz"):
        body = gzip.decompress(body)
    return [json.loads(line) for line in body.splitlines() if line.strip()]


def check_manifest(objects: dict[str, bytes], root: str) -> dict[str, list[dict]]:
    """Every marker names an existing shard with that many records and bytes.
    Returns batch -> its records."""
    markers = {k: v for k, v in objects.items() if k.startswith(f"{root}/manifest/")}
    shards = {k: v for k, v in objects.items() if k.startswith(f"{root}/shards/")}
    by_batch = {}
    for marker_key, raw in markers.items():
        info = msgspec.json.decode(raw, type=ShardInfo)
        assert marker_key == f"{root}/manifest/{info.batch}.json"
        shard_key = info.uri.removeprefix(f"s3://{BUCKET}/")
        assert info.uri.startswith(f"s3://{BUCKET}/") and shard_key in shards, f"{marker_key} names a missing shard"
        body = shards[shard_key]
        assert len(body) == info.bytes, f"{shard_key}: {len(body)} bytes, marker says {info.bytes}"
        records = shard_records(body, shard_key)
        assert len(records) == info.records
        assert {r["batch"] for r in records} == {info.batch}
        by_batch[info.batch] = records
    return by_batch


def test_job_from_s3_input_writes_s3_shards_one_record_per_prompt(moto, redis_url, rconn, sim, worker, tmp_path):  # noqa: F811 (the moto fixture)
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    ids, data = prompt_lines(57)
    s3.put_object(Bucket=BUCKET, Key="inputs/prompts.jsonl.gz", Body=gzip.compress(data))
    server = sim(max_running_requests=8, **FAST_SIM)

    out = run_genq("enqueue", f"s3://{BUCKET}/inputs/prompts.jsonl.gz", "--job", "s3job", "--batch-size", "10",
                   "--max-tokens", "64", "--output", f"s3://{BUCKET}/runs/2026", "--compression", "gzip",
                   "--s3-endpoint-url", moto.url, redis_url=redis_url)
    assert "queued 57 prompts in 6 batches" in out.stdout
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()

    objects = moto.objects(BUCKET, "runs/2026/s3job/")
    by_batch = check_manifest(objects, "runs/2026/s3job")
    batches = [b.decode() for b in rconn.zrange(keys.job_batches("s3job"), 0, -1)]
    assert sorted(by_batch) == batches
    enqueues = [k for k in objects if k.startswith("runs/2026/s3job/enqueues/")]
    assert len(enqueues) == 1, "the enqueue recorded in the output (what it brought)"
    assert len(objects) == 2 * len(batches) + 1 + 1, \
        "no shard without its marker, nothing else but job.json and the enqueue's record"
    job_file = msgspec.json.decode(objects["runs/2026/s3job/job.json"], type=JobRecord)
    # `--model auto` pinned to the model of the first server that took it (#24), in the ledger and in
    # job.json (a job rebuilt from its output keeps it: docs/fidelity.md): the same job.
    stored = load_config(rconn, "s3job")
    assert job_file.config.model == stored.model == "genq-sim/Sim-8B"
    assert job_file.config == stored and job_file.reserved >= len(batches)
    records = [r for rs in by_batch.values() for r in rs]
    assert sorted(r["id"] for r in records) == ids, "exactly one record per prompt"
    assert all(r["completion"] and r["metadata"] == {"topic": "s3"} for r in records)
    # Redis's manifest hash agrees with the markers in the bucket.
    for bid, raw in rconn.hgetall(keys.job_shards("s3job")).items():
        info = unpack(raw, ShardInfo)
        marker = msgspec.json.decode(objects[f"runs/2026/s3job/manifest/{bid.decode()}.json"], type=ShardInfo)
        assert (info.uri, info.records, info.bytes) == (marker.uri, marker.records, marker.bytes)

    # Export reads the manifest from S3 (the job's endpoint) into one file, in input order.
    dest = tmp_path / "exports" / "s3job.jsonl"
    exp = run_genq("export", "--job", "s3job", "--to", str(dest), redis_url=redis_url)
    size = dest.stat().st_size
    assert "wrote 57 records" in exp.stdout and f"{size:,} bytes" in exp.stdout and "from 6 shards" in exp.stdout
    rows = [json.loads(line) for line in dest.read_text().splitlines()]
    assert [r["id"] for r in rows] == ids and [r["index"] for r in rows] == list(range(57))

    # ... and to Parquet on S3.
    exp = run_genq("export", "--job", "s3job", "--to", f"s3://{BUCKET}/exports/s3job.parquet", redis_url=redis_url)
    assert f"to s3://{BUCKET}/exports/s3job.parquet from 6 shards" in exp.stdout
    table = pq.read_table(io.BytesIO(s3.get_object(Bucket=BUCKET, Key="exports/s3job.parquet")["Body"].read()))
    assert table.column("id").to_pylist() == ids
    assert table.column("messages").to_pylist()[3] == [{"role": "user", "content": "prompt p00003", "other": None}]
    # ... never over a shard it reads (or anything else in the job's folder).
    key = f"runs/2026/s3job/shards/{min(by_batch)}.jsonl.gz"
    before = s3.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    exp = run_genq("export", "--job", "s3job", "--to", f"s3://{BUCKET}/{key}", redis_url=redis_url, check=False)
    assert exp.returncode == 2 and "inside the job's output folder" in exp.stderr, exp.stdout + exp.stderr
    assert s3.get_object(Bucket=BUCKET, Key=key)["Body"].read() == before


def test_s3_outage_mid_run_acknowledges_only_uploaded_batches(moto, redis_url, rconn, sim, worker, tmp_path):  # noqa: F811 (the moto fixture)
    """moto keeps objects in memory: shards uploaded before the outage are gone with
    the old server. The honest checks: while S3 is down no batch is acknowledged;
    every batch whose upload failed was acknowledged later, and every batch
    acknowledged after the restart is in the new bucket, matching its marker;
    together, every prompt has exactly one record."""
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    ids, data = prompt_lines(96)
    src = tmp_path / "prompts.jsonl"
    src.write_bytes(data)
    # ~0.5 s a request, 12 rounds of 8: S3 goes down with most of the job left even when this process,
    # slowed by load, takes seconds to list the bucket and stop the server (at 0.15 s a request the
    # worker had finished all 12 batches by then, at load 11 on 2 cores).
    server = sim(max_running_requests=8, mean_output_tokens=160, output_sigma=0.3, tokens_per_step=16,
                 step_ms_base=50)
    run_genq("enqueue", str(src), "--job", "outage", "--batch-size", "8", "--max-tokens", "400",
             "--output", f"s3://{BUCKET}/out", "--s3-endpoint-url", moto.url, redis_url=redis_url)
    all_batches = {b.decode() for b in rconn.zrange(keys.job_batches("outage"), 0, -1)}
    assert len(all_batches) == 12

    def done() -> set[str]:
        return {b.decode() for b in rconn.smembers(keys.job_done("outage"))}

    proc = worker(server, "--burst", "--concurrency", "8", "--retry-backoff", "0.2", "--retry-backoff-max", "1")
    wait_until(lambda: len(done()) >= 2, 60, "two batches acknowledged")
    snapshot = check_manifest(moto.objects(BUCKET, "out/outage/"), "out/outage")
    moto.stop()
    failure = re.compile(r"batch outage/(b\d+): writing shard failed")
    # No clock windows: the worker's own retries mark time. Once a second failed upload is logged, any
    # upload that got through before the stop has long been released; from then on nothing may be acknowledged
    # while the worker keeps trying (two more failed uploads, of any batch, after the freeze).
    wait_until(lambda: len(failure.findall(proc.log())) >= 2, 60, "shard uploads failing while S3 is down")
    frozen = done()
    seen = len(failure.findall(proc.log()))
    assert frozen != all_batches, "the job must still have work when S3 goes down"
    wait_until(lambda: len(failure.findall(proc.log())) >= seen + 2, 60, "the worker retrying its uploads")
    assert done() == frozen, "a batch was acknowledged while S3 was down"
    failed_during_outage = set(failure.findall(proc.log()))
    assert failed_during_outage and not failed_during_outage & frozen

    moto.start()  # the same port, an empty server
    moto.client().create_bucket(Bucket=BUCKET)
    assert proc.wait(timeout=120) == 0, proc.log()

    assert done() == all_batches, "every batch acknowledged in the end"
    after = check_manifest(moto.objects(BUCKET, "out/outage/"), "out/outage")
    assert set(after) == all_batches - frozen, "every batch acknowledged after the restart is in the bucket"
    assert failed_during_outage <= set(after), "each failed upload was redone before its batch was acknowledged"
    # Batches acknowledged before the outage: their records are in the snapshot
    # (or, if one finished between the snapshot and the stop, counted by Redis).
    shards = {b.decode(): unpack(raw, ShardInfo) for b, raw in rconn.hgetall(keys.job_shards("outage")).items()}
    assert set(shards) == all_batches
    gap = frozen - set(snapshot)
    seen = ([r["id"] for b in frozen & set(snapshot) for r in snapshot[b]]
            + [r["id"] for rs in after.values() for r in rs])
    assert len(seen) == len(set(seen)), "a prompt has two records"
    assert len(seen) + sum(shards[b].records for b in gap) == len(ids)
    assert set(seen) <= set(ids)
    if not gap:
        assert sorted(seen) == ids
    log = proc.log()
    assert "results stay in Redis, retrying" in log
    assert log.count("writing shard failed") >= 2, "the worker kept retrying during the outage"


def test_enqueue_parquet_from_s3_with_column_mapping(moto, redis_url, rconn, tmp_path):  # noqa: F811 (the moto fixture)
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    table = pa.table({
        "uid": [f"row{i}" for i in range(2500)],
        "text": [f"complete this {i}" if i != 1700 else "" for i in range(2500)],
        "source": ["wiki"] * 2500,
    })
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=1000)  # three row groups, read a record batch at a time
    s3.put_object(Bucket=BUCKET, Key="in/rows.parquet", Body=buf.getvalue())

    proc = run_genq("enqueue", f"s3://{BUCKET}/in/rows.parquet", "--job", "pq", "--endpoint", "completions",
                    "--prompt-column", "text", "--id-column", "uid", "--batch-size", "1000",
                    "--s3-endpoint-url", moto.url, "--output", str(tmp_path / "out"),
                    "--rejects", str(tmp_path / "rej.jsonl"), redis_url=redis_url, check=False, cwd=tmp_path)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "queued 2,499 prompts in 3 batches" in proc.stdout
    assert "line 1701: 'prompt' must be a non-empty string" in proc.stderr
    rejected = [json.loads(line) for line in (tmp_path / "rej.jsonl").read_text().splitlines()]
    assert [r["line"] for r in rejected] == [1701] and '"row1700"' in rejected[0]["text"]
    first = batch_prompts(rconn, "pq", "b0000002")[0]
    assert (first.id, first.index, first.prompt, first.metadata) == ("row1000", 1000, "complete this 1000",
                                                                     {"source": "wiki"})

    missing = run_genq("enqueue", f"s3://{BUCKET}/in/rows.parquet", "--job", "pq2", "--messages-column", "chat",
                       "--s3-endpoint-url", moto.url, redis_url=redis_url, check=False)
    assert missing.returncode == 1
    assert "--messages-column 'chat': no such column" in missing.stderr and "uid, text, source" in missing.stderr
    gone = run_genq("enqueue", f"s3://{BUCKET}/in/nothing.jsonl", "--job", "pq3", "--s3-endpoint-url", moto.url,
                    redis_url=redis_url, check=False)
    assert gone.returncode == 1 and f"s3://{BUCKET}/in/nothing.jsonl: no such object" in gone.stderr


def test_s3_inputs_are_read_in_few_bounded_gets(moto, redis_url, tmp_path):  # noqa: F811 (the moto fixture)
    """A Parquet input is read by a few ranged GETs of at most a window each, not by GETs to the end of the object
    that the next seek abandons (dropping their connection); a JSONL input streams in one GET."""
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    rows = 1600
    texts = [os.urandom(4 << 10).hex() for _ in range(rows)]  # 8 KiB each, incompressible: ~13 MB in all
    buf = io.BytesIO()
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(rows)], "prompt": texts}), buf, row_group_size=400)
    s3.put_object(Bucket=BUCKET, Key="in/big.parquet", Body=buf.getvalue())
    ids, data = prompt_lines(300)
    s3.put_object(Bucket=BUCKET, Key="in/prompts.jsonl.gz", Body=gzip.compress(data))

    def gets(key: str) -> list[tuple[int, int]]:
        """The byte range each GET of the key asked for, [first, last]."""
        found = []
        for request in moto.recorded():
            if request["method"] == "GET" and request["url"].split("?")[0].endswith(f"/{BUCKET}/{key}"):
                first, last = re.fullmatch(r"bytes=(\d+)-(\d*)", request["headers"].get("Range", "bytes=0-")).groups()
                found.append((int(first), int(last) if last else -1))
        return found

    moto.record()
    out = run_genq("enqueue", f"s3://{BUCKET}/in/big.parquet", "--job", "pq", "--endpoint", "completions",
                   "--batch-size", "500", "--s3-endpoint-url", moto.url, "--output", str(tmp_path / "out"),
                   redis_url=redis_url)
    assert f"queued {rows:,} prompts" in out.stdout
    size, window = len(buf.getvalue()), 8 << 20
    ranges = gets("in/big.parquet")
    assert all(first <= last < first + window for first, last in ranges), f"a GET past its window: {ranges}"
    assert sum(last - first + 1 for first, last in ranges) <= size + window, ranges
    assert len(ranges) <= size // window + 3, ranges

    moto.record()
    run_genq("enqueue", f"s3://{BUCKET}/in/prompts.jsonl.gz", "--job", "jl", "--s3-endpoint-url", moto.url,
             "--output", str(tmp_path / "out"), redis_url=redis_url)
    compressed = len(gzip.compress(data))
    assert gets("in/prompts.jsonl.gz") in ([(0, compressed - 1)], [(0, -1)]), "a JSONL input streams in one GET"


def test_s3_input_stream_resumes_where_a_dropped_connection_left_off(moto):  # noqa: F811 (the moto fixture)
    from genq.output.s3 import open_stream
    from genq.producer.sources import SourceError, open_lines

    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    data = b"".join(b'{"id": "%08d", "prompt": "%s"}\n' % (i, b"x" * 90) for i in range(300_000))  # ~35 MB
    s3.put_object(Bucket=BUCKET, Key="big.jsonl", Body=data)
    stream = open_stream(f"s3://{BUCKET}/big.jsonl", moto.url, buffer_size=64 << 10)
    first = stream.read(1 << 20)
    # The endpoint goes away mid-body; it comes back with the same object (same ETag).
    moto.stop()
    moto.start()
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="big.jsonl", Body=data)
    rest = stream.read()
    assert stream.raw.resumes >= 1, "the connection broke, so the reader must have resumed"
    assert first + rest == data, "resumed at the right byte: nothing lost, nothing repeated"

    # A changed object is never spliced onto the old one: the resume is pinned to the ETag.
    lines = open_lines(f"s3://{BUCKET}/big.jsonl", s3_endpoint_url=moto.url)
    assert next(lines) == data[: data.index(b"\n") + 1]
    moto.stop()
    moto.start()
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    s3.put_object(Bucket=BUCKET, Key="big.jsonl", Body=data.replace(b"x", b"y"))
    with pytest.raises(SourceError, match="changed while it was being read"):
        for line in lines:
            assert b"y" not in line, "read a different version of the object after the resume"


def test_status_of_a_written_prompt_reads_only_its_own_shard(moto, redis_url, rconn, sim, worker, tmp_path):  # noqa: F811 (the moto fixture)
    """`genq status` of a prompt whose shard is written: the id index names its batch, so of a job of 60
    shards on S3 it GETs that one shard (counted in moto's own request log), not every shard before it."""
    s3 = moto.client()
    s3.create_bucket(Bucket=BUCKET)
    ids, data = prompt_lines(120)
    (tmp_path / "p.jsonl").write_bytes(data)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "many", "--batch-size", "2", "--max-tokens", "16",
             "--output", f"s3://{BUCKET}/runs", "--s3-endpoint-url", moto.url, redis_url=redis_url)
    assert worker(sim(max_running_requests=16, **FAST_SIM), "--burst").wait(timeout=120) == 0
    assert rconn.hlen(keys.job_shards("many")) == 60

    def shard_gets() -> int:
        return len(re.findall(rf'"GET /{BUCKET}/runs/many/shards/', moto.log_path.read_text()))

    reads = []
    for pid in ids[::23]:  # six prompts in six batches
        before = shard_gets()
        fate = json.loads(run_genq("status", "many", pid, "--json", redis_url=redis_url).stdout)
        assert fate["state"] == "done" and fate["record"]["id"] == pid, fate
        reads.append(shard_gets() - before)
    assert reads == [1] * 6, reads
    # An id indexed by an older genq (its content digest alone) names no batch: every shard may be read.
    rconn.hset(keys.job_ids("many"), ids[-1], rconn.hget(keys.job_ids("many"), ids[-1])[:8])
    before = shard_gets()
    fate = json.loads(run_genq("status", "many", ids[-1], "--json", redis_url=redis_url).stdout)
    assert fate["record"]["id"] == ids[-1] and shard_gets() - before >= 1
