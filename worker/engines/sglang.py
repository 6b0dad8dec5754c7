"""SGLang (sgl-project/sglang, python/sglang/srt/...; docs/engines.md has the lines).

- Told by `GET /server_info` (older `/get_server_info`, deprecated in 0.5.23: a warning in its log
  at every call): the running-request limit (internal_states[].effective_max_running_requests_per_dp;
  the top-level max_running_requests is null unless given on its command line) and the context
  (null unless --context-length was given: /v1/models max_model_len then tells it).
- Metrics with `--enable-metrics`, `sglang:` names, one series per DP/TP rank (summed).
- Errors: a flat body `{"object": "error", "message", "type", "param", "code"}`; an exception in a
  running stream is sent as an event with the blanket code 400 whatever its cause, then `[DONE]`.
- A prompt + max_tokens over the context is answered 400 (the brake's case, worker/brake.py).
"""

from __future__ import annotations

from typing import Any

from genq.core.records import Hardware
from genq.worker.engines.base import Engine, GetJson, Told


class SGLang(Engine):
    name = "sglang"
    metric_prefix = b"sglang:"
    running = ("sglang:num_running_reqs",)
    waiting = ("sglang:num_queue_reqs",)
    kv_usage = ("sglang:token_usage",)
    retracted = ("sglang:num_retracted_reqs",)  # gauge, with a pid label in 0.5.23
    retractions_total = ("sglang:num_retracted_requests_total",)  # a counter some versions have; not 0.5.23
    generated_total = ("sglang:generation_tokens_total",)  # split by is_streaming: summed

    async def probe(self, get_json: GetJson) -> Told | None:
        for path in ("/server_info", "/get_server_info"):  # newer, older name
            info = await get_json(path)
            if isinstance(info, dict):
                return Told(capacity=capacity_from_info(info), context_length=info.get("context_length"),
                            memory=memory_from_info(info))
        return None


def capacity_from_info(info: dict[str, Any]) -> int | None:
    """SGLang's running-request limit from /get_server_info, over its DP ranks."""
    states = info.get("internal_states") or []
    effective = [s.get("effective_max_running_requests_per_dp") for s in states if isinstance(s, dict)]
    if effective and all(isinstance(v, int) and v > 0 for v in effective):
        return sum(int(v) for v in effective if v)
    value = info.get("max_running_requests")
    return value if isinstance(value, int) and value > 0 else None


SGLANG = SGLang()


GIB = 2**30  # SGLang's "GB" in memory_usage: bytes / (1 << 30) (srt/mem_cache/memory_pool.py)


def memory_from_info(info: dict[str, Any]) -> Hardware:
    """Weights, KV cache and its token capacity from /server_info's memory_usage, over its DP ranks
    (each rank a GPU of its own: the weights are one rank's)."""
    states = [s for s in info.get("internal_states") or [] if isinstance(s, dict)]
    usage: list[dict[str, Any]] = [s["memory_usage"] for s in states if isinstance(s.get("memory_usage"), dict)]

    def figure(key: str) -> float | None:
        values = [u.get(key) for u in usage]
        numbers = [float(v) for v in values if isinstance(v, (int, float)) and v > 0]
        return sum(numbers) if numbers and len(numbers) == len(values) else None

    weight, kv, tokens = figure("weight"), figure("kvcache"), figure("token_capacity")
    ranks = max(1, len(usage))
    return Hardware(weight_bytes=None if weight is None else weight * GIB / ranks,
                    weight_from=None if weight is None else "SGLang /server_info memory_usage.weight",
                    kv_pool_bytes=None if kv is None else kv * GIB / ranks,
                    token_capacity=None if tokens is None else int(tokens) // ranks)
