"""All simulator knobs in one place; `genq sim` has one option per field (its help: genq/cli/sim.py)."""

from __future__ import annotations

import msgspec


class SimConfig(msgspec.Struct, kw_only=True):
    """Settings of one simulated server. Time is compressed: one engine step stands for one decode
    iteration but advances every running request by tokens_per_step tokens."""

    flavor: str = "sglang"
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "genq-sim/Sim-8B"
    served_model_name: str = ""  # empty: model_path, as in SGLang
    context_length: int = 32768
    max_running_requests: int = 37
    max_total_num_tokens: int = 400_000
    max_queued_requests: int | None = None  # None: unbounded (SGLang's default)
    weight_gb: float = 15.3
    # Llama-3-8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 128 KiB a token.
    kv_bytes_per_token: int = 131072
    tool_call_parser: str | None = None
    args_given: bool = False
    step_ms_base: float = 20.0
    step_ms_per_req: float = 0.05
    tokens_per_step: int = 16
    prefill_cost: float = 0.5  # vLLM on CPU: about a half (docs/vllm.md)
    mean_output_tokens: float = 256.0
    output_sigma: float = 1.0
    thinking_fraction: float = 0.3
    seed: int = 0
    startup_delay: float = 0.0
    health_delay: float = 0.0
    error_rate: float = 0.0
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    stream_error_rate: float = 0.0
    outage_at: float | None = None
    outage_for: float = 5.0
    crash_marker: str | None = None
    stream_close_delay: float = 0.1

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
