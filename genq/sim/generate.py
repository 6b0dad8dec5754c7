"""Generation requests of the simulated server: parse and check them as the flavor does,
queue them in the engine, and answer whole or streamed (the chunks of every choice
interleaved by index, with the flavor's ways of ending), with the fault switches applied."""

from __future__ import annotations

import asyncio
import math
import socket
import struct
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.engine import Engine, QueueFull, SimRequest
from genq.sim.faults import Fault, FaultInjector
from genq.sim.flavors import error_response, json_response, sse
from genq.sim.lengths import choice_key, output_length, prompt_key
from genq.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    validate,
)
from genq.sim.reply import WORDS, Reply, full_answer

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
# The message of the stream_error fault (and of the 500 a whole answer gets instead).
STREAM_ERROR = "Internal server error (simulated, mid-stream)"
# cpp-httplib's keep-alive header, which llama-server sends even on the streamed
# responses after which it closes the connection.
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}


@dataclass(slots=True)
class Job:
    """A request that passed validation."""

    body: ChatRequest | CompletionRequest
    key: str
    prompt_tokens: int
    max_new_tokens: int


def drop_connection(request: web.Request) -> web.Response:
    """Reset the TCP connection as a crashed server would: no response, no FIN. Returns the
    handler's answer, which is never sent."""
    transport = request.transport
    if transport is not None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            # Linger 0 turns close() into an RST, so the client sees a reset at once.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    return web.Response(status=500)


class Generation:
    def __init__(self, config: SimConfig, engine: Engine, faults: FaultInjector, ready: Callable[[], bool],
                 start_outage: Callable[[float], None]) -> None:
        self.config = config
        self.flavor = config.flavor
        self.engine = engine
        self.faults = faults
        self.ready = ready
        self.start_outage = start_outage
        # vLLM and llama.cpp answer tools with calls (genq sim plays no parser switch for them).
        self._tool_calls = config.flavor != "sglang" or config.tool_call_parser is not None
        self._text = (WORDS * (4 * config.context_length // len(WORDS) + 1))[: 4 * config.context_length]

    async def answer(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.faults.in_outage():
            return drop_connection(request)
        if not self.ready():
            return error_response(self.flavor, 503, "The server is not ready yet.", "ServiceUnavailableError")
        raw = await request.read()
        self.engine.stats.requests += 1
        job = self._parse(raw, chat)
        if isinstance(job, web.Response):
            return job
        cfg, body = self.config, job.body

        fault, where = self.faults.draw(job.key)
        if fault is Fault.ERROR:
            return error_response(self.flavor, 500, "Internal server error (simulated)", "InternalServerError")
        # One past what the context leaves: an answer cut by the context's end is "length" (as
        # the engines say), not a natural "stop" at exactly the room left.
        room = cfg.context_length - job.prompt_tokens + 1
        # One sequence per sample, each with its own deterministic length, as SGLang and vLLM
        # schedule each of the n choices as a request of its own. Faults strike the first.
        naturals = [output_length(choice_key(job.key, i), cfg.seed, cfg.mean_output_tokens, cfg.output_sigma, room)
                    for i in range(body.n)]
        reqs = [SimRequest(job.key, job.prompt_tokens, natural, job.max_new_tokens, body.stream)
                for natural in naturals]
        req = reqs[0]
        # Faults strike at a token count inside the output; where == 0: before the first token.
        if fault is Fault.HANG:
            req.hang_at = int(where * req.target)
        elif fault is Fault.RESET:
            req.drop_at = int(where * req.target)
        elif fault is Fault.STREAM_ERROR:
            # After at least one token: "mid-stream" (a one-token request finishes first).
            req.drop_at = 1 + int(where * (req.target - 1))
        failing = fault is Fault.STREAM_ERROR
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
            self.start_outage(cfg.outage_for)  # down it goes, with everything in flight

        sglang = self.flavor == "sglang"
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all start with chatcmpl-.
        prefix = "chatcmpl" if chat or self.flavor == "llamacpp" else "cmpl"
        rid = (body.rid if sglang else None) or f"{prefix}-{uuid.uuid4().hex}"
        chat_body = body if isinstance(body, ChatRequest) else None
        replies = [Reply(
            text=self._text[6 * i:] + self._text[:6 * i], chat=chat, rid=rid, model=body.model or cfg.model_name,
            prompt_tokens=job.prompt_tokens,
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
            # No-op once finished; frees the slot when the client went away
            # (cancelled handler, failed write), as SGLang aborts such requests.
            for each in reqs:
                self.engine.abort(each)

    def _parse(self, raw: bytes, chat: bool) -> Job | web.Response:
        """Decode and check a request as the engine does; a Response is the 400."""
        body: ChatRequest | CompletionRequest
        flavor = self.flavor
        try:
            body = _chat_decoder.decode(raw) if chat else _completion_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return flavors.bad_request(flavor, str(exc))
        prompt = body.counted_prompt()
        if isinstance(prompt, str):
            return flavors.bad_request(flavor, prompt)
        source, n_prompt = prompt
        max_new = body.max_new_tokens()
        problem = validate(body, max_new, flavor)
        if problem:
            return flavors.bad_request(flavor, problem)
        limit = flavors.context_check(flavor, n_prompt, max_new, self.config.context_length, self.config.args_given)
        if isinstance(limit, web.Response):
            return limit
        return Job(body, prompt_key(source), n_prompt, limit)

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
