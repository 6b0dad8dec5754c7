"""llama.cpp's llama-server (the tree vendored by llama-cpp-python 0.3.36; docs/engines.md).

- Told by `GET /props` (an answer with `default_generation_settings`): `total_slots` (`-np`) and
  each slot's context `n_ctx` (llama-server splits `-c` over the slots); `GET /slots` (only with
  `--slots`) counts the slots when /props does not.
- Metrics with `--metrics`, `llamacpp:` names, no labels; no KV usage (each slot owns a fixed share
  of the context) and no preemption (a slot keeps its request to the end).
- Errors: nested `{"error": {"code", "message", "type"}}`; a failure inside a stream is an event
  with code 500 and the stream ends without `[DONE]`. prompt + max_tokens over the slot is no
  error: generation stops at the slot's end.
- It closes the connection after every stream (worker/server.py sends again on a fresh one).
"""

from __future__ import annotations

from typing import Any

from genq.worker.engines.base import Engine, GetJson, Told


class LlamaCpp(Engine):
    name = "llamacpp"
    metric_prefix = b"llamacpp:"
    running = ("llamacpp:requests_processing",)
    waiting = ("llamacpp:requests_deferred",)
    generated_total = ("llamacpp:tokens_predicted_total",)
    context_where = "each slot's context (/props n_ctx)"

    async def probe(self, get_json: GetJson) -> Told | None:
        props = await get_json("/props")
        if not isinstance(props, dict) or "default_generation_settings" not in props:
            return None
        capacity, context = capacity_from_props(props)
        if capacity is None:
            slots = await get_json("/slots")  # only with --slots
            capacity = len(slots) if isinstance(slots, list) and slots else None
        return Told(capacity=capacity, context_length=context)


def capacity_from_props(props: dict[str, Any]) -> tuple[int | None, int | None]:
    """(slots, context per slot) from llama.cpp's /props."""
    slots = props.get("total_slots")
    settings = props.get("default_generation_settings")
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return (slots if isinstance(slots, int) and slots > 0 else None,
            n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None)


LLAMACPP = LlamaCpp()
