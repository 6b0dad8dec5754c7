"""The sim's HTTP face: SGLang's, vLLM's or llama.cpp's endpoints, checks, answers, errors, metrics and connection
habits (SimConfig.flavor; sources: docs/engines.md), and its fault switches. Unknown body fields are ignored, a wrongly
typed one is a 400 (SGLang's remapped 422); a client hanging up cancels its handler, which frees the slot."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import random
import signal
import socket
import struct
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from aiohttp import web

from genq.sim.config import SimConfig
from genq.sim.engine import Engine, SimRequest, new_stats
from genq.sim.lengths import choice_key, output_length, prompt_key

FLAVORS = ("sglang", "vllm", "llamacpp")
VERSION = "0.0.0-genq-sim"
# Each rate switch and its fault, in the order a draw tries them (stream_error: the engine's error after some output).
FAULTS = {"error_rate": "error", "reset_rate": "reset", "hang_rate": "hang", "stream_error_rate": "stream_error"}
STREAM_ERROR = "Internal server error (simulated, mid-stream)"
# cpp-httplib's header, which llama-server sends even on the streams after which it closes the connection.
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}
_Rate = Annotated[float, msgspec.Meta(ge=0, le=1)]
# Reported as matched_stop of a natural stop: Qwen's <|im_end|>, what SGLang reports at EOS.
EOS_TOKEN_ID = 151645
# The sim's text: about four characters a "token", sliced, never generated per token.
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "
_LLAMACPP_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "unavailable_error"}


class Refusal(Exception):
    """An answer other than 200, in the engine's error body."""

    def __init__(self, message: str, status: int = 400, err_type: str | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.err_type, self.extra = status, err_type, extra


def error_body(flavor: str, status: int, message: str, err_type: str | None = None, **extra: Any) -> dict[str, Any]:
    """SGLang's error body is flat; vLLM's and llama.cpp's (format_error_response()) nest it under "error"."""
    default = _LLAMACPP_TYPES.get(status, "server_error") if flavor == "llamacpp" else "BadRequestError"
    body = {"code": status, "message": message, "type": err_type or default}
    if flavor == "sglang":
        return {"object": "error", **body, "param": None}
    return {"error": {**body, "param": extra.get("param")} if flavor == "vllm" else {**body, **extra}}


def sse(data: Any) -> bytes:
    return b"data: " + msgspec.json.encode(data) + b"\n\n"


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class Request(msgspec.Struct, kw_only=True):
    """What the sim reads of a /v1/chat/completions or /v1/completions body."""

    model: str | None = None
    messages: list[dict[str, Any]] | None = None  # chat
    prompt: Any = None  # completions: a string or token ids, kept as sent for the prompt key
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    rid: str | None = None  # SGLang's: the response id
    logprobs: bool | int | None = None  # chat: true or false; completions: alternatives a token (0: none)
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def check(self, chat: bool, flavor: str, ctx: int, ctx_given: bool) -> tuple[Any, int, int, int | None]:
        """(what the prompt key hashes, its tokens, the most it may generate, logprobs' alternatives a token or None),
        or the engine's 400 (a Refusal). ctx_given: SGLang's --context-length. A batch of prompts is not served."""
        source, ids = self.prompt, isinstance(self.prompt, list) and all(isinstance(t, int) for t in self.prompt)
        n_prompt = len(source) // 4 + 1 if isinstance(source, str) else len(source) if ids else 0
        logprobs = None if self.logprobs is None else int(self.logprobs)
        max_new: int | None = 16 if self.max_tokens is None else self.max_tokens  # the OpenAI default for completions
        if chat:
            source, n_prompt = self.messages, chat_prompt_tokens(self.messages or [])
            # SGLang: max_completion_tokens wins over the deprecated max_tokens.
            max_new = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
            logprobs = (self.top_logprobs or 0) if self.logprobs else None
        left, over = ctx - n_prompt, max_new is not None and max_new > ctx
        llamacpp, vllm, sglang = (flavor == name for name in ("llamacpp", "vllm", "sglang"))
        checks: list[tuple[bool, str, dict[str, Any]]] = [
            (chat and not self.messages, "messages: Field required (a non-empty list).", {}),
            (not chat and not n_prompt, "prompt must be a string or a list of token ids in genq sim.", {}),
            (llamacpp and self.n != 1, "Only one completion choice is allowed", {}),
            (self.n < 1, f"n must be at least 1, got {self.n}.", {}),
            (self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20,
             f"top_logprobs must be between 0 and 20, got {self.top_logprobs}.", {}),
            (chat and not isinstance(self.logprobs, bool | None), "logprobs: Input should be a valid boolean", {}),
            (chat and bool(self.top_logprobs) and not self.logprobs, "top_logprobs requires logprobs to be true.", {}),
            (max_new is not None and max_new < 0, f"max_new_tokens must be at least 0, got {max_new}.", {}),
            (self.temperature is not None and self.temperature < 0,
             f"temperature must be non-negative, got {self.temperature}.", {}),
            (self.top_p is not None and not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}.", {}),
            # llama.cpp checks the slot's context; max_tokens past its end is no error, the slot stops there.
            (llamacpp and left <= 0, f"request ({n_prompt} tokens) exceeds the available context size ({ctx} tokens), "
             "try increasing it", {"err_type": "exceed_context_size_error", "n_prompt_tokens": n_prompt, "n_ctx": ctx}),
            # vLLM 0.32's, in its order. "at least ctx + 1": its chat tokenizer cuts there; the
            # "(parameter=..., value=...)" tail is VLLMValidationError's str().
            (vllm and over, f"max_tokens={max_new} cannot be greater than max_model_len={ctx}. Please request fewer "
             f"output tokens. (parameter=max_tokens, value={max_new})", {"param": "max_tokens"}),
            (vllm and left < 0, f"This model's maximum context length is {ctx} tokens. However, your prompt contains "
             f"at least {ctx + 1} input tokens, which exceeds this limit even without any output tokens. Please reduce "
             f"the length of the input prompt. (parameter=input_tokens, value={ctx + 1})", {"param": "input_tokens"}),
            (vllm and left == 0, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
             {"param": "max_tokens"}),
            # SGLang 0.5.23: with --context-length, max_tokens over it is refused before the prompt is tokenized
            # (its message's missing space included).
            (sglang and ctx_given and over, f"max_completion_tokens is too large: {max_new}.This model supports at "
             f"most {ctx} completion tokens.", {}),
            (sglang and left <= 0, f"The input ({n_prompt} tokens) is longer than the model's context length ({ctx} "
             "tokens).", {}),
            (sglang and max_new is not None and max_new + n_prompt >= ctx, "Requested token count exceeds the model's "
             f"maximum context length of {ctx} tokens. You requested a total of {(max_new or 0) + n_prompt} tokens: "
             f"{n_prompt} tokens from the input messages and {max_new} tokens for the completion. Please reduce the "
             "number of tokens in the input messages or the completion to fit within the limit.", {})]
        for bad, message, extra in checks:
            if bad:
                raise Refusal(message, **extra)
        # SGLang's checks leave max_new under left; a chat without one may run to the context's end.
        return source, n_prompt, left if max_new is None else min(max_new, left), logprobs

    def tool_called(self) -> str | None:
        """The function the sim's answer calls: the chosen one, else the first offered (none for "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        function = (self.tool_choice if isinstance(self.tool_choice, dict) else self.tools[0]).get("function")
        return str(function.get("name") or "") if isinstance(function, dict) else None


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About four characters a token, summed over message contents (the text parts of multimodal ones)."""
    texts = [message.get("content") for message in messages]
    texts = [" ".join(p.get("text", "") for p in t if isinstance(p, dict)) if isinstance(t, list) else t for t in texts]
    return sum(len(text if isinstance(text, str) else "") // 4 + 1 for text in texts)


@dataclass(slots=True, eq=False, kw_only=True)
class Choice(SimRequest):
    """One of a request's n samples, run as a request of its own (as in SGLang and vLLM), and its bodies: the text
    of tokens [a, b) is a slice of a fixed string (rotated per choice), reasoning first when thinking."""

    text: str
    chat: bool
    rid: str
    model: str
    think: int  # tokens of reasoning at the start of the output (0: no thinking)
    separate: bool  # separate_reasoning: reasoning goes to reasoning_content
    index: int
    top_logprobs: int | None  # logprobs asked for, with this many alternatives; None: not asked
    tool: str | None  # the tool the answer calls after its text (SGLang with a tool-call parser)
    sglang: bool  # SGLang's shapes (tests/recordings/sglang-0.5.23/)
    chunk_id: str

    def finish(self) -> str | None:
        """SGLang turns a natural stop after a tool call into "tool_calls" (serving_chat.py)."""
        return "tool_calls" if self.tool and self.finish_reason == "stop" else self.finish_reason

    def call(self, tokens: int) -> dict[str, Any]:
        return {"id": f"call_{self.rid[-8:]}_{self.index}", "type": "function",
                "function": {"name": self.tool, "arguments": msgspec.json.encode({"tokens": tokens}).decode()}}

    def pieces(self, a: int, b: int) -> tuple[str, str]:
        """(reasoning, content) text of output tokens [a, b)."""
        think, text = self.think, self.text
        reasoning = text[4 * a : 4 * min(b, think)] if a < think else ""
        content = text[4 * max(a, think) : 4 * b] if b > think else ""
        if not self.separate:  # without a parser the raw output shows where thinking ended
            return "", reasoning + ("</think>" if think and a <= think < b else "") + content
        return reasoning, content

    def usage(self, completion_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens, "prompt_tokens_details": None,
                "reasoning_tokens": min(completion_tokens, self.think)}

    def logprobs(self, a: int, b: int) -> dict[str, Any] | None:
        """Logprobs of tokens [a, b) in the endpoint's shape (None: not asked); fake, each alternative less likely."""
        k = self.top_logprobs
        if k is None:
            return None
        tokens = [self.text[4 * t : 4 * t + 4] for t in range(a, b)]
        values = [-round(((self.index * 7919 + t * 104729) % 1000) / 1000 + 0.001, 4) for t in range(a, b)]
        alts = [[(tok if i == 0 else f"{tok}~{i}", round(lp - i, 4)) for i in range(k)]
                for tok, lp in zip(tokens, values, strict=True)]
        if not self.chat:
            return {"tokens": tokens, "token_logprobs": values, "top_logprobs": [dict(alt) for alt in alts] if k
                    else [] if self.sglang else None, "text_offset": [4 * t for t in range(a, b)]}
        entries = [[{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in [(tok, lp), *alt]]
                   for tok, lp, alt in zip(tokens, values, alts, strict=True)]
        return {"content": [{**entry, "top_logprobs": tops} for entry, *tops in entries]}

    def stop_field(self, finish: str | None) -> dict[str, Any]:
        """SGLang's matched_stop names the EOS token; vLLM's stop_reason is null at EOS (it names stop strings)."""
        return {"matched_stop": EOS_TOKEN_ID if finish == "stop" else None} if self.sglang else {"stop_reason": None}

    def whole(self) -> dict[str, Any]:
        """This choice of a whole answer."""
        reasoning, content = self.pieces(0, self.generated)
        message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
        if self.tool or not self.sglang:  # SGLang's message has no tool_calls key without a call
            message["tool_calls"] = [self.call(self.generated)] if self.tool else None
        return {"index": self.index, **({"message": message} if self.chat else {"text": reasoning + content}),
                "logprobs": self.logprobs(0, self.generated), "finish_reason": self.finish(),
                **self.stop_field(self.finish_reason)}

    def chunk(self, delta: dict[str, Any] | None, finish: str | None = None, tokens: int | None = None,
              logprobs: dict[str, Any] | None = None, chunk_id: str | None = None) -> bytes:
        """One stream event; delta None is the finish chunk (empty delta or text), no delta at all the usage chunk."""
        if self.chat:
            choice = {"index": self.index, "delta": {"reasoning_content": None, **(delta or {})} if self.sglang
                      else delta or {}, "logprobs": logprobs}
        else:
            choice = {"index": self.index, "text": (delta or {}).get("text", ""), "logprobs": logprobs}
        out = self.head(chunk_id or self.chunk_id, [{**choice, "finish_reason": finish, **self.stop_field(finish)}])
        if tokens is not None or not self.sglang:  # SGLang's chunks without a count have no usage key
            out["usage"] = None if tokens is None else self.usage(tokens)
        return sse(out)

    def finish_chunks(self, continuous: bool, chunk_id: str | None = None) -> bytes:
        """Its tool call, if any, in two chunks (name, arguments), then its finish (SGLang's chat one: no usage)."""
        usage, out = self.generated if continuous else None, b""
        if self.tool:
            call = self.call(self.generated)
            head = {**call, "index": 0, "function": {"name": self.tool, "arguments": ""}}
            args = {"index": 0, "function": {"arguments": call["function"]["arguments"]}}
            out = b"".join(self.chunk({"tool_calls": [c]}, None, usage, None, chunk_id) for c in (head, args))
        return out + self.chunk(None, self.finish(), None if self.sglang and self.chat else usage, None, chunk_id)

    def head(self, chunk_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": chunk_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices}


# POST /sim/faults: the rate switches, an outage_for that starts an outage (0 ends one), stop_listening, hold_open
# (each stream's body left unended after its [DONE], the connection held); each optional.
_UPDATE: list[Any] = [*((name, _Rate | None, None) for name in FAULTS), ("stop_listening", bool | None, None),
                      ("hold_open", bool | None, None),
                      ("outage_for", Annotated[float, msgspec.Meta(ge=0)] | None, None)]
FaultUpdate = msgspec.defstruct("FaultUpdate", _UPDATE, kw_only=True, forbid_unknown_fields=True)


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=msgspec.json.encode(data), content_type="application/json")


def drop_connection(request: web.Request) -> web.Response:
    """Reset the connection as a crashed server would (linger 0: an RST, no FIN); the Response is never sent."""
    if request.transport is not None:
        linger = struct.pack("ii", 1, 0)
        request.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
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
        self.listening = True
        self.hold_open = False  # streams never end their body after [DONE] (a stuck proxy, a server's bug)
        self.open_requests = 0  # requests being handled
        self._tool_calls = config.flavor != "sglang" or config.tool_call_parser is not None  # vLLM, llama.cpp: always
        self._text = (WORDS * (4 * config.context_length // len(WORDS) + 1))[: 4 * config.context_length]
        app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[self.gate])  # SGLang's large prompts
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
        self._engine = asyncio.get_running_loop().create_task(self.engine.run(), name="sim-engine")
        if self.config.outage_at is not None:  # a timer left over at close is harmless
            asyncio.get_running_loop().call_later(self.config.outage_at, self.start_outage, self.config.outage_for)
        yield
        self._engine.cancel()

    def start_outage(self, duration: float) -> None:
        """Down for `duration` seconds: every request in flight dropped, the next ones reset."""
        self._outage_until = time.monotonic() + duration
        if duration > 0:
            for choice in [*self.engine.running, *self.engine.waiting]:
                self.engine.abort(choice, dropped=True)

    def draw(self, key: str) -> tuple[str | None, float]:
        """The fault of the next request for this prompt, and where in its output (a fraction) it strikes:
        the n-th request for a key draws the same whatever else arrives, its retry (n+1) afresh."""
        if not any(self.rates.values()):
            return None, 0.0
        attempt = self._attempts[key] = self._attempts.get(key, -1) + 1
        rng = random.Random(f"{key}:{self.config.seed}:{attempt}")
        u, where, bounds = rng.random(), rng.random(), itertools.accumulate(self.rates[name] for name in FAULTS)
        return next((fault for fault, bound in zip(FAULTS.values(), bounds) if u < bound), None), where

    async def stop_listening(self) -> None:
        """llama-server on SIGTERM: the listening socket closes, requests in progress hang (no output, no
        answer, no close), a request on a kept-alive connection loses it; nothing moves again."""
        self.listening = False
        if self.site is not None:
            await self.site.stop()
        self._engine.cancel()

    @web.middleware
    async def gate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not self.listening:  # stopped: the connection just closes
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)  # never sent
        self.open_requests += 1
        try:
            return await handler(request)
        except (Refusal, msgspec.DecodeError, msgspec.ValidationError) as exc:  # a body it cannot read: a 400
            no = exc if isinstance(exc, Refusal) else Refusal(str(exc))
            return json_response(error_body(self.flavor, no.status, str(no), no.err_type, **no.extra), no.status)
        except web.HTTPNotFound:  # an unknown path: SGLang's (FastAPI's) 404 is JSON
            if self.flavor != "sglang":
                raise
            return json_response({"detail": "Not Found"}, 404)
        finally:
            self.open_requests -= 1

    async def health(self, request: web.Request) -> web.Response:
        # SGLang's /health runs a one-token generation (about 1 s on 0.5.23 on CPU): one engine step here.
        await asyncio.sleep(self.config.health_delay + (self.flavor == "sglang") * self.config.step_ms_base / 1000)
        ok = time.monotonic() - self.started_at >= self.config.startup_delay and self._outage_until <= time.monotonic()
        if self.flavor == "llamacpp" and not ok:
            raise Refusal("Loading model", 503, "unavailable_error")
        return json_response({"status": "ok"}) if self.flavor == "llamacpp" else web.Response(status=200 if ok else 503)

    async def info(self, request: web.Request) -> web.Response:
        return json_response(self._info[request.path]())

    async def metrics(self, request: web.Request) -> web.Response:
        """/metrics in the engine's names: llama.cpp's server-task.cpp (no labels, integer values); vLLM 0.32's
        v1/metrics/loggers.py (counters get _total on the wire; the counts as its last step left them, none deferred);
        SGLang's metrics/collector.py (0.5.23: counters split by is_streaming; the retracted gauge, with a pid label,
        the sim never retracts; no aborted counter)."""
        cfg, eng, flavor, totals = self.config, self.engine, self.flavor, self.engine.totals
        usage = eng.used_tokens / cfg.max_total_num_tokens
        label = cfg.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        prompt = ("counter", "prompt_tokens_total", "Number of prefill tokens processed.", totals["prompt_tokens"])
        generated = ("counter", "generation_tokens_total", "Number of generation tokens processed.",
                     totals["generated_tokens"])

        def split(*counts: str) -> dict[str, int]:
            whole = sum(totals[c] for c in counts) - (streamed := sum(eng.streamed[c] for c in counts))
            return {',is_streaming="false"': whole, ',is_streaming="true"': streamed}

        # Each row: kind, name, help, and its value, or {more labels: value} for several samples.
        tables: dict[str, list[tuple[str, str, str, Any]]] = {
            "llamacpp": [
                ("counter", "prompt_tokens_total", "Number of prompt tokens processed", totals["prompt_tokens"]),
                ("counter", "tokens_predicted_total", "Number of generation tokens processed",
                 totals["generated_tokens"]),
                ("gauge", "requests_processing", "Number of requests processing", len(eng.running)),
                ("gauge", "requests_deferred", "Number of requests deferred", len(eng.waiting))],
            "vllm": [
                ("gauge", "num_requests_running", "Number of requests in model execution batches.",
                 eng.stepped_running),
                ("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", eng.stepped_waiting),
                ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
                ("counter", "num_preemptions_total", "Cumulative number of preemption from the engine.", 0),
                prompt, generated,
                ("gauge", "num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason labels: "
                 "'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA "
                 "budget, KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
                 {',reason="capacity"': eng.stepped_waiting, ',reason="deferred"': 0})],
            "sglang": [
                ("gauge", "num_running_reqs", "The number of running requests.", len(eng.running)),
                ("gauge", "num_queue_reqs", "The number of requests in the waiting queue.", len(eng.waiting)),
                ("gauge", "num_used_tokens", "The number of used tokens.", eng.used_tokens),
                ("gauge", "token_usage", "The token usage.", usage),
                ("gauge", "gen_throughput", "The generation throughput (token/s).", eng.last_gen_throughput),
                ("gauge", "num_retracted_reqs", "The number of retracted requests.", {f',pid="{os.getpid()}"': 0}),
                (*prompt[:3], split("prompt_tokens")), (*generated[:3], split("generated_tokens")),
                ("counter", "num_requests_total", "Number of requests processed.",
                 split("finished_requests", "aborted_requests"))]}
        labels = {"llamacpp": "", "vllm": f'engine="0",model_name="{label}"',
                  "sglang": f'engine_type="unified",model_name="{label}"'}[flavor]
        rank = ',moe_ep_rank="0",pp_rank="0",tp_rank="0"' if flavor == "sglang" else ""  # on its gauges
        page = "".join(f"# HELP {flavor}:{name} {text}\n# TYPE {flavor}:{name} {kind}\n" + "".join(
            f"{flavor}:{name} {v}\n" if flavor == "llamacpp" else
            f"{flavor}:{name}{{{labels}{rank if kind == 'gauge' else ''}{more}}} {float(v)}\n"
            for more, v in (value if isinstance(value, dict) else {"": value}).items())
            for kind, name, text, value in tables[flavor])
        return web.Response(text=page, content_type="text/plain", charset="utf-8")

    async def reset(self, request: web.Request) -> web.Response:
        self.engine.stats = new_stats()
        return json_response({"reset": True})

    async def faults(self, request: web.Request) -> web.Response:
        """GET: the switches; POST: change them (FaultUpdate, all or none)."""
        if request.method == "POST":
            update = msgspec.to_builtins(msgspec.json.decode(await request.read(), type=FaultUpdate))
            self.rates.update({name: update[name] for name in FAULTS if update[name] is not None})
            if update["outage_for"] is not None:
                self.start_outage(update["outage_for"])
            self.hold_open = self.hold_open if update["hold_open"] is None else update["hold_open"]
            if update["stop_listening"]:
                await self.stop_listening()
        remaining = max(self._outage_until - time.monotonic(), 0.0)
        return json_response({**self.rates, "outage": remaining > 0, "outage_remaining_s": remaining,
                              "listening": self.listening})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        cfg, flavor, chat = self.config, self.flavor, request.path.endswith("/chat/completions")
        if self._outage_until > time.monotonic():
            return drop_connection(request)
        if time.monotonic() - self.started_at < self.config.startup_delay:
            raise Refusal("The server is not ready yet.", 503, "ServiceUnavailableError")
        raw = await request.read()
        self.engine.stats["generation_requests"] += 1
        body = msgspec.json.decode(raw, type=Request)
        if flavor == "vllm" and body.model not in (None, cfg.model_name):  # its first check (SGLang serves any name)
            raise Refusal(f"The model `{body.model}` does not exist.", 404, "NotFoundError", param="model")
        source, n_prompt, max_new, logprobs = body.check(chat, flavor, cfg.context_length, cfg.args_given)
        fault, where = self.draw(key := prompt_key(source))
        if fault == "error":
            raise Refusal("Internal server error (simulated)", 500, "InternalServerError")
        sglang, thinking = flavor == "sglang", chat and bool((body.chat_template_kwargs or {}).get("enable_thinking"))
        tool = body.tool_called() if chat and self._tool_calls else None
        # Only SGLang takes the client's rid as the response id; llama.cpp's ids all start with chatcmpl-.
        prefix = "chatcmpl" if chat or flavor == "llamacpp" else "cmpl"
        rid = (body.rid if sglang else None) or f"{prefix}-{uuid.uuid4().hex}"
        # Each sample its own deterministic length; one past the context's room: an answer cut there is "length".
        lengths = [output_length(choice_key(key, i), cfg.seed, cfg.mean_output_tokens, cfg.output_sigma,
                                 cfg.context_length - n_prompt + 1) for i in range(body.n)]
        event = asyncio.Event()
        choices = [Choice(
            key, n_prompt, natural, max_new, body.stream, event=event, index=i, chat=chat, rid=rid, sglang=sglang,
            text=self._text[6 * i:] + self._text[:6 * i], model=body.model or cfg.model_name, top_logprobs=logprobs,
            think=max(1, math.ceil(natural * cfg.thinking_fraction)) if thinking else 0,
            separate=not chat or body.separate_reasoning, tool=tool,
            chunk_id=rid if i == 0 or not sglang else uuid.uuid4().hex,  # SGLang's n > 1: a sub-request id each
        ) for i, natural in enumerate(lengths)]
        first = choices[0]  # faults strike the first
        # At a token count inside the output (a hang at 0: before the first token); a stream error after one.
        first.hang_at = int(where * first.target) if fault == "hang" else None
        first.drop_at = {"reset": int(where * first.target),
                         "stream_error": 1 + int(where * (first.target - 1))}.get(fault or "")
        try:
            if not all(self.engine.submit(choice) for choice in choices):  # all() stops at the first refused
                raise Refusal("The request queue is full.", 503, "ServiceUnavailableError")
            if cfg.crash_marker and cfg.crash_marker.encode() in raw:
                self.start_outage(cfg.outage_for)  # a prompt that crashes its server, with everything in flight
            if body.stream:
                return await self._stream(request, choices, body.stream_options or StreamOptions(),
                                          fault == "stream_error")
            await until(event, lambda: all(choice.finish_reason for choice in choices))
            if first.dropped and fault == "stream_error":
                raise Refusal(STREAM_ERROR, 500, "InternalServerError")
            if any(choice.dropped for choice in choices):
                return drop_connection(request)
            # The prompt counted once, the output summed (SGLang's _build_chat_response and UsageProcessor; vLLM alike).
            return json_response({"id": rid, "object": "chat.completion" if chat else "text_completion",
                                  "created": int(time.time()), "model": first.model,
                                  "choices": [c.whole() for c in choices],
                                  "usage": first.usage(sum(c.generated for c in choices))})
        finally:
            for choice in choices:  # a no-op once finished; frees the slots of a client that went away
                self.engine.abort(choice)

    async def _stream(self, request: web.Request, choices: list[Choice], options: StreamOptions,
                      failing: bool) -> web.StreamResponse:
        """Choices interleaved, a chunk one choice. vLLM and llama.cpp send a chunk a step and end each choice as it
        finishes; SGLang a chunk a token and every chat finish chunk after the last output (_generate_chat_stream)."""
        flavor, first, event, continuous = self.flavor, choices[0], choices[0].event, options.continuous_usage_stats
        sglang, headers = flavor == "sglang", {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        resp = web.StreamResponse(headers={**headers, **_LLAMACPP_KEEP_ALIVE} if flavor == "llamacpp" else headers)
        if flavor != "vllm":  # vLLM's StreamingResponse sends its headers at once; the others only with the first
            # result (llama-server, SGLang's _handle_streaming_request): no byte while queued.
            await until(event, lambda: any(c.generated or c.finish_reason for c in choices))
            if first.dropped and not failing:
                drop_connection(request)
                return resp
        await resp.prepare(request)
        sent, pending, last_id = [0] * len(choices), list(choices), first.chunk_id
        while True:
            await until(event, lambda: any(c.generated > sent[c.index] or c.finish_reason for c in pending))
            for c in list(pending):
                a, b = sent[c.index], c.generated
                if b <= a and c.finish_reason is None:
                    continue
                out = []
                if a == 0 and c.chat:  # chat streams open with the role, completions with text
                    out.append(c.chunk({"role": "assistant", "content": ""}, None,
                                       0 if continuous and not sglang else None))
                for x, y in [(t, t + 1) for t in range(a, b)] if sglang else [(a, b)] * (b > a):
                    # SGLang's chat stream sends nothing for the end-of-sequence token its usage counts.
                    if sglang and c.chat and c.finish_reason == "stop" and y == c.target:
                        continue
                    # SGLang's completions stream ends a choice on its last token's chunk, with the finish.
                    last = sglang and not c.chat and y == c.target and c.finish_reason is not None
                    reasoning, content = c.pieces(x, y)
                    deltas = [{"text": content}] if not c.chat else [
                        {k: v} for k, v in (("reasoning_content", reasoning), ("content", content)) if v]
                    out += [c.chunk(delta, c.finish_reason if last and d == len(deltas) else None,
                                    y if continuous else None, c.logprobs(x, y) if d == len(deltas) else None)
                            for d, delta in enumerate(deltas, 1)]
                sent[c.index], last_id = b, c.chunk_id if out else last_id
                if c.finish_reason is not None:
                    pending.remove(c)
                    if not (sglang or c.dropped):
                        out.append(c.finish_chunks(continuous))
                await resp.write(b"".join(out))
            if not pending or first.dropped:
                break
        if first.dropped and failing:
            # The engine's event on its HTTP 200 stream: SGLang's create_streaming_error_response() makes any
            # failure a 400, vLLM's GenerationError a 500.
            body = error_body(flavor, 400 if sglang else 500, STREAM_ERROR,
                              "InternalServerError" if flavor == "vllm" else None)
            done_event = b"" if flavor == "llamacpp" else b"data: [DONE]\n\n"
            await resp.write(sse({"error": body} if sglang else body) + done_event)
        elif any(c.dropped for c in choices):
            drop_connection(request)
            return resp
        else:
            # SGLang's finish chunks, and its usage chunk, all carry the id of the last chunk sent.
            tail = [c.finish_chunks(continuous, last_id) for c in choices if sglang and c.chat]
            if options.include_usage:
                usage = first.usage(sum(sent))
                if sglang and not first.chat:  # SGLang's completions stream: no prompt_tokens_details here
                    del usage["prompt_tokens_details"]
                tail.append(sse({**first.head(last_id, []), "usage": usage}))
            await resp.write(b"".join(tail) + b"data: [DONE]\n\n")
            if self.hold_open:
                await asyncio.Event().wait()  # till the client closes (handler_cancellation)
        await resp.write_eof()
        if flavor == "llamacpp" and request.transport is not None:
            # llama-server closes the connection after a stream, whatever its Keep-Alive header said.
            request.transport.pause_reading()
            asyncio.get_running_loop().call_later(self.config.stream_close_delay, request.transport.close)
        return resp


def info_endpoints(cfg: SimConfig, engine: Engine) -> dict[str, Callable[[], Any]]:
    """GET path -> its JSON answer, for the flavor."""
    card = {"id": cfg.model_path if cfg.flavor == "llamacpp" else cfg.model_name,  # llama.cpp: the file (--alias)
            "object": "model", "owned_by": cfg.flavor, "root": cfg.model_path, "max_model_len": cfg.context_length,
            **({"parent": None} if cfg.flavor == "sglang" else {})}
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
    """Serve until SIGINT or SIGTERM (llamacpp: as llama-server, see stop_listening); on_ready gets the base URL."""

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
