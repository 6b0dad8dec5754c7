"""Response bodies of the OpenAI-compatible endpoints, built from token counts.

Shared by every flavor: SGLang, vLLM and llama.cpp answer chat/completions in the
same shapes (SGLang's extra fields, matched_stop and reasoning_content, are kept).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgspec

from genq.sim.engine import SimRequest
from genq.sim.protocol import ChatRequest, CompletionRequest

# Reported as matched_stop of a natural stop: Qwen's <|im_end|> token id, what
# SGLang reports when generation ends on EOS.
EOS_TOKEN_ID = 151645
# The sim's text: about four characters a "token", sliced, never generated per token.
WORDS = "lorem ipsum dolor sit amet consectetur adipiscing elit sed do eiusmod tempor "

_encode = msgspec.json.encode


def sse(data: Any) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


@dataclass(slots=True)
class Job:
    """A request that passed validation."""

    body: ChatRequest | CompletionRequest
    key: str
    prompt_tokens: int
    max_new_tokens: int


@dataclass(slots=True)
class Reply:
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
