"""Every record holds what its request asked for (#24): all n samples, the logprobs, and
fields genq could not record refused at enqueue. Real private Redis, real workers, `genq sim`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.audit import audit
from tests.conftest import read_results, run_genq, sim_stats, wait_until

SIM = {"max_running_requests": 16, "mean_output_tokens": 40, "output_sigma": 0.8, "tokens_per_step": 4,
       "step_ms_base": 5}


def rows(path: Path, n: int, sampling: dict | None = None, *, prompt: bool = False) -> list[str]:
    ids = []
    with open(path, "w") as f:
        for i in range(n):
            row: dict = {"id": f"q{i:03d}"}
            if prompt:
                row["prompt"] = f"continue this text number {i}"
            else:
                row["messages"] = [{"role": "user", "content": f"question number {i}"}]
            if sampling:
                row["sampling"] = sampling
            f.write(json.dumps(row) + "\n")
            ids.append(row["id"])
    return ids


def run_job(tmp_path: Path, redis_url: str, rconn, sim, worker, job: str, sampling: dict | None,
            *worker_args: str, prompt: bool = False, count: int = 12, sim_options: dict | None = None) -> list[dict]:
    ids = rows(tmp_path / f"{job}.jsonl", count, sampling, prompt=prompt)
    out = tmp_path / "out"
    endpoint = ["--endpoint", "completions"] if prompt else []
    run_genq("enqueue", str(tmp_path / f"{job}.jsonl"), "--job", job, "--output", str(out), "--max-tokens", "96",
             "--batch-size", "5", *endpoint, redis_url=redis_url)
    w = worker(sim(**{**SIM, **(sim_options or {})}), "--burst", *worker_args)
    assert w.wait(timeout=120) == 0, w.log()
    assert not audit(rconn, job, out, ids).letters
    return sorted(read_results(out, job), key=lambda r: r["index"])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_n_samples_are_one_record_with_every_choice(redis_url, rconn, sim, worker, tmp_path, stream, endpoint):
    flag = "--stream" if stream else "--no-stream"
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "njob", {"n": 3}, flag,
                      prompt=endpoint == "completions")
    assert len(records) == 12
    lengths_differ = 0
    for r in records:
        assert r["sampling"] == {"n": 3}  # the row's request fields, as sent
        choices = r["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2]
        texts = [c["completion"] for c in choices]
        assert len(set(texts)) == 3, texts  # three samples, not one thrice
        assert all(c["finish_reason"] in ("stop", "length") for c in choices)
        # The fields a one-sample reader knows are choice 0's.
        assert (r["completion"], r["finish_reason"]) == (texts[0], choices[0]["finish_reason"])
        # The sim's text is four characters a token (SGLang's chat stream sends none for the
        # end-of-sequence token, which it counts): each sample's own length, and usage is their sum.
        tokens = [len(t) // 4 + (stream and endpoint == "chat" and c["finish_reason"] == "stop")
                  for t, c in zip(texts, choices, strict=True)]
        assert r["usage"]["completion_tokens"] == sum(tokens)
        if stream:
            assert [c["completion_tokens"] for c in choices] == tokens
        else:  # a whole answer gives only the request's total
            assert all("completion_tokens" not in c for c in choices)
        lengths_differ += len(set(tokens)) > 1
    assert lengths_differ > 6  # each choice its own deterministic length


def test_one_sample_record_keeps_its_shape(redis_url, rconn, sim, worker, tmp_path):
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "one", None, count=5)
    for r in records:
        assert "choices" not in r and "logprobs" not in r and "matched_stop" not in r
        # Streamed (genq's default), SGLang sends no text for the end-of-sequence token it counts.
        assert r["usage"]["completion_tokens"] == len(r["completion"]) // 4 + (r["finish_reason"] == "stop")


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_chat_logprobs_are_kept(redis_url, rconn, sim, worker, tmp_path, stream):
    flag = "--stream" if stream else "--no-stream"
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "lp", {"logprobs": True, "top_logprobs": 2, "n": 2},
                      flag, count=6)
    for r in records:
        for c in r["choices"]:
            content = c["logprobs"]["content"]
            if stream and c["finish_reason"] == "stop":
                # SGLang streams nothing for the end-of-sequence token: its entry is all null.
                assert content[-1] == {"token": None, "logprob": None, "bytes": None, "top_logprobs": None}
                content = content[:-1]
            # One entry a token, in order, the stream's pieces concatenated: they spell the text.
            assert "".join(e["token"] for e in content) == c["completion"][:4 * len(content)]
            assert len(content) == len(c["completion"]) // 4
            assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
            assert all(e["logprob"] < 0 for e in content)
        assert r["logprobs"] == r["choices"][0]["logprobs"]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_logprobs_one_per_generated_token_when_the_stream_leaves_out_eos(redis_url, rconn, sim, worker, tmp_path,
                                                                          stream, endpoint):
    """SGLang streams no logprob for the end-of-sequence token, which usage counts (the sim
    plays it): the record still has one entry a generated token, and an answer that is EOS
    alone (no entry at all in the stream) is a valid, empty answer, not a dead letter."""
    flag = "--stream" if stream else "--no-stream"
    sampling = {"logprobs": 0} if endpoint == "completions" else {"logprobs": True, "n": 2}
    # Short answers: lognormal lengths with mean 2 put a good share at one token (EOS first).
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "eos", sampling, flag, count=30,
                      prompt=endpoint == "completions", sim_options={"mean_output_tokens": 2, "output_sigma": 1.0})
    assert len(records) == 30
    eos_first = 0
    for r in records:
        choices = r.get("choices") or [{**r, "completion_tokens": r["usage"]["completion_tokens"]}]
        if len(choices) > 1 and not stream:  # a whole answer counts only the request's tokens
            assert r["usage"]["completion_tokens"] == sum(len(c["completion"]) // 4 for c in choices)
            choices = [{**c, "completion_tokens": len(c["completion"]) // 4} for c in choices]
        for c in choices:
            tokens = c["completion_tokens"]
            # The sim's text is four characters a token; SGLang's chat stream sends no text for EOS.
            unsent = stream and endpoint == "chat" and c["finish_reason"] == "stop"
            assert len(c["completion"]) // 4 == tokens - unsent, (c, tokens)
            lp = c["logprobs"]
            entries = lp["content"] if endpoint == "chat" else lp["token_logprobs"]
            assert len(entries) == tokens, (c, tokens)
            known = [e["logprob"] for e in entries] if endpoint == "chat" else entries
            # What the server sent is kept as sent; the entry it left out is there, all null.
            unknown = [i for i, v in enumerate(known) if v is None]
            assert unknown == ([tokens - 1] if unsent else []), (c, unknown)
            eos_first += tokens == 1 and c["finish_reason"] == "stop"
    assert eos_first >= 2


def test_completions_logprobs_are_kept(redis_url, rconn, sim, worker, tmp_path):
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "lpc", {"logprobs": 3}, prompt=True, count=6)
    for r in records:
        lp = r["logprobs"]
        if r["finish_reason"] == "stop" and lp["tokens"][-1] is None:  # streamed: SGLang's unsent EOS entry
            assert [lp[k][-1] for k in ("token_logprobs", "top_logprobs", "text_offset")] == [None] * 3
            lp = {k: v[:-1] for k, v in lp.items()}
        assert "".join(lp["tokens"]) == r["completion"][:4 * len(lp["tokens"])]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
        assert all(len(alts) == 3 for alts in lp["top_logprobs"])
        assert lp["text_offset"] == [4 * i for i in range(len(lp["tokens"]))]


@pytest.mark.parametrize("flavor", ["sglang", "vllm"])
def test_a_stop_request_keeps_what_stopped_it(redis_url, rconn, sim, worker, tmp_path, flavor):
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "stops", {"stop": ["never appears"]}, count=8,
                      sim_options={"mean_output_tokens": 10, "flavor": flavor})
    stopped = [r for r in records if r["finish_reason"] == "stop"]
    # SGLang names the EOS token (the sim's is Qwen's <|im_end|>); vLLM's stop_reason is null at EOS.
    assert stopped and all(r["matched_stop"] == (151645 if flavor == "sglang" else None) for r in stopped)
    # Asked, and nothing matched: recorded as null, told apart from "not asked" (no key).
    assert all(r["matched_stop"] is None for r in records if r["finish_reason"] == "length")


def test_export_keeps_every_choice(redis_url, rconn, sim, worker, tmp_path):
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "exp", {"n": 2, "logprobs": True}, count=5)
    batch = tmp_path / "batch.jsonl"
    run_genq("export", "--job", "exp", "--to", str(batch), "--format", "openai-batch", redis_url=redis_url)
    lines = [json.loads(line) for line in batch.read_text().splitlines()]
    for line, r in zip(lines, records, strict=True):
        choices = line["response"]["body"]["choices"]
        assert [c["message"]["content"] for c in choices] == [c["completion"] for c in r["choices"]]
        assert [c["logprobs"] for c in choices] == [c["logprobs"] for c in r["choices"]]
    table = pq.read_table(_export(tmp_path, redis_url, "parquet"))
    for row, r in zip(table.to_pylist(), records, strict=True):
        assert [c["completion"] for c in row["choices"]] == [c["completion"] for c in r["choices"]]
        assert [json.loads(c["logprobs"]) for c in row["choices"]] == [c["logprobs"] for c in r["choices"]]
        assert json.loads(row["logprobs"]) == r["logprobs"]
    jsonl = [json.loads(line) for line in _export(tmp_path, redis_url, "jsonl").read_text().splitlines()]
    assert sorted(jsonl, key=lambda r: r["index"]) == records


TOOL = {"type": "function", "function": {"name": "count_tokens", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_tool_calls_are_kept(redis_url, rconn, sim, worker, tmp_path, stream):
    flag = "--stream" if stream else "--no-stream"
    records = run_job(tmp_path, redis_url, rconn, sim, worker, "tools", {"tools": [TOOL], "n": 2}, flag, count=6,
                      sim_options={"mean_output_tokens": 10, "tool_call_parser": "qwen25"})
    for r in records:
        for c in r["choices"]:
            # The sim calls the first tool with its own length as the argument, streamed in pieces.
            [call] = c["tool_calls"]
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert call["function"]["name"] == "count_tokens"
            # (streamed, SGLang sends no text for the end-of-sequence token it counts)
            unsent = stream and c["finish_reason"] == "tool_calls"
            assert json.loads(call["function"]["arguments"]) == {"tokens": len(c["completion"]) // 4 + unsent}
            assert c["finish_reason"] in ("tool_calls", "length")
        assert r["tool_calls"] == r["choices"][0]["tool_calls"]
    assert any(r["finish_reason"] == "tool_calls" for r in records)
    batch = tmp_path / "tools.batch.jsonl"
    run_genq("export", "--job", "tools", "--to", str(batch), "--format", "openai-batch", redis_url=redis_url)
    for line, r in zip(batch.read_text().splitlines(), records, strict=True):
        choices = json.loads(line)["response"]["body"]["choices"]
        assert [c["message"]["tool_calls"] for c in choices] == [c["tool_calls"] for c in r["choices"]]


def _export(tmp_path: Path, redis_url: str, fmt: str) -> Path:
    dest = tmp_path / f"exp-export.{fmt}"  # exp.jsonl is the job's input: export refuses to write over it
    run_genq("export", "--job", "exp", "--to", str(dest), "--format", fmt, redis_url=redis_url)
    return dest


@pytest.mark.parametrize(("line", "endpoint", "message"), [
    ({"sampling": {"functions": [{"name": "f"}]}}, "chat", "'functions' is refused: OpenAI's deprecated function"),
    ({"sampling": {"tools": [TOOL]}}, "completions", "'tools' is a chat field"),
    ({"sampling": {"best_of": 2}}, "chat", "'best_of' is refused"),
    ({"sampling": {"top_logprobs": 2}}, "chat", "top_logprobs needs logprobs: true"),
    ({"sampling": {"logprobs": 2}}, "chat", "logprobs must be true or false for chat"),
    ({"sampling": {"echo": True}}, "chat", "'echo' is a /v1/completions field"),
    ({"sampling": {"logprobs": True}}, "completions", "logprobs must be an integer 0..20 for completions"),
    ({"sampling": {"top_logprobs": 1}}, "completions", "'top_logprobs' is a chat field"),
    ({"sampling": {"modalities": ["audio"]}}, "chat", "'modalities' is refused"),
    # SGLang's and vLLM's /v1/completions ignore these: the job's max_tokens was dropped for the
    # server's default of 16, and a template switch did nothing.
    ({"sampling": {"max_completion_tokens": 5}}, "completions", "'max_completion_tokens' is a chat field; use"),
    ({"sampling": {"chat_template_kwargs": {"enable_thinking": True}}}, "completions",
     "'chat_template_kwargs' is a chat field; completions have no chat template"),
    ({"sampling": {"separate_reasoning": False}}, "completions", "'separate_reasoning' is a chat field"),
])
def test_fields_genq_cannot_record_are_refused_at_enqueue(redis_url, tmp_path, line, endpoint, message):
    src = tmp_path / "in.jsonl"
    body = {"prompt": "hello"} if endpoint == "completions" else {"messages": [{"role": "user", "content": "hi"}]}
    src.write_text(json.dumps({"id": "ok", **body}) + "\n" + json.dumps({"id": "bad", **body, **line}) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "refuse", "--endpoint", endpoint, "--output", str(tmp_path / "o"),
                    redis_url=redis_url, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"line 2: 'sampling': {message}" in proc.stderr or f"line 2: {message}" in proc.stderr, proc.stderr


def test_a_row_is_checked_with_the_jobs_extra_body_as_the_request_sent(redis_url, tmp_path):
    # top_logprobs needs logprobs: true in the request sent: the job's --extra-body gives it to every row.
    src, msg = tmp_path / "in.jsonl", {"messages": [{"role": "user", "content": "hi"}]}
    src.write_text(json.dumps({"id": "a", **msg, "sampling": {"top_logprobs": 2}}) + "\n"
                   + json.dumps({"id": "b", **msg, "sampling": {"logprobs": False, "top_logprobs": 2}}) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "lp", "--endpoint", "chat", "--extra-body", '{"logprobs": true}',
                    "--output", str(tmp_path / "o"), redis_url=redis_url, check=False)
    assert proc.returncode == 3 and "line 1" not in proc.stderr, proc.stdout + proc.stderr
    assert "line 2: 'sampling': top_logprobs needs logprobs: true" in proc.stderr, proc.stderr


def test_a_rows_top_logprobs_keeps_logprobs_when_jobs_set_drops_them_from_the_extra_body(redis_url, rconn, sim,
                                                                                           worker, tmp_path):
    """Queued under the job's logprobs: true, a row's top_logprobs was a 400 and a dead letter once `jobs set
    --extra-body '{}'` dropped it: the row's own field wins, and asks for logprobs."""
    ids, out = rows(tmp_path / "in.jsonl", 4, {"top_logprobs": 2}), tmp_path / "out"
    run_genq("enqueue", str(tmp_path / "in.jsonl"), "--job", "lp", "--output", str(out), "--max-tokens", "32",
             "--extra-body", '{"logprobs": true}', redis_url=redis_url)
    run_genq("jobs", "set", "lp", "--extra-body", "{}", redis_url=redis_url)
    w = worker(sim(**SIM), "--burst")
    assert w.wait(timeout=120) == 0, w.log()
    assert not audit(rconn, "lp", out, ids).letters
    for r in read_results(out, "lp"):
        assert (r["sampling"], r["settings_version"]) == ({"top_logprobs": 2}, 2), r
        assert all(len(e["top_logprobs"]) == 2 for e in r["logprobs"]["content"][:-1]), r["logprobs"]


def test_job_wide_fields_are_checked_for_the_endpoint(redis_url, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "hello"}) + "\n")
    proc = run_genq("enqueue", str(src), "--job", "x", "--endpoint", "completions", "--extra-body",
                    '{"logprobs": true}', "--output", str(tmp_path / "o"), redis_url=redis_url, check=False)
    assert proc.returncode != 0 and "--extra-body: logprobs must be an integer" in proc.stderr, proc.stderr
    # ... and when `genq jobs set` changes them later (they were taken, then ignored by the server).
    run_genq("enqueue", str(src), "--job", "x", "--endpoint", "completions", "--output", str(tmp_path / "o"),
             redis_url=redis_url)
    proc = run_genq("jobs", "set", "x", "--extra-body", json.dumps({"tools": [TOOL]}), redis_url=redis_url,
                    check=False)
    assert proc.returncode == 2 and "--extra-body: 'tools' is a chat field" in proc.stderr, proc.stdout + proc.stderr
    assert "settings version 1" in run_genq("jobs", "show", "x", redis_url=redis_url).stdout
    # A job-wide token cap under another name hid --max-tokens: `jobs set --max-tokens` (the brake's advice)
    # changed nothing the servers used.
    for command in (["enqueue", str(src), "--job", "y", "--output", str(tmp_path / "o")], ["jobs", "set", "x"]):
        proc = run_genq(*command, "--extra-body", '{"max_completion_tokens": 900}', redis_url=redis_url, check=False)
        assert proc.returncode != 0 and "the job's token cap is --max-tokens" in proc.stderr, proc.stdout + proc.stderr


def test_a_request_for_n_samples_counts_as_n_sequences(redis_url, rconn, sim, worker, tmp_path):
    """The in-flight window counts what the server runs: with room for 8 sequences, requests of
    4 samples go out two at a time, so none waits in the server's queue."""
    ids = rows(tmp_path / "seq.jsonl", 16, {"n": 4})
    out = tmp_path / "out"
    run_genq("enqueue", str(tmp_path / "seq.jsonl"), "--job", "seq", "--output", str(out), "--max-tokens", "64",
             "--batch-size", "8", redis_url=redis_url)
    server = sim(max_running_requests=8, mean_output_tokens=30, output_sigma=0.3, tokens_per_step=2, step_ms_base=10)
    w = worker(server, "--burst", "--concurrency", "8")
    assert w.wait(timeout=120) == 0, w.log()
    assert not audit(rconn, "seq", out, ids).letters
    stats = sim_stats(server)
    assert stats["finished_requests"] == 16 * 4
    # Counted as requests, 8 in flight would be 32 sequences: 24 of them waiting all along.
    assert stats["busy_mean_waiting"] < 1.0, stats
    assert stats["busy_mean_running"] > 5.0, stats


def test_the_eta_sees_requests_of_n_samples_as_fewer_slots(redis_url, rconn, sim, worker, tmp_path):
    """A worker whose 8 sequences in flight are 2 requests of 4 samples decodes 2 prompts at
    once: the ETA counts 2 slots, not 8 (and its throughput per prompt is 4 samples')."""
    from genq.core.ledger.figures import read_job

    rows(tmp_path / "eta.jsonl", 12, {"n": 4})
    run_genq("enqueue", str(tmp_path / "eta.jsonl"), "--job", "eta", "--output", str(tmp_path / "out"),
             "--max-tokens", "200", "--batch-size", "4", redis_url=redis_url)
    server = sim(max_running_requests=8, mean_output_tokens=150, output_sigma=0.1, tokens_per_step=1,
                 step_ms_base=20)
    worker(server, "--concurrency", "8")

    def busy_view():
        views = [w for w in read_job(rconn, "eta").workers if w.live_status and w.live_status.in_flight == 2]
        return views[0] if views else None

    view = wait_until(busy_view, 60, "the worker running two requests")
    assert (view.live_status.sequences, view.live_status.concurrency_target) == (8, 8)
    assert view.slots == 2


@pytest.mark.parametrize(("job", "row", "cap"), [
    ({}, {"max_completion_tokens": 7}, {"max_completion_tokens": 7}),
    ({"max_completion_tokens": 900}, {"max_tokens": 7}, {"max_tokens": 7}),
    ({"max_completion_tokens": 900}, {}, {"max_tokens": 96, "max_completion_tokens": 900}),
])
def test_the_rows_token_cap_wins_over_the_jobs_whichever_name_each_uses(job, row, cap):
    """SGLang and vLLM take max_completion_tokens over max_tokens: a row's max_tokens under a job's
    --extra-body max_completion_tokens was sent beside it, and the job's cap was used."""
    from genq.core.records import JobConfig, Prompt
    from genq.worker.server import build_body

    config = JobConfig(name="j", output="o", max_tokens=96, extra_body=job)
    body = build_body(config, Prompt(id="a", index=0, prompt="hi", sampling=row or None), "m", stream=False)
    assert {k: v for k, v in body.items() if k in ("max_tokens", "max_completion_tokens")} == cap
