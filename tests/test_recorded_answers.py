"""genq's reader and record on real SGLang 0.5.23 answers (tests/recordings/sglang-0.5.23/): every
recorded answer to a request for logprobs becomes a record with one entry per generated token, the
ones the server sent kept as sent, and the end-of-sequence entry its chat stream leaves out recorded
as nulls; an answer that is EOS alone is a valid, empty record."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from genq.core.records import Prompt, Result
from genq.worker.server import (
    UNSENT_MAX,
    Completion,
    Failure,
    Progress,
    StreamSink,
    one_per_token,
    parse_completion_bytes,
    result_of,
)

RECORDED = Path(__file__).parent / "recordings" / "sglang-0.5.23"
NAMES = sorted(p.stem for p in RECORDED.glob("*logprobs_eos*.json")) + \
    sorted(p.stem for p in RECORDED.glob("chat_*_n2_eos*.json"))


def record_of(name: str) -> Result:
    recorded = json.loads((RECORDED / f"{name}.json").read_text())
    completion: Any
    if "events" in recorded:
        state = StreamSink("m", Progress())
        for event in recorded["events"]:
            assert state.feed(event.encode() if isinstance(event, str) else json.dumps(event).encode()) is None
        completion = state.completion()
    else:
        completion = parse_completion_bytes(json.dumps(recorded["body"]).encode(), "m")
    assert isinstance(completion, Completion), completion
    result = result_of(recorded["request"]["body"], completion, prompt=Prompt(id="p", index=0), job="j", batch="b",
                       worker="w", attempts=1, latency_s=0.1)
    assert isinstance(result, Result), result
    return msgspec.json.decode(msgspec.json.encode(result))


@pytest.mark.parametrize("name", NAMES)
def test_one_logprob_entry_per_generated_token(name: str) -> None:
    r = record_of(name)
    streamed, chat = "_stream_" in name, name.startswith("chat")
    choices = r.get("choices") or [{**r, "completion_tokens": r["usage"]["completion_tokens"]}]
    counts = [c.get("completion_tokens") for c in choices]
    if None in counts:  # a whole n > 1 answer: the request's total only
        counts = [r["usage"]["completion_tokens"] // len(choices)] * len(choices)
    assert counts == [1 if "eos_first" in name else 4] * len(choices)  # as the logit bias forced them
    assert sum(counts) == r["usage"]["completion_tokens"]
    for c, tokens in zip(choices, counts, strict=True):
        entries = c["logprobs"]["content"] if chat else c["logprobs"]["token_logprobs"]
        assert len(entries) == tokens and c["finish_reason"] == "stop"
        last = entries[-1]
        if streamed and chat:  # sent nothing for EOS: its entry is all null
            assert last == {"token": None, "logprob": None, "bytes": None, "top_logprobs": None}
            assert all(e["logprob"] is not None for e in entries[:-1])
        elif chat:
            assert last["token"] == "<|im_end|>" and last["logprob"] <= 0  # 0.0: the bias made it certain
        else:
            assert c["logprobs"]["tokens"][-1] == "<|im_end|>" and last <= 0
        if "eos_first" in name:
            assert c["completion"] == ""  # a valid, empty answer


def test_a_length_cut_answer_whose_last_token_made_no_text() -> None:
    """Seen in make test-sglang (2026-12-06): streamed, finish length at max_tokens 16, 15 logprob
    entries: the last token decoded to no text (a character's first bytes) and SGLang's chat stream
    sends logprobs only with text. Its entry is recorded as nulls; a whole gap is not filled."""
    sent = {"content": [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}] * 15}
    filled = one_per_token(sent, 16, "length", chat=True)
    assert filled is not None and len(filled["content"]) == 16 and filled["content"][-1]["logprob"] is None
    assert one_per_token(sent, 15, "length", chat=True) is sent  # nothing missing
    assert one_per_token(sent, 15 + UNSENT_MAX + 1, "length", chat=True) is sent  # more than trailing bytes: as sent
    assert one_per_token(None, 16, "length", chat=True) is None  # no logprobs at all: the server ignored them


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("reason", ["abort", "error"])
def test_an_answer_the_server_aborted_is_a_failure_to_retry_not_a_record(reason: str, stream: bool) -> None:
    """SGLang ends a request it aborts (scheduler gone, abort all at shutdown) with finish_reason "abort",
    vLLM with "abort" or "error": the text is what was made before, not an answer. It is a server_error,
    retried (and dead-lettered only on evidence, as any), naming the reason. It was recorded as the
    prompt's result: a cut answer in the output, the prompt never generated whole."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    if stream:
        sink = StreamSink("m", Progress())
        for event in ({"choices": [{"index": 0, "delta": {"content": "Once upon"}}]},
                      {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]},
                      {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}):
            assert sink.feed(json.dumps(event).encode()) is None
        assert sink.feed(b"[DONE]") is None
        completion: Any = sink.outcome()
    else:
        answer = {"choices": [{"index": 0, "message": {"content": "Once upon"}, "finish_reason": reason}],
                  "usage": {"prompt_tokens": 9, "completion_tokens": 2}}
        completion = parse_completion_bytes(json.dumps(answer).encode(), "m")
    assert isinstance(completion, Completion), completion
    outcome = result_of(body, completion, prompt=Prompt(id="p", index=0), job="j", batch="b", worker="w", attempts=1,
                        latency_s=0.1)
    assert isinstance(outcome, Failure), outcome
    assert (outcome.kind, outcome.retryable) == ("server_error", True) and f"finish_reason {reason}" in outcome.message
