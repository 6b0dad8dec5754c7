"""Generation requests of the simulated server: parse and check them as the flavor does,
queue them in the engine, and answer whole or streamed, with the fault switches applied."""

from __future__ import annotations

import math
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
from genq.sim.lengths import choice_key, output_length, prompt_key
from genq.sim.protocol import (
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    chat_prompt_tokens,
    completion_prompt_tokens,
    validate,
)
from genq.sim.reply import WORDS, Job, Reply, full_answer
from genq.sim.streaming import STREAM_ERROR, drop_connection, stream

_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
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
            drop_connection(request)
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

        thinking = isinstance(body, ChatRequest) and body.thinking()
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all
        # start with chatcmpl-.
        prefix = "chatcmpl" if chat or self.flavor == "llamacpp" else "cmpl"
        rid = (body.rid if self.flavor == "sglang" else None) or f"{prefix}-{uuid.uuid4().hex}"
        replies = [Reply(
            text=self._text[6 * i:] + self._text[:6 * i],
            chat=chat,
            rid=rid,
            model=body.model or cfg.model_name,
            prompt_tokens=job.prompt_tokens,
            think=max(1, math.ceil(naturals[i] * cfg.thinking_fraction)) if thinking else 0,
            separate=not isinstance(body, ChatRequest) or body.separate_reasoning,
            index=i,
            top_logprobs=body.logprobs_asked(),
            tool=body.tool_called() if isinstance(body, ChatRequest) and self._tool_calls else None,
            sglang=self.flavor == "sglang",
            # SGLang runs each of n > 1 samples as a sub-request with an id of its own.
            chunk_id=rid if i == 0 or self.flavor != "sglang" else uuid.uuid4().hex,
        ) for i in range(body.n)]
        try:
            if body.stream:
                return await stream(self.engine, cfg, request, reqs, replies, body.stream_options or StreamOptions(), failing)
            for each in reqs:
                while each.finish_reason is None:
                    await self.engine.wait(each, each.generated)
            if req.dropped and failing:
                return error_response(self.flavor, 500, STREAM_ERROR, "InternalServerError")
            if any(each.dropped for each in reqs):
                drop_connection(request)
                return web.Response(status=500)  # never sent
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
        problem = validate(body, max_new, flavor)
        if problem:
            return flavors.bad_request(flavor, problem)
        limit = flavors.context_check(flavor, n_prompt, max_new, self.config.context_length, self.config.args_given)
        if isinstance(limit, web.Response):
            return limit
        return Job(body, prompt_key(source), n_prompt, limit)
