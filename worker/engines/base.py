"""What genq knows of one kind of inference server, behind one small interface.

Each engine genq drives has a class of its own beside this file (sglang.py, vllm.py, llamacpp.py,
openai.py, one instance each): how to tell a server is this engine (`probe`, or its metric prefix),
how many requests it runs at once (told by `probe`, else learned by the concurrency controller from
its metrics), the metric names it publishes for each meaning, where its context length comes from,
and the shape of its errors (in its docstring: one tolerant reader, worker/wire.py, decodes every
answer, because an answer is read the same whichever engine sent it). Callers ask the engine object
(ServerInfo.engine) instead of branching on its name. The engines' sources, line by line, are in
docs/engines.md.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, ClassVar

import msgspec

from genq.core.records import Hardware

# The JSON answer of a GET on the server, or None when it has no such endpoint (worker/server.py).
GetJson = Callable[[str], Awaitable[Any]]

# Where the controller starts when the server does not tell its capacity (vLLM, or one genq does
# not recognise), then follows /metrics. vLLM's default max_num_seqs is 128 on CPU, 256 on most
# GPUs, 1024 on H100/H200/B200 (vllm/engine/arg_utils.py): growing by half per look reaches any of
# them within seconds.
CAPACITY_START = 64


class Told(msgspec.Struct, frozen=True):
    """What a server's own endpoint says about itself (None: it does not say)."""

    capacity: int | None = None  # requests it runs at once
    context_length: int | None = None  # per request (llama.cpp: per slot)
    memory: Hardware = Hardware()  # its weight and KV cache sizes, where it says (SGLang)


class Engine:
    """One kind of inference server. The defaults are a plain OpenAI-compatible server's: no
    endpoint of its own, no metrics genq knows."""

    name: ClassVar[str]  # the flavor: ServerInfo.flavor, logs and messages
    # Its metric names start so (None: it has none genq knows); their presence on /metrics says
    # the server publishes metrics genq can read.
    metric_prefix: ClassVar[bytes | None] = None
    # True for an engine with no endpoint of its own to tell it by: its metric prefix names it.
    named_by_metrics: ClassVar[bool] = False
    # Its Prometheus names for each figure the controller reads (worker/engines/metrics.py),
    # each a tuple of the names it has used (newer first where they differ).
    running: ClassVar[tuple[str, ...]] = ()
    waiting: ClassVar[tuple[str, ...]] = ()
    # A gauge with a reason="capacity" series: of the waiting requests, those that wait for a slot.
    waiting_for_slot: ClassVar[str | None] = None
    kv_usage: ClassVar[tuple[str, ...]] = ()  # fraction 0..1 per rank
    retracted: ClassVar[tuple[str, ...]] = ()  # gauge: requests retracted lately
    retractions_total: ClassVar[tuple[str, ...]] = ()  # counter: retracted/preempted since start
    generated_total: ClassVar[tuple[str, ...]] = ()  # counter: output tokens made since start
    # What the context length the server reports is, for the preflight's message.
    context_where: ClassVar[str] = "the model's context"

    async def probe(self, get_json: GetJson) -> Told | None:
        """What this engine's own endpoint says, or None when the server is not this engine (or
        the engine has no endpoint to tell it by)."""
        return None

    def __repr__(self) -> str:
        return f"<engine {self.name}>"
