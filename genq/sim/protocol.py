"""Request bodies of SGLang's OpenAI-compatible endpoints, as far as the sim reads them.

msgspec ignores unknown fields, as SGLang does, and a wrongly typed field is a
ValidationError, which the server answers 400 like SGLang's remapped 422.
"""

from __future__ import annotations

from typing import Any

import msgspec


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
