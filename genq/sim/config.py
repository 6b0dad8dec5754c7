"""All simulator knobs in one place; the CLI exposes one option per field."""

from __future__ import annotations

import msgspec


class SimConfig(msgspec.Struct, kw_only=True):
    """Settings of one simulated server.

    Time is compressed: one engine step stands for one decode iteration of a real
    server but advances every running request by tokens_per_step tokens, so that
    a test generating thousands of tokens finishes in seconds.
    """

    # Which engine to play: "sglang", "vllm" or "llamacpp" (genq/sim/flavors.py).
    flavor: str = "sglang"
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
    # SGLang only, as its command line would say (0.5.23, tests/recordings/sglang-0.5.23/):
    # - tool_call_parser: without one a request's `tools` are ignored; with one the answer calls the first tool.
    # - args_given: started with --max-running-requests and --context-length. Only then does /server_info
    #   show them at the top level (else null), and max_tokens over the context gets the "max_completion_tokens
    #   is too large" 400 before the prompt is looked at.
    tool_call_parser: str | None = None
    args_given: bool = False

    # Step timing. A fixed cost dominates, as in memory-bound decode, so
    # throughput grows with the batch size. Both 0: an (almost) instant server.
    step_ms_base: float = 20.0
    step_ms_per_req: float = 0.05
    tokens_per_step: int = 16
    # A prompt's prefill runs in the step that admits it: each of its tokens costs this fraction of
    # what a running request's token costs (vLLM on CPU: about a half, docs/vllm.md, 2026-12-05).
    prefill_cost: float = 0.5

    # Output lengths: lognormal per prompt (genq/sim/lengths.py); thinking_fraction of it is
    # reasoning when enable_thinking is set.
    mean_output_tokens: float = 256.0
    output_sigma: float = 1.0
    thinking_fraction: float = 0.3
    seed: int = 0

    # Seconds during which the port is open but /health and generation answer 503.
    startup_delay: float = 0.0
    # Seconds /health takes to answer (SGLang's generates one token: a second at least, up to
    # 20 s, its SGLANG_HEALTH_CHECK_TIMEOUT, when the scheduler is busy or stalled).
    health_delay: float = 0.0

    # Fault switches (also settable at run time through POST /sim/faults); stream_error: some
    # output, then the flavor's SSE error event.
    error_rate: float = 0.0
    reset_rate: float = 0.0
    hang_rate: float = 0.0
    stream_error_rate: float = 0.0
    # An outage (every request in flight dropped, the next ones reset) at outage_at seconds after
    # start (None: none), lasting outage_for seconds.
    outage_at: float | None = None
    outage_for: float = 5.0
    # A request whose body contains this text starts such an outage, every time it is sent: a
    # prompt that crashes its server.
    crash_marker: str | None = None
    # llama.cpp only: after a streamed response the server stops reading the connection and closes
    # it this many seconds later, despite its Keep-Alive header; a request sent on it meanwhile is lost.
    stream_close_delay: float = 0.1

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
