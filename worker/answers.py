"""From what the server answered to the record: every choice asked for, and only what was asked.

A request for n samples must come back with n choices (indexes 0..n-1) or it is a failure:
a record that holds fewer samples than its request asked for would pass unnoticed into
training data. docs/fidelity.md lists where each request field's answer lands.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from genq.core.records import JobConfig, Prompt, Result
from genq.worker.decoding import DecodeMeter
from genq.worker.held import Task
from genq.worker.wire import Completion, Failure

# Request fields whose answer genq keeps (Result.matched_stop) only when they were set.
_STOP_FIELDS = ("stop", "stop_token_ids")


def samples(config: JobConfig, prompt: Prompt) -> int:
    """How many samples (sequences on the server) the request asks for: its n."""
    n = (prompt.sampling or {}).get("n", config.extra_body.get("n", 1))
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1


class Running(dict[Task, "asyncio.Task[None]"]):
    """The requests in flight, and the sequences they are on the server (the in-flight target's
    unit): a request for n samples is n, SGLang and vLLM schedule each choice as its own."""

    def __init__(self) -> None:
        super().__init__()
        self.sequences = 0
        self.meter = DecodeMeter()  # their streamed tokens against how many decode (worker/decoding.py)

    # A task's n is its progress's `sequences`, set when it was taken to send (dispatch._take).
    def __setitem__(self, task: Task, aio: asyncio.Task[None]) -> None:
        if task not in self:
            self.sequences += task.progress.sequences
            self.meter.sent(task.progress)
        super().__setitem__(task, aio)

    def cancel_all(self, reason: str | None = None) -> None:
        """Stop every request. With a reason, each ends as a failure with it (and is retried by the
        failure policy); without, nothing is recorded or counted."""
        for task, aio in list(self.items()):
            task.cancel_reason = reason
            aio.cancel()

    def pop(self, task: Task, default: Any = None) -> Any:
        if task in self:
            self.sequences -= task.progress.sequences
            self.meter.ended(task.progress)
        return super().pop(task, default)


def result_of(body: dict[str, Any], c: Completion, *, prompt: Prompt, job: str, batch: str, worker: str,
              attempts: int, latency_s: float, settings_version: int = 0) -> Result | Failure:
    n = body.get("n", 1)
    n = n if isinstance(n, int) and n > 1 else 1
    indexes = [choice.index for choice in c.choices]
    if indexes != list(range(n)):
        return Failure("protocol", f"the request asked for n={n} choices; the server answered with "
                       f"indexes {indexes}", retryable=False)
    asked_stop = any(body.get(name) for name in _STOP_FIELDS)
    # Chat asks with true; completions with a count of alternatives, 0 included.
    asked_logprobs = body.get("logprobs") is not None and body.get("logprobs") is not False
    for choice in c.choices:
        if not asked_stop:
            choice.matched_stop = msgspec.UNSET  # absent: not asked; null: asked, the server named none
        if not asked_logprobs:
            choice.logprobs = None
            continue
        tokens = choice.completion_tokens if choice.completion_tokens is not None else \
            c.usage.completion_tokens if n == 1 else None
        logprobs = one_per_token(choice.logprobs, tokens, choice.finish_reason, chat="messages" in body)
        if logprobs is None:
            return Failure("protocol", f"the request asked for logprobs; the server's choice {choice.index} has none",
                           retryable=False)
        choice.logprobs = logprobs
    first = c.choices[0]
    return Result(
        id=prompt.id, job=job, batch=batch, index=prompt.index,
        completion=first.completion, reasoning_content=first.reasoning_content, finish_reason=first.finish_reason,
        usage=c.usage, model=c.model, worker=worker, attempts=attempts, latency_s=round(latency_s, 3),
        # Without its prompt, as Redis keeps it (records.without_prompt): the shard joins them again.
        response_id=c.response_id, finished_at=time.time(),
        choices=c.choices if n > 1 else None, logprobs=first.logprobs, matched_stop=first.matched_stop,
        tool_calls=first.tool_calls, settings_version=settings_version,
    )


# The most trailing tokens SGLang's chat stream counts without sending their logprobs: those that
# decode to no text, the end-of-sequence token or the bytes of an unfinished UTF-8 character (<= 4).
UNSENT_MAX = 4


def one_per_token(logprobs: dict[str, Any] | None, tokens: int | None, finish_reason: str | None, *,
                  chat: bool) -> dict[str, Any] | None:
    """A choice's logprobs with one entry per generated token (docs/engines.md, "Logprobs"): the
    trailing tokens SGLang's chat stream counts and never sends, at most UNSENT_MAX, are null entries
    (no figure made up). None: the server sent none for a choice that needed more (it ignored the
    request)."""
    have = 0 if logprobs is None else len(logprobs.get("content" if chat else "token_logprobs") or ())
    unsent = 0 if tokens is None else tokens - have
    if not 0 < unsent <= UNSENT_MAX or (logprobs is None and finish_reason not in ("stop", "tool_calls")):
        return logprobs
    if chat:
        entry = {"token": None, "logprob": None, "bytes": None, "top_logprobs": None}
        return {**(logprobs or {}), "content": [*((logprobs or {}).get("content") or ()), *[entry] * unsent]}
    if logprobs is None:
        return {k: [None] * unsent for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    # Each per-token list grows (top_logprobs is null, not a list, when no alternatives were asked).
    return {k: [*v, *[None] * unsent] if isinstance(v, list) and len(v) == have else v for k, v in logprobs.items()}
