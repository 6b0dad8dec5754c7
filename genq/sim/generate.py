"""Generation requests of the simulated server: parse and check them as the flavor does,
queue them in the engine, and answer whole or streamed, with the fault switches applied."""

from __future__ import annotations

import asyncio
import math
import socket
import struct
import uuid
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.engine import Engine, QueueFull, SimRequest
from genq.sim.faults import Fault, FaultInjector
from genq.sim.flavors import error_response, json_response
from genq.sim.lengths import output_length, prompt_key
from genq.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    chat_prompt_tokens,
    completion_prompt_tokens,
    validate,
)
from genq.sim.reply import WORDS, Job, Reply, sse

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
# cpp-httplib's keep-alive header, which llama-server sends even on the streamed
# responses after which it closes the connection.
# The message of the stream_error fault (and of the 500 a whole answer gets instead).
_STREAM_ERROR = "Internal server error (simulated, mid-stream)"
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}


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


class Generation:
    def __init__(self, config: SimConfig, engine: Engine, faults: FaultInjector, ready: Callable[[], bool],
                 start_outage: Callable[[float], None]) -> None:
        self.config = config
        self.flavor = config.flavor
        self.engine = engine
        self.faults = faults
        self.ready = ready
        self.start_outage = start_outage
        self._text = (WORDS * (4 * config.context_length // len(WORDS) + 1))[: 4 * config.context_length]

    async def answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.faults.in_outage():
            _drop_connection(request)
            return web.Response(status=500)  # never sent: the connection is gone
        if not self.ready():
            return error_response(self.flavor, 503, "The server is not ready yet.", "ServiceUnavailableError")
        raw = await request.read()
        self.engine.stats.requests += 1
        job = self._parse(raw, chat)
        if isinstance(job, web.Response):
            self.engine.stats.rejected += 1
            return job
        cfg, body = self.config, job.body

        fault, where = self.faults.draw(job.key)
        if fault is Fault.ERROR:
            return error_response(self.flavor, 500, "Internal server error (simulated)", "InternalServerError")
        room = cfg.context_length - job.prompt_tokens
        natural = output_length(job.key, cfg.seed, cfg.mean_output_tokens, cfg.output_sigma, room)
        req = SimRequest(job.key, job.prompt_tokens, natural, job.max_new_tokens, body.stream)
        # Faults strike at a token count inside the output, so a stream shows some
        # output first; where == 0 strikes before the first token.
        if fault is Fault.HANG:
            req.hang_at = int(where * req.target)
        elif fault is Fault.RESET:
            req.drop_at = int(where * req.target)
        elif fault is Fault.STREAM_ERROR:
            # The engine aborts the request after at least one token (a request of one
            # token finishes first): "mid-stream".
            req.drop_at = 1 + int(where * (req.target - 1))
        failing = fault is Fault.STREAM_ERROR
        try:
            self.engine.submit(req)
        except QueueFull:
            return error_response(self.flavor, 503, "The request queue is full.", "ServiceUnavailableError")
        if cfg.crash_marker and cfg.crash_marker.encode() in raw:
            self.start_outage(cfg.outage_for)  # down it goes, with everything in flight

        thinking = isinstance(body, ChatRequest) and body.thinking()
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all
        # start with chatcmpl-.
        prefix = "chatcmpl" if chat or self.flavor == "llamacpp" else "cmpl"
        reply = Reply(
            text=self._text,
            chat=chat,
            rid=(body.rid if self.flavor == "sglang" else None) or f"{prefix}-{uuid.uuid4().hex}",
            model=body.model or cfg.model_name,
            prompt_tokens=job.prompt_tokens,
            think=max(1, math.ceil(natural * cfg.thinking_fraction)) if thinking else 0,
            separate=not isinstance(body, ChatRequest) or body.separate_reasoning,
        )
        try:
            if body.stream:
                return await self._stream(request, req, reply, body.stream_options or StreamOptions(), failing)
            while req.finish_reason is None:
                await self.engine.wait(req, req.generated)
            if req.dropped and failing:
                return error_response(self.flavor, 500, _STREAM_ERROR, "InternalServerError")
            if req.dropped:
                _drop_connection(request)
                return web.Response(status=500)  # never sent
            return json_response(reply.full(req))
        finally:
            # No-op once finished; frees the slot when the client went away
            # (cancelled handler, failed write), as SGLang aborts such requests.
            self.engine.abort(req)

    def _parse(self, raw: bytes, chat: bool) -> Job | web.Response:
        """Decode and check a request as the engine does; a Response is the 400."""
        body: ChatRequest | CompletionRequest
        flavor = self.flavor
        try:
            body = _chat_decoder.decode(raw) if chat else _completion_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return flavors.bad_request(flavor, str(exc))
        if isinstance(body, ChatRequest):
            if not body.messages:
                return flavors.bad_request(flavor, "messages: Field required (a non-empty list).")
            source: Any = body.messages
            n_prompt = chat_prompt_tokens(body.messages)
            max_new = body.max_new_tokens()
        else:
            source = body.prompt
            counted = completion_prompt_tokens(body.prompt)
            if counted is None:
                return flavors.bad_request(flavor, "prompt must be a string or a list of token ids in genq sim.")
            n_prompt = counted
            max_new = 16 if body.max_tokens is None else body.max_tokens
        problem = validate(body, max_new)
        if problem:
            return flavors.bad_request(flavor, problem)
        limit = flavors.context_check(flavor, n_prompt, max_new, self.config.context_length)
        if isinstance(limit, web.Response):
            return limit
        return Job(body, prompt_key(source), n_prompt, limit)

    async def _stream(
        self, request: web.Request, req: SimRequest, reply: Reply, options: StreamOptions, failing: bool
    ) -> web.StreamResponse:
        continuous = options.continuous_usage_stats
        llamacpp = self.flavor == "llamacpp"
        headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        resp = web.StreamResponse(headers={**headers, **_LLAMACPP_KEEP_ALIVE} if llamacpp else headers)
        if self.flavor in ("llamacpp", "sglang"):
            # llama-server answers (headers included) only with the first result, and
            # SGLang's _handle_streaming_request awaits the stream's first chunk before
            # it returns the response: a queued request gets no byte at all until it runs.
            await self.engine.wait(req, 0)
            if req.dropped and not failing:
                _drop_connection(request)
                return resp
        # vLLM returns Starlette's StreamingResponse at once: headers at once, the
        # first event (the role) only with the first output, nothing while queued.
        await resp.prepare(request)
        sent = 0
        while True:
            await self.engine.wait(req, sent)
            done = req.generated
            if done > sent or req.finish_reason is not None:
                if sent == 0 and reply.chat:
                    # Chat streams open with the role; completion streams start with text.
                    await resp.write(sse(reply.chunk({"role": "assistant", "content": ""}, None,
                                                      0 if continuous else None)))
            if done > sent:
                usage_so_far = done if continuous else None
                for delta in reply.deltas(sent, done):
                    await resp.write(sse(reply.chunk(delta, None, usage_so_far)))
                sent = done
            if req.finish_reason is not None:
                break
        if req.dropped and failing:
            await resp.write(flavors.stream_error(self.flavor, _STREAM_ERROR))
        elif req.dropped:
            _drop_connection(request)
            return resp
        else:
            await resp.write(sse(reply.chunk(None, req.finish_reason, sent if continuous else None)))
            if options.include_usage:
                await resp.write(sse(reply.usage_chunk(sent)))
            await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        if llamacpp and request.transport is not None:
            # llama-server closes the connection after a stream, whatever its
            # Keep-Alive header said: stop reading it now, close it a moment later.
            transport = request.transport
            transport.pause_reading()
            asyncio.get_running_loop().call_later(self.config.stream_close_delay, transport.close)
        return resp
