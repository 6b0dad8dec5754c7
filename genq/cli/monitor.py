"""genq monitor: totals, throughput, an honest ETA and per-GPU efficiency, live or once."""

from __future__ import annotations

import logging
import os
import sys
import time
from contextlib import nullcontext

import click
import redis

from genq.cli import Finite, JobName, redis_url
from genq.core.ledger.figures import FINISHED_STATUSES
from genq.core.redisconn import connect, describe_error, mask_url, refusal
from genq.monitor.progress import Monitor, document, encode
from genq.output.truth import write_atomic


@click.command(short_help="A job's progress, rates, ETA and workers (live, JSON, web).")
@click.option("--job", type=JobName(), default=None, help="Job to show. [default: the only job, or every job]")
@click.option("--once", is_flag=True, help="One report, then exit (rates from the workers' own records: less certain).")
@click.option("--json", "as_json", is_flag=True,
              help="JSON instead of the live view: one document with --once, else one line per refresh.")
@click.option("--progress-file", type=click.Path(dir_okay=False, writable=True), default=None,
              help="(Re)write this JSON file atomically on every refresh (once with --once).")
@click.option("--interval", type=Finite(0.2), default=2.0, show_default=True,
              help="Seconds between refreshes.")
@click.option("--rate-window", type=Finite(5), default=120.0, show_default=True,
              help="Seconds of the monitor's own samples the throughput is read from.")
@click.option("--metrics", "listen", default=None, metavar="[HOST]:PORT",
              help="Expose Prometheus metrics on HOST:PORT (e.g. :9108) while running; scrape with "
                   "honor_labels: true (the genq job is the `job` label). Grafana: dashboards/grafana-genq.json.")
@click.option("--web", "web_listen", default=None, metavar="[HOST]:PORT",
              help="Serve a live page with plots on HOST:PORT (e.g. 127.0.0.1:8008; reach it through a port "
                   "forward). Read-only unless --web-control.")
@click.option("--web-control", is_flag=True,
              help="Add pause/resume/drain buttons to the --web page; they need the token in the "
                   "GENQ_WEB_TOKEN environment variable (not an option: ps shows options).")
@click.option("--web-allow-host", "web_hosts", multiple=True, metavar="NAME",
              help="Another host name the --web page answers to (a reverse proxy's, a DNS name of this "
                   "machine); repeatable. Addresses, localhost, this machine's name and --web's host always "
                   "are; any other Host gets 403 (a DNS-rebinding page).")
@click.option("--until-done", is_flag=True,
              help="Exit once every shown job is done and every shard written (for scripts).")
@click.pass_context
def monitor(ctx: click.Context, job: str | None, once: bool, as_json: bool, progress_file: str | None,
            interval: float, rate_window: float, listen: str | None, web_listen: str | None, web_control: bool,
            web_hosts: tuple[str, ...], until_done: bool) -> None:
    """Show job progress: totals, rates, tokens, an ETA with its range, and each worker.

    JSON (--json, --progress-file): one object with --job or when exactly one job
    exists, else an object keyed by job name; its fields are in docs/monitoring.md
    (--json adds eta_s, eta_low_s, eta_high_s in seconds, null without an honest
    estimate). The ETA's range is a central 90% (docs/monitoring.md says how).
    """
    url = redis_url(ctx)
    token = os.environ.get("GENQ_WEB_TOKEN") or None
    if once and (listen or web_listen):
        raise click.UsageError(f"{'--metrics' if listen else '--web'} needs a running monitor; drop --once")
    for option, value in (("--metrics", listen), ("--web", web_listen)):
        if value:  # a malformed address is bad usage, said before anything starts
            from genq.monitor.exporter import parse_listen

            try:
                parse_listen(value, option)
            except ValueError as exc:  # it names the option and the value
                raise click.UsageError(str(exc)) from None
    if (web_control or web_hosts) and not web_listen:
        raise click.UsageError(f"{'--web-control' if web_control else '--web-allow-host'} goes with --web")
    if web_control and (token is None or len(token) < 16):
        raise click.UsageError("--web-control needs a token of 16 or more characters in GENQ_WEB_TOKEN")
    try:
        conn = connect(url)
        conn.ping()
    except (redis.RedisError, OSError) as exc:
        if refusal(exc) is None:  # a Redis refusing writes (MISCONF refuses PING) still answers reads
            raise click.ClickException(describe_error(url, exc)) from None
    history = None
    if web_listen:
        from genq.monitor.webapp import History, serve_web

        history = History()
    mon = Monitor(conn, job, window_s=rate_window, once=once, on_refresh=history.record if history else None)
    if listen:
        from genq.monitor.exporter import serve

        logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
        try:
            serve(mon, listen, max_age=interval)
        except OSError as exc:
            raise click.ClickException(f"--metrics {listen}: {exc}") from None
        click.echo(f"genq monitor: Prometheus metrics on http://{_shown(listen)}/metrics", err=True)
    if web_listen and history is not None:
        try:
            serve_web(mon, history, web_listen, interval, token if web_control else None, web_hosts)
        except OSError as exc:
            raise click.ClickException(f"--web {web_listen}: {exc}") from None
        click.echo(f"genq monitor: live page on http://{_shown(web_listen)}/"
                   f"{' (pause/resume/drain enabled)' if web_control else ' (read-only)'}", err=True)
    try:  # what Redis says instead of answering, and JobNotFound, are the genq group's to print
        _loop(mon, as_json, progress_file, mask_url(url), None if once else interval, until_done)
    except OSError as exc:  # the progress file cannot be written
        raise click.ClickException(f"--progress-file {progress_file}: {exc}") from None
    except KeyboardInterrupt:
        pass


def _shown(listen: str) -> str:
    return "0.0.0.0" + listen if listen.startswith(":") else listen


def _loop(mon: Monitor, as_json: bool, progress_file: str | None, shown_url: str, interval: float | None,
          until_done: bool) -> None:
    """A refresh every `interval` seconds (None: one, --once), as JSON or the view (live in a terminal)."""
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from genq.monitor.view import render

    console = Console()
    live = Live(console=console, auto_refresh=False) if console.is_terminal and interval and not as_json else None
    with live or nullcontext():
        while True:
            started = time.monotonic()
            try:
                reports = mon.refresh()
            except redis.RedisError as exc:
                if interval is None:
                    raise
                # A live monitor outlasts a Redis restart: say so and try again next time.
                message = f"cannot read Redis at {shown_url} ({type(exc).__name__}: {exc}); retrying"
                if live is not None:
                    live.update(Text(message, style="bold red"), refresh=True)
                else:
                    click.echo(message, err=True)
                reports = []
            else:
                if progress_file:
                    write_atomic(progress_file, encode(document(reports, mon.single, for_json=False)) + b"\n")
                if as_json:
                    if mon.redis_note:  # stdout stays the JSON document
                        click.echo(f"warning: {mon.redis_note.text}", err=True)
                    sys.stdout.buffer.write(encode(document(reports, mon.single, for_json=True)) + b"\n")
                    sys.stdout.flush()
                else:
                    view = render(reports, shown_url, interval, mon.redis_note.text if mon.redis_note else None)
                    if live is not None:
                        live.update(view, refresh=True)
                    else:  # a pipe or a file: not squeezed into 80 columns
                        (console if console.is_terminal else Console(width=140)).print(view)
            # "done" means every shard is written too (not only every prompt finished): a script
            # that exports right after --until-done gets every batch.
            if interval is None or (until_done and reports and all(
                    r.progress.status in FINISHED_STATUSES for r in reports)):
                return
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
