"""The OpenAI-compatible protocol both ways, as each engine serves it (sources: docs/engines.md): the request
bodies as far as the sim reads them (unknown fields ignored, as SGLang does; a wrongly typed one a 400, like
SGLang's remapped 422), the engine's checks and error bodies, and the answers built from token counts."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from genq.sim.engine import SimRequest

_encode = msgspec.json.encode
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
    if flavor == "sglang":
        return {"object": "error", "message": message, "type": err_type or "BadRequestError", "param": None,
                "code": status}
    if flavor == "vllm":
        return {"error": {"message": message, "type": err_type or "BadRequestError", "param": extra.get("param"),
                          "code": status}}
    return {"error": {"code": status, "message": message,
                      "type": err_type or _LLAMACPP_TYPES.get(status, "server_error"), **extra}}


def stream_error(flavor: str, message: str) -> bytes:
    """The SSE event an engine sends on its HTTP 200 stream when a request fails after output began
    (SGLang's create_streaming_error_response() makes any failure a 400; vLLM's GenerationError a 500)."""
    if flavor == "llamacpp":
        return sse(error_body(flavor, 500, message))
    body = error_body(flavor, 400, message) if flavor == "sglang" else error_body(flavor, 500, message, "InternalServerError")
    return sse({"error": body} if flavor == "sglang" else body) + b"data: [DONE]\n\n"


def sse(data: Any) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


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
        """(what the prompt key hashes, its tokens, the most tokens it may generate, alternatives a token in the
        answer's logprobs or None: none), or the engine's 400 (a Refusal). ctx_given: SGLang was started with
        --context-length. A batch of prompts (several choices in SGLang) is not served."""
        source: Any = self.prompt
        logprobs = None if self.logprobs is None else int(self.logprobs)
        max_new: int | None = 16 if self.max_tokens is None else self.max_tokens  # the OpenAI default for completions
        if chat:
            if not self.messages:
                raise Refusal("messages: Field required (a non-empty list).")
            source, n_prompt = self.messages, chat_prompt_tokens(self.messages)
            # SGLang: max_completion_tokens wins over the deprecated max_tokens.
            max_new = self.max_tokens if self.max_completion_tokens is None else self.max_completion_tokens
            logprobs = (self.top_logprobs or 0) if self.logprobs else None
        elif isinstance(source, str):
            n_prompt = text_tokens(source)
        elif isinstance(source, list) and source and all(isinstance(t, int) for t in source):
            n_prompt = len(source)
        else:
            raise Refusal("prompt must be a string or a list of token ids in genq sim.")
        return source, n_prompt, self._limit(chat, flavor, n_prompt, max_new, ctx, ctx_given), logprobs

    def _limit(self, chat: bool, flavor: str, n_prompt: int, max_new: int | None, ctx: int, ctx_given: bool) -> int:
        for bad, message in (
                (flavor == "llamacpp" and self.n != 1, "Only one completion choice is allowed"),
                (self.n < 1, f"n must be at least 1, got {self.n}."),
                (self.top_logprobs is not None and not 0 <= self.top_logprobs <= 20,
                 f"top_logprobs must be between 0 and 20, got {self.top_logprobs}."),
                (chat and not isinstance(self.logprobs, bool | None), "logprobs: Input should be a valid boolean"),
                (chat and bool(self.top_logprobs) and not self.logprobs, "top_logprobs requires logprobs to be true."),
                (max_new is not None and max_new < 0, f"max_new_tokens must be at least 0, got {max_new}."),
                (self.temperature is not None and self.temperature < 0,
                 f"temperature must be non-negative, got {self.temperature}."),
                (self.top_p is not None and not 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}.")):
            if bad:
                raise Refusal(message)
        left = ctx - n_prompt
        if flavor == "llamacpp":
            # Checked against the slot's context; max_tokens past its end is no error, the slot stops there.
            if left <= 0:
                raise Refusal(f"request ({n_prompt} tokens) exceeds the available context size ({ctx} tokens), try "
                              "increasing it", 400, "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=ctx)
            return left if max_new is None else min(max_new, left)
        if flavor == "vllm":
            # vLLM 0.32's checks in its order. "at least ctx + 1": its chat tokenizer cuts there; the
            # "(parameter=..., value=...)" tail is VLLMValidationError's str().
            if max_new is not None and max_new > ctx:
                raise Refusal(f"max_tokens={max_new} cannot be greater than max_model_len={ctx}. Please request fewer "
                              f"output tokens. (parameter=max_tokens, value={max_new})", param="max_tokens")
            if left < 0:
                raise Refusal(f"This model's maximum context length is {ctx} tokens. However, your prompt contains at "
                              f"least {ctx + 1} input tokens, which exceeds this limit even without any output tokens. "
                              f"Please reduce the length of the input prompt. (parameter=input_tokens, value={ctx + 1})",
                              param="input_tokens")
            if left == 0:
                raise Refusal("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)", param="max_tokens")
            return left if max_new is None else min(max_new, left)
        # SGLang 0.5.23: with --context-length, max_tokens over it is refused before the prompt is
        # tokenized (its message's missing space included).
        if ctx_given and max_new is not None and max_new > ctx:
            raise Refusal(f"max_completion_tokens is too large: {max_new}.This model supports at most {ctx} "
                          "completion tokens.")
        if left <= 0:
            raise Refusal(f"The input ({n_prompt} tokens) is longer than the model's context length ({ctx} tokens).")
        if max_new is not None and max_new + n_prompt >= ctx:
            raise Refusal(f"Requested token count exceeds the model's maximum context length of {ctx} tokens. You "
                          f"requested a total of {max_new + n_prompt} tokens: {n_prompt} tokens from the input messages "
                          f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                          "messages or the completion to fit within the limit.")
        return left if max_new is None else max_new  # SGLang runs a chat without a limit to the context's end

    def tool_called(self) -> str | None:
        """The function the sim's answer calls: the chosen one, else the first offered (none for "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            return str((self.tool_choice.get("function") or {}).get("name") or "")
        function = self.tools[0].get("function")
        return str(function.get("name")) if isinstance(function, dict) else None


def text_tokens(text: str) -> int:
    return len(text) // 4 + 1


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About four characters a token, summed over message contents (the text parts of multimodal ones)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += text_tokens(content if isinstance(content, str) else "")
    return total



@dataclass(slots=True, eq=False, kw_only=True)
class Choice(SimRequest):
    """One choice of a request (its n samples run as requests of their own, as in SGLang and vLLM) and the
    bodies it answers with, from token counts: the text of tokens [a, b) is a slice of a fixed string (rotated
    per choice, so samples differ), reasoning first when thinking. SGLang's shapes (tests/recordings/sglang-0.5.23/):
    every delta has reasoning_content, and each choice's chunks carry its own sub-request's id (chunk_id)."""

    text: str
    chat: bool
    rid: str
    model: str
    think: int  # tokens of reasoning at the start of the output (0: no thinking)
    separate: bool  # separate_reasoning: reasoning goes to reasoning_content
    index: int
    top_logprobs: int | None  # logprobs asked for, with this many alternatives; None: not asked
    tool: str | None  # the tool the answer calls after its text (SGLang with a tool-call parser)
    sglang: bool
    chunk_id: str

    def finish(self) -> str | None:
        """SGLang turns a natural stop after a tool call into "tool_calls" (serving_chat.py)."""
        return "tool_calls" if self.tool and self.finish_reason == "stop" else self.finish_reason

    def call(self, tokens: int) -> dict[str, Any]:
        return {"id": f"call_{self.rid[-8:]}_{self.index}", "type": "function",
                "function": {"name": self.tool, "arguments": _encode({"tokens": tokens}).decode()}}

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
        """Logprobs of output tokens [a, b) in the endpoint's shape, None when not asked; fake values, fixed
        by choice and position, each alternative less likely than the one before."""
        k = self.top_logprobs
        if k is None:
            return None
        tokens = [self.text[4 * t : 4 * t + 4] for t in range(a, b)]
        values = [-round(((self.index * 7919 + t * 104729) % 1000) / 1000 + 0.001, 4) for t in range(a, b)]
        alts = [[(tok if i == 0 else f"{tok}~{i}", round(lp - i, 4)) for i in range(k)]
                for tok, lp in zip(tokens, values, strict=True)]
        if self.chat:
            return {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                 "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in alt]}
                                for tok, lp, alt in zip(tokens, values, alts, strict=True)]}
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": [dict(alt) for alt in alts] if k else None,
                "text_offset": [4 * t for t in range(a, b)]}

    def stop_field(self, finish: str | None) -> dict[str, Any]:
        """SGLang's matched_stop names the EOS token; vLLM's stop_reason is null at EOS (it names stop strings)."""
        return {"matched_stop": EOS_TOKEN_ID if finish == "stop" else None} if self.sglang else {"stop_reason": None}

    def whole(self) -> dict[str, Any]:
        """This choice of a whole answer."""
        reasoning, content = self.pieces(0, self.generated)
        body: dict[str, Any] = {"index": self.index, "text": reasoning + content}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
            if self.tool or not self.sglang:  # SGLang's message has no tool_calls key without a call
                message["tool_calls"] = [self.call(self.generated)] if self.tool else None
            body = {"index": self.index, "message": message}
        return {**body, "logprobs": self.logprobs(0, self.generated),
                "finish_reason": self.finish() if self.chat else self.finish_reason,
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
        """A choice's last events: its tool call, if any, in two pieces (name, then arguments), then its
        finish_reason (SGLang's chat finish chunk has no usage)."""
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


def full_answer(choices: list[Choice]) -> dict[str, Any]:
    """A whole answer: one choice per sample, the prompt counted once, the output summed (SGLang's
    _build_chat_response and UsageProcessor; vLLM alike)."""
    first = choices[0]
    return {"id": first.rid, "object": "chat.completion" if first.chat else "text_completion",
            "created": int(time.time()), "model": first.model, "choices": [c.whole() for c in choices],
            "usage": first.usage(sum(c.generated for c in choices))}
