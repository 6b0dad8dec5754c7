"""`genq sim`: run the simulator of one GPU inference server (SGLang, vLLM or llama.cpp)."""

from __future__ import annotations

from typing import Any

import click
import msgspec

from genq.sim.config import SimConfig
from genq.sim.serve import FLAVORS, run

RATE = click.FloatRange(0, 1)
# One option per SimConfig field: (field, type where the default does not say it, help).
OPTIONS: list[tuple[str, Any, str]] = [
    ("flavor", click.Choice(FLAVORS),
     "Engine to play: its endpoints, metric names, error bodies, queueing and connection habits."),
    ("host", None, "Address to listen on."),
    ("port", None, "Port to listen on (0: any free port)."),
    ("model_path", None, "Model path reported by the info endpoints."),
    ("served_model_name", None, "Model name in responses, /v1/models and metrics labels (empty: the model path)."),
    ("context_length", None, "Context length (per slot for llamacpp): a prompt, or prompt + max_tokens, over it "
                             "gets the flavor's 400 (SGLang's, vLLM's; llama.cpp's for the prompt alone)."),
    ("max_running_requests", None, "Most requests decoding at once; the rest wait in a FIFO queue."),
    ("max_total_num_tokens", None, "KV cache budget: prompt plus generated tokens of running requests."),
    ("weight_gb", None, "sglang flavor: the weights' GB (2^30 bytes) /server_info's memory_usage reports."),
    ("kv_bytes_per_token", None,
     "sglang flavor: KV cache bytes per token; memory_usage.kvcache is this x --max-total-num-tokens."),
    ("max_queued_requests", int,
     "Waiting queue limit; beyond it requests get 503 'The request queue is full.' [default: unlimited]"),
    ("step_ms_base", None, "Fixed cost of one engine step in ms (0 with --step-ms-per-req 0: instant server)."),
    ("step_ms_per_req", None, "Extra step cost in ms per running request."),
    ("tokens_per_step", None, "Tokens each running request gains per step (time compression)."),
    ("prefill_cost", None, "What a prompt token of the step's prefills costs, over a running request's token "
                           "(the step's cost grows by --step-ms-per-req x this x its prompt tokens / --tokens-per-step)."),
    ("mean_output_tokens", None, "Mean of the lognormal output length, fixed per prompt."),
    ("output_sigma", None, "Sigma of the lognormal output length (0: every prompt gets the mean)."),
    ("thinking_fraction", None, "Share of the output that is reasoning_content when enable_thinking is set."),
    ("seed", None, "Seed of output lengths and fault draws."),
    ("startup_delay", None, "Seconds during which /health and generation answer 503 after start."),
    ("error_rate", RATE, "Fraction of requests answered 500 InternalServerError."),
    ("reset_rate", RATE, "Fraction of requests whose connection is reset mid-generation."),
    ("hang_rate", RATE, "Fraction of requests that stop producing output until the client leaves."),
    ("stream_error_rate", RATE, "Fraction of requests that fail after some output: a stream gets the engine's SSE "
                                "error event and [DONE] on its HTTP 200, a whole answer a 500."),
    ("outage_at", float, "Seconds after start at which the server 'crashes': in-flight requests are reset, "
                         "/health is 503, new requests are reset. [default: never]"),
    ("outage_for", None, "Length of that outage in seconds."),
    ("crash_marker", str, "A request containing TEXT takes the server down for --outage-for seconds, every time. "
                          "[default: none]"),
    ("health_delay", None, "Seconds /health takes to answer (SGLang's takes a second or more, up to 20 s when busy)."),
    ("stream_close_delay", None, "llamacpp flavor: seconds after a streamed response at which the connection "
                                 "closes (unread meanwhile), whatever its Keep-Alive header said."),
    ("tool_call_parser", str, "sglang flavor: as SGLang's flag; without one, `tools` are ignored and answers are "
                              "plain content. [default: none]"),
    ("args_given", bool, "sglang flavor: play a server started with --max-running-requests and --context-length "
                         "(/server_info shows them; max_tokens over the context gets SGLang's own 400 for it)."),
]
_D = msgspec.to_builtins(SimConfig())
_METAVARS = {"crash_marker": "TEXT", "tool_call_parser": "NAME"}


def sim_command(**options: Any) -> None:
    """Serve a simulator of one GPU inference server (SGLang, vLLM or llama.cpp).

    Continuous batching with compressed time, deterministic per-prompt output
    lengths, the flavor's endpoints, errors and /metrics, plus /sim/stats,
    /sim/reset and /sim/faults for tests and benchmarks. Stops on SIGINT/SIGTERM
    (llamacpp: the first SIGTERM stops listening and leaves open requests hanging,
    as llama-server does; it exits when none is left open, or on a second signal).
    """
    config = SimConfig(**options)
    shown = ("flavor", "max_running_requests", "max_total_num_tokens", "step_ms_base", "step_ms_per_req",
             "tokens_per_step", "mean_output_tokens")
    summary = ", ".join(f"{name}={getattr(config, name)}" for name in shown)
    run(config, on_ready=lambda url: click.echo(f"genq sim: listening on {url} ({summary})"))


for _name, _type, _help in reversed(OPTIONS):
    _flags = ["--" + _name.replace("_", "-")] + (["--max-context"] if _name == "context_length" else [])
    sim_command = click.option(*_flags, _name, default=_D[_name], type=_type or type(_D[_name]), help=_help,
                               metavar=_METAVARS.get(_name))(sim_command)
sim_command = click.command("sim", short_help="Simulate one SGLang, vLLM or llama.cpp server (no GPU needed).",
                            context_settings={"show_default": True, "max_content_width": 100})(sim_command)
