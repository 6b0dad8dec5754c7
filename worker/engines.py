"""The inference servers genq knows, one row each (docs/engines.md): how to tell it (`probe`: its own
endpoint; else its metric prefix on /metrics), what it tells of itself, its metric names."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from genq.core.records import Hardware

GetJson = Callable[[str], Awaitable[Any]]  # a GET's JSON answer, None when there is no such endpoint
Get = Callable[[str], Awaitable[tuple[int, bytes]]]  # a GET's (status, body)

# Where the controller starts when the server does not tell its capacity (vLLM's max_num_seqs is
# 128 on CPU, 256 on most GPUs, 1024 on H100/H200/B200: growing by half a look reaches any soon).
CAPACITY_START = 64
GIB = 2**30  # SGLang's "GB" in memory_usage


@dataclass(frozen=True, eq=False)
class Engine:
    """One kind of inference server; the defaults are a plain OpenAI-compatible server's."""

    name: str  # ServerInfo.flavor
    probe: Callable[[GetJson], Awaitable[ServerInfo | None]] | None = None  # None: not this engine
    metric_prefix: bytes | None = None
    # A Metrics field -> this engine's names for it, newer first; `name{label}` counts only that label's series.
    metrics: dict[str, tuple[str, ...]] = field(default_factory=dict)
    context_where: str = "the model's context"  # what its reported context is, for the preflight


class ServerInfo(msgspec.Struct, frozen=True):
    """Which engine a server is and what it tells of itself (None: it does not tell)."""

    engine: Engine
    capacity: int | None = None  # requests it runs at once (None: learned from /metrics, if any)
    context_length: int | None = None  # per request (llama.cpp: per slot)
    has_metrics: bool = False  # /metrics carries names of an engine genq knows
    memory: Hardware = Hardware()  # weight and KV cache sizes where it tells (genq.core.decodebound)
    model: str | None = None  # as /v1/models names it

    @property
    def flavor(self) -> str:
        return self.engine.name


async def _sglang_probe(get_json: GetJson) -> ServerInfo | None:
    """/server_info (the older /get_server_info logs a deprecation warning at each call)."""
    for path in ("/server_info", "/get_server_info"):
        if isinstance(info := await get_json(path), dict):
            return ServerInfo(SGLANG, capacity=capacity_from_info(info), context_length=info.get("context_length"),
                              memory=memory_from_info(info))
    return None


def capacity_from_info(info: dict[str, Any]) -> int | None:
    """SGLang's running-request limit: its DP ranks' effective ones summed, else max_running_requests
    (null unless given on its command line)."""
    effective = [s.get("effective_max_running_requests_per_dp") for s in info.get("internal_states") or []
                 if isinstance(s, dict)]
    counts: list[int] = [v for v in effective if isinstance(v, int) and v > 0]
    if counts and len(counts) == len(effective):
        return sum(counts)
    value = info.get("max_running_requests")
    return value if isinstance(value, int) and value > 0 else None


def memory_from_info(info: dict[str, Any]) -> Hardware:
    """Weights, KV cache and token capacity from SGLang's memory_usage, one rank's (each DP rank a GPU)."""
    usage = [s["memory_usage"] for s in info.get("internal_states") or []
             if isinstance(s, dict) and isinstance(s.get("memory_usage"), dict)]

    def per_rank(key: str, unit: float = GIB) -> float | None:
        values = [u.get(key) for u in usage]
        ok = values and all(isinstance(v, (int, float)) and v > 0 for v in values)
        return sum(values) / len(values) * unit if ok else None

    weight, tokens = per_rank("weight"), per_rank("token_capacity", 1)
    told = None if weight is None else "SGLang /server_info memory_usage.weight"
    return Hardware(weight_bytes=weight, weight_from=told, kv_pool_bytes=per_rank("kvcache"),
                    token_capacity=None if tokens is None else int(tokens))


async def _llamacpp_probe(get_json: GetJson) -> ServerInfo | None:
    """/props: `total_slots` (-np), each slot's `n_ctx`; else /slots (only with --slots) counts them."""
    props = await get_json("/props")
    if not isinstance(props, dict) or "default_generation_settings" not in props:
        return None
    slots, settings = props.get("total_slots"), props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    capacity = slots if isinstance(slots, int) and slots > 0 else None
    if capacity is None:
        listed = await get_json("/slots")
        capacity = len(listed) if isinstance(listed, list) and listed else None
    return ServerInfo(LLAMACPP, capacity=capacity,
                      context_length=n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None)


SGLANG = Engine("sglang", _sglang_probe, b"sglang:", metrics={
    "running": ("sglang:num_running_reqs",), "waiting": ("sglang:num_queue_reqs",),
    "kv_usage": ("sglang:token_usage",),
    "retracted": ("sglang:num_retracted_reqs",),  # a gauge, with a pid label in 0.5.23
    "retractions_total": ("sglang:num_retracted_requests_total",),  # some versions; not 0.5.23
    "generated_total": ("sglang:generation_tokens_total",)})
VLLM = Engine("vllm", None, b"vllm:", metrics={  # no endpoint of its own; max_num_seqs is learned
    "running": ("vllm:num_requests_running",), "waiting": ("vllm:num_requests_waiting",),
    # reason="capacity", apart from those deferred for LoRA budget, KV transfer or a blocked status
    "waiting_capacity": ('vllm:num_requests_waiting_by_reason{reason="capacity"}',),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "retractions_total": ("vllm:num_preemptions_total",), "generated_total": ("vllm:generation_tokens_total",)})
LLAMACPP = Engine("llamacpp", _llamacpp_probe, b"llamacpp:", metrics={  # no KV usage, no preemption
    "running": ("llamacpp:requests_processing",), "waiting": ("llamacpp:requests_deferred",),
    "generated_total": ("llamacpp:tokens_predicted_total",)}, context_where="each slot's context (/props n_ctx)")
OPENAI = Engine("openai-compatible")
# In the order tried: those with an endpoint of their own, then those their metrics name. The same
# order ranks the metric names read (a page has one engine's names, so ties never come).
ENGINES: tuple[Engine, ...] = (SGLANG, VLLM, LLAMACPP, OPENAI)


async def detect(get_json: GetJson, get: Get) -> ServerInfo:
    found = None
    for engine in ENGINES:
        if engine.probe and (found := await engine.probe(get_json)) is not None:
            break
    status, page = await get("/metrics")
    seen = [e for e in ENGINES if e.metric_prefix and status == 200 and e.metric_prefix in page]
    if found is None:
        found = ServerInfo(next((e for e in seen if e.probe is None), OPENAI))
    return msgspec.structs.replace(found, has_metrics=bool(seen))


@dataclass
class Metrics:
    """The figures the concurrency controller reads off /metrics (None: the page has none)."""

    running: float | None = None
    waiting: float | None = None
    waiting_capacity: float | None = None  # of those waiting, how many wait for a slot (vLLM)
    kv_usage: float | None = None  # fraction 0..1: the fullest rank, the one that retracts
    retracted: float | None = None  # gauge: requests retracted lately
    retractions_total: float | None = None  # counter: requests retracted/preempted since start
    generated_total: float | None = None  # counter: output tokens made since the server started
    at: float = 0.0  # when the page was read (time.monotonic())


_NAMES = {f: tuple(n for e in ENGINES for n in e.metrics.get(f, ())) for f in Metrics.__dataclass_fields__ if f != "at"}
_WANTED = {n.split("{")[0] for names in _NAMES.values() for n in names}


def metrics_from_text(text: str) -> Metrics:
    """A Prometheus text page's figures: each name's series (one per rank) summed, KV usage the highest."""
    series: dict[str, list[tuple[str, float]]] = {}
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name not in _WANTED:
            continue
        labels, _, rest = line[len(name):].rpartition("}")  # `name{labels} value [time]` or `name value [time]`
        try:
            series.setdefault(name, []).append((labels, float(rest.split()[0])))
        except (IndexError, ValueError):
            continue
    figures = Metrics(at=time.monotonic())
    for key, names in _NAMES.items():
        for wanted in names:
            name, _, label = wanted.partition("{")
            if values := [v for labels, v in series.get(name, ()) if label.rstrip("}") in labels]:
                setattr(figures, key, max(values) if key == "kv_usage" else sum(values))
                break
    return figures
