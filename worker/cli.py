"""genq worker: drive one local inference server from the queue."""

from __future__ import annotations

import asyncio
import logging

import click

from genq.cli import settings
from worker.engine import WorkerOptions, run_engine


class Concurrency(click.ParamType):
    name = "auto|N"

    def convert(self, value, param, ctx):
        if value is None or str(value).lower() == "auto":
            return None
        try:
            number = int(value)
        except ValueError:
            self.fail(f"{value!r} is neither 'auto' nor a whole number", param, ctx)
        if number < 1:
            self.fail("must be at least 1", param, ctx)
        return number


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )


@click.command()
@click.option("--server", "server_url", required=True, metavar="URL", help="The local inference server, e.g. http://127.0.0.1:30000 (SGLang, vLLM or genq sim).")
@click.option("--gpu", type=click.IntRange(0), default=None, help="GPU index this server runs on (telemetry, default worker name).")
@click.option("--name", default=None, help="Worker name, unique in the fleet. [default: HOST.gpuN, or HOST.PORT]")
@click.option("--host", default=None, help="Host name to report. [default: this machine's]")
@click.option("--concurrency", type=Concurrency(), default="auto", show_default=True, help="Requests in flight: 'auto' follows the server's capacity and metrics; a number caps it. Change it live with `genq concurrency`.")
@click.option("--burst", is_flag=True, help="Exit once the queue is empty and nothing is in flight.")
@click.option("--prefetch", "loops", type=click.IntRange(1, 16), default=2, show_default=True, help="Batches held at once (RQ work loops); 2 lets the next batch fill slots while one drains.")
@click.option("--stream/--no-stream", default=True, show_default=True, help="Stream responses (stall detection and live token counts for the ETA).")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=None, help="Attempts per prompt before the dead-letter queue. [default: the job's, 5]")
@click.option("--request-timeout", type=click.FloatRange(1), default=3600, show_default=True, help="Seconds one request may take (a 32K-token thinking completion fits).")
@click.option("--stall-timeout", type=click.FloatRange(0.1), default=300, show_default=True, help="Seconds without output before a request is cancelled and retried.")
@click.option("--server-down-timeout", type=click.FloatRange(0), default=300, show_default=True, help="Seconds the server may be down before held batches go back to the queue for other GPUs.")
@click.option("--grace-period", type=click.FloatRange(0), default=60, show_default=True, help="On SIGTERM/Ctrl-C: seconds to finish held batches before handing the rest back.")
@click.option("--retry-backoff", type=click.FloatRange(0), default=1.0, show_default=True, help="First retry delay in seconds; doubles per attempt (with jitter), capped at 60.")
@click.option("--heartbeat-interval", "job_monitoring_interval", type=click.IntRange(1, 600), default=10, show_default=True, help="RQ job heartbeat; a batch of a killed worker is recovered after this + 60 s.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info", show_default=True)
@click.pass_context
def worker(ctx: click.Context, log_level: str, **options) -> None:
    """Take batches from the queue and drive one server with them.

    Run one per GPU. Prompts of the batches it holds share one in-flight window,
    sized from the server's capacity, so the next batch fills slots while the
    current one's long tail drains. Each finished prompt is recorded at once; a
    batch's shard is written when all its prompts are done, and only then is
    the batch acknowledged. Ctrl-C or SIGTERM: finish held batches (up to
    --grace-period), hand back the rest, exit 0; a second Ctrl-C stops at once.
    """
    setup_logging(log_level)
    opts = WorkerOptions(redis_url=settings(ctx).redis_url, **options)
    raise SystemExit(asyncio.run(run_engine(opts)))
