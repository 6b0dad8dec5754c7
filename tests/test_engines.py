"""genq against each engine flavor the simulator plays: SGLang, vLLM, llama.cpp.

The sim's flavors copy the engines' endpoints, metric names, error bodies,
queueing and connection habits (docs/engines.md cites their sources). The client
is tested in-process against an in-process sim; the worker end to end, as a real
`genq worker --burst` with default settings against a real `genq sim` process.
No timing assertions: conditions are waited on with deadlines.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from genq.sim.config import SimConfig
from genq.sim.serve import SimServer, start
from genq.worker.engines import metrics_from_text
from genq.worker.server import Completion, Failure, Progress, ServerClient
from tests.conftest import read_results, run_genq, sim_stats, write_prompts

Body = Callable[[SimServer, aiohttp.ClientSession], Awaitable[None]]
# Requests of a few hundred ms: slots stay busy long enough to see a queue.
SLOW = dict(step_ms_base=20.0, step_ms_per_req=0.0, tokens_per_step=4, mean_output_tokens=64.0, output_sigma=0.0)
# The held request runs about 2 s (100 steps): its queue is there while the test looks.
HOLD = {**SLOW, "mean_output_tokens": 400.0}


def with_sim(**overrides: Any) -> Callable[[Body], Callable[[], None]]:
    """Run an async test body against a fresh in-process sim on a free port."""

    def wrap(body: Body) -> Callable[[], None]:
        def test() -> None:
            async def main() -> None:
                sim = await start(SimConfig(**{"port": 0, **overrides}))
                try:
                    async with aiohttp.ClientSession(sim.url) as http:
                        await asyncio.wait_for(body(sim, http), timeout=20)
                finally:
                    await sim.close()

            asyncio.run(main())

        test.__name__ = body.__name__
        return test

    return wrap


def chat(content: str = "hello", stream: bool = True, max_tokens: int = 32) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": content}],
                            "max_tokens": max_tokens, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


async def discover(url: str):
    client = ServerClient(url)
    try:
        return await client.discover(), await client.metrics()
    finally:
        await client.close()


# ---------------------------------------------------------------- what each flavor serves


@with_sim(flavor="llamacpp", max_running_requests=8, context_length=2048)
async def test_llamacpp_flavor_endpoints_and_errors(sim: SimServer, http: aiohttp.ClientSession) -> None:
    async with http.get("/props") as resp:
        props = await resp.json()
    assert props["total_slots"] == 8 and props["default_generation_settings"]["n_ctx"] == 2048
    async with http.get("/slots") as resp:
        assert len(await resp.json()) == 8
    async with http.get("/get_server_info") as resp:
        assert resp.status == 404, "llama.cpp has no SGLang server info"
    async with http.post("/v1/chat/completions", json=chat("word " * 3000, stream=True)) as resp:
        assert resp.status == 400
        err = (await resp.json())["error"]
    assert err["type"] == "exceed_context_size_error" and err["code"] == 400 and err["n_ctx"] == 2048
    assert "exceeds the available context size (2048 tokens)" in err["message"]
    info, m = await discover(sim.url)
    assert (info.flavor, info.capacity, info.context_length, info.has_metrics) == ("llamacpp", 8, 2048, True)
    assert (m.running, m.waiting) == (0.0, 0.0)


@with_sim(flavor="vllm", served_model_name="m", max_running_requests=8, context_length=1024)
async def test_vllm_flavor_endpoints_and_errors(sim: SimServer, http: aiohttp.ClientSession) -> None:
    for path in ("/get_server_info", "/server_info", "/props", "/slots"):
        async with http.get(path) as resp:
            assert resp.status == 404, f"vLLM serves no {path}"
    async with http.post("/v1/chat/completions", json=chat("word " * 2000, stream=False)) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert "maximum context length is 1024 tokens" in body["error"]["message"], "vLLM nests its errors"
    info, m = await discover(sim.url)
    assert (info.flavor, info.capacity, info.has_metrics) == ("vllm", None, True)
    assert m.running == 0.0 and m.kv_usage is not None


def test_metrics_pages_of_llamacpp():
    page = """# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 8
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 56
llamacpp:tokens_predicted_total 12345
"""
    m = metrics_from_text(page)
    assert (m.running, m.waiting, m.kv_usage, m.retractions_total) == (8.0, 56.0, None, None)


# ---------------------------------------------------------------- queueing: no byte while deferred


async def _hold_then_second(sim: SimServer, http: aiohttp.ClientSession, headers_expected: bool = False
                            ) -> tuple[Progress, Progress, bool]:
    """With one slot: one request runs, others wait in the server's queue. Returns
    their progress and whether a waiting one had its response (headers) while waiting."""
    client = ServerClient(sim.url)
    try:
        first, second = Progress(), Progress()
        running = asyncio.ensure_future(client.generate("chat", chat("first", max_tokens=400), first))
        while len(sim.engine.running) < 1:
            await asyncio.sleep(0.01)
        # A raw request shows whether headers come while deferred.
        raw = asyncio.ensure_future(http.post("/v1/chat/completions", json=chat("raw", max_tokens=4)))
        waiting = asyncio.ensure_future(client.generate("chat", chat("second", max_tokens=8), second))
        while len(sim.engine.waiting) < 2:
            await asyncio.sleep(0.01)
        if headers_expected:
            await asyncio.wait([raw])  # the with_sim timeout bounds the wait
            assert len(sim.engine.waiting) == 2, "the headers came while both still waited"
        headers_while_waiting = raw.done()
        assert second.first_byte is None, "no response byte while the request waits for a slot"
        done = await running
        assert isinstance(done, Completion) and first.first_byte is not None
        assert isinstance(await waiting, Completion)
        assert second.first_byte is not None and second.first_byte >= first.first_byte
        (await raw).release()
        return first, second, headers_while_waiting
    finally:
        await client.close()


@with_sim(flavor="llamacpp", max_running_requests=1, **HOLD)
async def test_llamacpp_sends_nothing_while_a_request_is_deferred(sim: SimServer, http) -> None:
    _, _, headers_while_waiting = await _hold_then_second(sim, http)
    assert not headers_while_waiting, "llama-server answers only with the first result"


@with_sim(flavor="sglang", max_running_requests=1, **HOLD)
async def test_sglang_sends_nothing_while_a_request_is_queued(sim: SimServer, http) -> None:
    _, _, headers_while_waiting = await _hold_then_second(sim, http)
    assert not headers_while_waiting, "SGLang awaits a stream's first chunk before it answers"


@with_sim(flavor="vllm", served_model_name="m", max_running_requests=1, **HOLD)
async def test_vllm_sends_stream_headers_but_no_event_while_queued(sim: SimServer, http) -> None:
    _, _, headers_while_waiting = await _hold_then_second(sim, http, headers_expected=True)
    # first_byte is the first event, not the headers: still None while queued (checked inside).
    assert headers_while_waiting, "vLLM's StreamingResponse sends its headers at once"


# ---------------------------------------------------------------- connections


@with_sim(flavor="llamacpp", max_running_requests=4, stream_close_delay=2.0, **SLOW)
async def test_a_dead_reused_connection_costs_no_failure(sim: SimServer, http) -> None:
    """llama-server closes the connection after each stream while its header says
    Keep-Alive: the next request on it is lost before any response byte. The client
    sends it again on a fresh connection instead of returning a Failure."""
    client = ServerClient(sim.url, connections=1)  # one pooled connection: the next request reuses it
    try:
        outcomes = []
        for i in range(3):
            outcomes.append(await client.generate("chat", chat(f"again {i}", max_tokens=8), Progress()))
        assert all(isinstance(o, Completion) for o in outcomes), outcomes
        assert client.pool.reconnects >= 1, "the second request went out on the dead connection"
        # Failures on a fresh connection still count: nothing listens there.
        await client.close()
        client = ServerClient("http://127.0.0.1:9")
        outcome = await client.generate("chat", chat(), Progress())
        assert isinstance(outcome, Failure) and outcome.kind == "connection" and client.pool.reconnects == 0
    finally:
        await client.close()


@with_sim(flavor="llamacpp", max_running_requests=4, stream_close_delay=1.5, **SLOW)
async def test_a_health_check_after_streams_ends_reads_a_live_server_as_up(sim: SimServer, http) -> None:
    """llama-server closes each connection a moment after its stream, so every pooled
    connection may be one it is about to close. A health check sent on one is lost, and
    aiohttp's one retry takes the next pooled connection: one that another stream has
    just released, lost the same way. The worker then read a live server as down and
    counted a crash on every prompt in flight (three, and a valid prompt was dead-lettered
    as server_crash). Health checks go out on a connection of their own."""
    client = ServerClient(sim.url)
    try:
        # Two streams at once: two pooled connections. The short one ends first; the
        # long one ends while the health check waits on the short one's connection.
        short = asyncio.ensure_future(client.generate("chat", chat("short", max_tokens=8), Progress()))
        long = asyncio.ensure_future(client.generate("chat", chat("long", max_tokens=64), Progress()))
        assert isinstance(await short, Completion)
        assert not long.done(), "the long stream is still running when the health check goes out"
        assert await client.healthy(), "the server is up: its health check must say so"
        assert isinstance(await long, Completion)
    finally:
        await client.close()


@with_sim(flavor="sglang", health_delay=7.0)
async def test_a_busy_sglang_that_answers_its_health_check_late_is_up(sim: SimServer, http) -> None:
    """SGLang's /health answers once its scheduler says anything, up to 20 s later, and
    only then says 503. A client that stopped waiting at 5 s read a live server as down
    (and the worker cancelled every request in flight as a crash). The client waits for
    the server's verdict."""
    client = ServerClient(sim.url)
    try:
        assert await client.healthy(), "a late 200 is still a 200"
        await client.discover()  # the start-up check waits as long
    finally:
        await client.close()


@with_sim(flavor="llamacpp", max_running_requests=2, **SLOW)
async def test_stop_listening_leaves_open_requests_hanging(sim: SimServer, http) -> None:
    """llama-server on SIGTERM: the port closes, open requests get no answer and no close."""
    client = ServerClient(sim.url)
    try:
        pending = asyncio.ensure_future(client.generate("chat", chat(max_tokens=10_000), Progress()))
        while len(sim.engine.running) < 1:
            await asyncio.sleep(0.01)
        async with http.post("/sim/faults", json={"stop_listening": True}) as resp:
            assert (await resp.json())["listening"] is False
        probe = ServerClient(sim.url)
        try:
            assert not await probe.healthy(), "the listening socket is closed: refused"
        finally:
            await probe.close()
        done, _ = await asyncio.wait([pending], timeout=0.5)
        assert not done, "the open request hangs: no answer, no close"
        pending.cancel()
    finally:
        await client.close()


# ---------------------------------------------------------------- a real worker, default settings

LONG = 5


def enqueue_with_long(tmp_path: Path, redis_url: str, n: int, job: str) -> tuple[list[str], list[str], Path]:
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n)
    long_ids = [f"long{i}" for i in range(LONG)]
    with open(src, "a") as f:
        for pid in long_ids:
            f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": "word " * 1000}]}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--batch-size", "40", "--max-tokens", "64",
             "--output", str(out), redis_url=redis_url)
    return ids, long_ids, out


def dead_letters(redis_url: str) -> dict[str, dict]:
    letters = json.loads(run_genq("dlq", "list", "--json", redis_url=redis_url).stdout)
    return {letter["id"]: letter for letter in letters}


def check_run(server: str, out: Path, job: str, ids: list[str], long_ids: list[str], redis_url: str,
              message: str) -> list[dict]:
    rows = read_results(out, job)
    assert sorted(r["id"] for r in rows) == sorted(ids), "every prompt that fits completes exactly once"
    assert all(r["attempts"] == 1 for r in rows), [r for r in rows if r["attempts"] != 1][:3]
    generated = sim_stats(server)["generated_by_key"]
    assert len(generated) == len(ids) and set(generated.values()) == {1}, "each generated once"
    letters = dead_letters(redis_url)
    assert sorted(letters) == sorted(long_ids), "no dead letters but the too-long prompts"
    for letter in letters.values():
        assert letter["kind"] == "bad_request" and message in letter["message"], letter
    return rows


def test_worker_defaults_against_llamacpp(redis_url, sim, worker, tmp_path):
    server = sim(flavor="llamacpp", max_running_requests=8, context_length=512, step_ms_base=5,
                 step_ms_per_req=0, tokens_per_step=4, mean_output_tokens=48, output_sigma=0.5)
    ids, long_ids, out = enqueue_with_long(tmp_path, redis_url, 200, "lcpp")
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()[-3000:]
    check_run(server, out, "lcpp", ids, long_ids, redis_url, "exceeds the available context size")
    log = proc.log()
    assert "llamacpp" in log and "capacity 8)" in log, log[:2000]


def test_worker_defaults_against_vllm_learns_capacity(redis_url, sim, worker, tmp_path):
    server = sim(flavor="vllm", max_running_requests=8, context_length=512, step_ms_base=20,
                 step_ms_per_req=0, tokens_per_step=4, mean_output_tokens=48, output_sigma=0.3)
    ids, long_ids, out = enqueue_with_long(tmp_path, redis_url, 200, "vllm")
    proc = worker(server, "--burst")
    assert proc.wait(timeout=120) == 0, proc.log()[-3000:]
    check_run(server, out, "vllm", ids, long_ids, redis_url, "maximum context length is 512 tokens")
    log = proc.log()
    assert "learned server capacity 8" in log, log[-3000:]


def test_llamacpp_flavor_sigterm_stops_listening_and_exits_when_no_request_is_open(sim):
    """The CLI copies llama-server's SIGTERM: port closed, open request left hanging;
    the process exits once its client gives up."""
    import signal

    server = sim(flavor="llamacpp", max_running_requests=2, **{k: v for k, v in SLOW.items()
                                                               if k != "mean_output_tokens"},
                 mean_output_tokens=100_000)
    proc = sim.procs[server]

    async def scenario() -> None:
        client = ServerClient(server)
        try:
            pending = asyncio.ensure_future(client.generate("chat", chat(max_tokens=50_000), Progress()))
            while sim_stats(server)["num_running"] < 1:
                await asyncio.sleep(0.02)
            proc.signal(signal.SIGTERM)
            probe = ServerClient(server)
            try:
                while await probe.healthy():  # until the listening socket is gone
                    await asyncio.sleep(0.02)
            finally:
                await probe.close()
            assert proc.alive() and not pending.done(), "the open request hangs, the process waits for it"
            pending.cancel()  # the client gives up
        finally:
            await client.close()

    asyncio.run(scenario())
    assert proc.wait(timeout=20) == 0


@with_sim(flavor="vllm", served_model_name="m", max_running_requests=8, context_length=1024,
          mean_output_tokens=100_000.0, output_sigma=0.0)
async def test_vllm_flavor_answers_the_context_as_vllm_0_32(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM 0.32 (renderers/params.py, entrypoints/serve/utils/api_utils.py get_max_tokens): a prompt
    over the context and max_tokens over the context are 400s with its wording; a prompt that fits
    with max_tokens that fits alone is no error: max_tokens is cut to what the context leaves."""
    async with http.post("/v1/chat/completions", json=chat("word " * 2000, stream=False)) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["message"] == (
        "This model's maximum context length is 1024 tokens. However, your prompt contains at least 1025 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        "of the input prompt. (parameter=input_tokens, value=1025)"), body
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == \
        ("BadRequestError", "input_tokens", 400)
    async with http.post("/v1/chat/completions", json=chat("hello", stream=False, max_tokens=5000)) as resp:
        assert resp.status == 400
        body = await resp.json()
    assert body["error"]["message"] == ("max_tokens=5000 cannot be greater than max_model_len=1024. "
                                        "Please request fewer output tokens. (parameter=max_tokens, value=5000)"), body
    assert body["error"]["param"] == "max_tokens"
    async with http.post("/v1/chat/completions", json=chat("word " * 600, stream=False, max_tokens=1000)) as resp:
        assert resp.status == 200, await resp.text()
        body = await resp.json()
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == 1024 - usage["prompt_tokens"], usage


@with_sim(flavor="vllm", served_model_name="served")
async def test_vllm_flavor_refuses_a_model_it_does_not_serve(sim: SimServer, http: aiohttp.ClientSession) -> None:
    """vLLM checks the model name before anything else: 404 NotFoundError, nested, streamed or not."""
    for stream in (False, True):
        async with http.post("/v1/chat/completions", json={**chat("hi", stream), "model": "other"}) as resp:
            refused = {"message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model",
                       "code": 404}
            assert (resp.status, await resp.json()) == (404, {"error": refused})
    for model in ("served", None):
        async with http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": model}) as resp:
            assert resp.status == 200
