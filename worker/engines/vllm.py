"""vLLM (vllm-project/vllm; the 0.32 scheduler and metrics in docs/engines.md and docs/vllm.md).

- No endpoint of its own (no capacity, no server info): its metrics, always on, name it.
- Capacity learned (worker/controller.py): `max_num_seqs` is nowhere to read. While requests wait
  for a slot (`vllm:num_requests_waiting_by_reason{reason="capacity"}`) the highest running count
  is the capacity; running is reported after the step's finished requests left, so it dips.
- Context: `/v1/models` `max_model_len` (worker/server.py reads it for every engine).
- Errors: nested `{"error": {"message", "type", "param", "code"}}`; a failed generation inside a
  stream is an event with code 500, then `[DONE]`. Version 0.32 cuts max_tokens to what a prompt
  leaves below the context, and answers 400 once max_tokens alone is over it.
"""

from __future__ import annotations

from genq.worker.engines.base import Engine


class VLLM(Engine):
    name = "vllm"
    metric_prefix = b"vllm:"
    named_by_metrics = True
    running = ("vllm:num_requests_running",)
    waiting = ("vllm:num_requests_waiting",)
    # reason="capacity" apart from those deferred for LoRA budget, KV transfer or a blocked
    # status (reason="deferred").
    waiting_for_slot = "vllm:num_requests_waiting_by_reason"
    kv_usage = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # newer, older name
    retractions_total = ("vllm:num_preemptions_total",)
    generated_total = ("vllm:generation_tokens_total",)


VLLM_ENGINE = VLLM()
