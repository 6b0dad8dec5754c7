"""A streamed answer, event by event: demultiplexed by choice index into whole choices.

A request for n > 1 samples streams them interleaved: SGLang and vLLM send one choice per
chunk, each with its `index` (SGLang's _generate_chat_stream, vLLM's chat_completion_stream_generator;
docs/fidelity.md names the lines). With continuous usage stats a chunk's usage counts the
tokens of its own choice; the last chunk (no choices) has the request's total.
"""

from __future__ import annotations

import time
from typing import Any

from genq.core.records import Choice
from genq.worker.wire import Completion, Failure, Progress, WireUsage, decode_answer, event_failure, usage_of


class _ChoiceState:
    __slots__ = ("text", "reasoning", "finish_reason", "tokens", "logprobs", "matched_stop", "tool_calls")

    def __init__(self) -> None:
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.finish_reason: str | None = None
        self.tokens: int | None = None  # the last per-choice usage seen
        self.logprobs: dict[str, Any] | None = None
        self.matched_stop: int | str | None = None
        self.tool_calls: dict[int, dict[str, Any]] = {}  # by the call's index

    def add_tool_calls(self, pieces: list[dict[str, Any]]) -> None:
        """Streamed calls come in pieces by index: the first names id, type and function name,
        the rest carry more of the arguments (OpenAI's shape; SGLang and vLLM send it)."""
        for piece in pieces:
            index = piece.get("index", len(self.tool_calls))
            call = self.tool_calls.setdefault(index if isinstance(index, int) else 0,
                                              {"id": None, "type": "function", "function": {"name": None, "arguments": ""}})
            for key in ("id", "type"):
                if piece.get(key):
                    call[key] = piece[key]
            function = piece.get("function")
            if isinstance(function, dict):
                if function.get("name"):
                    call["function"]["name"] = function["name"]
                if isinstance(function.get("arguments"), str):
                    call["function"]["arguments"] += function["arguments"]

    def add_logprobs(self, piece: dict[str, Any]) -> None:
        """A chunk's logprobs: its lists (chat's content; completions' tokens, token_logprobs,
        top_logprobs, text_offset) extend what came before."""
        have = self.logprobs = self.logprobs or {}
        for key, value in piece.items():
            if isinstance(value, list) and isinstance(have.get(key), list):
                have[key].extend(value)
            elif value is not None or key not in have:
                have[key] = list(value) if isinstance(value, list) else value

    def choice(self, index: int) -> Choice:
        return Choice(index=index, completion="".join(self.text), finish_reason=self.finish_reason,
                      completion_tokens=self.tokens,
                      reasoning_content="".join(self.reasoning) if self.reasoning else None,
                      logprobs=self.logprobs, matched_stop=self.matched_stop,
                      tool_calls=[self.tool_calls[i] for i in sorted(self.tool_calls)] or None)


class _StreamState:
    """What the events of one stream have said so far."""

    __slots__ = ("choices", "usage", "total_seen", "response_id", "model", "done", "events")

    def __init__(self, model: str) -> None:
        self.choices: dict[int, _ChoiceState] = {}
        self.usage: WireUsage | None = None
        self.total_seen = False  # usage came on a chunk without choices: the request's total
        self.response_id: str | None = None
        self.model = model
        self.done = False
        self.events = 0  # events before this one

    def feed(self, payload: bytes, progress: Progress) -> Failure | None:
        if payload == b"[DONE]":
            self.done = True
            return None
        event = decode_answer(payload)
        if isinstance(event, Failure):
            return Failure("protocol", f"stream event is not a JSON object: {payload[:200]!r}")
        if event.error is not None:  # the engines report errors in a running stream this way, on HTTP 200
            return event_failure(event.error, mid_stream=self.events > 0)
        self.events += 1
        if self.response_id is None:
            self.response_id = event.id
        if event.model:
            self.model = event.model
        usage = event.usage
        for wire in event.choices or ():
            state = self.choices.get(wire.index)
            if state is None:
                state = self.choices[wire.index] = _ChoiceState()
            delta = wire.delta
            if delta is not None:
                if delta.content:
                    state.text.append(delta.content)
                piece = delta.reasoning_content or delta.reasoning
                if piece:
                    state.reasoning.append(piece)
                if delta.tool_calls:
                    state.add_tool_calls(delta.tool_calls)
            elif wire.text:
                state.text.append(wire.text)
            if wire.finish_reason:
                state.finish_reason = wire.finish_reason
                state.matched_stop = wire.stop
            if wire.logprobs:
                state.add_logprobs(wire.logprobs)
            if usage is not None and usage.completion_tokens is not None:
                state.tokens = usage.completion_tokens
        if usage is not None:
            self.total_seen = self.total_seen or not event.choices
            whole = self.total_seen or len(self.choices) <= 1  # the request's count, not one choice's
            if whole:
                self.usage = usage
            elif self.usage is None:  # per-choice usage: the prompt's tokens for the total
                self.usage = WireUsage(prompt_tokens=usage.prompt_tokens)
            progress.advance((usage.completion_tokens or 0) if whole else sum(s.tokens or 0 for s in self.choices.values()))
        elif self.usage is None:
            progress.advance(progress.tokens + 1)  # no usage stats: count events
        return None

    def completion(self) -> Completion:
        indexes = sorted(self.choices) or [0]
        choices = [self.choices.get(i, _ChoiceState()).choice(i) for i in indexes]
        usage = usage_of(self.usage)
        if not self.total_seen and len(choices) > 1:
            # No total from the server: the sum of what each choice's last chunk counted.
            usage.completion_tokens = sum(c.completion_tokens or 0 for c in choices)
        elif len(choices) > 1:
            # SGLang's chat stream sends no chunk for a choice's end-of-sequence token, which its
            # total counts: when the total exceeds the choices' own counts by the number of
            # choices that stopped, each of those has one token more than its chunks said.
            stopped = [c for c in choices if c.finish_reason in ("stop", "tool_calls")]
            if stopped and usage.completion_tokens - sum(c.completion_tokens or 0 for c in choices) == len(stopped):
                for c in stopped:
                    c.completion_tokens = (c.completion_tokens or 0) + 1
        if len(choices) == 1 and (choices[0].completion_tokens is None or self.total_seen):
            choices[0].completion_tokens = usage.completion_tokens
        return Completion(choices=choices, usage=usage, model=self.model, response_id=self.response_id)


class StreamSink:
    """A stream's body as it comes, in pieces of any size: split into lines, each `data:`
    event fed to the state. Called with each piece; True once a failure ends the reading."""

    __slots__ = ("state", "progress", "rest", "failure")

    def __init__(self, model: str, progress: Progress) -> None:
        self.state = _StreamState(model)
        self.progress = progress
        self.rest = b""  # the unfinished last line
        self.failure: Failure | None = None

    def __call__(self, chunk: bytes) -> bool:
        progress = self.progress
        now = progress.last_activity = time.monotonic()
        if progress.first_byte is None:
            progress.first_byte = now
        state = self.state
        if state.done:  # read on to the body's end: a body left unread costs the connection
            return False
        if self.rest:
            chunk = self.rest + chunk
        lines = chunk.split(b"\n")
        self.rest = lines.pop()
        for line in lines:
            if line.startswith(b"data:"):
                self.failure = state.feed(line[5:].strip(), progress)
                if self.failure is not None:
                    return True
                if state.done:
                    break
        return False

    def outcome(self) -> Completion | Failure:
        """Once the body has ended (or a failure stopped the reading)."""
        if self.failure is not None:
            return self.failure
        if not self.state.done and self.rest.startswith(b"data:"):
            failure = self.state.feed(self.rest[5:].strip(), self.progress)
            if failure is not None:
                return failure
        if not self.state.done:
            return Failure("connection", "stream ended before [DONE]")
        return self.state.completion()
