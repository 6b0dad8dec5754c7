"""`genq worker`: drive one inference server from the queue, or (--gpus) one per GPU of this machine."""

from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path

import click
from click.core import ParameterSource

from genq.cli import Concurrency, redis_url
from genq.worker.options import DEFAULT_PREFETCH, WorkerOptions, name_problem, server_url_problem

# The worker's defaults are WorkerOptions' own: one definition, shown by --help.
DEFAULTS = WorkerOptions(redis_url="", server_url="")

BURST_SERVER_WAIT_S = 30.0  # --burst --server: how long a server that does not answer is waited for


class ByteSize(click.ParamType):
    """A size in bytes (or bytes/s): 54GB, 1.79TB/s, 48GiB, or a plain number; decimal units as
    vendors rate bandwidth, KiB..TiB binary."""

    name = "SIZE"
    UNITS = {"": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2.0**10, "MIB": 2.0**20, "GIB": 2.0**30, "TIB": 2.0**40}

    def __init__(self, per_second: bool = False) -> None:
        self.per_second = per_second

    def convert(self, value, param, ctx):
        if isinstance(value, float):
            return value
        text = str(value).strip().upper().replace(" ", "")
        if self.per_second and text.endswith("/S"):
            text = text[:-2]
        number = text.rstrip("KMGTIB")
        try:
            size = float(number) * self.UNITS[text[len(number):]]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size: give e.g. {'1.79TB/s' if self.per_second else '54GB'}", param, ctx)
        if size <= 0:
            self.fail(f"{value!r} is not a size above 0", param, ctx)
        return size


def _checked_server(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (problem := server_url_problem(value)):
        raise click.BadParameter(problem, ctx, param)
    return value


@click.command(short_help="Drive one server (--server), or one per GPU (--gpus).")
@click.option("--server", "server_url", default=None, metavar="URL", callback=_checked_server, help="One worker for this server, e.g. http://127.0.0.1:30000 (SGLang, vLLM or genq sim). Use either --server or --gpus.")
@click.option("--gpus", default=None, metavar="all|0,1,5", help="One worker per GPU of this machine, each a child process restarted if it fails: 'all' (every GPU NVML sees) or a list of indices as nvidia-smi numbers them.")
@click.option("--server-url", "server_url_template", default="http://127.0.0.1:{port}", show_default=True, metavar="TEMPLATE", help="With --gpus: each GPU's server; {port} is --base-port + the GPU's position in the --gpus list (0,1,5 -> 30000,30001,30002), {gpu} its index.")
@click.option("--base-port", type=click.IntRange(1, 65535), default=30000, show_default=True, help="With --gpus: port of the first listed GPU's server; the next ones count up.")
@click.option("--launch", default=None, metavar="COMMAND", help="With --gpus: start and supervise each GPU's server with COMMAND (split like a shell, run without one; {port} and {gpu} substituted, nothing else), with CUDA_VISIBLE_DEVICES set to the GPU. It is restarted when it exits or /health fails for --server-health-timeout; its output goes to LOG_DIR/server-gpuN.log. E.g. \"python -m sglang.launch_server --model-path M --port {port} --enable-metrics\".")
@click.option("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("genq-logs"), show_default=True, help="With --gpus: server-gpuN.log, worker-gpuN.log and their .pid files.")
@click.option("--max-restarts", type=click.IntRange(0), default=10, show_default=True, help="With --gpus: restarts in a row (1 s backoff, doubling to 60 s) before a GPU's server or worker is given up; 10 minutes of good running resets the count.")
@click.option("--server-start-timeout", type=click.FloatRange(1), default=1800, show_default=True, help=f"Seconds a starting server may take to answer /health (model loading): with --launch it is then restarted. A --burst worker with --server gives up (exit 1) after this if given, else after {BURST_SERVER_WAIT_S:.0f} s (its server should be up already). Otherwise the worker waits, saying so.")
@click.option("--server-health-timeout", type=click.FloatRange(0.5), default=60, show_default=True, help="With --launch: seconds /health may fail, after the server has answered once, before it is restarted.")
@click.option("--health-interval", type=click.FloatRange(0.1), default=5, show_default=True, help="With --launch: seconds between /health checks of a healthy server.")
@click.option("--gpu", type=click.IntRange(0), default=None, help="With --server: GPU index this server runs on (telemetry, default worker name).")
@click.option("--gpu-bandwidth", type=ByteSize(per_second=True), default=None, metavar="RATE", help="The GPU's memory bandwidth, e.g. 1.79TB/s, for the decode bound (genq workers' bound column): where NVML cannot read it (no GPU, no driver) or reads it wrong. [default: NVML's]")
@click.option("--model-bytes", type=ByteSize(), default=None, metavar="SIZE", help="The model's weight bytes on this GPU, e.g. 54GB for 27B in bf16, for the decode bound where the server does not publish them (vLLM). [default: the server's]")
@click.option("--name", default=None, help="Worker name, unique in the fleet. [default: HOST.gpuN, or HOST.PORT]; with --gpus, a prefix: NAME.gpuN.")
@click.option("--host", default=None, help="Host name to report. [default: this machine's]")
@click.option("--concurrency", type=Concurrency(), default="auto", show_default=True, help="Requests in flight: 'auto' follows the server's capacity and metrics; a number caps it. Change it live with `genq concurrency`.")
@click.option("--burst", is_flag=True, help="Exit once the queue is empty and nothing is in flight.")
@click.option("--prefetch", "loops", type=click.IntRange(1, 16), default=DEFAULT_PREFETCH, show_default=True, help="Batches held at once, at least: the next batch fills slots while one drains; more are taken while held batches drain long tails.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Stream responses (stall detection and live token counts for the ETA).")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=None, help="Attempts per prompt before the dead-letter queue. [default: the job's, 5]")
@click.option("--request-timeout", type=click.FloatRange(1), default=DEFAULTS.request_timeout, show_default=True, help="Seconds one request may take (a 32K-token thinking completion fits).")
@click.option("--stall-timeout", type=click.FloatRange(0.1), default=DEFAULTS.stall_timeout, show_default=True, help="Seconds without output before a request is cancelled and retried.")
@click.option("--server-down-timeout", type=click.FloatRange(0), default=DEFAULTS.server_down_timeout, show_default=True, help="Seconds the server may be down before held batches go back to the queue for other GPUs.")
@click.option("--server-crash-limit", type=click.IntRange(1, 100), default=DEFAULTS.server_crash_limit, show_default=True, help="A prompt in flight while its server went down this many times (sent alone after the second) is dead-lettered as server_crash.")
@click.option("--grace-period", type=click.FloatRange(0), default=DEFAULTS.grace_period, show_default=True, help="On SIGTERM/Ctrl-C: seconds to finish held batches before handing the rest back.")
@click.option("--retry-backoff", type=click.FloatRange(0), default=DEFAULTS.retry_backoff, show_default=True, help="First retry delay in seconds, of a request and of a shard write; doubles per attempt (with jitter).")
@click.option("--retry-backoff-max", type=click.FloatRange(0), default=DEFAULTS.retry_backoff_max, show_default=True, help="Longest retry delay in seconds.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False), default="info", show_default=True, help="Least severe log lines shown (any case: INFO or info).")
@click.pass_context
def worker(ctx: click.Context, log_level: str, **options) -> None:
    """Take batches from the queue and drive one server with them (--server),
    or one server per GPU of this machine (--gpus).

    Prompts of the batches a worker holds share one in-flight window, sized
    from the server's capacity, so the next batch fills slots while the current
    one's long tail drains. Each finished prompt is recorded at once; a batch's
    shard is written when all its prompts are done, and only then is the batch
    acknowledged. Ctrl-C or SIGTERM: finish held batches (up to --grace-period),
    hand back the rest, exit 0; a second Ctrl-C stops at once.

    \b
    One command per machine (joining machines run the same with --redis):
      genq --redis redis://HEAD:6379/0 worker --gpus all \\
        --launch "python -m sglang.launch_server --model-path M --port {port} --enable-metrics"
    GPU i of the list gets port --base-port + i and worker name HOST.gpuN.
    """
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for option in ("name", "host"):  # the worker names are NAME, NAME.gpuN, HOST.gpuN or HOST.PORT
        if options[option] is not None and (problem := name_problem(options[option], f"--{option}")):
            raise click.UsageError(problem)
    fleet_opts = {k: options.pop(k) for k in FLEET_ONLY}
    if (options["server_url"] is None) == (fleet_opts["gpus"] is None):
        raise click.UsageError("give either --server URL (one worker) or --gpus all|0,1,... (one worker per GPU)")
    if fleet_opts["gpus"] is not None:
        if options["gpu"] is not None:
            raise click.UsageError("--gpu is for --server; with --gpus each worker gets its GPU from the list")
        fleet_opts["server_start_timeout"] = options["server_start_timeout"]
        raise SystemExit(_run_fleet(ctx, fleet_opts, options["name"], options["host"]))
    given = [f"--{k.replace('_template', '').replace('_', '-')}" for k in FLEET_ONLY
             if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT]
    if given:
        raise click.UsageError(f"{', '.join(given)} only work(s) with --gpus (use --gpus N for one GPU)")
    from genq.worker.engine import run_engine

    if not options["burst"]:
        options["server_start_timeout"] = None  # a long-lived worker waits for its server, saying so
    elif ctx.get_parameter_source("server_start_timeout") is ParameterSource.DEFAULT:
        # A burst worker expects its server up: a dead port (a typo, a dead server) fails in
        # seconds, not after the 30 minutes a model may take to load.
        options["server_start_timeout"] = BURST_SERVER_WAIT_S
    raise SystemExit(asyncio.run(run_engine(WorkerOptions(redis_url=redis_url(ctx), **options))))


# Options of the fleet itself (--gpus); everything else is passed to each GPU's worker.
FLEET_ONLY = ("gpus", "server_url_template", "base_port", "launch", "log_dir", "max_restarts",
              "server_health_timeout", "health_interval")
# Set per GPU by the fleet, never forwarded as given.
PER_WORKER = ("server_url", "gpu", "name", "host")


def forwarded_options(ctx: click.Context) -> list[str]:
    """The shared options the operator gave, as arguments for each GPU's `genq worker` (--redis is
    the fleet's own to pass, and not held in ctx.params)."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if name in FLEET_ONLY or name in PER_WORKER or name not in ctx.params or not isinstance(param, click.Option):
            continue
        if ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, None):
            continue
        value = ctx.params[name]
        if param.is_flag:
            if param.secondary_opts:
                args.append(param.opts[0] if value else param.secondary_opts[0])
            elif value:
                args.append(param.opts[0])
            continue
        args += [param.opts[0], "auto" if value is None else str(value)]
    return args


def _run_fleet(ctx: click.Context, fleet: dict, name: str | None, host: str | None) -> int:
    from genq.worker.fleet import FleetOptions, HealthTimeouts, parse_gpus, run_fleet

    return asyncio.run(run_fleet(FleetOptions(
        redis_url=redis_url(ctx), gpus=parse_gpus(fleet["gpus"]), host=host or socket.gethostname(),
        base_port=fleet["base_port"], server_url=fleet["server_url_template"], launch=fleet["launch"],
        log_dir=fleet["log_dir"], name_prefix=name, engine_args=forwarded_options(ctx), max_restarts=fleet["max_restarts"],
        health=HealthTimeouts(start=fleet["server_start_timeout"], unhealthy=fleet["server_health_timeout"],
                              interval=fleet["health_interval"]))))
