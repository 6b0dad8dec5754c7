"""The simulator's HTTP face: SGLang's, vLLM's or llama.cpp's endpoints, status codes and connection
habits (SimConfig.flavor; their differences are in flavors.py, the sources in docs/engines.md), and
its fault switches. aiohttp runs with handler_cancellation=True: a client hanging up on a whole
answer cancels its handler, which frees the slot, as SGLang aborts such requests.

Faults are drawn per request, deterministic for a seed: the n-th request for a prompt key always
draws the same one, whatever else arrives, and its retry (n+1) draws afresh.
"""

from __future__ import annotations

import asyncio
import math
import random
import signal
import socket
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.engine import Engine, QueueFull, SimRequest
from genq.sim.flavors import bad_request, error_response, json_response, sse
from genq.sim.lengths import choice_key, output_length, prompt_key
from genq.sim.protocol import WORDS, ChatRequest, CompletionRequest, Reply, StreamOptions, full_answer, validate

# Each rate switch and its fault, in the order a draw tries them. stream_error: some output, then the
# engine's SSE error event (a whole answer: a 500), as SGLang and vLLM report an internal error.
FAULTS = {"error_rate": "error", "reset_rate": "reset", "hang_rate": "hang", "stream_error_rate": "stream_error"}
STREAM_ERROR = "Internal server error (simulated, mid-stream)"
# cpp-httplib's header, which llama-server sends even on the streams after which it closes the connection.
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


class FaultUpdate(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Body of POST /sim/faults; fields left out keep their value. outage_for: an outage starting now
    (0 ends one); stop_listening: what llama-server does on SIGTERM, for good."""

    error_rate: float | None = None
    reset_rate: float | None = None
    hang_rate: float | None = None
    stream_error_rate: float | None = None
    outage_for: float | None = None
    stop_listening: bool | None = None


_fault_decoder = msgspec.json.Decoder(FaultUpdate)


def drop_connection(request: web.Request) -> web.Response:
    """Reset the connection as a crashed server would (linger 0: an RST, no FIN); the Response is never sent."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return web.Response(status=500)


class SimServer:
    """One engine, the fault switches and the clock behind the handlers."""

    def __init__(self, config: SimConfig) -> None:
        if config.flavor not in flavors.FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(flavors.FLAVORS)}, got {config.flavor!r}")
        self.config = config
        self.flavor = config.flavor
        self.engine = Engine(config)
        self.rates = {name: float(getattr(config, name)) for name in FAULTS}
        self._attempts: dict[str, int] = {}  # prompt key -> requests drawn for it
        self._outage_until = 0.0
        self._outage_task: asyncio.Task[None] | None = None
        self.started_at = time.monotonic()
        self.sites: list[web.BaseSite] = []  # set by start(): what stop_listening closes
        self.listening = True
        self.open_requests = 0  # generation requests being handled
        # vLLM and llama.cpp answer tools with calls (genq sim plays no parser switch for them).
        self._tool_calls = config.flavor != "sglang" or config.tool_call_parser is not None
        self._text = (WORDS * (4 * config.context_length // len(WORDS) + 1))[: 4 * config.context_length]

    # ---- lifecycle and faults ----------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.started_at = time.monotonic()
        self.engine.start()
        if self.config.outage_at is not None:
            self._outage_task = asyncio.get_running_loop().create_task(self._scheduled_outage())

    async def on_cleanup(self, app: web.Application) -> None:
        if self._outage_task is not None:
            self._outage_task.cancel()
        await self.engine.stop()

    async def _scheduled_outage(self) -> None:
        await asyncio.sleep(self.config.outage_at or 0.0)
        self.start_outage(self.config.outage_for)

    def start_outage(self, duration: float) -> None:
        """Down for `duration` seconds: every request in flight dropped, the next ones reset."""
        self._outage_until = time.monotonic() + duration
        if duration > 0:
            self.engine.drop_all()

    def in_outage(self) -> bool:
        return self._outage_until > time.monotonic()

    def draw(self, key: str) -> tuple[str | None, float]:
        """The fault of the next request for this prompt, and where in its output (a fraction) it strikes."""
        if not any(self.rates.values()):
            return None, 0.0
        attempt = self._attempts.get(key, 0)
        self._attempts[key] = attempt + 1
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
        for site in self.sites:
            await site.stop()
        await self.engine.stop()

    def ready(self) -> bool:
        return time.monotonic() - self.started_at >= self.config.startup_delay

    @web.middleware
    async def gate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not self.listening:  # stopped: the connection just closes
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)  # never sent
        return await handler(request)

    # ---- endpoints ---------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.config.health_delay:
            await asyncio.sleep(self.config.health_delay)
        if self.flavor == "sglang":
            # SGLang's /health runs a one-token generation (about 1 s on 0.5.23 on CPU): one engine step here.
            await asyncio.sleep(self.config.step_ms_base / 1000)
        ok = self.ready() and not self.in_outage()
        if self.flavor == "llamacpp":
            return json_response({"status": "ok"}) if ok else error_response(self.flavor, 503, "Loading model",
                                                                             "unavailable_error")
        return web.Response(status=200 if ok else 503)

    async def sim_faults(self, request: web.Request) -> web.Response:
        """GET: the switches; POST: change them (FaultUpdate, all or none)."""
        if request.method == "POST":
            try:
                update = _fault_decoder.decode(await request.read())
                rates = {name: value for name in FAULTS if (value := getattr(update, name)) is not None}
                for name, value in rates.items():
                    if not 0.0 <= value <= 1.0:
                        raise ValueError(f"{name} must be in [0, 1], got {value}")
                if update.outage_for is not None and update.outage_for < 0:
                    raise ValueError(f"outage_for must be >= 0, got {update.outage_for}")
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                return bad_request(self.flavor, str(exc))
            self.rates.update(rates)
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
        finally:
            self.open_requests -= 1

    # ---- generation --------------------------------------------------------

    async def _answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.in_outage():
            return drop_connection(request)
        if not self.ready():
            return error_response(self.flavor, 503, "The server is not ready yet.", "ServiceUnavailableError")
        raw = await request.read()
        self.engine.stats.requests += 1
        parsed = self._parse(raw, chat)
        if isinstance(parsed, web.Response):
            return parsed
        body, key, n_prompt, max_new = parsed
        cfg = self.config
        fault, where = self.draw(key)
        if fault == "error":
            return error_response(self.flavor, 500, "Internal server error (simulated)", "InternalServerError")
        # One past the context's room: an answer cut by the context's end is "length", not a natural "stop".
        room = cfg.context_length - n_prompt + 1
        # One sequence per sample, each its own deterministic length, as SGLang and vLLM schedule each
        # of the n choices as a request of its own. Faults strike the first.
        naturals = [output_length(choice_key(key, i), cfg.seed, cfg.mean_output_tokens, cfg.output_sigma, room)
                    for i in range(body.n)]
        reqs = [SimRequest(key, n_prompt, natural, max_new, body.stream) for natural in naturals]
        req = reqs[0]
        if fault == "hang":  # at a token count inside the output; where == 0: before the first token
            req.hang_at = int(where * req.target)
        elif fault == "reset":
            req.drop_at = int(where * req.target)
        elif fault == "stream_error":  # after at least one token: "mid-stream"
            req.drop_at = 1 + int(where * (req.target - 1))
        failing = fault == "stream_error"
        submitted: list[SimRequest] = []
        try:
            for each in reqs:
                self.engine.submit(each)
                submitted.append(each)
        except QueueFull:
            for each in submitted:
                self.engine.abort(each)
            return error_response(self.flavor, 503, "The request queue is full.", "ServiceUnavailableError")
        if cfg.crash_marker and cfg.crash_marker.encode() in raw:
            self.start_outage(cfg.outage_for)  # a prompt that crashes its server, with everything in flight

        sglang = self.flavor == "sglang"
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all start with chatcmpl-.
        prefix = "chatcmpl" if chat or self.flavor == "llamacpp" else "cmpl"
        rid = (body.rid if sglang else None) or f"{prefix}-{uuid.uuid4().hex}"
        chat_body = body if isinstance(body, ChatRequest) else None
        replies = [Reply(
            text=self._text[6 * i:] + self._text[:6 * i], chat=chat, rid=rid, model=body.model or cfg.model_name,
            prompt_tokens=n_prompt,
            think=max(1, math.ceil(natural * cfg.thinking_fraction)) if chat_body and chat_body.thinking() else 0,
            separate=chat_body is None or chat_body.separate_reasoning, index=i, top_logprobs=body.logprobs_asked(),
            tool=chat_body.tool_called() if chat_body and self._tool_calls else None, sglang=sglang,
            # SGLang runs each of n > 1 samples as a sub-request with an id of its own.
            chunk_id=rid if i == 0 or not sglang else uuid.uuid4().hex,
        ) for i, natural in enumerate(naturals)]
        try:
            if body.stream:
                return await self._stream(request, reqs, replies, body.stream_options or StreamOptions(), failing)
            for each in reqs:
                while each.finish_reason is None:
                    await self.engine.wait(each, each.generated)
            if req.dropped and failing:
                return error_response(self.flavor, 500, STREAM_ERROR, "InternalServerError")
            if any(each.dropped for each in reqs):
                return drop_connection(request)
            return json_response(full_answer(replies, reqs))
        finally:
            # A no-op once finished; frees the slots of a client that went away.
            for each in reqs:
                self.engine.abort(each)

    def _parse(self, raw: bytes, chat: bool) -> tuple[ChatRequest | CompletionRequest, str, int, int] | web.Response:
        """(body, prompt key, prompt tokens, tokens it may generate), checked as the engine does, or its 400."""
        body: ChatRequest | CompletionRequest
        try:
            body = _chat_decoder.decode(raw) if chat else _completion_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return bad_request(self.flavor, str(exc))
        prompt = body.counted_prompt()
        if isinstance(prompt, str):
            return bad_request(self.flavor, prompt)
        source, n_prompt = prompt
        max_new = body.max_new_tokens()
        problem = validate(body, max_new, self.flavor)
        if problem:
            return bad_request(self.flavor, problem)
        limit = flavors.context_check(self.flavor, n_prompt, max_new, self.config.context_length,
                                      self.config.args_given)
        return limit if isinstance(limit, web.Response) else (body, prompt_key(source), n_prompt, limit)

    async def _stream(self, request: web.Request, reqs: list[SimRequest], replies: list[Reply],
                      options: StreamOptions, failing: bool) -> web.StreamResponse:
        continuous = options.continuous_usage_stats
        flavor, req = self.flavor, reqs[0]
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        resp = web.StreamResponse(headers={**headers, **_LLAMACPP_KEEP_ALIVE} if flavor == "llamacpp" else headers)
        if flavor in ("llamacpp", "sglang"):
            # llama-server answers (headers included) only with the first result, and
            # SGLang's _handle_streaming_request awaits the stream's first chunk before
            # it returns the response: a queued request gets no byte at all until it runs.
            await self._any_progress([(each, 0) for each in reqs])
            if req.dropped and not failing:
                drop_connection(request)
                return resp
        # vLLM returns Starlette's StreamingResponse at once: headers at once, the
        # first event (the role) only with the first output, nothing while queued.
        await resp.prepare(request)
        # Choices stream interleaved, each chunk one choice with its index. vLLM ends each
        # choice with its finish_reason as it finishes; SGLang sends a chunk per token (the
        # others one per step) and every finish chunk after the last output (serving_chat.py,
        # _generate_chat_stream).
        sglang = flavor == "sglang"
        sent = [0] * len(reqs)
        finished = [False] * len(reqs)
        last_id = replies[0].chunk_id
        finished_early = [False] * len(reqs)  # its finish went with its last token (SGLang's completions)
        while True:
            await self._any_progress([(each, sent[i]) for i, each in enumerate(reqs) if not finished[i]])
            for i, (each, reply) in enumerate(zip(reqs, replies, strict=True)):
                done = each.generated
                if finished[i] or (done <= sent[i] and each.finish_reason is None):
                    continue
                if sent[i] == 0 and reply.chat:
                    # Chat streams open with the role; completion streams start with text.
                    await resp.write(sse(reply.chunk({"role": "assistant", "content": ""}, None,
                                                     0 if continuous and not sglang else None)))
                    last_id = reply.chunk_id
                steps = [(t, t + 1) for t in range(sent[i], done)] if sglang else [(sent[i], done)] * (done > sent[i])
                for a, b in steps:
                    sent[i] = b
                    # SGLang's chat stream sends nothing for the end-of-sequence token (no text, no
                    # logprob), though its usage counts it and its whole answer lists its logprob.
                    if sglang and reply.chat and each.natural_finish == "stop" and b == each.target:
                        continue
                    deltas = reply.deltas(a, b)
                    # SGLang's completions stream ends a choice on its last token's chunk, with the
                    # finish and (at end-of-sequence) that token's logprob; there is no finish chunk.
                    last = sglang and not reply.chat and b == each.target and each.finish_reason is not None
                    for d, delta in enumerate(deltas):
                        # The step's logprobs (and SGLang's completions finish) ride on its last delta.
                        final = d == len(deltas) - 1
                        await resp.write(sse(reply.chunk(delta, each.finish_reason if last and final else None,
                                                         b if continuous else None,
                                                         reply.logprobs(a, b) if final else None)))
                        last_id = reply.chunk_id
                    finished_early[i] = finished_early[i] or last
                if each.finish_reason is not None:
                    finished[i] = True
                    if not (sglang or each.dropped):
                        await _finish(resp, reply, each, done, continuous)
            if all(finished) or req.dropped:
                break
        if req.dropped and failing:
            await resp.write(flavors.stream_error(flavor, STREAM_ERROR))
        elif any(each.dropped for each in reqs):
            drop_connection(request)
            return resp
        else:
            if sglang:
                # SGLang's finish chunks, and its usage chunk, all carry the id of the last chunk sent.
                for each, reply, tokens, early in zip(reqs, replies, sent, finished_early, strict=True):
                    if not early:
                        await _finish(resp, reply, each, tokens, continuous, last_id)
            if options.include_usage:
                await resp.write(sse(replies[0].usage_chunk(sum(sent), last_id if sglang else None)))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if flavor == "llamacpp" and request.transport is not None:
            # llama-server closes the connection after a stream, whatever its
            # Keep-Alive header said: stop reading it now, close it a moment later.
            transport = request.transport
            transport.pause_reading()
            asyncio.get_running_loop().call_later(self.config.stream_close_delay, transport.close)
        return resp

    async def _any_progress(self, waiting: list[tuple[SimRequest, int]]) -> None:
        """Return once any of these choices has more tokens than it sent, or has finished."""
        if len(waiting) == 1:
            await self.engine.wait(*waiting[0])
            return
        if any(r.finish_reason is not None or r.generated > seen for r, seen in waiting):
            return
        waits = [asyncio.ensure_future(self.engine.wait(r, seen)) for r, seen in waiting]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()


async def _finish(resp: web.StreamResponse, reply: Reply, req: SimRequest, tokens: int, continuous: bool,
                  chunk_id: str | None = None) -> None:
    """A choice's last chunks: its tool call, if it makes one, then its finish_reason (SGLang's
    chat finish chunk has no usage)."""
    usage = tokens if continuous else None
    for delta in reply.tool_deltas(tokens):
        await resp.write(sse(reply.chunk(delta, None, usage, chunk_id=chunk_id)))
    usage = None if reply.sglang and reply.chat else usage
    await resp.write(sse(reply.chunk(None, reply.finish(req.finish_reason), usage, chunk_id=chunk_id)))


SIM_KEY = web.AppKey("sim", SimServer)


def make_app(config: SimConfig) -> web.Application:
    sim = SimServer(config)
    # SGLang takes large prompts; aiohttp's 1 MiB default body limit would not.
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[sim.gate])
    app[SIM_KEY] = sim
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    engine = sim.engine
    answers: dict[str, Callable[[], object]] = {
        "/v1/models": lambda: {"object": "list", "data": [flavors.model_card(config)]},
        "/sim/stats": engine.stats_snapshot,
    }
    if config.flavor == "sglang":
        info = lambda: flavors.sglang_server_info(config, engine)  # noqa: E731
        model = lambda: {"model_path": config.model_path, "tokenizer_path": config.model_path,  # noqa: E731
                         "is_generation": True}
        answers.update({"/get_server_info": info, "/server_info": info, "/get_model_info": model,
                        "/model_info": model})
        app.router.add_get("/health_generate", sim.health)
    elif config.flavor == "llamacpp":
        answers.update({"/props": lambda: flavors.llamacpp_props(config),
                        "/slots": lambda: flavors.llamacpp_slots(config, engine)})
    for path, make in answers.items():
        app.router.add_get(path, _answering(make))

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=flavors.metrics_page(config, engine), content_type="text/plain", charset="utf-8")

    async def reset(request: web.Request) -> web.Response:
        engine.reset_stats()
        return json_response({"reset": True})

    app.router.add_get("/health", sim.health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/v1/chat/completions", sim.generate)
    app.router.add_post("/v1/completions", sim.generate)
    app.router.add_post("/sim/reset", reset)
    app.router.add_get("/sim/faults", sim.sim_faults)
    app.router.add_post("/sim/faults", sim.sim_faults)
    return app


def _answering(make: Callable[[], object]) -> Callable:
    async def handler(request: web.Request) -> web.Response:
        return json_response(make())

    return handler
@dataclass
class RunningSim:
    """A sim serving on a port; close() stops it."""

    runner: web.AppRunner
    url: str

    @property
    def sim(self) -> SimServer:
        return self.runner.app[SIM_KEY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(config: SimConfig) -> RunningSim:
    """Serve make_app(config) on config.host:config.port (0: any free port)."""
    # No access log: it would cost more than the instant mode itself.
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    runner.app[SIM_KEY].sites.append(site)
    host, port = runner.addresses[0][:2]
    return RunningSim(runner, f"http://{host}:{port}")


def run(config: SimConfig, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; on_ready gets the base URL once listening.

    The llamacpp flavor answers its first SIGTERM as llama-server does: it stops
    listening and leaves open requests hanging; it exits once none is open (their
    clients gave up) or on a second signal."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        running = await start(config)
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if config.flavor == "llamacpp" and signals == 1:
                loop.create_task(running.sim.stop_listening())
            else:
                stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            on_ready(running.url)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.2)
                except TimeoutError:
                    if not running.sim.listening and running.sim.open_requests == 0:
                        break
        finally:
            await running.close()

    asyncio.run(serve())
