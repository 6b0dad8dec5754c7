"""`genq sim --flavor sglang` against real SGLang 0.5.23's recorded answers (tests/recordings/sglang-0.5.23/,
written by scripts/sglang/record.py from the server `make test-sglang` starts): the same request sent to
the sim must come back in the same shape, wherever genq reads it (worker/server.py,
worker/engines.py): chunk by chunk per choice, which delta keys, how many logprob entries, the
finish and what stopped it, where usage is, the ids; the status and error text; the info endpoints.

The real answers are random text of a random model, made to end on end-of-sequence after a known
number of tokens (a logit bias and min_tokens, which the sim ignores); the sim gets the same
lengths from a seed chosen for them (its lengths are a function of prompt and seed)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from genq.sim.config import SimConfig
from genq.sim.lengths import choice_key, output_length, prompt_key
from tests.sim_client import with_sim
from worker.engines import SGLANG

RECORDED = Path(__file__).parent / "recordings" / "sglang-0.5.23"
# As make test-sglang starts the real server: 16 running requests, a 2,048-token context, both given.
SIM = {"flavor": "sglang", "args_given": True, "context_length": 2048, "max_running_requests": 16,
       "mean_output_tokens": 3.0, "output_sigma": 1.0}


def recorded(name: str) -> dict[str, Any]:
    return json.loads((RECORDED / f"{name}.json").read_text())


def seed_for(record: dict[str, Any], tokens: int) -> int:
    """A sim seed that gives every choice of the recorded request `tokens` tokens, ending on EOS."""
    body = record["request"]["body"]
    key = prompt_key(body["messages"] if "messages" in body else body["prompt"])
    cfg = SimConfig(**SIM)
    for seed in range(100_000):
        if all(output_length(choice_key(key, i), seed, cfg.mean_output_tokens, cfg.output_sigma, 10**6) == tokens
               for i in range(body.get("n", 1))):
            return seed
    raise AssertionError("no seed")


async def replay(http: aiohttp.ClientSession, record: dict[str, Any]) -> dict[str, Any]:
    request = record["request"]
    started = time.monotonic()
    async with http.request(request["method"], request["path"], json=request["body"]) as resp:
        raw = (await resp.read()).decode()
        out: dict[str, Any] = {"status": resp.status, "content_type": resp.headers.get("Content-Type", ""),
                               "seconds": time.monotonic() - started}
    if out["content_type"].startswith("text/event-stream"):
        out["events"] = [e[5:].strip() if e[5:].strip() == "[DONE]" else json.loads(e[5:])
                         for e in raw.split("\n\n") if e.startswith("data:")]
    elif out["content_type"].startswith("application/json"):
        out["body"] = json.loads(raw)
    else:
        out["text"] = raw
    return out


def _entries(logprobs: dict[str, Any] | None) -> int | None:
    if logprobs is None:
        return None
    return len(logprobs["content"] if "content" in logprobs else logprobs["token_logprobs"])


def stream_shape(events: list[Any]) -> dict[str, Any]:
    """What genq reads of a stream, per choice in order, and the ids' pattern."""
    per_choice: dict[int, list[tuple[Any, ...]]] = {}
    tail = []
    ids: dict[str, list[str]] = {"role": [], "finish": []}
    for e in events:
        if e == "[DONE]" or not e["choices"]:
            tail.append("[DONE]" if e == "[DONE]" else ("usage", e["usage"]["completion_tokens"],
                                                        sorted(set(e["usage"]) - {"completion_tokens_details"})))
            continue
        [c] = e["choices"]  # SGLang: one choice a chunk
        delta = c.get("delta", {})
        kind = "role" if delta.get("role") else "finish" if c["finish_reason"] else "content"
        if kind in ids:
            ids[kind].append(e["id"])
        usage = e.get("usage")
        per_choice.setdefault(c["index"], []).append((
            kind, sorted(k for k in delta if k in ("role", "content", "reasoning_content", "tool_calls")),
            _entries(c.get("logprobs")), c["finish_reason"], type(c.get("matched_stop")).__name__,
            usage and usage["completion_tokens"]))
    return {"choices": per_choice, "tail": tail,
            # Each choice's own id (n > 1), and one id on every finish chunk.
            "role_ids_distinct": len(set(ids["role"])) == len(ids["role"]), "finish_ids": len(set(ids["finish"]))}


def whole_shape(body: dict[str, Any]) -> dict[str, Any]:
    return {"choices": [(c["index"], sorted(k for k in c.get("message", {}) if k in ("content", "reasoning_content",
                                                                                       "tool_calls")),
                         _entries(c.get("logprobs")), c["finish_reason"], type(c.get("matched_stop")).__name__)
                        for c in body["choices"]],
            "completion_tokens": body["usage"]["completion_tokens"]}


STREAMS = [(name, tokens) for name in ("chat_stream_logprobs", "completions_stream_logprobs", "chat_stream_n2",
                                       "chat_stream_stop") for tokens in (1, 4)]


@pytest.mark.parametrize(("name", "tokens"), STREAMS, ids=[f"{n}-{t}" for n, t in STREAMS])
def test_streams_as_recorded(name: str, tokens: int) -> None:
    """Chunk per token, none for EOS in chat (logprob and text left out; usage counts it), the
    completions stream's EOS logprob sent, reasoning_content null in deltas, per-choice ids,
    finish chunks without usage, matched_stop the EOS token id, and the usage chunk's keys (no
    prompt_tokens_details in the completions stream's)."""
    record = recorded(f"{name}_{'eos_first' if tokens == 1 else 'eos_after_3'}")

    @with_sim(**SIM, seed=seed_for(record, tokens))
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        answer = await replay(http, record)
        assert answer["status"] == record["status"] == 200
        assert stream_shape(answer["events"]) == stream_shape(record["events"])

    body()


WHOLES = [(name, tokens) for name in ("chat_whole_logprobs", "completions_whole_logprobs", "chat_whole_n2",
                                      "chat_whole_stop") for tokens in (1, 4)]


@pytest.mark.parametrize(("name", "tokens"), WHOLES, ids=[f"{n}-{t}" for n, t in WHOLES])
def test_whole_answers_as_recorded(name: str, tokens: int) -> None:
    """Not streamed, the EOS token's logprob is listed; matched_stop is its id."""
    record = recorded(f"{name}_{'eos_first' if tokens == 1 else 'eos_after_3'}")

    @with_sim(**SIM, seed=seed_for(record, tokens))
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        answer = await replay(http, record)
        assert answer["status"] == record["status"] == 200
        assert whole_shape(answer["body"]) == whole_shape(record["body"])

    body()


def _words(message: str) -> str:
    return re.sub(r"\d+", "N", message)


@pytest.mark.parametrize("name", ["chat_whole_too_large", "chat_whole_over_context", "chat_stream_over_context"])
def test_refusals_as_recorded(name: str) -> None:
    """max_tokens over a given context, and a prompt over it: a flat JSON 400, streamed or not."""
    record = recorded(name)

    @with_sim(**SIM)
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        answer = await replay(http, record)
        assert (answer["status"], answer["content_type"].split(";")[0]) == (400, "application/json")
        assert (record["status"], record["content_type"]) == (400, "application/json")
        assert sorted(answer["body"]) == sorted(record["body"])
        assert _words(answer["body"]["message"]) == _words(record["body"]["message"])

    body()


def test_unknown_model_and_tools_without_a_parser_as_recorded() -> None:
    """Any model name is served and echoed; tools with no tool-call parser give plain content."""
    @with_sim(**SIM)
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        for name in ("chat_whole_unknown_model", "chat_whole_tools"):
            record, answer = recorded(name), await replay(http, recorded(name))
            assert answer["status"] == record["status"] == 200
            for b in (answer["body"], record["body"]):
                assert b["model"] == record["request"]["body"]["model"]
                assert b["choices"][0]["message"].get("tool_calls") is None
                assert b["choices"][0]["finish_reason"] in ("stop", "length")
        record = recorded("chat_stream_tools")
        answer = await replay(http, record)
        for events in (answer["events"], record["events"]):
            choices = [c for e in events if isinstance(e, dict) for c in e["choices"]]
            assert not any(c["delta"].get("tool_calls") for c in choices)
            assert {c["finish_reason"] for c in choices} - {None} <= {"stop", "length"}

    body()


def test_info_endpoints_as_recorded() -> None:
    """What discovery reads: /server_info (and the older name), /v1/models, /metrics names, /health; a 404."""
    @with_sim(**SIM)
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        for name in ("server_info", "get_server_info"):
            record, answer = recorded(name), await replay(http, recorded(name))
            for info in (record["body"], answer["body"]):
                assert (info["max_running_requests"], info["context_length"]) == (16, 2048)
                [state] = info["internal_states"]
                assert state["effective_max_running_requests_per_dp"] == 16
                assert {"weight", "kvcache", "token_capacity"} <= set(state["memory_usage"])
        record, answer = recorded("v1_models"), await replay(http, recorded("v1_models"))
        assert answer["body"]["data"][0]["max_model_len"] == record["body"]["data"][0]["max_model_len"] == 2048
        assert sorted(answer["body"]["data"][0]) == sorted(record["body"]["data"][0])
        for name in ("version", "get_load"):  # FastAPI's 404: {"detail": "Not Found"}
            record, answer = recorded(name), await replay(http, recorded(name))
            assert [(a["status"], a["content_type"].split(";")[0], a.get("body")) for a in (answer, record)] == \
                [(404, "application/json", {"detail": "Not Found"})] * 2
        record, answer = recorded("health"), await replay(http, recorded("health"))
        assert (answer["status"], answer["text"]) == (record["status"], record["text"]) == (200, "")
        assert answer["seconds"] >= 0.002  # with_sim's 2 ms step: a generation step, not at once
        page = (await replay(http, recorded("metrics")))["text"]
        wanted = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:num_retracted_reqs")
        for text in (page, recorded("metrics")["text"]):
            assert all(re.search(rf"^{name}{{", text, re.M) for name in wanted), wanted

    body()


@with_sim(flavor="sglang", context_length=2048, max_running_requests=16)
async def test_server_info_without_the_flags(sim: Any, http: aiohttp.ClientSession) -> None:
    """Not given on its command line, SGLang shows both as null; the limit stays in internal_states."""
    async with http.get("/server_info") as resp:
        info = await resp.json()
    assert (info["max_running_requests"], info["context_length"]) == (None, None)
    assert info["internal_states"][0]["effective_max_running_requests_per_dp"] == 16
    async with http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                       "max_tokens": 5000}) as resp:
        assert resp.status == 400 and "Requested token count exceeds" in (await resp.json())["message"]


def shape(value: Any, path: str = "$", out: dict[str, set[str]] | None = None) -> dict[str, set[str]]:
    """Every key path of a JSON value (list items merged as `[]`) and the types found there."""
    out = {} if out is None else out
    out.setdefault(path, set()).add(type(value).__name__)
    if isinstance(value, dict):
        for key, item in value.items():
            shape(item, f"{path}.{key}", out)
    elif isinstance(value, list):
        for item in value:
            shape(item, f"{path}[]", out)
    return out


# What genq neither reads nor records: SGLang's weight-version metadata, a details object always null here.
UNREAD = ("$.metadata", "$[].usage.completion_tokens_details", "$.usage.completion_tokens_details")
ANSWERS = sorted(p.stem for p in RECORDED.glob("*.json") if p.stem.startswith(("chat_", "completions_")))


@pytest.mark.parametrize("name", ANSWERS)
def test_answer_shapes_as_recorded(name: str) -> None:
    """Status, content type and every key and value type of the body or of the stream's events, as recorded
    (not the text): what a record keeps of an answer comes from these."""
    record = recorded(name)
    answers = [record["body"]] if "body" in record else [e for e in record["events"] if isinstance(e, dict)]
    finishes = {c["finish_reason"] for a in answers for c in a.get("choices", ())} - {None}
    # Ended on EOS: the sim's seed gives each choice the same length; else both run to max_tokens.
    tokens = answers[-1]["usage"]["completion_tokens"] // record["request"]["body"].get("n", 1) \
        if finishes == {"stop"} else None
    sim = {**SIM, "seed": seed_for(record, tokens)} if tokens else {**SIM, "mean_output_tokens": 1e4,
                                                                     "output_sigma": 0.0}

    @with_sim(**sim)
    async def body(sim: Any, http: aiohttp.ClientSession) -> None:
        answer = await replay(http, record)
        media = [(a["status"], a["content_type"].split(";")[0]) for a in (answer, record)]
        assert media[0] == media[1], media
        key = "events" if "events" in record else "body"
        got, want = ({p: t for p, t in shape(a[key]).items() if not p.startswith(UNREAD)} for a in (answer, record))
        assert {p: sorted(t) for p, t in got.items() if got.get(p) != want.get(p)} == \
               {p: sorted(t) for p, t in want.items() if got.get(p) != want.get(p)}

    body()


def label_keys(page: str) -> dict[str, set[tuple[str, ...]]]:
    """Each series name of a Prometheus page and the label-key sets its samples carry."""
    out: dict[str, set[tuple[str, ...]]] = {}
    for name, labels in re.findall(r"^([\w:]+)(?:\{(.*)\})? \S+$", page, re.M):
        out.setdefault(name, set()).add(tuple(sorted(re.findall(r'(\w+)="', labels))))
    return out


@with_sim(**SIM)
async def test_metric_labels_as_recorded(sim: Any, http: aiohttp.ClientSession) -> None:
    """Every series the sim shows is one of SGLang 0.5.23's, with its label keys: the rank labels on gauges (and
    pid on the retracted gauge), is_streaming on the counters (genq sums the series); those genq reads among them.
    The same request streamed and not counts once in each counter's two series, the same prompt and output tokens."""
    for stream in (True, False):
        async with http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 4, "stream": stream}) as resp:
            await resp.read()
    async with http.get("/metrics") as resp:
        page = await resp.text()
    got = label_keys(page)
    counts = {(name, streamed): float(v) for name, streamed, v in
              re.findall(r'^sglang:(\w+)\{.*is_streaming="(\w+)".*\} (\S+)$', page, re.M)}
    names = ("prompt_tokens_total", "generation_tokens_total", "num_requests_total")
    assert sorted(counts) == sorted((n, s) for n in names for s in ("false", "true"))
    assert all(counts[n, "true"] == counts[n, "false"] > 0 for n in names) and counts["num_requests_total", "true"] == 1
    want = label_keys(recorded("metrics")["text"])
    read = [n for names in SGLANG.metrics.values() for n in names if n in want]
    assert len(read) == 5 and set(read) <= set(got)
    assert got == {n: want.get(n) for n in got}
