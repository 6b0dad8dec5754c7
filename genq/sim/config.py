"""All simulator knobs in one place: `genq sim` has one option per field, whose help is the field's annotation."""

from __future__ import annotations

from typing import Annotated as A

import msgspec


class SimConfig(msgspec.Struct, kw_only=True):
    """One simulated server. Time is compressed: an engine step (a decode iteration) makes tokens_per_step tokens."""

    flavor: A[str, "Engine to play: its endpoints, metrics, error bodies, queueing and connection habits."] = "sglang"
    host: A[str, "Address to listen on."] = "127.0.0.1"
    port: A[int, "Port to listen on (0: any free port)."] = 30000
    model_path: A[str, "Model path reported by the info endpoints."] = "genq-sim/Sim-8B"
    served_model_name: A[str, "Model name in responses, /v1/models and metrics labels (empty: the model path)."] = ""
    context_length: A[int, "Context length (per slot for llamacpp): a prompt, or prompt + max_tokens, over it gets the "
                           "flavor's 400 (SGLang's, vLLM's; llama.cpp's for the prompt alone)."] = 32768
    max_running_requests: A[int, "Most requests decoding at once; the rest wait in a FIFO queue."] = 37
    max_total_num_tokens: A[int, "KV cache budget: prompt plus generated tokens of running requests."] = 400_000
    weight_gb: A[float, "sglang flavor: the weights' GB (2^30 bytes) /server_info's memory_usage reports."] = 15.3
    # Llama-3-8B bf16: 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 B = 128 KiB a token.
    kv_bytes_per_token: A[int, "sglang flavor: KV bytes a token (memory_usage.kvcache: x --max-total-num-tokens)."] = (
        131072)
    max_queued_requests: A[int | None, "Waiting queue limit; beyond it requests get 503 'The request queue is full.' "
                                       "[default: unlimited]"] = None
    step_ms_base: A[float, "Fixed cost of one engine step in ms (0 with --step-ms-per-req 0: instant server)."] = 20.0
    step_ms_per_req: A[float, "Extra step cost in ms per running request."] = 0.05
    tokens_per_step: A[int, "Tokens each running request gains per step (time compression)."] = 16
    # vLLM on CPU: about a half (docs/vllm.md).
    prefill_cost: A[float, "A prefilled prompt token's cost over a running request's token: a step costs "
                           "--step-ms-per-req x this x its prompt tokens / --tokens-per-step more."] = 0.5
    mean_output_tokens: A[float, "Mean of the lognormal output length, fixed per prompt."] = 256.0
    output_sigma: A[float, "Sigma of the lognormal output length (0: every prompt gets the mean)."] = 1.0
    thinking_fraction: A[float, "Share of the output that is reasoning_content when enable_thinking is set."] = 0.3
    seed: A[int, "Seed of output lengths and fault draws."] = 0
    startup_delay: A[float, "Seconds during which /health and generation answer 503 after start."] = 0.0
    error_rate: A[float, "Fraction of requests answered 500 InternalServerError."] = 0.0
    reset_rate: A[float, "Fraction of requests whose connection is reset mid-generation."] = 0.0
    hang_rate: A[float, "Fraction of requests that stop producing output until the client leaves."] = 0.0
    stream_error_rate: A[float, "Fraction of requests that fail after some output: a stream gets the engine's SSE "
                                "error event and [DONE] on its HTTP 200, a whole answer a 500."] = 0.0
    outage_at: A[float | None, "Seconds after start at which the server 'crashes': in-flight requests are reset, "
                               "/health is 503, new requests are reset. [default: never]"] = None
    outage_for: A[float, "Length of that outage in seconds."] = 5.0
    crash_marker: A[str | None, "A request containing TEXT takes the server down for --outage-for seconds, every "
                                "time. [default: none]"] = None
    health_delay: A[float, "Seconds /health takes to answer (SGLang's: a second or more, 20 s when busy)."] = 0.0
    stream_close_delay: A[float, "llamacpp flavor: seconds after a streamed response at which the connection closes "
                                 "(unread meanwhile), whatever its Keep-Alive header said."] = 0.1
    tool_call_parser: A[str | None, "sglang flavor: as SGLang's flag; without one, `tools` are ignored and answers "
                                    "are plain content. [default: none]"] = None
    args_given: A[bool, "sglang flavor: play a server started with --max-running-requests and --context-length "
                        "(/server_info shows them; max_tokens over the context gets SGLang's own 400 for it)."] = False

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path
