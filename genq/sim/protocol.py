"""The OpenAI-compatible protocol as SGLang serves it, both ways: the request bodies as far as the sim
reads them, and the answers, built from token counts, in the shapes SGLang, vLLM and llama.cpp share
(SGLang's extras, matched_stop and reasoning_content, kept). msgspec ignores unknown fields, as SGLang
does; a wrongly typed one is a ValidationError, answered 400 like SGLang's remapped 422.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from genq.sim.engine import SimRequest


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # SGLang uses rid as the response id.
    rid: str | None = None
    top_logprobs: int | None = None


class ChatRequest(_Sampling, kw_only=True):
    messages: list[dict[str, Any]] | None = None
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    separate_reasoning: bool = True
    logprobs: bool = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None

    def tool_called(self) -> str | None:
        """The function the sim's answer calls: the chosen one, else the first offered (none
        with tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, dict):
            return str((self.tool_choice.get("function") or {}).get("name") or "")
        function = self.tools[0].get("function")
        return str(function.get("name")) if isinstance(function, dict) else None

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the answer's logprobs list, or None: no logprobs."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_new_tokens(self) -> int | None:
        # SGLang: max_completion_tokens wins over the deprecated max_tokens.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def counted_prompt(self) -> tuple[Any, int] | str:
        """(what the prompt key hashes, its tokens), or why the sim refuses it."""
        if not self.messages:
            return "messages: Field required (a non-empty list)."
        return self.messages, chat_prompt_tokens(self.messages)

    def thinking(self) -> bool:
        return bool((self.chat_template_kwargs or {}).get("enable_thinking"))


class CompletionRequest(_Sampling, kw_only=True):
    # str, list of str, or token ids; kept as sent for the prompt key.
    prompt: Any = None
    logprobs: int | None = None  # completions: the number of alternatives, 0 for the chosen token only

    def logprobs_asked(self) -> int | None:
        return self.logprobs

    def max_new_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens  # the OpenAI default for completions

    def counted_prompt(self) -> tuple[Any, int] | str:
        """(what the prompt key hashes, its tokens), or why the sim refuses it: a batch of prompts,
        which SGLang answers with several choices, is not served."""
        if isinstance(self.prompt, str):
            return self.prompt, _text_tokens(self.prompt)
        if isinstance(self.prompt, list) and self.prompt and all(isinstance(t, int) for t in self.prompt):
            return self.prompt, len(self.prompt)
        return "prompt must be a string or a list of token ids in genq sim."


def _text_tokens(text: str) -> int:
    return len(text) // 4 + 1


def chat_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """About four characters a token, summed over message contents (text parts of
    multimodal contents count, other parts do not)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
        total += _text_tokens(content if isinstance(content, str) else "")
    return total


def validate(body: _Sampling, max_new_tokens: int | None, flavor: str) -> str | None:
    """SGLang's checks on sampling values; returns the error message or None."""
    if flavor == "llamacpp" and body.n != 1:
        # llama.cpp's oaicompat params parsing refuses any other n.
        return "Only one completion choice is allowed"
    if body.n < 1:
        return f"n must be at least 1, got {body.n}."
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        return f"top_logprobs must be between 0 and 20, got {body.top_logprobs}."
    if isinstance(body, ChatRequest) and body.top_logprobs and not body.logprobs:
        return "top_logprobs requires logprobs to be true."
    if max_new_tokens is not None and max_new_tokens < 0:
        return f"max_new_tokens must be at least 0, got {max_new_tokens}."
    if body.temperature is not None and body.temperature < 0:
        return f"temperature must be non-negative, got {body.temperature}."
    if body.top_p is not None and not 0 < body.top_p <= 1:
        return f"top_p must be in (0, 1], got {body.top_p}."
    return None


# Reported as matched_stop of a natural stop: Qwen's <|im_end|> token id, what
# SGLang reports when generation ends on EOS.
EOS_TOKEN_ID = 151645
# The sim's text: about four characters a "token", sliced, never generated per token.
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "

_encode = msgspec.json.encode


@dataclass(slots=True)
class Reply:
    """Builds response bodies for one choice of a request from token counts: the text of
    tokens [a, b) is a slice of a fixed string (rotated per choice, so that the n samples
    of a request differ), reasoning first when thinking is on."""

    text: str
    chat: bool
    rid: str
    model: str
    prompt_tokens: int
    think: int  # tokens of reasoning at the start of the output (0: no thinking)
    separate: bool  # separate_reasoning: reasoning goes to reasoning_content
    index: int = 0  # the choice's index (n > 1)
    top_logprobs: int | None = None  # logprobs asked for, with this many alternatives; None: not asked
    # The tool the answer calls (the request offered tools), as SGLang with a tool-call
    # parser answers: the text, then the call; None: no call.
    tool: str | None = None
    # SGLang's stream shapes (recorded from 0.5.23, tests/recordings/sglang-0.5.23/): every
    # delta has reasoning_content (null when none), and each choice's chunks carry the id of
    # its own sub-request. chunk_id: that id (the request's rid for choice 0).
    sglang: bool = False
    chunk_id: str = ""

    def finish(self, reason: str | None) -> str | None:
        """SGLang turns a natural stop after a tool call into "tool_calls" (serving_chat.py)."""
        return "tool_calls" if self.tool and reason == "stop" else reason

    def call(self, tokens: int) -> dict[str, Any]:
        return {"id": f"call_{self.rid[-8:]}_{self.index}", "type": "function",
                "function": {"name": self.tool, "arguments": _encode({"tokens": tokens}).decode()}}

    def tool_deltas(self, tokens: int) -> list[dict[str, Any]]:
        """The call streamed in two pieces, as the engines send it: its name, then its arguments."""
        if not self.tool:
            return []
        call = self.call(tokens)
        head = {**call, "index": 0, "function": {"name": self.tool, "arguments": ""}}
        return [{"tool_calls": [head]}, {"tool_calls": [{"index": 0, "function": {"arguments": call["function"]["arguments"]}}]}]

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

    def logprobs(self, a: int, b: int) -> dict[str, Any] | None:
        """The logprobs of output tokens [a, b) in the OpenAI shape of the endpoint, or None
        when not asked for. Values are fake but fixed: a function of the choice and position."""
        if self.top_logprobs is None:
            return None
        k, tokens = self.top_logprobs, [self.text[4 * t : 4 * t + 4] for t in range(a, b)]
        values = [_logprob(self.index, t) for t in range(a, b)]
        if self.chat:
            return {"content": [
                {"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                 "top_logprobs": [{"token": alt, "logprob": alp, "bytes": list(alt.encode())}
                                  for alt, alp in _alternatives(tok, lp, k)]}
                for tok, lp in zip(tokens, values, strict=True)]}
        return {"tokens": tokens, "token_logprobs": values,
                "top_logprobs": [dict(_alternatives(tok, lp, k)) for tok, lp in zip(tokens, values, strict=True)]
                if k else None,
                "text_offset": [4 * t for t in range(a, b)]}

    def choice(self, req: SimRequest) -> dict[str, Any]:
        """This choice of a whole (non-streamed) answer."""
        reasoning, content = self.pieces(0, req.generated)
        if not self.chat:
            body: dict[str, Any] = {"index": self.index, "text": reasoning + content}
        else:
            message: dict[str, Any] = {"role": "assistant", "content": content, "reasoning_content": reasoning or None}
            if self.tool or not self.sglang:  # SGLang's message has no tool_calls key without a call
                message["tool_calls"] = [self.call(req.generated)] if self.tool else None
            body = {"index": self.index, "message": message}
        finish = self.finish(req.finish_reason) if self.chat else req.finish_reason
        return {**body, "logprobs": self.logprobs(0, req.generated), "finish_reason": finish,
                **self.stop_field(req.finish_reason)}

    def stop_field(self, finish: str | None) -> dict[str, Any]:
        """What stopped the choice: SGLang's matched_stop names the EOS token; vLLM's stop_reason
        is null at EOS (it names only stop strings and stop_token_ids)."""
        if self.sglang:
            return {"matched_stop": EOS_TOKEN_ID if finish == "stop" else None}
        return {"stop_reason": None}

    def deltas(self, a: int, b: int) -> list[dict[str, Any]]:
        reasoning, content = self.pieces(a, b)
        if not self.chat:
            return [{"text": content}]
        out: list[dict[str, Any]] = []
        if reasoning:
            out.append({"reasoning_content": reasoning})
        if content:
            out.append({"content": content})
        if self.sglang:
            out = [{"reasoning_content": None, **d} for d in out]
        return out

    def chunk(self, delta: dict[str, Any] | None, finish: str | None, tokens: int | None,
              logprobs: dict[str, Any] | None = None, chunk_id: str | None = None) -> dict[str, Any]:
        """One stream chunk; delta None is the finish chunk (empty delta/text)."""
        if self.chat:
            if self.sglang:
                delta = {"reasoning_content": None, **(delta or {})}
            choice: dict[str, Any] = {"index": self.index, "delta": delta or {}, "logprobs": logprobs}
        else:
            choice = {"index": self.index, "text": (delta or {}).get("text", ""), "logprobs": logprobs}
        choice["finish_reason"] = finish
        choice.update(self.stop_field(finish))
        out = self._head(chunk_id or self.chunk_id or self.rid, [choice])
        # SGLang's chunks without a count (its role and finish chunks) have no usage key.
        if tokens is not None or not self.sglang:
            out["usage"] = None if tokens is None else self.usage(tokens)
        return out

    def usage_chunk(self, tokens: int, chunk_id: str | None = None) -> dict[str, Any]:
        """The last chunk: the request's usage (tokens: over all its choices), no choices."""
        return {**self._head(chunk_id or self.rid, []), "usage": self.usage(tokens)}

    def _head(self, chunk_id: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": chunk_id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(time.time()), "model": self.model, "choices": choices}


def full_answer(replies: list[Reply], reqs: list[SimRequest]) -> dict[str, Any]:
    """A whole answer: one choice per sample, the prompt counted once and the output tokens
    summed (SGLang's _build_chat_response and UsageProcessor; vLLM alike)."""
    first = replies[0]
    return {
        "id": first.rid,
        "object": "chat.completion" if first.chat else "text_completion",
        "created": int(time.time()),
        "model": first.model,
        "choices": [reply.choice(req) for reply, req in zip(replies, reqs, strict=True)],
        "usage": first.usage(sum(req.generated for req in reqs)),
    }


def _logprob(index: int, position: int) -> float:
    return -round(((index * 7919 + position * 104729) % 1000) / 1000 + 0.001, 4)


def _alternatives(token: str, logprob: float, k: int) -> list[tuple[str, float]]:
    """k alternatives, the chosen token first, each less likely than the one before."""
    return [(token if i == 0 else f"{token}~{i}", round(logprob - i, 4)) for i in range(k)]
