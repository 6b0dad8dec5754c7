"""genq sim: fault switches, outages, info endpoints and the command line."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from typing import Any

import aiohttp
import pytest

from genq.sim.serve import SimServer
from tests.sim_client import (
    REPO,
    chat,
    health_becomes,
    metrics,
    post,
    sim_stats,
    sse_events,
    wait_for_metric,
    with_sim,
)


@with_sim(error_rate=1.0)
async def test_error_rate_gives_500(sim: SimServer, http: aiohttp.ClientSession) -> None:
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
async def test_reset_rate_drops_connections(sim: SimServer, http: aiohttp.ClientSession) -> None:
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
    assert sim.engine.totals["aborted_requests"] == 2 and (await metrics(http))["sglang:num_running_reqs"] == 0


@with_sim(hang_rate=1.0, max_running_requests=1)
async def test_hang_until_client_leaves(sim: SimServer, http: aiohttp.ClientSession) -> None:
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(post(http, chat("stuck", max_tokens=1000)), timeout=0.3)
    await wait_for_metric(http, "sglang:num_running_reqs", 0)
    assert sim.engine.totals["aborted_requests"] == 1


# What each engine sends when a request fails after its stream began (genq/sim/serve.py
# stream_error names the engines' source places): an SSE event holding the error on the
# HTTP 200 stream, after some output; SGLang's carries its blanket code 400.
STREAM_ERRORS = {
    "sglang": {"object": "error", "message": "Internal server error (simulated, mid-stream)",
               "type": "BadRequestError", "param": None, "code": 400},
    "vllm": {"message": "Internal server error (simulated, mid-stream)", "type": "InternalServerError",
             "param": None, "code": 500},
    "llamacpp": {"code": 500, "message": "Internal server error (simulated, mid-stream)", "type": "server_error"},
}


async def _stream_error_body(flavor: str, sim: SimServer) -> None:
    # A connection per request: llama-server closes each after a stream.
    async with aiohttp.ClientSession(sim.url, connector=aiohttp.TCPConnector(force_close=True)) as http:
        await _stream_errors(flavor, http)


async def _stream_errors(flavor: str, http: aiohttp.ClientSession) -> None:
    for n in range(3):
        events = await sse_events(http, chat(f"fail {n}", max_tokens=400, stream=True))
        *output, last = events if flavor == "llamacpp" else events[:-1]
        assert flavor == "llamacpp" or events[-1] == "[DONE]", "SGLang and vLLM end with [DONE]"
        assert last == {"error": STREAM_ERRORS[flavor]}, last
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in output)
        assert output[0]["choices"][0]["delta"]["role"] == "assistant" and text, "some output came first"
        assert all("error" not in e and e["choices"][0]["finish_reason"] is None for e in output)
    status, body = await post(http, chat("whole", max_tokens=400))
    assert status == 500 and "Internal server error (simulated, mid-stream)" in str(body)
    if flavor == "sglang":
        assert (await sim_stats(http))["aborted_requests"] == 4, "the engine aborted each one"
    async with http.post("/sim/faults", json={"stream_error_rate": 0.0}) as resp:
        assert (await resp.json())["stream_error_rate"] == 0.0
    events = await sse_events(http, chat("fine", max_tokens=50, stream=True))
    assert not any(isinstance(e, dict) and "error" in e for e in events)


SE = dict(stream_error_rate=1.0, tokens_per_step=2, mean_output_tokens=400.0, output_sigma=0.0)


@with_sim(flavor="sglang", **SE)
async def test_stream_error_event_sglang(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await _stream_error_body("sglang", sim)


@with_sim(flavor="vllm", served_model_name="m", **SE)
async def test_stream_error_event_vllm(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await _stream_error_body("vllm", sim)


@with_sim(flavor="llamacpp", **SE)
async def test_stream_error_event_llamacpp(sim: SimServer, http: aiohttp.ClientSession) -> None:
    await _stream_error_body("llamacpp", sim)


@with_sim(startup_delay=0.4)
async def test_503_while_starting(sim: SimServer, http: aiohttp.ClientSession) -> None:
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
async def test_outage_resets_then_recovers(sim: SimServer, http: aiohttp.ClientSession) -> None:
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
async def test_scheduled_outage(sim: SimServer, http: aiohttp.ClientSession) -> None:
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
async def test_info_endpoints(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for path in ("/get_server_info", "/server_info"):
        async with http.get(path) as resp:
            info = await resp.json()
        # As SGLang 0.5.23: null at the top level unless given as flags (tests/test_sim_sglang_recorded.py)
        assert info["max_running_requests"] is None and info["context_length"] is None
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
        assert 'sglang:num_running_reqs{engine_type="unified",model_name="served",moe_ep_rank="0",pp_rank="0",' \
               'tp_rank="0"} 0.0' in await resp.text()


@pytest.mark.e2e  # starts a process
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

        assert asyncio.run(probe())["internal_states"][0]["effective_max_running_requests_per_dp"] == 7
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        assert proc.wait(timeout=max(deadline - time.monotonic(), 0)) == 0
    finally:
        proc.kill()
        proc.wait()
