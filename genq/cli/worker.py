"""`genq worker`: drive one inference server from the queue, or (--gpus) one per GPU of this machine."""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
from pathlib import Path

import click
from click.core import ParameterSource

from genq.cli import Finite, concurrency, redis_url
from genq.worker.options import WorkerOptions, name_problem, server_url_problem

# The worker's defaults are WorkerOptions' own: one definition, shown by --help.
DEFAULTS = WorkerOptions(redis_url="", server_url="")

BURST_SERVER_WAIT_S = 30.0  # --burst --server: how long a server that does not answer is waited for
opt = functools.partial(click.option, show_default=True)


class ByteSize(click.ParamType):
    """A size in bytes (or bytes/s): 54GB, 1.79TB/s, 48GiB, or a plain number; decimal units as vendors
    rate bandwidth, KiB..TiB binary."""

    name = "SIZE"
    UNITS = {"": 1.0, "B": 1.0, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
             "KIB": 2.0**10, "MIB": 2.0**20, "GIB": 2.0**30, "TIB": 2.0**40}

    def __init__(self, per_second: bool = False) -> None:
        self.per_second = per_second

    def convert(self, value, param, ctx):
        text = str(value).strip().upper().replace(" ", "")  # a float: as --gpus forwards it
        text = text.removesuffix("/S") if self.per_second else text
        number = text.rstrip("KMGTIB")
        try:
            size = float(number) * self.UNITS[text[len(number):]]
        except (ValueError, KeyError):
            self.fail(f"{value!r} is not a size: give e.g. {'1.79TB/s' if self.per_second else '54GB'}", param, ctx)
        if not 0 < size < float("inf"):  # nan fails both
            self.fail(f"{value!r} is not a finite size above 0", param, ctx)
        return size


def _checked_server(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None and (problem := server_url_problem(value)):
        raise click.BadParameter(problem, ctx, param)
    return value


@click.command()
@click.option("--server", "server_url", metavar="URL", callback=_checked_server, help="One worker for this server.")
@click.option("--gpus", metavar="all|0,1,5",
              help="One worker per GPU of this machine: all (as NVML sees them) or indices (docs/fleet.md).")
@opt("--server-url", "server_url_template", default="http://127.0.0.1:{port}", metavar="TEMPLATE",
     help="With --gpus: each GPU's server; {port} is --base-port + its place in --gpus, {gpu} its index.")
@opt("--base-port", type=click.IntRange(1, 65535), default=30000, help="With --gpus: the first GPU's server port.")
@click.option("--launch", metavar="COMMAND",
              help="With --gpus: start and supervise each GPU's server with COMMAND (split like a shell, run without "
                   "one; {port} and {gpu} substituted; CUDA_VISIBLE_DEVICES set to the GPU), e.g. "
                   "'python -m sglang.launch_server --model-path M --port {port} --enable-metrics'.")
@opt("--log-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("genq-logs"),
     help="With --gpus: server-gpuN.log, worker-gpuN.log and their .pid files.")
@opt("--max-restarts", type=click.IntRange(0), default=10,
     help="With --gpus: restarts in a row (1 s backoff doubling to 60 s) before giving up.")
@opt("--server-start-timeout", type=Finite(1), default=1800,
     help=f"Seconds a starting server may take to answer /health ({BURST_SERVER_WAIT_S:.0f} for --burst --server).")
@opt("--server-health-timeout", type=Finite(0.5), default=60, help="With --launch: failing /health seconds.")
@opt("--health-interval", type=Finite(0.1), default=5, help="With --launch: seconds between /health checks.")
@click.option("--gpu", type=click.IntRange(0), help="With --server: the GPU this server runs on.")
@click.option("--gpu-bandwidth", type=ByteSize(per_second=True), metavar="RATE", help="e.g. 1.79TB/s (decode bound).")
@click.option("--model-bytes", type=ByteSize(), metavar="SIZE", help="Weight bytes per GPU, e.g. 54GB (decode bound).")
@click.option("--name", help="Worker name, unique in the fleet (with --gpus a prefix: NAME.gpuN).")
@click.option("--host", help="Host name to report. [default: this machine's]")
@opt("--concurrency", type=concurrency, metavar="auto|N", default="auto", help="Requests in flight: auto, or a cap.")
@click.option("--burst", is_flag=True, help="Exit once the queue is empty and nothing is in flight.")
@opt("--prefetch", "loops", type=click.IntRange(1, 16), default=DEFAULTS.loops, help="Least batches held at once.")
@opt("--stream/--no-stream", default=True, help="Stream responses.")
@click.option("--max-attempts", type=click.IntRange(1, 100), help="Attempts per prompt. [default: the job's, 5]")
@opt("--request-timeout", type=Finite(1), default=DEFAULTS.request_timeout, help="Seconds per request.")
@opt("--stall-timeout", type=Finite(0.1), default=DEFAULTS.stall_timeout, help="Seconds without output.")
@opt("--server-down-timeout", type=Finite(0), default=DEFAULTS.server_down_timeout,
     help="Seconds the server may be down before held batches go back to the queue.")
@opt("--server-crash-limit", type=click.IntRange(1, 100), default=DEFAULTS.server_crash_limit,
     help="Server outages a prompt may be in flight for before its dead letter.")
@opt("--grace-period", type=Finite(0), default=DEFAULTS.grace_period, help="On SIGTERM: seconds to finish.")
@opt("--retry-backoff", type=Finite(0), default=DEFAULTS.retry_backoff, help="First retry delay, seconds.")
@opt("--retry-backoff-max", type=Finite(0), default=DEFAULTS.retry_backoff_max,
     help="Longest retry delay, also for a server's Retry-After.")
@opt("--log-level", type=click.Choice(["debug", "info", "warning", "error"], case_sensitive=False), default="info")
@click.pass_context
def worker(ctx: click.Context, log_level: str, **options) -> None:
    """Drive one server (--server), or one per GPU (--gpus). See docs/fleet.md."""
    logging.basicConfig(level=getattr(logging, log_level.upper()), format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for option in ("name", "host"):  # the worker names are NAME, NAME.gpuN, HOST.gpuN or HOST.PORT
        if options[option] is not None and (problem := name_problem(options[option], f"--{option}")):
            raise click.UsageError(problem)
    if options["retry_backoff"] > options["retry_backoff_max"]:  # each GPU's worker gets both: said once, here
        raise click.UsageError(f"--retry-backoff {options['retry_backoff']} is more than --retry-backoff-max "
                               f"{options['retry_backoff_max']}: the first retry delay cannot exceed the longest")
    f = {k: options.pop(k) for k in FLEET_ONLY}  # the fleet's own options
    if (options["server_url"] is None) == (f["gpus"] is None):
        raise click.UsageError("give either --server URL (one worker) or --gpus all|0,1,... (one worker per GPU)")
    if f["gpus"] is not None:
        if options["gpu"] is not None:
            raise click.UsageError("--gpu is for --server; with --gpus each worker gets its GPU from the list")
        from genq.worker import fleet
        from genq.worker.fleet import FleetError, FleetOptions, HealthTimeouts, parse_gpus, run_fleet

        try:  # a bad template is bad usage, said before anything starts
            fleet.check_template(f["server_url_template"], "--server-url")
            if f["launch"] is not None:
                fleet.launch_argv(f["launch"], port=0, gpu=0)
        except FleetError as exc:
            raise click.UsageError(str(exc)) from None
        try:
            gpus = parse_gpus(f["gpus"])  # FleetError: NVML cannot answer --gpus all (exit 1)
        except ValueError as exc:
            raise click.UsageError(str(exc)) from None
        raise SystemExit(asyncio.run(run_fleet(FleetOptions(
            redis_url=redis_url(ctx), gpus=gpus, host=options["host"] or socket.gethostname(),
            base_port=f["base_port"], server_url=f["server_url_template"], launch=f["launch"], log_dir=f["log_dir"],
            name_prefix=options["name"], engine_args=forwarded_options(ctx), max_restarts=f["max_restarts"],
            health=HealthTimeouts(start=options["server_start_timeout"], unhealthy=f["server_health_timeout"],
                                  interval=f["health_interval"])))))
    if given := [f"--{k.replace('_template', '').replace('_', '-')}" for k in FLEET_ONLY
                 if ctx.get_parameter_source(k) is not ParameterSource.DEFAULT]:
        raise click.UsageError(f"{', '.join(given)} only work(s) with --gpus (use --gpus N for one GPU)")
    from genq.worker.engine import run_engine

    if not options["burst"]:
        options["server_start_timeout"] = None  # a long-lived worker waits for its server, saying so
    elif ctx.get_parameter_source("server_start_timeout") is ParameterSource.DEFAULT:
        # A burst worker expects its server up: a dead port (a typo, a dead server) fails in seconds,
        # not after the 30 minutes a model may take to load.
        options["server_start_timeout"] = BURST_SERVER_WAIT_S
    raise SystemExit(asyncio.run(run_engine(WorkerOptions(redis_url=redis_url(ctx), **options))))


# Options of the fleet itself (--gpus), and those set per GPU by it: neither is forwarded to each GPU's worker.
FLEET_ONLY = ("gpus", "server_url_template", "base_port", "launch", "log_dir", "max_restarts",
              "server_health_timeout", "health_interval")
PER_WORKER = ("server_url", "gpu", "name", "host")


def forwarded_options(ctx: click.Context) -> list[str]:
    """The shared options the operator gave, as arguments for each GPU's `genq worker` (--redis is the
    fleet's own to pass)."""
    args: list[str] = []
    for param in ctx.command.params:
        name = param.name
        if (name in FLEET_ONLY or name in PER_WORKER or name not in ctx.params or not isinstance(param, click.Option)
                or ctx.get_parameter_source(name) in (ParameterSource.DEFAULT, None)):
            continue
        value = ctx.params[name]
        if not param.is_flag:
            args += [param.opts[0], "auto" if value is None else str(value)]
        elif param.secondary_opts or value:
            args.append(param.opts[0] if value else param.secondary_opts[0])
    return args
