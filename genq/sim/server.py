"""HTTP face of the simulator: SGLang's endpoints, field names and status codes.

make_app() builds the aiohttp application; start() serves it on a port (tests),
run() serves it until SIGINT/SIGTERM (the CLI). Serve through start()/run(), or
pass handler_cancellation=True to your own AppRunner: that is how a client that
hangs up on a non-stream request is noticed and its slot freed, as SGLang does.
"""

from __future__ import annotations

import asyncio
import math
import signal
import socket
import struct
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from genq.sim.config import SimConfig
from genq.sim.engine import Engine, QueueFull, SimRequest
from genq.sim.faults import Fault, FaultInjector, FaultUpdate
from genq.sim.lengths import output_length, prompt_key
from genq.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    chat_prompt_tokens,
    completion_prompt_tokens,
    validate,
)

VERSION = "0.0.0-genq-sim"
# Reported as matched_stop of a natural stop: Qwen's <|im_end|> token id, what
# SGLang reports when generation ends on EOS.
EOS_TOKEN_ID = 151645
# The sim's text: about four characters a "token", sliced, never generated per token.
_WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
_JSON = "application/json"

_encode = msgspec.json.encode
_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_fault_decoder = msgspec.json.Decoder(FaultUpdate)


def error_response(status: int, message: str, err_type: str) -> web.Response:
    """SGLang's flat OpenAI-style error body."""
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.Response(status=status, body=_encode(body), content_type=_JSON)


def _bad_request(message: str) -> web.Response:
    return error_response(400, message, "BadRequestError")


def _json(data: Any) -> web.Response:
    return web.Response(body=_encode(data), content_type=_JSON)


def _drop_connection(request: web.Request) -> None:
    """Reset the TCP connection as a crashed server would: no response, no FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0 turns close() into an RST, so the client sees a reset at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


def _sse(data: Any) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


class SimServer:
    """State behind the handlers: one engine, the fault switches, the clock."""

    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.engine = Engine(config)
        self.faults = FaultInjector(config)
        self.started_at = time.monotonic()
        self._text = (_WORDS * (4 * config.context_length // len(_WORDS) + 1))[: 4 * config.context_length]
        self._outage_task: asyncio.Task[None] | None = None

    # ---- lifecycle -------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.started_at = time.monotonic()
        self.engine.start()
        if self.config.outage_at is not None:
            self._outage_task = asyncio.get_running_loop().create_task(self._scheduled_outage(self.config.outage_at))

    async def on_cleanup(self, app: web.Application) -> None:
        if self._outage_task is not None:
            self._outage_task.cancel()
        await self.engine.stop()

    async def _scheduled_outage(self, at: float) -> None:
        await asyncio.sleep(at)
        self.start_outage(self.config.outage_for)

    def start_outage(self, duration: float) -> None:
        self.faults.start_outage(duration)
        if duration > 0:
            self.engine.drop_all()

    def ready(self) -> bool:
        return time.monotonic() - self.started_at >= self.config.startup_delay

    # ---- info endpoints --------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        ok = self.ready() and not self.faults.in_outage()
        return web.Response(status=200 if ok else 503)

    def _memory_usage(self) -> dict[str, float | int]:
        # Plausible figures for an 8B model on one 80 GB GPU; the token capacity
        # is the one a client can act on.
        return {"weight": 15.3, "kvcache": 52.4, "token_capacity": self.config.max_total_num_tokens, "graph": 1.2}

    async def server_info(self, request: web.Request) -> web.Response:
        cfg = self.config
        return _json(
            {
                "model_path": cfg.model_path,
                "tokenizer_path": cfg.model_path,
                "served_model_name": cfg.model_name,
                "host": cfg.host,
                "port": cfg.port,
                "context_length": cfg.context_length,
                "max_running_requests": cfg.max_running_requests,
                "max_queued_requests": cfg.max_queued_requests,
                "max_total_num_tokens": cfg.max_total_num_tokens,
                "max_req_input_len": min(cfg.context_length, cfg.max_total_num_tokens) - 1,
                "chunked_prefill_size": 8192,
                "schedule_policy": "fcfs",
                "tp_size": 1,
                "dp_size": 1,
                "enable_metrics": True,
                "reasoning_parser": "qwen3",
                "version": VERSION,
                "internal_states": [
                    {
                        "last_gen_throughput": self.engine.last_gen_throughput,
                        "effective_max_running_requests_per_dp": cfg.max_running_requests,
                        "memory_usage": self._memory_usage(),
                    }
                ],
                # Not in SGLang: the simulator's own knobs, for benchmark reports.
                "sim": msgspec.to_builtins(cfg),
            }
        )

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.config.model_path
        return _json({"model_path": path, "tokenizer_path": path, "is_generation": True})

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        card = {
            "id": cfg.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sglang",
            "root": cfg.model_path,
            "max_model_len": cfg.context_length,
        }
        return _json({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        eng, cfg = self.engine, self.config
        label = cfg.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        gauges = [
            ("num_running_reqs", "The number of running requests.", eng.num_running),
            ("num_queue_reqs", "The number of requests in the waiting queue.", eng.num_waiting),
            ("num_used_tokens", "The number of used tokens.", eng.used_tokens),
            ("token_usage", "The token usage.", eng.used_tokens / cfg.max_total_num_tokens),
            ("gen_throughput", "The generation throughput (token/s).", eng.last_gen_throughput),
        ]
        counters = [
            ("prompt_tokens", "Number of prefill tokens processed.", eng.prompt_tokens_total),
            ("generation_tokens", "Number of generation tokens processed.", eng.generation_tokens_total),
            ("num_requests", "Number of requests processed.", eng.num_requests_total),
            ("num_aborted_requests", "Number of requests aborted.", eng.num_aborted_total),
        ]
        lines: list[str] = []
        for name, help_text, value in gauges:
            lines += [f"# HELP sglang:{name} {help_text}", f"# TYPE sglang:{name} gauge"]
            lines.append(f'sglang:{name}{{model_name="{label}"}} {float(value)}')
        for name, help_text, value in counters:
            lines += [f"# HELP sglang:{name}_total {help_text}", f"# TYPE sglang:{name}_total counter"]
            lines.append(f'sglang:{name}_total{{model_name="{label}"}} {float(value)}')
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain", charset="utf-8")

    # ---- simulator control -----------------------------------------------

    async def sim_stats(self, request: web.Request) -> web.Response:
        return _json(self.engine.stats_snapshot())

    async def sim_reset(self, request: web.Request) -> web.Response:
        self.engine.reset_stats()
        return _json({"reset": True})

    async def sim_faults_get(self, request: web.Request) -> web.Response:
        return _json(self.faults.snapshot())

    async def sim_faults_post(self, request: web.Request) -> web.Response:
        try:
            update = _fault_decoder.decode(await request.read())
            self.faults.apply(update)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return _bad_request(str(exc))
        if update.outage_for is not None:
            self.start_outage(update.outage_for)
        return _json(self.faults.snapshot())

    # ---- generation ------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.faults.in_outage():
            _drop_connection(request)
            return web.Response(status=500)  # never sent: the connection is gone
        if not self.ready():
            return error_response(503, "The server is not ready yet.", "ServiceUnavailableError")
        raw = await request.read()
        job = self._parse(raw, chat)
        if isinstance(job, web.Response):
            return job
        cfg, body = self.config, job.body

        fault, where = self.faults.draw(job.key)
        if fault is Fault.ERROR:
            return error_response(500, "Internal server error (simulated)", "InternalServerError")
        room = cfg.context_length - job.prompt_tokens
        natural = output_length(job.key, cfg.seed, cfg.mean_output_tokens, cfg.output_sigma, room)
        req = SimRequest(job.key, job.prompt_tokens, natural, job.max_new_tokens, body.stream)
        # Faults strike at a token count inside the output, so a stream shows some
        # output first; where == 0 strikes before the first token.
        if fault is Fault.HANG:
            req.hang_at = int(where * req.target)
        elif fault is Fault.RESET:
            req.drop_at = int(where * req.target)
        try:
            self.engine.submit(req)
        except QueueFull:
            return error_response(503, "The request queue is full.", "ServiceUnavailableError")
        if cfg.crash_marker and cfg.crash_marker.encode() in raw:
            self.start_outage(cfg.outage_for)  # down it goes, with everything in flight

        thinking = isinstance(body, ChatRequest) and body.thinking()
        reply = _Reply(
            text=self._text,
            chat=chat,
            rid=body.rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
            model=body.model or cfg.model_name,
            prompt_tokens=job.prompt_tokens,
            think=max(1, math.ceil(natural * cfg.thinking_fraction)) if thinking else 0,
            separate=not isinstance(body, ChatRequest) or body.separate_reasoning,
        )
        try:
            if body.stream:
                return await self._stream(request, req, reply, body.stream_options or StreamOptions())
            while req.finish_reason is None:
                await self.engine.wait(req, req.generated)
            if req.dropped:
                _drop_connection(request)
                return web.Response(status=500)  # never sent
            return _json(reply.full(req))
        finally:
            # No-op once finished; frees the slot when the client went away
            # (cancelled handler, failed write), as SGLang aborts such requests.
            self.engine.abort(req)

    def _parse(self, raw: bytes, chat: bool) -> _Job | web.Response:
        """Decode and check a request as SGLang does; a Response is the 400."""
        body: ChatRequest | CompletionRequest
        try:
            body = _chat_decoder.decode(raw) if chat else _completion_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _bad_request(str(exc))
        if isinstance(body, ChatRequest):
            if not body.messages:
                return _bad_request("messages: Field required (a non-empty list).")
            source: Any = body.messages
            n_prompt = chat_prompt_tokens(body.messages)
            max_new = body.max_new_tokens()
        else:
            source = body.prompt
            counted = completion_prompt_tokens(body.prompt)
            if counted is None:
                return _bad_request("prompt must be a string or a list of token ids in genq sim.")
            n_prompt = counted
            max_new = 16 if body.max_tokens is None else body.max_tokens
        problem = validate(body, max_new)
        if problem:
            return _bad_request(problem)
        ctx = self.config.context_length
        if n_prompt >= ctx:
            return _bad_request(
                f"The input ({n_prompt} tokens) is longer than the model's context length ({ctx} tokens)."
            )
        if max_new is not None and max_new + n_prompt >= ctx:
            return _bad_request(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {max_new + n_prompt} tokens: {n_prompt} tokens from the "
                f"input messages and {max_new} tokens for the completion. Please reduce the number "
                f"of tokens in the input messages or the completion to fit within the limit."
            )
        # SGLang runs a chat request without a limit up to the context length.
        limit = ctx - n_prompt if max_new is None else max_new
        return _Job(body, prompt_key(source), n_prompt, limit)

    async def _stream(
        self, request: web.Request, req: SimRequest, reply: _Reply, options: StreamOptions
    ) -> web.StreamResponse:
        continuous = options.continuous_usage_stats
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if reply.chat:
            # Chat streams open with the role; completion streams start with text.
            role = {"role": "assistant", "content": ""}
            await resp.write(_sse(reply.chunk(role, None, 0 if continuous else None)))
        sent = 0
        while True:
            await self.engine.wait(req, sent)
            done = req.generated
            if done > sent:
                usage_so_far = done if continuous else None
                for delta in reply.deltas(sent, done):
                    await resp.write(_sse(reply.chunk(delta, None, usage_so_far)))
                sent = done
            if req.finish_reason is not None:
                break
        if req.dropped:
            _drop_connection(request)
            return resp
        await resp.write(_sse(reply.chunk(None, req.finish_reason, sent if continuous else None)))
        if options.include_usage:
            await resp.write(_sse(reply.usage_chunk(sent)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@dataclass(slots=True)
class _Job:
    """A request that passed validation."""

    body: ChatRequest | CompletionRequest
    key: str
    prompt_tokens: int
    max_new_tokens: int


@dataclass(slots=True)
class _Reply:
    """Builds response bodies for one request from token counts: the text of tokens
    [a, b) is a slice of a fixed string, reasoning first when thinking is on."""

    text: str
    chat: bool
    rid: str
    model: str
    prompt_tokens: int
    think: int  # tokens of reasoning at the start of the output (0: no thinking)
    separate: bool  # separate_reasoning: reasoning goes to reasoning_content

    def pieces(self, a: int, b: int) -> tuple[str, str]:
        """(reasoning, content) text of output tokens [a, b)."""
        think, text = self.think, self.text
        reasoning = text[4 * a : 4 * min(b, think)] if a < think else ""
        content = text[4 * max(a, think) : 4 * b] if b > think else ""
        if not self.separate:
            # Without a parser the raw output shows where thinking ended.
            tag = "</think>" if think and a <= think < b else ""
            return "", reasoning + tag + content
        return reasoning, content

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": None,
            "reasoning_tokens": min(completion_tokens, self.think),
        }

    def full(self, req: SimRequest) -> dict[str, Any]:
        reasoning, content = self.pieces(0, req.generated)
        matched = EOS_TOKEN_ID if req.finish_reason == "stop" else None
        if self.chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {
                    "role": "assistant",
                    "content": content,
                    "reasoning_content": reasoning or None,
                    "tool_calls": None,
                },
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "matched_stop": matched,
            }
        else:
            choice = {
                "index": 0,
                "text": reasoning + content,
                "logprobs": None,
                "finish_reason": req.finish_reason,
                "matched_stop": matched,
            }
        return {
            "id": self.rid,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(req.generated),
        }

    def deltas(self, a: int, b: int) -> list[dict[str, Any]]:
        reasoning, content = self.pieces(a, b)
        if not self.chat:
            return [{"text": content}]
        out = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if content:
            out.append({"content": content})
        return out

    def chunk(self, delta: dict[str, Any] | None, finish: str | None, tokens: int | None) -> dict[str, Any]:
        """One stream chunk; delta None is the finish chunk (empty delta/text)."""
        matched = EOS_TOKEN_ID if finish == "stop" else None
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta or {}, "logprobs": None}
        else:
            choice = {"index": 0, "text": (delta or {}).get("text", ""), "logprobs": None}
        choice["finish_reason"] = finish
        choice["matched_stop"] = matched
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [choice],
            "usage": None if tokens is None else self.usage(tokens),
        }

    def usage_chunk(self, tokens: int) -> dict[str, Any]:
        return {
            "id": self.rid,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": int(time.time()),
            "model": self.model,
            "choices": [],
            "usage": self.usage(tokens),
        }


SIM_KEY = web.AppKey("sim", SimServer)


def make_app(config: SimConfig) -> web.Application:
    # SGLang takes large prompts; aiohttp's 1 MiB default body limit would not.
    app = web.Application(client_max_size=256 * 1024 * 1024)
    sim = SimServer(config)
    app[SIM_KEY] = sim
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    r = app.router
    for path in ("/health", "/health_generate"):
        r.add_get(path, sim.health)
    for path in ("/get_server_info", "/server_info"):
        r.add_get(path, sim.server_info)
    for path in ("/get_model_info", "/model_info"):
        r.add_get(path, sim.model_info)
    r.add_get("/v1/models", sim.models)
    r.add_get("/metrics", sim.metrics)
    r.add_post("/v1/chat/completions", sim.chat_completions)
    r.add_post("/v1/completions", sim.completions)
    r.add_get("/sim/stats", sim.sim_stats)
    r.add_post("/sim/reset", sim.sim_reset)
    r.add_get("/sim/faults", sim.sim_faults_get)
    r.add_post("/sim/faults", sim.sim_faults_post)
    return app


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
    # handler_cancellation: a client hang-up cancels its handler, which aborts
    # the request. No access log: it would cost more than the instant mode itself.
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    host, port = runner.addresses[0][:2]
    return RunningSim(runner, f"http://{host}:{port}")


def run(config: SimConfig, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; on_ready gets the base URL once listening."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        running = await start(config)
        try:
            on_ready(running.url)
            await stop.wait()
        finally:
            await running.close()

    asyncio.run(serve())
