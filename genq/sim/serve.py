"""The simulator's HTTP face: SGLang's, vLLM's or llama.cpp's endpoints, status codes, metrics and connection
habits (SimConfig.flavor; the sources in docs/engines.md), and its fault switches. A client hanging up on a
whole answer cancels its handler (handler_cancellation), which frees the slot, as SGLang aborts such requests."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import signal
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import msgspec
from aiohttp import web

from genq.sim import protocol
from genq.sim.config import SimConfig
from genq.sim.engine import Engine, new_stats
from genq.sim.lengths import choice_key, output_length, prompt_key
from genq.sim.protocol import Choice, Refusal, StreamOptions, sse

FLAVORS = ("sglang", "vllm", "llamacpp")
VERSION = "0.0.0-genq-sim"
# Each rate switch and its fault, in the order a draw tries them. stream_error: some output, then the
# engine's SSE error event (a whole answer: a 500), as SGLang and vLLM report an internal error.
FAULTS = {"error_rate": "error", "reset_rate": "reset", "hang_rate": "hang", "stream_error_rate": "stream_error"}
STREAM_ERROR = "Internal server error (simulated, mid-stream)"
# cpp-httplib's header, which llama-server sends even on the streams after which it closes the connection.
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}
_Rate = Annotated[float, msgspec.Meta(ge=0, le=1)]


class FaultUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of POST /sim/faults; fields left out keep their value. outage_for: an outage starting now
    (0 ends one); stop_listening: what llama-server does on SIGTERM, for good."""

    error_rate: _Rate | None = None
    reset_rate: _Rate | None = None
    hang_rate: _Rate | None = None
    stream_error_rate: _Rate | None = None
    outage_for: Annotated[float, msgspec.Meta(ge=0)] | None = None
    stop_listening: bool | None = None


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type="application/json")


def drop_connection(request: web.Request) -> web.Response:
    """Reset the connection as a crashed server would (linger 0: an RST, no FIN); the Response is never sent."""
    if request.transport is not None:
        sock = request.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        request.transport.abort()
    return web.Response(status=500)


async def until(event: asyncio.Event, done: Callable[[], bool]) -> None:
    """Wait until done(), looked at again whenever the engine sets the request's event."""
    while not done():
        event.clear()
        await event.wait()


class SimServer:
    """One engine, the fault switches and the clock behind the handlers."""

    def __init__(self, config: SimConfig) -> None:
        if config.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(FLAVORS)}, got {config.flavor!r}")
        self.config, self.flavor = config, config.flavor
        self.engine = Engine(config)
        self.rates = {name: float(getattr(config, name)) for name in FAULTS}
        self._attempts: dict[str, int] = {}  # prompt key -> requests drawn for it
        self._outage_until = 0.0
        self.started_at = time.monotonic()
        self.listening = True
        self.open_requests = 0  # generation requests being handled
        # vLLM and llama.cpp answer tools with calls (genq sim plays no parser switch for them).
        self._tool_calls = config.flavor != "sglang" or config.tool_call_parser is not None
        self._text = (protocol.WORDS * (4 * config.context_length // len(protocol.WORDS) + 1))[: 4 * config.context_length]
        # SGLang takes large prompts; aiohttp's 1 MiB default body limit would not.
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self.gate])
        app.cleanup_ctx.append(self.lifetime)
        self._info = info_endpoints(config, self.engine)
        app.add_routes([web.get(path, self.info) for path in self._info])
        app.add_routes([web.get("/health", self.health), web.get("/metrics", self.metrics),
                        web.post("/v1/chat/completions", self.generate), web.post("/v1/completions", self.generate),
                        web.post("/sim/reset", self.reset), web.get("/sim/faults", self.faults),
                        web.post("/sim/faults", self.faults)])
        if config.flavor == "sglang":
            app.router.add_get("/health_generate", self.health)
        # No access log: it would cost more than the instant mode itself.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        self.site: web.BaseSite | None = None  # start() sets both
        self.url = ""

    async def close(self) -> None:
        await self.runner.cleanup()

    async def lifetime(self, app: web.Application) -> AsyncIterator[None]:
        self.started_at = time.monotonic()
        self.engine.start()
        if self.config.outage_at is not None:  # a timer left over at close is harmless
            asyncio.get_running_loop().call_later(self.config.outage_at, self.start_outage, self.config.outage_for)
        yield
        self.engine.stop()

    def start_outage(self, duration: float) -> None:
        """Down for `duration` seconds: every request in flight dropped, the next ones reset."""
        self._outage_until = time.monotonic() + duration
        if duration > 0:
            for choice in [*self.engine.running, *self.engine.waiting]:
                self.engine.abort(choice, dropped=True)

    def in_outage(self) -> bool:
        return self._outage_until > time.monotonic()

    def draw(self, key: str) -> tuple[str | None, float]:
        """The fault of the next request for this prompt, and where in its output (a fraction) it strikes:
        the n-th request for a key draws the same whatever else arrives, its retry (n+1) afresh."""
        if not any(self.rates.values()):
            return None, 0.0
        attempt = self._attempts[key] = self._attempts.get(key, -1) + 1
        rng = random.Random(f"{key}:{self.config.seed}:{attempt}")
        u, where, bound = rng.random(), rng.random(), 0.0
        for name, fault in FAULTS.items():
            bound += self.rates[name]
            if u < bound:
                return fault, where
        return None, where

    async def stop_listening(self) -> None:
        """llama-server on SIGTERM: the listening socket closes, requests in progress hang (no output, no
        answer, no close), a request on a kept-alive connection loses it; nothing moves again."""
        self.listening = False
        if self.site is not None:
            await self.site.stop()
        self.engine.stop()

    def error(self, status: int, message: str, err_type: str | None = None, **extra: Any) -> web.Response:
        return json_response(protocol.error_body(self.flavor, status, message, err_type, **extra), status)

    @web.middleware
    async def gate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not self.listening:  # stopped: the connection just closes
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)  # never sent
        return await handler(request)

    async def health(self, request: web.Request) -> web.Response:
        # SGLang's /health runs a one-token generation (about 1 s on 0.5.23 on CPU): one engine step here.
        await asyncio.sleep(self.config.health_delay + (self.config.step_ms_base / 1000 if self.flavor == "sglang" else 0))
        ok = time.monotonic() - self.started_at >= self.config.startup_delay and not self.in_outage()
        if self.flavor == "llamacpp":
            return json_response({"status": "ok"}) if ok else self.error(503, "Loading model", "unavailable_error")
        return web.Response(status=200 if ok else 503)

    async def info(self, request: web.Request) -> web.Response:
        return json_response(self._info[request.path]())

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=metrics_page(self.config, self.engine), content_type="text/plain", charset="utf-8")

    async def reset(self, request: web.Request) -> web.Response:
        self.engine.stats = new_stats()
        return json_response({"reset": True})

    async def faults(self, request: web.Request) -> web.Response:
        """GET: the switches; POST: change them (FaultUpdate, all or none)."""
        if request.method == "POST":
            try:
                update = msgspec.json.decode(await request.read(), type=FaultUpdate)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return self.error(400, str(exc))
            self.rates.update({name: value for name in FAULTS if (value := getattr(update, name)) is not None})
            if update.outage_for is not None:
                self.start_outage(update.outage_for)
            if update.stop_listening:
                await self.stop_listening()
        remaining = max(self._outage_until - time.monotonic(), 0.0)
        return json_response({**self.rates, "outage": remaining > 0, "outage_remaining_s": remaining,
                              "listening": self.listening})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.open_requests += 1
        try:
            return await self._answer(request, chat=request.path.endswith("/chat/completions"))
        except Refusal as refusal:
            return self.error(refusal.status, str(refusal), refusal.err_type, **refusal.extra)
        finally:
            self.open_requests -= 1

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        cfg, flavor = self.config, self.flavor
        if self.in_outage():
            return drop_connection(request)
        if time.monotonic() - self.started_at < self.config.startup_delay:
            raise Refusal("The server is not ready yet.", 503, "ServiceUnavailableError")
        raw = await request.read()
        self.engine.stats["generation_requests"] += 1
        try:
            body = msgspec.json.decode(raw, type=protocol.Request)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise Refusal(str(exc)) from None
        source, n_prompt, max_new, logprobs = body.check(chat, flavor, cfg.context_length, cfg.args_given)
        key = prompt_key(source)
        fault, where = self.draw(key)
        if fault == "error":
            raise Refusal("Internal server error (simulated)", 500, "InternalServerError")
        sglang, thinking = flavor == "sglang", chat and bool((body.chat_template_kwargs or {}).get("enable_thinking"))
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all start with chatcmpl-.
        rid = (body.rid if sglang else None) or f"{'chatcmpl' if chat or flavor == 'llamacpp' else 'cmpl'}-{uuid.uuid4().hex}"
        # Each sample its own deterministic length; one past the context's room: an answer cut there is "length".
        lengths = [output_length(choice_key(key, i), cfg.seed, cfg.mean_output_tokens, cfg.output_sigma,
                                 cfg.context_length - n_prompt + 1) for i in range(body.n)]
        event = asyncio.Event()
        choices = [Choice(
            key, n_prompt, natural, max_new, body.stream, event=event, index=i, chat=chat, rid=rid, sglang=sglang,
            text=self._text[6 * i:] + self._text[:6 * i], model=body.model or cfg.model_name, top_logprobs=logprobs,
            think=max(1, math.ceil(natural * cfg.thinking_fraction)) if thinking else 0,
            separate=not chat or body.separate_reasoning, tool=body.tool_called() if chat and self._tool_calls else None,
            chunk_id=rid if i == 0 or not sglang else uuid.uuid4().hex,  # SGLang's n > 1: a sub-request id each
        ) for i, natural in enumerate(lengths)]
        first = choices[0]  # faults strike the first
        # At a token count inside the output (a hang at 0: before the first token); a stream error after one.
        first.hang_at = int(where * first.target) if fault == "hang" else None
        first.drop_at = {"reset": int(where * first.target),
                         "stream_error": 1 + int(where * (first.target - 1))}.get(fault or "")
        for i, choice in enumerate(choices):
            if not self.engine.submit(choice):
                for submitted in choices[:i]:
                    self.engine.abort(submitted)
                raise Refusal("The request queue is full.", 503, "ServiceUnavailableError")
        if cfg.crash_marker and cfg.crash_marker.encode() in raw:
            self.start_outage(cfg.outage_for)  # a prompt that crashes its server, with everything in flight
        try:
            if body.stream:
                return await self._stream(request, choices, body.stream_options or StreamOptions(),
                                          fault == "stream_error")
            await until(event, lambda: all(choice.finish_reason for choice in choices))
            if first.dropped and fault == "stream_error":
                raise Refusal(STREAM_ERROR, 500, "InternalServerError")
            if any(choice.dropped for choice in choices):
                return drop_connection(request)
            return json_response(protocol.full_answer(choices))
        finally:
            for choice in choices:  # a no-op once finished; frees the slots of a client that went away
                self.engine.abort(choice)

    async def _stream(self, request: web.Request, choices: list[Choice], options: StreamOptions,
                      failing: bool) -> web.StreamResponse:
        """Choices stream interleaved, each chunk one choice with its index. vLLM and llama.cpp send a chunk
        a step and end each choice as it finishes; SGLang sends a chunk a token and every chat finish chunk
        after the last output (serving_chat.py, _generate_chat_stream)."""
        flavor, first, event, continuous = self.flavor, choices[0], choices[0].event, options.continuous_usage_stats
        sglang = flavor == "sglang"
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        resp = web.StreamResponse(headers={**headers, **_LLAMACPP_KEEP_ALIVE} if flavor == "llamacpp" else headers)
        if flavor != "vllm":
            # llama-server answers (headers included) only with the first result, and SGLang's
            # _handle_streaming_request awaits the first chunk: a queued request gets no byte at all.
            # vLLM's StreamingResponse sends its headers at once, its first event with the first output.
            await until(event, lambda: any(c.generated or c.finish_reason for c in choices))
            if first.dropped and not failing:
                drop_connection(request)
                return resp
        await resp.prepare(request)
        sent, done, last_id = [0] * len(choices), [False] * len(choices), first.chunk_id
        while True:
            await until(event, lambda: any(not d and (c.generated > s or c.finish_reason)
                                           for c, s, d in zip(choices, sent, done, strict=True)))
            for i, c in enumerate(choices):
                a, b = sent[i], c.generated
                if done[i] or (b <= a and c.finish_reason is None):
                    continue
                out = []
                if a == 0 and c.chat:  # chat streams open with the role, completions with text
                    out.append(c.chunk({"role": "assistant", "content": ""}, None, 0 if continuous and not sglang else None))
                for x, y in [(t, t + 1) for t in range(a, b)] if sglang else [(a, b)] * (b > a):
                    # SGLang's chat stream sends nothing for the end-of-sequence token (no text, no
                    # logprob), though its usage counts it and its whole answer lists its logprob.
                    if sglang and c.chat and c.finish_reason == "stop" and y == c.target:
                        continue
                    # SGLang's completions stream ends a choice on its last token's chunk, with the finish.
                    last = sglang and not c.chat and y == c.target and c.finish_reason is not None
                    reasoning, content = c.pieces(x, y)
                    deltas = [{"text": content}] if not c.chat else [
                        {key: value} for key, value in (("reasoning_content", reasoning), ("content", content)) if value]
                    out += [c.chunk(delta, c.finish_reason if last and d == len(deltas) else None,
                                    y if continuous else None, c.logprobs(x, y) if d == len(deltas) else None)
                            for d, delta in enumerate(deltas, 1)]
                sent[i] = b
                if out:
                    last_id = c.chunk_id
                if c.finish_reason is not None:
                    done[i] = True
                    if not (sglang or c.dropped):
                        out.append(c.finish_chunks(continuous))
                await resp.write(b"".join(out))
            if all(done) or first.dropped:
                break
        if first.dropped and failing:
            await resp.write(protocol.stream_error(flavor, STREAM_ERROR))
        elif any(c.dropped for c in choices):
            drop_connection(request)
            return resp
        else:
            # SGLang's finish chunks, and its usage chunk, all carry the id of the last chunk sent.
            tail = [c.finish_chunks(continuous, last_id) for c in choices if sglang and c.chat]
            if options.include_usage:
                tail.append(sse({**first.head(last_id, []), "usage": first.usage(sum(sent))}))
            await resp.write(b"".join(tail) + b"data: [DONE]\n\n")
        await resp.write_eof()
        if flavor == "llamacpp" and request.transport is not None:
            # llama-server closes the connection after a stream, whatever its Keep-Alive header
            # said: stop reading it now, close it a moment later.
            request.transport.pause_reading()
            asyncio.get_running_loop().call_later(self.config.stream_close_delay, request.transport.close)
        return resp


def metrics_page(cfg: SimConfig, eng: Engine) -> str:
    """/metrics in the engine's names: llama.cpp's server_task_result_metrics (tools/server/server-task.cpp: no
    labels, integer values); vLLM 0.32's PrometheusStatLogger (vllm/v1/metrics/loggers.py: counters get _total on
    the wire; the scheduler's counts as its last step left them, none deferred); SGLang's metrics/collector.py
    (0.5.23 has the retracted gauge; the sim never retracts)."""
    flavor, usage = cfg.flavor, eng.used_tokens / cfg.max_total_num_tokens
    label = cfg.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    prompt = ("counter", "prompt_tokens_total", "Number of prefill tokens processed.", eng.prompt_tokens_total)
    generated = ("counter", "generation_tokens_total", "Number of generation tokens processed.",
                 eng.generation_tokens_total)
    tables: dict[str, list[tuple[str, str, str, Any]]] = {
        "llamacpp": [
            ("counter", "prompt_tokens_total", "Number of prompt tokens processed", eng.prompt_tokens_total),
            ("counter", "tokens_predicted_total", "Number of generation tokens processed", eng.generation_tokens_total),
            ("gauge", "requests_processing", "Number of requests processing", len(eng.running)),
            ("gauge", "requests_deferred", "Number of requests deferred", len(eng.waiting))],
        "vllm": [
            ("gauge", "num_requests_running", "Number of requests in model execution batches.", eng.stepped_running),
            ("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", eng.stepped_waiting),
            ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("counter", "num_preemptions_total", "Cumulative number of preemption from the engine.", 0),
            prompt, generated],
        "sglang": [
            ("gauge", "num_running_reqs", "The number of running requests.", len(eng.running)),
            ("gauge", "num_queue_reqs", "The number of requests in the waiting queue.", len(eng.waiting)),
            ("gauge", "num_used_tokens", "The number of used tokens.", eng.used_tokens),
            ("gauge", "token_usage", "The token usage.", usage),
            ("gauge", "gen_throughput", "The generation throughput (token/s).", eng.last_gen_throughput),
            ("gauge", "num_retracted_reqs", "The number of retracted requests.", 0),
            prompt, generated,
            ("counter", "num_requests_total", "Number of requests processed.", eng.num_requests_total),
            ("counter", "num_aborted_requests_total", "Number of requests aborted.", eng.num_aborted_total)]}
    labels = {"llamacpp": "", "vllm": f'engine="0",model_name="{label}"', "sglang": f'model_name="{label}"'}[flavor]
    page = "".join(f"# HELP {flavor}:{name} {text}\n# TYPE {flavor}:{name} {kind}\n{flavor}:{name}"
                   + (f" {value}\n" if flavor == "llamacpp" else f"{{{labels}}} {float(value)}\n")
                   for kind, name, text, value in tables[flavor])
    if flavor == "vllm":
        name = "vllm:num_requests_waiting_by_reason"
        page += (f"# HELP {name} Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
                 "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV transfer, "
                 f"blocked status). Sum of all reasons equals vllm:num_requests_waiting.\n# TYPE {name} gauge\n"
                 f'{name}{{{labels},reason="capacity"}} {float(eng.stepped_waiting)}\n'
                 f'{name}{{{labels},reason="deferred"}} 0.0\n')
    return page


def info_endpoints(cfg: SimConfig, engine: Engine) -> dict[str, Callable[[], Any]]:
    """GET path -> its JSON answer, for the flavor."""
    card = {"id": cfg.model_path if cfg.flavor == "llamacpp" else cfg.model_name,  # llama.cpp: the file (--alias)
            "object": "model", "owned_by": cfg.flavor, "root": cfg.model_path, "max_model_len": cfg.context_length}
    answers: dict[str, Callable[[], Any]] = {
        "/v1/models": lambda: {"object": "list", "data": [{**card, "created": int(time.time())}]},
        "/sim/stats": engine.stats_snapshot}
    if cfg.flavor == "sglang":
        # memory_usage as SGLang's scheduler reports it (GB: bytes / 2^30); context_length and max_running_requests
        # as given on its command line (null unless given).
        tokens, given = cfg.max_total_num_tokens, cfg.args_given
        memory = {"weight": cfg.weight_gb, "kvcache": round(tokens * cfg.kv_bytes_per_token / 2**30, 3),
                  "token_capacity": tokens, "graph": 1.2}
        info = {"model_path": cfg.model_path, "served_model_name": cfg.model_name, "host": cfg.host, "port": cfg.port,
                "context_length": cfg.context_length if given else None,
                "max_running_requests": cfg.max_running_requests if given else None,
                "max_queued_requests": cfg.max_queued_requests, "max_total_num_tokens": tokens,
                "max_req_input_len": min(cfg.context_length, tokens) - 1, "version": VERSION}
        model = {"model_path": cfg.model_path, "tokenizer_path": cfg.model_path, "is_generation": True}
        for prefix in ("/", "/get_"):
            answers[f"{prefix}model_info"] = lambda: model
            answers[f"{prefix}server_info"] = lambda: {**info, "internal_states": [{
                "last_gen_throughput": engine.last_gen_throughput, "memory_usage": memory,
                "effective_max_running_requests_per_dp": cfg.max_running_requests}]}
    elif cfg.flavor == "llamacpp":
        # get_res_props() in tools/server/server-context.cpp (the fields a client reads); /slots (with --slots):
        # one entry a slot, the first `running` busy.
        props = {"default_generation_settings": {"n_ctx": cfg.context_length, "params": {"n_predict": -1}},
                 "total_slots": cfg.max_running_requests, "model_alias": cfg.model_name, "model_path": cfg.model_path,
                 "modalities": {"vision": False, "audio": False}, "build_info": VERSION}
        answers |= {"/props": lambda: props, "/slots": lambda: [
            {"id": i, "n_ctx": cfg.context_length, "speculative": False, "is_processing": i < len(engine.running)}
            for i in range(cfg.max_running_requests)]}
    return answers


async def start(config: SimConfig) -> SimServer:
    """Serve a SimServer on config.host:config.port (0: any free port); its url says where."""
    sim = SimServer(config)
    await sim.runner.setup()
    sim.site = web.TCPSite(sim.runner, config.host, config.port)
    await sim.site.start()
    host, port = sim.runner.addresses[0][:2]
    sim.url = f"http://{host}:{port}"
    return sim


def run(config: SimConfig, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; on_ready gets the base URL once listening. The llamacpp flavor answers
    its first SIGTERM as llama-server does: it stops listening and leaves open requests hanging; it exits
    once none is open (their clients gave up) or on a second signal."""

    async def serve() -> None:
        stop, loop = asyncio.Event(), asyncio.get_running_loop()
        sim = await start(config)

        def on_signal() -> None:
            if config.flavor == "llamacpp" and sim.listening:
                loop.create_task(sim.stop_listening())
            else:
                stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            on_ready(sim.url)
            while not stop.is_set() and (sim.listening or sim.open_requests):
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=0.2)
        finally:
            await sim.close()

    asyncio.run(serve())
