"""genq export (JSONL, Parquet, OpenAI Batch) and Parquet inputs, on real files,
real Redis and a real `genq sim`."""

from __future__ import annotations

import json

import msgspec
import pyarrow as pa
import pyarrow.parquet as pq

from genq.core import keys
from genq.core.records import DeadLetter, Result, Usage, unpack
from genq.output.truth import LocalStore, commit_shard, shard_bytes
from tests.audit import audit
from tests.conftest import batch_prompts, read_results, run_genq, write_prompts


def result(pid: str, index: int, batch: str, job: str = "hand", **extra) -> Result:
    return Result(id=pid, job=job, batch=batch, index=index, completion=f"answer {pid}", finish_reason="stop",
                  usage=Usage(prompt_tokens=5, completion_tokens=7), model="m", worker="w", attempts=1,
                  latency_s=0.1, messages=[{"role": "user", "content": f"question {pid}"}],
                  metadata={"n": index}, finished_at=1_700_000_000.0 + index, **extra)


def write_shard(out, batch: str, results: list[Result], job: str = "hand") -> None:
    data = shard_bytes(results, "none")
    commit_shard(LocalStore(str(out)), job, batch, data, len(results), 0.0, compression="none", incarnation="",
                 outcome=None)


def test_openai_batch_round_trip_with_a_rejected_row(redis_url, rconn, sim, worker, tmp_path):
    # The sim's context is small: the long row gets SGLang's 400 and lands in the errors file.
    server = sim(context_length=256, max_running_requests=8, mean_output_tokens=200, output_sigma=0.1,
                 tokens_per_step=16, step_ms_base=5)
    custom_ids = [f"request-{i}" for i in range(23)]
    long_id = "request-17"
    lines = []
    for cid in custom_ids:
        content = "word " * 2000 if cid == long_id else f"Say something about {cid}"
        lines.append(json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "gpt-4o-mini", "max_tokens": 24, "temperature": 0.3,
                                          "messages": [{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": content}]}}))
    src = tmp_path / "batch_input.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "oai", "--batch-size", "8", "--max-tokens", "64",
             "--output", str(out), redis_url=redis_url)
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()
    found = audit(rconn, "oai", out, custom_ids)
    assert list(found.letters) == [long_id]
    letter = unpack(rconn.hget(keys.job_dlq("oai"), long_id), DeadLetter)
    assert letter.status == 400 and letter.kind == "bad_request"

    dest = tmp_path / "export" / "results.jsonl"
    exp = run_genq("export", "--job", "oai", "--to", str(dest), "--format", "openai-batch", redis_url=redis_url)
    errors_path = tmp_path / "export" / "results.errors.jsonl"
    assert "wrote 22 records" in exp.stdout
    assert f"{dest.stat().st_size:,} bytes) to {dest} from 3 shards" in exp.stdout
    assert f"wrote 1 error line to {errors_path}" in exp.stdout

    output = [json.loads(line) for line in dest.read_text().splitlines()]
    errors = [json.loads(line) for line in errors_path.read_text().splitlines()]
    got = [o["custom_id"] for o in output] + [e["custom_id"] for e in errors]
    assert sorted(got) == sorted(custom_ids) and len(set(got)) == len(got), "every custom_id exactly once"
    assert [o["custom_id"] for o in output] == [c for c in custom_ids if c != long_id], "input order"

    shard_results = {r["id"]: r for r in read_results(out, "oai")}
    for line in output:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["id"].startswith("batch_req_")
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"]
        body = response["body"]
        r = shard_results[line["custom_id"]]
        assert body["object"] == "chat.completion" and body["model"] == "genq-sim/Sim-8B"
        assert body["created"] == int(r["finished_at"]) and body["id"]
        [choice] = body["choices"]
        assert choice["index"] == 0 and choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == r["completion"] and "reasoning_content" in choice["message"]
        # The row's body max_tokens (24) overrode the job's 64: every output was cut there.
        assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 24
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["prompt_tokens"] == r["usage"]["prompt_tokens"] > 0

    [error] = errors
    assert error["custom_id"] == long_id and error["error"] is None
    assert error["response"]["status_code"] == 400 and error["response"]["request_id"]
    message = error["response"]["body"]["error"]["message"]
    assert "is longer than the model's context length (256 tokens)" in message
    assert error["response"]["body"]["error"]["type"] == "invalid_request_error"

    # --errors puts the error file elsewhere.
    other = tmp_path / "elsewhere.jsonl"
    run_genq("export", "--job", "oai", "--to", str(tmp_path / "o2.jsonl"), "--format", "openai-batch",
             "--errors", str(other), redis_url=redis_url)
    assert [json.loads(line)["custom_id"] for line in other.read_text().splitlines()] == [long_id]


def test_export_dedups_orders_and_reads_only_shards_in_the_manifest(redis_url, tmp_path):
    out = tmp_path / "out"
    # b0000001 holds the input's later half plus p00002; b0000002 the first half, p00002 again.
    first = [result("p00002", 2, "b0000001")] + [result(f"p{i:05d}", i, "b0000001") for i in range(5, 10)]
    second = [result(f"p{i:05d}", i, "b0000002") for i in range(0, 5)]
    write_shard(out, "b0000001", first)
    write_shard(out, "b0000002", second)
    # A shard without a marker (a write that never finished) is not exported.
    (out / "hand" / "shards" / "b0000003.jsonl").write_bytes(shard_bytes([result("zzz", 99, "b0000003")], "none"))

    by_input = tmp_path / "input.jsonl"
    proc = run_genq("export", "--job", "hand", "--from", str(out), "--to", str(by_input), redis_url=redis_url)
    assert "wrote 10 records" in proc.stdout and f"{by_input.stat().st_size:,} bytes" in proc.stdout
    assert "from 2 shards" in proc.stdout and "dropped 1 duplicate record (same id" in proc.stdout
    rows = [json.loads(line) for line in by_input.read_text().splitlines()]
    assert [r["id"] for r in rows] == [f"p{i:05d}" for i in range(10)]
    assert [r["index"] for r in rows] == list(range(10))
    assert next(r for r in rows if r["id"] == "p00002")["batch"] == "b0000001", "the first copy (batch order) wins"
    assert rows[3] == msgspec.json.decode(msgspec.json.encode(second[3])), "records are copied unchanged"

    by_batch = tmp_path / "batch.jsonl"
    run_genq("export", "--job", "hand", "--from", str(out), "--to", str(by_batch), "--order", "batch",
             redis_url=redis_url)
    assert [json.loads(line)["id"] for line in by_batch.read_text().splitlines()] == (
        ["p00002", "p00005", "p00006", "p00007", "p00008", "p00009", "p00000", "p00001", "p00003", "p00004"])

    # Parquet into a directory: JOB.parquet, same order, typed columns.
    folder = tmp_path / "exports"
    folder.mkdir()
    proc = run_genq("export", "--job", "hand", "--from", str(out), "--to", str(folder), "--format", "parquet",
                    redis_url=redis_url)
    table = pq.read_table(folder / "hand.parquet")
    assert f"to {folder / 'hand.parquet'} from 2 shards" in proc.stdout
    assert table.num_rows == 10 and table.column("id").to_pylist() == [f"p{i:05d}" for i in range(10)]
    assert table.schema.field("completion_tokens").type == pa.int64()
    assert table.column("messages").to_pylist()[4] == [{"role": "user", "content": "question p00004", "other": None}]
    assert [json.loads(m) for m in table.column("metadata").to_pylist()] == [{"n": i} for i in range(10)]

    # A shard that disagrees with its marker stops the export, naming both.
    marker = out / "hand" / "manifest" / "b0000002.json"
    info = json.loads(marker.read_text())
    marker.write_text(json.dumps({**info, "records": 6}))
    bad = run_genq("export", "--job", "hand", "--from", str(out), "--to", str(tmp_path / "x.jsonl"),
                   redis_url=redis_url, check=False)
    assert bad.returncode == 1
    assert "has 5 records but its manifest marker says 6" in bad.stderr and "b0000002.jsonl" in bad.stderr
    assert not (tmp_path / "x.jsonl").exists()

    unknown = run_genq("export", "--job", "nojob", "--to", str(tmp_path / "y.jsonl"), redis_url=redis_url,
                       check=False)
    assert unknown.returncode == 1 and "no job named 'nojob'" in unknown.stderr
    empty = run_genq("export", "--job", "hand", "--from", str(tmp_path / "nowhere"), "--to", str(tmp_path / "z.jsonl"),
                     redis_url=redis_url, check=False)
    assert empty.returncode == 1 and "no shards to export" in empty.stderr and "nowhere/hand/manifest/" in empty.stderr


def test_gzip_shards_export_the_same_records(redis_url, tmp_path):
    out = tmp_path / "out"
    results = [result(f"p{i:05d}", i, "b0000001") for i in range(6)]
    commit_shard(LocalStore(str(out)), "hand", "b0000001", shard_bytes(results, "gzip"), 6, 0.0, compression="gzip",
                 incarnation="", outcome=None)
    dest = tmp_path / "g.jsonl"
    run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), redis_url=redis_url)
    assert dest.read_bytes() == shard_bytes(results, "none")


def test_parquet_input_with_column_mapping_runs_end_to_end(redis_url, rconn, sim, worker, tmp_path):
    conversation = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())]))
    rows = []
    for i in range(30):
        chat = [{"role": "user", "content": f"tell me about {i}", "name": None}]
        if i == 4:
            chat = []  # rejected: empty messages
        if i == 9:
            chat = [{"role": "user", "content": None, "name": None}]  # rejected: no content
        rows.append({"uid": f"u{i:03d}", "conversation": chat, "lang": "fr" if i % 2 else "en",
                     "prompt": "an unrelated column named like a request field"})
    table = pa.Table.from_pylist(rows, schema=pa.schema([("uid", pa.string()), ("conversation", conversation),
                                                         ("lang", pa.string()), ("prompt", pa.string())]))
    src = tmp_path / "chats.parquet"
    pq.write_table(table, src, row_group_size=7)
    out = tmp_path / "out"
    proc = run_genq("enqueue", str(src), "--job", "pqjob", "--messages-column", "conversation", "--id-column", "uid",
                    "--batch-size", "10", "--max-tokens", "32", "--output", str(out), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "queued 28 prompts in 3 batches" in proc.stdout
    assert "line 5: 'messages' must be a non-empty list" in proc.stderr
    assert "line 10: messages[0] has no 'content'" in proc.stderr
    assert (out / "pqjob" / "rejects" / "chats.rejects.jsonl").exists()
    prompt = batch_prompts(rconn, "pqjob", "b0000001")[1]
    # Parquet's null struct fields are dropped; other columns are metadata, the unmapped
    # "prompt" column too (kept, never taken for the request).
    assert prompt.id == "u001" and prompt.index == 1
    assert prompt.messages == [{"role": "user", "content": "tell me about 1"}]
    assert prompt.metadata == {"lang": "fr", "prompt": "an unrelated column named like a request field"}
    assert prompt.prompt is None

    server = sim(max_running_requests=8, mean_output_tokens=24, output_sigma=0.5, tokens_per_step=16,
                 step_ms_base=5)
    w = worker(server, "--burst")
    assert w.wait(timeout=120) == 0, w.log()
    assert not audit(rconn, "pqjob", out, [f"u{i:03d}" for i in range(30) if i not in (4, 9)]).letters
    dest = tmp_path / "pqjob.parquet"
    run_genq("export", "--job", "pqjob", "--to", str(dest), redis_url=redis_url)
    exported = pq.read_table(dest)
    expected = [f"u{i:03d}" for i in range(30) if i not in (4, 9)]
    assert exported.column("id").to_pylist() == expected
    assert exported.column("index").to_pylist() == [i for i in range(30) if i not in (4, 9)]

    # Messages stored as a JSON string column work too.
    rows = pa.table({"id": ["a", "b"], "messages": [json.dumps([{"role": "user", "content": "hi"}]), "[oops"]})
    pq.write_table(rows, tmp_path / "strings.parquet")
    proc = run_genq("enqueue", str(tmp_path / "strings.parquet"), "--job", "pqjson", "--output", str(out),
                    redis_url=redis_url, check=False)
    assert proc.returncode == 3 and "queued 1 prompt in" in proc.stdout
    assert "line 2: 'messages' is a string but not JSON" in proc.stderr
    assert batch_prompts(rconn, "pqjson", "b0000001")[0].messages == [{"role": "user", "content": "hi"}]


def test_openai_batch_lines_for_completions_and_errors_without_an_http_answer():
    from genq.cli.export import openai_error_line, openai_output_line
    from genq.core.records import Prompt

    r = Result(id="c1", job="j", batch="b0000001", index=0, completion=" world", finish_reason="stop",
               usage=Usage(prompt_tokens=3, completion_tokens=2, reasoning_tokens=1), model="m", worker="w",
               attempts=1, latency_s=0.1, prompt="hello", custom_id="c1", finished_at=1_700_000_000.5)
    body = openai_output_line(r)["response"]["body"]
    assert body["object"] == "text_completion" and body["choices"][0]["text"] == " world"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5,
                             "completion_tokens_details": {"reasoning_tokens": 1}}
    assert body["created"] == 1_700_000_000

    prompt = Prompt(id="c2", index=1, prompt="x", custom_id="c2")
    timeout = DeadLetter(id="c2", job="j", batch="b0000001", attempts=5, kind="timeout",
                         message="no output for 300 s", worker="w", at=1.0, prompt=prompt)
    line = openai_error_line(timeout)
    assert line["custom_id"] == "c2" and line["response"] is None
    assert line["error"] == {"code": "timeout", "message": "no output for 300 s"}
    sse = DeadLetter(id="c3", job="j", batch="b0000001", attempts=5, kind="server_error",
                     message="scheduler error", worker="w", at=1.0)
    line = openai_error_line(sse)
    assert line["response"]["status_code"] == 500 and line["error"] is None
    assert line["response"]["body"]["error"]["type"] == "server_error"


def test_parquet_request_named_columns_that_are_not_the_mapped_ones_are_metadata(tmp_path):
    """A "prompt" column beside --prompt-column text is data like any other column: it goes to the
    row's metadata, not away."""
    from genq.producer.sources import ColumnMap, open_rows

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"text": ["say hi"], "prompt": ["an older prompt"], "messages": ["[]"], "n": [1]}), path)
    (row,) = open_rows(str(path), endpoint="completions", columns=ColumnMap(prompt="text"))
    assert row.prompt.prompt == "say hi"
    assert row.prompt.metadata == {"prompt": "an older prompt", "messages": "[]", "n": 1}


def test_a_batch_written_while_export_runs_makes_it_partly_done(redis_url, sim, tmp_path, monkeypatch):
    """The last batch of a job written while `genq export` reads the shards is not in the file: the exit
    status must say partly done (3), not done (0), though the job counts every batch written by the end."""
    from click.testing import CliRunner

    from genq.cli import cli
    from genq.cli import export as export_cli

    url = sim()
    out = tmp_path / "out"
    first = tmp_path / "first.jsonl"
    write_prompts(first, 5)
    run_genq("enqueue", str(first), "--job", "race", "--output", str(out), "--batch-size", "5")
    run_genq("worker", "--server", url, "--burst", timeout=300)
    second = tmp_path / "second.jsonl"
    write_prompts(second, 5, start=5)
    run_genq("enqueue", str(second), "--job", "race", "--output", str(out), "--batch-size", "5", "--add")

    real = export_cli.run_export

    def export_then_the_last_batch_lands(*args, **kwargs):
        written = real(*args, **kwargs)  # the shards listed and merged: the second batch's is not among them
        run_genq("worker", "--server", url, "--burst", timeout=300)  # a worker writes it meanwhile
        return written

    monkeypatch.setattr(export_cli, "run_export", export_then_the_last_batch_lands)
    dest = tmp_path / "race.jsonl"
    ran = CliRunner().invoke(cli, ["--redis", redis_url, "export", "--job", "race", "--to", str(dest)])
    exported = [json.loads(line)["id"] for line in dest.read_text().splitlines()]
    assert exported == [f"p{i:05d}" for i in range(5)]
    assert len(read_results(out, "race")) == 10  # the job is whole now; the file is not
    assert ran.exit_code == 3, ran.output


def test_an_output_that_is_a_file_is_one_line_for_export_and_recover(redis_url, tmp_path):
    """--output naming a file (the input, say) is the operator's mistake: one line naming the path, exit 1."""
    wrong = tmp_path / "prompts.jsonl"
    write_prompts(wrong, 3)
    for args in (("export", "--job", "mixup", "--to", str(tmp_path / "x.jsonl"), "--output", str(wrong)),
                 ("recover", "--job", "mixup", "--output", str(wrong))):
        ran = run_genq(*args, check=False)
        assert ran.returncode == 1 and "Traceback" not in ran.stderr, (args, ran.stderr)
        assert str(wrong) in ran.stderr and len(ran.stderr.strip().splitlines()) == 1, (args, ran.stderr)


def test_parquet_sampling_and_openai_batch_bodies_lose_the_nulls_struct_unification_adds(tmp_path):
    """Arrow gives every row of a struct column every field, null where the row had none: a row's
    `sampling` (or an OpenAI Batch `body`) is what it set, not a refusal of the nulls added."""
    from genq.producer.sources import open_rows

    path = tmp_path / "rows.parquet"
    chat = [{"role": "user", "content": "hi"}]
    pq.write_table(pa.Table.from_pylist([
        {"id": "a", "messages": chat, "sampling": {"temperature": 0.2}},
        {"id": "b", "messages": chat, "sampling": {"n": 2}},
        {"id": "c", "messages": chat, "sampling": None},
    ]), path)
    assert [(r.prompt.id, r.prompt.sampling) for r in open_rows(str(path), endpoint="chat")] == \
        [("a", {"temperature": 0.2}), ("b", {"n": 2}), ("c", None)]
    pq.write_table(pa.Table.from_pylist([
        {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": chat, **body}}
        for i, body in enumerate([{"max_tokens": 5}, {"temperature": 0.5}])]), path)
    assert [r.prompt.sampling for r in open_rows(str(path), endpoint="chat")] == [{"max_tokens": 5},
                                                                                  {"temperature": 0.5}]


def test_export_to_a_gz_name_writes_gzip(redis_url, tmp_path):
    """A FILE named .gz is read with zcat or gzip.open downstream: plain JSON under that name is not."""
    import gzip

    out = tmp_path / "out"
    write_shard(out, "b0000001", [result(f"p{i:05d}", i, "b0000001") for i in range(3)])
    dest = tmp_path / "all.jsonl.gz"
    proc = run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), redis_url=redis_url)
    assert "wrote 3 records" in proc.stdout and f"{dest.stat().st_size:,} bytes" in proc.stdout, proc.stdout
    assert [json.loads(line)["id"] for line in gzip.open(dest)] == ["p00000", "p00001", "p00002"]


def test_export_refuses_to_write_over_what_it_reads(redis_url, tmp_path):
    """--to (or --errors) inside the job's own output folder (a shard, a marker, job.json) overwrote what
    the export read; now it is refused, exit 2, before anything is written."""
    out = tmp_path / "out"
    write_shard(out, "b0000001", [result(f"p{i}", i, "b0000001") for i in range(3)])
    shard = out / "hand" / "shards" / "b0000001.jsonl"
    before = shard.read_bytes()
    for extra in (["--to", str(shard)], ["--to", str(out / "hand" / "manifest" / "b0000001.json")],
                  ["--to", str(out / "hand")], ["--to", str(tmp_path / "ok.jsonl"), "--format", "openai-batch",
                                                "--errors", str(shard)]):
        proc = run_genq("export", "--job", "hand", "--from", str(out), *extra, redis_url=redis_url, check=False)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, (extra, proc.stdout + proc.stderr)
        assert "--to" in proc.stderr or "--errors" in proc.stderr, proc.stderr
        assert shard.read_bytes() == before and not (tmp_path / "ok.jsonl").exists()
        assert sorted(p.name for p in (out / "hand").iterdir()) == ["manifest", "shards"]


def test_export_refuses_to_write_over_the_jobs_input(redis_url, tmp_path):
    """--to naming the job's own input file (job.json's inputs) overwrote the prompts; now refused, exit 2."""
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out"
    write_prompts(src, 3)
    before = src.read_bytes()
    run_genq("enqueue", str(src), "--job", "hand", "--output", str(out), redis_url=redis_url)
    write_shard(out, "b0000001", [result(f"p{i}", i, "b0000001") for i in range(3)])
    proc = run_genq("export", "--job", "hand", "--to", str(src), redis_url=redis_url, check=False)
    assert proc.returncode == 2 and f"--to {src} is the job's input" in proc.stderr, proc.stdout + proc.stderr
    assert src.read_bytes() == before


def test_parquet_export_keeps_each_records_settings_version(redis_url, tmp_path):
    """JSONL records name the settings version they were sent with (genq jobs set); Parquet dropped it."""
    out = tmp_path / "out"
    write_shard(out, "b0000001", [result("a", 0, "b0000001", settings_version=3), result("b", 1, "b0000001")])
    dest = tmp_path / "v.parquet"
    run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), redis_url=redis_url)
    assert pq.read_table(dest).column("settings_version").to_pylist() == [3, 0]


def test_parquet_export_keeps_every_key_of_a_message(redis_url, tmp_path):
    """A message's keys beyond role and content (an assistant's tool_calls, a tool's tool_call_id, a name)
    were dropped from Parquet's messages column; they are kept there as JSON in 'other'."""
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
    messages = [{"role": "user", "content": "sum", "name": "ann"}, {"role": "assistant", "content": None,
                "tool_calls": [call]}, {"role": "tool", "content": "42", "tool_call_id": "c1"}]
    out = tmp_path / "out"
    write_shard(out, "b0000001", [msgspec.structs.replace(result("a", 0, "b0000001"), messages=messages)])
    dest = tmp_path / "m.parquet"
    run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), redis_url=redis_url)
    [got] = pq.read_table(dest).column("messages").to_pylist()
    back = [{"role": m["role"], "content": m["content"], **json.loads(m["other"] or "{}")} for m in got]
    assert back == messages and got[0]["other"] == '{"name":"ann"}'


def test_openai_batch_errors_file_cannot_be_the_output(redis_url, tmp_path):
    """--errors naming --to's file wrote the error lines over the results; now refused, exit 2."""
    out, dest = tmp_path / "out", tmp_path / "r.jsonl"
    write_shard(out, "b0000001", [result("a", 0, "b0000001")])
    proc = run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), "--format", "openai-batch",
                    "--errors", str(tmp_path / "." / "r.jsonl"), redis_url=redis_url, check=False)
    assert proc.returncode == 2 and "--errors" in proc.stderr and "is --to's file" in proc.stderr, \
        proc.stdout + proc.stderr
    assert not dest.exists()


def test_openai_batch_export_keeps_the_matched_stop(redis_url, tmp_path):
    """A request that set stop records what stopped it (matched_stop); the OpenAI Batch export dropped it. It is
    kept on each choice, by SGLang's name, when the record has it (null: asked, nothing matched)."""
    out, dest = tmp_path / "out", tmp_path / "b.jsonl"
    write_shard(out, "b0000001", [result("a", 0, "b0000001", matched_stop="END"),
                                  result("b", 1, "b0000001", matched_stop=None), result("c", 2, "b0000001")])
    run_genq("export", "--job", "hand", "--from", str(out), "--to", str(dest), "--format", "openai-batch",
             redis_url=redis_url)
    choices = [json.loads(x)["response"]["body"]["choices"][0] for x in dest.read_text().splitlines()]
    assert [c.get("matched_stop", "absent") for c in choices] == ["END", None, "absent"]
