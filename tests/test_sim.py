"""The SGLang simulator over real HTTP on loopback, driven by an aiohttp client."""

from __future__ import annotations

import asyncio
import hashlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from genq.sim.config import SimConfig
from genq.sim.lengths import output_length, prompt_key
from genq.sim.serve import RunningSim, start

REPO = Path(__file__).resolve().parents[1]
Body = Callable[[RunningSim, aiohttp.ClientSession], Awaitable[None]]


def with_sim(**overrides: Any) -> Callable[[Body], Callable[[], None]]:
    """Run an async test body against a fresh in-process sim on a free port.
    Fast steps by default so that every test finishes in about a second."""
    settings: dict[str, Any] = {"port": 0, "step_ms_base": 2.0, "step_ms_per_req": 0.0, "mean_output_tokens": 64.0}
    settings.update(overrides)

    def decorate(body: Body) -> Callable[[], None]:
        async def main() -> None:
            sim = await start(SimConfig(**settings))
            try:
                async with aiohttp.ClientSession(sim.url) as http:
                    await asyncio.wait_for(body(sim, http), timeout=8)
            finally:
                await sim.close()

        def test() -> None:
            asyncio.run(main())

        return test

    return decorate


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def post(http: aiohttp.ClientSession, body: dict[str, Any], path: str = "/v1/chat/completions") -> tuple[int, Any]:
    async with http.post(path, json=body) as resp:
        return resp.status, await resp.json()


async def sse_events(http: aiohttp.ClientSession, body: dict[str, Any], path: str = "/v1/chat/completions") -> list[Any]:
    """Every `data:` event of a stream, decoded; "[DONE]" stays a string."""
    async with http.post(path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def metrics(http: aiohttp.ClientSession) -> dict[str, float]:
    async with http.get("/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            values[name_labels.split("{")[0]] = float(value)
    return values


async def wait_for_metric(http: aiohttp.ClientSession, name: str, value: float) -> dict[str, float]:
    """Poll /metrics until name == value (the with_sim timeout bounds the wait)."""
    while (m := await metrics(http))[name] != value:
        await asyncio.sleep(0.005)
    return m


async def health_becomes(http: aiohttp.ClientSession, status: int) -> None:
    """Poll /health until it answers status (the with_sim timeout bounds the wait)."""
    while True:
        async with http.get("/health") as resp:
            if resp.status == status:
                return
        await asyncio.sleep(0.01)


async def sim_stats(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with http.get("/sim/stats") as resp:
        return await resp.json()


# ---- lengths --------------------------------------------------------------


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
async def test_chat_non_stream_shape(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
async def test_stream_shape_and_usage(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
    assert finish["finish_reason"] == "stop" and finish["delta"] == {}
    content_chunks = chunks[1:-2]
    assert all(c["choices"][0]["finish_reason"] is None for c in content_chunks)
    # One chunk per engine step of tokens_per_step tokens.
    assert len(content_chunks) == math.ceil(whole["usage"]["completion_tokens"] / 4)
    text = "".join(c["choices"][0]["delta"]["content"] for c in content_chunks)
    assert text == whole["choices"][0]["message"]["content"]

    events = await sse_events(http, {**request, "stream": True, "stream_options": {"continuous_usage_stats": True}})
    assert events[-1] == "[DONE]"
    so_far = [c["usage"]["completion_tokens"] for c in events[:-1]]
    assert so_far == sorted(so_far) and so_far[-1] == whole["usage"]["completion_tokens"]
    assert events[-2]["choices"], "no usage-only chunk without include_usage"

    events = await sse_events(http, {"prompt": "Once", "max_tokens": 10, "stream": True}, "/v1/completions")
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    assert all(e["object"] == "text_completion" for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == (await post(
        http, {"prompt": "Once", "max_tokens": 10}, "/v1/completions"))[1]["choices"][0]["text"]


@with_sim(mean_output_tokens=100.0, output_sigma=0.0, thinking_fraction=0.3)
async def test_reasoning_split(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    content = "".join(d.get("content", "") for d in deltas)
    assert len(reasoning) == 4 * 30 and len(content) == 4 * 70
    first_content = next(i for i, d in enumerate(deltas) if "content" in d)
    assert all("content" not in d for d in deltas[:first_content])
    assert all("reasoning_content" not in d for d in deltas[first_content + 1 :])


@with_sim(mean_output_tokens=200.0, output_sigma=1.0)
async def test_lengths_per_prompt_and_finish_length(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
async def test_continuous_batching(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
async def test_queue_full_503(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    # 400 tokens at 16 a step: each request runs for 25 steps of 5 ms.
    jobs = [asyncio.create_task(post(http, chat(f"q{i}", max_tokens=400))) for i in range(2)]
    await wait_for_metric(http, "sglang:num_queue_reqs", 1)
    status, body = await post(http, chat("q2", max_tokens=20))
    assert status == 503 and body["message"] == "The request queue is full." and body["code"] == 503
    assert [s for s, _ in await asyncio.gather(*jobs)] == [200, 200]


@with_sim(max_running_requests=1, step_ms_base=5.0, mean_output_tokens=100_000.0, output_sigma=0.0)
async def test_client_disconnect_frees_slot(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    for stream in (False, True):
        hog = asyncio.create_task(post(http, chat("long", max_tokens=30_000, stream=stream)))
        await wait_for_metric(http, "sglang:num_running_reqs", 1)
        before = sim.sim.engine.generation_tokens_total
        while sim.sim.engine.generation_tokens_total == before:  # it is generating
            await asyncio.sleep(0.005)
        hog.cancel()  # closes the connection
        status, _ = await post(http, chat("short", max_tokens=5))
        assert status == 200
    m = await metrics(http)
    assert m["sglang:num_aborted_requests_total"] == 2
    assert m["sglang:num_running_reqs"] == 0
    stats = await sim_stats(http)
    assert stats["aborted_requests"] == 2
    assert prompt_key([{"role": "user", "content": "long"}]) not in stats["generated_by_key"]


@with_sim()
async def test_generated_by_key_counts_and_reset(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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
async def test_bad_requests_get_sglang_400(sim: RunningSim, http: aiohttp.ClientSession) -> None:
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


@with_sim(error_rate=1.0)
async def test_error_rate_gives_500(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    for _ in range(3):
        status, body = await post(http, chat("hi", max_tokens=5))
        assert status == 500
        assert body == {
            "object": "error",
            "message": "Internal server error (simulated)",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    async with http.post("/sim/faults", json={"error_rate": 0.0}) as resp:
        assert (await resp.json())["error_rate"] == 0.0
    assert (await post(http, chat("hi", max_tokens=5)))[0] == 200


@with_sim(reset_rate=1.0, tokens_per_step=2, mean_output_tokens=400.0, output_sigma=0.0, seed=3)
async def test_reset_rate_drops_connections(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(http, chat("reset me", max_tokens=1000))
    # A stream gets part of its output, then the connection is reset.
    got = b""
    with pytest.raises(aiohttp.ClientError):
        async with http.post("/v1/chat/completions", json=chat("me too", max_tokens=1000, stream=True)) as resp:
            assert resp.status == 200
            async for line in resp.content:
                got += line
    assert b'"role":"assistant"' in got and b"[DONE]" not in got
    m = await metrics(http)
    assert m["sglang:num_aborted_requests_total"] == 2 and m["sglang:num_running_reqs"] == 0


@with_sim(hang_rate=1.0, max_running_requests=1)
async def test_hang_until_client_leaves(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(http, chat("stuck", max_tokens=1000)), timeout=0.3)
    m = await wait_for_metric(http, "sglang:num_running_reqs", 0)
    assert m["sglang:num_aborted_requests_total"] == 1


@with_sim(startup_delay=0.4)
async def test_503_while_starting(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    for path in ("/health", "/health_generate"):
        async with http.get(path) as resp:
            assert resp.status == 503
    status, body = await post(http, chat("hi", max_tokens=5))
    assert status == 503 and body["object"] == "error"
    await health_becomes(http, 200)  # the with_sim timeout bounds the wait
    async with http.get("/health") as resp:
        assert resp.status == 200 and await resp.read() == b""
    assert (await post(http, chat("hi", max_tokens=5)))[0] == 200


@with_sim(step_ms_base=5.0, mean_output_tokens=100_000.0, output_sigma=0.0)
async def test_outage_resets_then_recovers(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    inflight = [
        asyncio.create_task(post(http, chat("long 1", max_tokens=30_000))),
        asyncio.create_task(sse_events(http, chat("long 2", max_tokens=30_000, stream=True))),
    ]
    await wait_for_metric(http, "sglang:num_running_reqs", 2)
    async with http.post("/sim/faults", json={"outage_for": 0.5}) as resp:
        assert (await resp.json())["outage"] is True
    for outcome in await asyncio.gather(*inflight, return_exceptions=True):
        assert isinstance(outcome, aiohttp.ClientError), outcome
    async with http.get("/health") as resp:
        assert resp.status == 503
    with pytest.raises(aiohttp.ClientConnectionError):
        await post(http, chat("during", max_tokens=5))
    await health_becomes(http, 200)
    assert (await post(http, chat("after", max_tokens=5)))[0] == 200


@with_sim(outage_at=0.3, outage_for=0.4)
async def test_scheduled_outage(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    await health_becomes(http, 503)
    async with http.get("/sim/faults") as resp:
        state = await resp.json()
    # The sim's own clock says how long is left: at most outage_for.
    assert state["outage"] is True or state["outage_remaining_s"] == 0
    assert state["outage_remaining_s"] <= 0.4
    await health_becomes(http, 200)
    assert (await post(http, chat("after", max_tokens=5)))[0] == 200


# ---- info endpoints and CLI -----------------------------------------------


@with_sim(max_running_requests=5, served_model_name="served", context_length=4096)
async def test_info_endpoints(sim: RunningSim, http: aiohttp.ClientSession) -> None:
    for path in ("/get_server_info", "/server_info"):
        async with http.get(path) as resp:
            info = await resp.json()
        assert info["max_running_requests"] == 5 and info["context_length"] == 4096
        assert info["served_model_name"] == "served" and info["version"] == "0.0.0-genq-sim"
        assert {"max_total_num_tokens", "max_req_input_len", "model_path"} <= info.keys()
        (state,) = info["internal_states"]
        assert state["effective_max_running_requests_per_dp"] == 5
        assert isinstance(state["last_gen_throughput"], float) and "memory_usage" in state
    async with http.get("/v1/models") as resp:
        models = await resp.json()
    assert models["object"] == "list" and models["data"][0]["id"] == "served"
    assert models["data"][0]["max_model_len"] == 4096
    async with http.get("/model_info") as resp:
        assert (await resp.json())["is_generation"] is True
    async with http.get("/metrics") as resp:
        assert 'sglang:num_running_reqs{model_name="served"} 0.0' in await resp.text()


def test_cli_serves_until_sigterm() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "genq", "sim", "--port", "0", "--max-running-requests", "7"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("genq sim: listening on http://127.0.0.1:") and "max_running_requests=7" in line
        url = line.split()[4]

        async def probe() -> dict[str, Any]:
            async with aiohttp.ClientSession(url) as http:
                async with http.get("/get_server_info") as resp:
                    return await resp.json()

        assert asyncio.run(probe())["max_running_requests"] == 7
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        assert proc.wait(timeout=max(deadline - time.monotonic(), 0)) == 0
    finally:
        proc.kill()
        proc.wait()
