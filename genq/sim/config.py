"""All simulator knobs in one place; `genq sim` has one option per field, whose help says what it does."""

from __future__ import annotations

import msgspec


class SimConfig(msgspec.Struct, kw_only=True):
    """Settings of one simulated server. Time is compressed: one engine step stands for one decode
    iteration but advances every running request by tokens_per_step tokens, so that a test generating
    thousands of tokens finishes in seconds."""

    flavor: str = "sglang"  # the engine played: "sglang", "vllm" or "llamacpp" (flavors.py)
    host: str = "127.0.0.1"
    port: int = 30000
    model_path: str = "genq-sim/Sim-8B"
    served_model_name: str = ""  # empty: model_path, as in SGLang
    context_length: int = 32768

    # Scheduler capacity; max_queued_requests None: an unbounded queue (SGLang's default), else 503 when full.
    max_running_requests: int = 37
    max_total_num_tokens: int = 400_000
    max_queued_requests: int | None = None

    # What /server_info's memory_usage reports (GB: bytes / 2^30): the weights, and the KV cache as
    # max_total_num_tokens x this (Llama-3-8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 128 KiB).
    weight_gb: float = 15.3
    kv_bytes_per_token: int = 131072
    # SGLang only, as its command line would say (0.5.23, tests/recordings/sglang-0.5.23/): without a
    # tool_call_parser `tools` are ignored; args_given: started with --max-running-requests and
    # --context-length, so /server_info shows them (else null) and max_tokens over the context gets the
    # "max_completion_tokens is too large" 400 before the prompt is looked at.
    tool_call_parser: str | None = None
    args_given: bool = False

    # A step costs step_ms_base + step_ms_per_req per running request (+ prefill_cost of that per prompt
    # token admitted: vLLM on CPU, about a half, docs/vllm.md): throughput grows with the batch, as in
    # memory-bound decode. Both 0: an (almost) instant server.
    step_ms_base: float = 20.0
    step_ms_per_req: float = 0.05
    tokens_per_step: int = 16
    prefill_cost: float = 0.5

    # Output lengths: lognormal per prompt (lengths.py); thinking_fraction of it is reasoning with enable_thinking.
    mean_output_tokens: float = 256.0
    output_sigma: float = 1.0
    thinking_fraction: float = 0.3
    seed: int = 0

    startup_delay: float = 0.0  # seconds the port is open but /health and generation answer 503
    health_delay: float = 0.0  # seconds /health takes (SGLang's: 1 s at least, 20 s when its scheduler is busy)

    # Fault switches (also POST /sim/faults). An outage (every request in flight dropped, the next ones
    # reset) at outage_at seconds (None: none) lasting outage_for, or whenever a body contains
    # crash_marker (a prompt that crashes its server).
    error_rate: float = 0.0
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    stream_error_rate: float = 0.0
    outage_at: float | None = None
    outage_for: float = 5.0
    crash_marker: str | None = None
    # llama.cpp only: after a stream the server stops reading the connection and closes it this many
    # seconds later, despite its Keep-Alive header; a request sent on it meanwhile is lost.
    stream_close_delay: float = 0.1

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
