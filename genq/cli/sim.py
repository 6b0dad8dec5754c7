"""`genq sim`: run the simulator of one GPU inference server (SGLang, vLLM or llama.cpp)."""

from __future__ import annotations

from typing import Any

import click

from genq.sim.config import SimConfig
from genq.sim.flavors import FLAVORS
from genq.sim.serve import run

_D = SimConfig()


@click.command("sim", short_help="Simulate one SGLang, vLLM or llama.cpp server (no GPU needed).", context_settings={"show_default": True, "max_content_width": 100})
@click.option("--flavor", default=_D.flavor, type=click.Choice(FLAVORS),
              help="Engine to play: its endpoints, metric names, error bodies, queueing and connection habits.")
@click.option("--host", default=_D.host, help="Address to listen on.")
@click.option("--port", default=_D.port, type=int, help="Port to listen on (0: any free port).")
@click.option("--model-path", default=_D.model_path, help="Model path reported by the info endpoints.")
@click.option("--served-model-name", default=_D.served_model_name,
              help="Model name in responses, /v1/models and metrics labels (empty: the model path).")
@click.option("--context-length", "--max-context", "context_length", default=_D.context_length, type=int,
              help="Context length (per slot for llamacpp): a prompt, or prompt + max_tokens, over it gets the "
                   "flavor's 400 (SGLang's, vLLM's; llama.cpp's for the prompt alone).")
@click.option("--max-running-requests", default=_D.max_running_requests, type=int,
              help="Most requests decoding at once; the rest wait in a FIFO queue.")
@click.option("--max-total-num-tokens", default=_D.max_total_num_tokens, type=int,
              help="KV cache budget: prompt plus generated tokens of running requests.")
@click.option("--weight-gb", default=_D.weight_gb, type=float,
              help="sglang flavor: the weights' GB (2^30 bytes) /server_info's memory_usage reports.")
@click.option("--kv-bytes-per-token", default=_D.kv_bytes_per_token, type=int,
              help="sglang flavor: KV cache bytes per token; memory_usage.kvcache is this x --max-total-num-tokens.")
@click.option("--max-queued-requests", default=_D.max_queued_requests, type=int,
              help="Waiting queue limit; beyond it requests get 503 'The request queue is full.' "
                   "[default: unlimited]")
@click.option("--step-ms-base", default=_D.step_ms_base, type=float,
              help="Fixed cost of one engine step in ms (0 with --step-ms-per-req 0: instant server).")
@click.option("--step-ms-per-req", default=_D.step_ms_per_req, type=float,
              help="Extra step cost in ms per running request.")
@click.option("--tokens-per-step", default=_D.tokens_per_step, type=int,
              help="Tokens each running request gains per step (time compression).")
@click.option("--prefill-cost", default=_D.prefill_cost, type=float,
              help="What a prompt token of the step's prefills costs, over a running request's token "
                   "(the step's cost grows by --step-ms-per-req x this x its prompt tokens / --tokens-per-step).")
@click.option("--mean-output-tokens", default=_D.mean_output_tokens, type=float,
              help="Mean of the lognormal output length, fixed per prompt.")
@click.option("--output-sigma", default=_D.output_sigma, type=float,
              help="Sigma of the lognormal output length (0: every prompt gets the mean).")
@click.option("--thinking-fraction", default=_D.thinking_fraction, type=float,
              help="Share of the output that is reasoning_content when enable_thinking is set.")
@click.option("--seed", default=_D.seed, type=int, help="Seed of output lengths and fault draws.")
@click.option("--startup-delay", default=_D.startup_delay, type=float,
              help="Seconds during which /health and generation answer 503 after start.")
@click.option("--error-rate", default=_D.error_rate, type=click.FloatRange(0, 1),
              help="Fraction of requests answered 500 InternalServerError.")
@click.option("--reset-rate", default=_D.reset_rate, type=click.FloatRange(0, 1),
              help="Fraction of requests whose connection is reset mid-generation.")
@click.option("--hang-rate", default=_D.hang_rate, type=click.FloatRange(0, 1),
              help="Fraction of requests that stop producing output until the client leaves.")
@click.option("--stream-error-rate", default=_D.stream_error_rate, type=click.FloatRange(0, 1),
              help="Fraction of requests that fail after some output: a stream gets the engine's SSE "
                   "error event and [DONE] on its HTTP 200, a whole answer a 500.")
@click.option("--outage-at", default=_D.outage_at, type=float,
              help="Seconds after start at which the server 'crashes': in-flight requests are "
                   "reset, /health is 503, new requests are reset. [default: never]")
@click.option("--outage-for", default=_D.outage_for, type=float, help="Length of that outage in seconds.")
@click.option("--crash-marker", default=None, metavar="TEXT",
              help="A request containing TEXT takes the server down for --outage-for seconds, every time. "
                   "[default: none]")
@click.option("--health-delay", default=_D.health_delay, type=float,
              help="Seconds /health takes to answer (SGLang's takes a second or more, up to 20 s when busy).")
@click.option("--stream-close-delay", default=_D.stream_close_delay, type=float,
              help="llamacpp flavor: seconds after a streamed response at which the connection closes "
                   "(unread meanwhile), whatever its Keep-Alive header said.")
@click.option("--tool-call-parser", default=_D.tool_call_parser, metavar="NAME",
              help="sglang flavor: as SGLang's flag; without one, `tools` are ignored and answers are plain "
                   "content. [default: none]")
@click.option("--args-given", default=_D.args_given, type=bool,
              help="sglang flavor: play a server started with --max-running-requests and --context-length "
                   "(/server_info shows them; max_tokens over the context gets SGLang's own 400 for it).")
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
