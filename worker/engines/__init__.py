"""The engines genq knows, one module each (base.py: the interface), and how a server is told apart.

ENGINES is in the order they are tried: first the engines with an endpoint of their own (SGLang's
/server_info, llama.cpp's /props), then the metric prefixes on /metrics name vLLM; anything
else is a plain OpenAI-compatible server. The same order is the order of the metric names read
(worker/engines/metrics.py): a page has one engine's names, so it only breaks ties that never come.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import msgspec

from genq.core.records import Hardware
from genq.worker.engines.base import Engine, GetJson
from genq.worker.engines.llamacpp import LLAMACPP
from genq.worker.engines.openai import OPENAI
from genq.worker.engines.sglang import SGLANG
from genq.worker.engines.vllm import VLLM_ENGINE

ENGINES: tuple[Engine, ...] = (SGLANG, VLLM_ENGINE, LLAMACPP, OPENAI)

# (status, body) of a GET on the server (worker/server.py).
Get = Callable[[str], Awaitable[tuple[int, bytes]]]


class Detected(msgspec.Struct, frozen=True):
    engine: Engine
    capacity: int | None  # as its own endpoint tells (None: learned from /metrics, if any)
    context_length: int | None  # as its own endpoint tells
    has_metrics: bool  # /metrics carries names of an engine genq knows
    memory: Hardware = Hardware()  # as its own endpoint tells


async def detect(get_json: GetJson, get: Get) -> Detected:
    """Which engine the server is, and what it tells of itself."""
    found, told = None, None
    for engine in ENGINES:
        told = await engine.probe(get_json)
        if told is not None:
            found = engine
            break
    status, page = await get("/metrics")
    seen = [e for e in ENGINES if e.metric_prefix and status == 200 and e.metric_prefix in page]
    if found is None:
        found = next((e for e in seen if e.named_by_metrics), OPENAI)
    return Detected(engine=found, capacity=told.capacity if told else None,
                    context_length=told.context_length if told else None, has_metrics=bool(seen),
                    memory=told.memory if told else Hardware())
