"""The SGLang simulator over real HTTP on loopback, driven by an aiohttp client."""


from __future__ import annotations

import asyncio
import hashlib
import json
from typing import Any

import aiohttp

from genq.sim.lengths import output_length, prompt_key
from genq.sim.serve import SimServer
from tests.sim_client import (
    chat,
    metrics,
    post,
    sim_stats,
    sse_events,
    wait_for_metric,
    with_sim,
)


def test_prompt_key_and_lengths_are_deterministic_lognormal() -> None:
    messages = [{"role": "user", "content": "héllo"}]
    canonical = json.dumps(messages, sort_keys=True, separators=(",", ":"))
    assert prompt_key(messages) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert prompt_key("a prompt") != prompt_key(["a prompt"])

    keys = [prompt_key(f"prompt {i}") for i in range(4000)]
    lengths = [output_length(k, 7, 200.0, 1.0, 10**9) for k in keys]
    assert lengths == [output_length(k, 7, 200.0, 1.0, 10**9) for k in keys]
    assert lengths != [output_length(k, 8, 200.0, 1.0, 10**9) for k in keys]
    assert 180 < sum(lengths) / len(lengths) < 220
    # Heavy tail: the longest answers are many times the median.
    assert max(lengths) > 8 * sorted(lengths)[len(lengths) // 2]
    assert min(output_length(k, 0, 2.0, 2.0, 50) for k in keys) >= 1
    assert max(output_length(k, 0, 2000.0, 2.0, 50) for k in keys) == 50


# ---- response shapes ------------------------------------------------------


@with_sim()
async def test_chat_non_stream_shape(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, chat("What is 2+2?", max_tokens=10_000, rid="req-1"))
    assert status == 200
    assert body["id"] == "req-1"
    assert body["object"] == "chat.completion"
    assert body["model"] == "m"
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["reasoning_content"] is None
    assert choice["finish_reason"] == "stop"
    usage = body["usage"]
    assert usage["prompt_tokens"] == len("What is 2+2?") // 4 + 1
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert usage["prompt_tokens_details"] is None and usage["reasoning_tokens"] == 0
    assert len(choice["message"]["content"]) == 4 * usage["completion_tokens"]

    status, body = await post(http, {"prompt": "Once upon a time", "model": "m"}, "/v1/completions")
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 16  # /v1/completions defaults to 16 tokens
    assert len(body["choices"][0]["text"]) == 4 * body["usage"]["completion_tokens"]


@with_sim(tokens_per_step=4)
async def test_stream_shape_and_usage(sim: SimServer, http: aiohttp.ClientSession) -> None:
    request = chat("Tell me a story", max_tokens=10_000)
    _, whole = await post(http, request)
    events = await sse_events(http, {**request, "stream": True, "stream_options": {"include_usage": True}})

    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == whole["usage"]
    finish = chunks[-2]["choices"][0]
    # SGLang 0.5.23 (tests/recordings/sglang-0.5.23/): every delta has reasoning_content.
    assert finish["finish_reason"] == "stop" and finish["delta"] == {"reasoning_content": None}
    assert finish["matched_stop"] == 151645 and "usage" not in chunks[-2]
    content_chunks = chunks[1:-2]
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks)
    # One chunk per token, none for the end-of-sequence token (counted in usage).
    tokens = whole["usage"]["completion_tokens"]
    assert len(content_chunks) == tokens - 1
    text = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert text == whole["choices"][0]["message"]["content"][:4 * (tokens - 1)]

    events = await sse_events(http, {**request, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert events[-1] == "[DONE]"
    so_far = [c["usage"]["completion_tokens"] for c in events[:-1] if "usage" in c]
    assert so_far == list(range(1, tokens))  # the role and finish chunks carry no usage
    assert events[-2]["choices"], "no usage-only chunk without include_usage"

    events = await sse_events(http, {"prompt": "Once", "max_tokens": 10, "stream": True}, "/v1/completions")
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == (await post(
        http, {"prompt": "Once", "max_tokens": 10}, "/v1/completions"))[1]["choices"][0]["text"]


@with_sim(mean_output_tokens=100.0, output_sigma=0.0, thinking_fraction=0.3)
async def test_reasoning_split(sim: SimServer, http: aiohttp.ClientSession) -> None:
    thinking = {"chat_template_kwargs": {"enable_thinking": True}}
    _, body = await post(http, chat("Think first", max_tokens=1000, **thinking))
    message, usage = body["choices"][0]["message"], body["usage"]
    assert usage["completion_tokens"] == 100 and usage["reasoning_tokens"] == 30
    assert len(message["reasoning_content"]) == 4 * 30 and len(message["content"]) == 4 * 70

    # Cut by max_tokens before thinking ends: all of it is reasoning.
    _, body = await post(http, chat("Think first", max_tokens=20, **thinking))
    message = body["choices"][0]["message"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert message["content"] == "" and len(message["reasoning_content"]) == 4 * 20

    # separate_reasoning=false: the raw output, thinking closed by </think>.
    _, body = await post(http, chat("Think first", max_tokens=1000, separate_reasoning=False, **thinking))
    message = body["choices"][0]["message"]
    assert message["reasoning_content"] is None
    assert message["content"].index("</think>") == 4 * 30

    events = await sse_events(http, chat("Think first", max_tokens=1000, stream=True, **thinking))
    deltas = [e["choices"][0]["delta"] for e in events[1:-2]]
    reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    content = "".join(d.get("content") or "" for d in deltas)
    # The end-of-sequence token, the last of the content, is not streamed.
    assert len(reasoning) == 4 * 30 and len(content) == 4 * 69
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(not d.get("content") for d in deltas[:first_content])
    assert all(d["reasoning_content"] is None for d in deltas[first_content + 1 :])


@with_sim(mean_output_tokens=200.0, output_sigma=1.0)
async def test_lengths_per_prompt_and_finish_length(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async def tokens(prompt: str, **extra: Any) -> tuple[int, str]:
        _, body = await post(http, chat(prompt, **extra))
        return body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]

    first = [await tokens(f"prompt {i}", max_tokens=10_000) for i in range(6)]
    again = [await tokens(f"prompt {i}", max_tokens=10_000) for i in range(6)]
    assert first == again
    assert len({n for n, _ in first}) > 1
    assert {reason for _, reason in first} == {"stop"}
    n, _ = first[0]
    assert await tokens("prompt 0", max_tokens=n - 1) == (n - 1, "length")
    assert await tokens("prompt 0", max_tokens=n) == (n, "stop")
    # Without max_tokens a chat may run to the context limit, as in SGLang.
    assert await tokens("prompt 0") == (n, "stop")


# ---- scheduling -----------------------------------------------------------


@with_sim(max_running_requests=4, step_ms_base=10.0, tokens_per_step=8, mean_output_tokens=96.0, output_sigma=0.0)
async def test_continuous_batching(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await http.post("/sim/reset")
    jobs = [asyncio.create_task(post(http, chat(f"job {i}", max_tokens=1000))) for i in range(12)]
    seen_running, seen_queue = [], []
    while not all(j.done() for j in jobs):
        m = await metrics(http)
        seen_running.append(m["sglang:num_running_reqs"])
        seen_queue.append(m["sglang:num_queue_reqs"])
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*jobs)
    assert all(status == 200 for status, _ in results)
    assert max(seen_running) == 4 and max(seen_queue) > 0

    stats = await sim_stats(http)
    assert stats["finished_requests"] == 12
    assert stats["generated_tokens"] == 12 * 96
    # Continuous batching: a freed slot is refilled at the next step, so no step
    # runs with a free slot while a request waits. Counts, not times.
    assert stats["starved_steps"] == 0
    assert stats["busy_mean_waiting"] > 0
    m = await metrics(http)
    assert m["sglang:generation_tokens_total"] == 12 * 96 and m["sglang:num_requests_total"] == 12
    # 12 steps per request (96 tokens, 8 a step), at most 4 at a step: at least 36 steps.
    assert stats["request_steps"] == 12 * 12 and stats["steps"] >= 36


@with_sim(max_running_requests=1, max_queued_requests=1, step_ms_base=5.0, mean_output_tokens=1000.0, output_sigma=0.0)
async def test_queue_full_503(sim: SimServer, http: aiohttp.ClientSession) -> None:
    # 400 tokens at 16 a step: each request runs for 25 steps of 5 ms.
    jobs = [asyncio.create_task(post(http, chat(f"q{i}", max_tokens=400))) for i in range(2)]
    await wait_for_metric(http, "sglang:num_queue_reqs", 1)
    status, body = await post(http, chat("q2", max_tokens=20))
    assert status == 503 and body["message"] == "The request queue is full." and body["code"] == 503
    assert [s for s, _ in await asyncio.gather(*jobs)] == [200, 200]


@with_sim(max_running_requests=1, step_ms_base=5.0, mean_output_tokens=100_000.0, output_sigma=0.0)
async def test_client_disconnect_frees_slot(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for stream in (False, True):
        hog = asyncio.create_task(post(http, chat("long", max_tokens=30_000, stream=stream)))
        await wait_for_metric(http, "sglang:num_running_reqs", 1)
        before = sim.engine.totals["generated_tokens"]
        while sim.engine.totals["generated_tokens"] == before:  # it is generating
            await asyncio.sleep(0.005)
        hog.cancel()  # closes the connection
        status, _ = await post(http, chat("short", max_tokens=5))
        assert status == 200
    m = await metrics(http)
    assert m["sglang:num_running_reqs"] == 0
    stats = await sim_stats(http)
    assert stats["aborted_requests"] == 2
    assert prompt_key([{"role": "user", "content": "long"}]) not in stats["generated_by_key"]


@with_sim()
async def test_generated_by_key_counts_and_reset(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for content in ("a", "a", "b"):
        await post(http, chat(content, max_tokens=5))
    await post(http, {"prompt": "c", "max_tokens": 5}, "/v1/completions")
    stats = await sim_stats(http)
    key = lambda c: prompt_key([{"role": "user", "content": c}])  # noqa: E731
    assert stats["generated_by_key"] == {key("a"): 2, key("b"): 1, prompt_key("c"): 1}
    assert stats["finished_requests"] == 4
    await http.post("/sim/reset")
    stats = await sim_stats(http)
    assert stats["generated_by_key"] == {} and stats["finished_requests"] == 0


# ---- errors ---------------------------------------------------------------


@with_sim(context_length=1000)
async def test_bad_requests_get_sglang_400(sim: SimServer, http: aiohttp.ClientSession) -> None:
    status, body = await post(http, chat("x" * 4000, max_tokens=10))
    assert status == 400
    assert body == {
        "object": "error",
        "message": "The input (1001 tokens) is longer than the model's context length (1000 tokens).",
        "type": "BadRequestError",
        "param": None,
        "code": 400,
    }
    status, body = await post(http, chat("x" * 400, max_tokens=950))
    assert status == 400 and body["message"].startswith("Requested token count exceeds")
    for bad in (
        {"model": "m"},
        chat("hi", temperature=-0.5),
        chat("hi", max_tokens=-1),
        chat("hi", max_tokens="many"),
    ):
        status, body = await post(http, bad)
        assert status == 400 and body["type"] == "BadRequestError", bad
    async with http.post("/v1/chat/completions", data=b"{not json") as resp:
        assert resp.status == 400 and (await resp.json())["code"] == 400
    assert (await sim_stats(http))["generated_by_key"] == {}
