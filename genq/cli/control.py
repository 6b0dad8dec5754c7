"""Operator commands: genq workers, jobs, pause, resume, drain, concurrency.

They only read and write Redis (see genq.ops.control); workers pick changes up
within about a second, wherever they run.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import cast

import click
import msgspec
import redis
from rich.console import Console, JustifyMethod
from rich.live import Live
from rich.table import Table

from genq.cli import Concurrency, JobName, jobset, settings
from genq.core.health import NO_HEARTBEAT
from genq.core.ledger.jobs import job_keys_shown
from genq.core.queueing import list_jobs
from genq.core.redisconn import connect, describe_error
from genq.core.timings import LEASE_TIMEOUT_S, LOST_BATCH_BACK_S, RECONCILE_EVERY_S
from genq.core.words import plural
from genq.ops import control
from genq.ops.settings import describe_block
from genq.worker.models import servable_jobs


def _console() -> Console:
    # Piped output (logs, docs, tests) gets wide lines rather than wrapped cells.
    return Console() if sys.stdout.isatty() else Console(width=200, no_color=True)


@contextmanager
def _redis(ctx: click.Context) -> Iterator[redis.Redis]:
    url = settings(ctx).redis_url
    conn = connect(url)
    try:
        yield conn
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        raise click.ClickException(describe_error(url, exc)) from None
    finally:
        conn.close()


def _check_job(conn: redis.Redis, job: str) -> None:
    jobs = list_jobs(conn)
    if job not in jobs:
        raise click.ClickException(f"no job named {job!r}; jobs: {', '.join(jobs) or 'none'}")


# ---------------------------------------------------------------- fleet view


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _batches(row: control.WorkerRow, limit: int = 3) -> str:
    if not row.batches:
        return "-" if row.live else ""
    shown = " ".join(row.batches[:limit])
    more = f" +{len(row.batches) - limit}" if len(row.batches) > limit else ""
    return f"{len(row.batches)}: {shown}{more}"


def workers_table(rows: list[control.WorkerRow], title: str | None = None,
                  serves: dict[str, list[str]] | None = None) -> Table:
    table = Table(title=title, show_edge=False, header_style="bold")
    for col, justify in (("worker", "left"), ("host", "left"), ("gpu", "right"), ("server", "left"),
                         ("model: jobs it serves", "left"),
                         ("state", "left"), ("batches", "left"), ("in flight", "right"), ("queued", "right"),
                         ("tok/s", "right"), ("done", "right"), ("heartbeat", "right"), ("note", "left")):
        # One line per worker; a long note (a connection error) is cut: --json has it whole.
        table.add_column(col, justify=cast(JustifyMethod, justify), no_wrap=True, overflow="ellipsis",
                         max_width=60 if col == "note" else None)
    styles = {"busy": "green", "idle": "cyan", "paused": "yellow", "draining": "yellow",
              "server_down": "red", "stopped": "dim", control.LOST: "red"}
    for r in rows:
        live = r.live
        flight = f"{r.in_flight}/{r.target}" + (f" cap {r.cap}" if r.cap else "") if live else ""
        table.add_row(
            r.name, r.host or "?", r.gpu if r.gpu is not None else "-", r.server or "",
            f"{r.model or '?'}: {', '.join((serves or {}).get(r.name, [])) or '-'}" if live else "",
            f"[{styles.get(r.state, '')}]{r.state}[/]" if styles.get(r.state) else r.state,
            _batches(r), flight, str(r.queued) if live else "", f"{r.tok_per_s:,.0f}" if live else "",
            str(r.done) if r.state != control.LOST else "", _age(r.heartbeat_age_s), r.note or "",
        )
    return table


WORKERS_HELP = f"""The fleet: every worker with its host, GPU, server, state and load.

    \b
    States: busy, idle, paused, draining, server_down (its server is not
    answering /health; it holds its batches and takes no new ones), stopped
    (exited cleanly), lost ({NO_HEARTBEAT}: killed or unreachable). A
    lost worker's batches run elsewhere within about {LOST_BATCH_BACK_S:.0f} s of
    its death: its engine's liveness key lapses after {LEASE_TIMEOUT_S:.0f} s and the
    reconciler every worker runs every {RECONCILE_EVERY_S:.0f} s queues them again
    (docs/operations.md has the measurement).
    "in flight" is requests running / the worker's current target.
    """


@click.command(help=WORKERS_HELP)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of workers (machine-readable).")
@click.option("--prune", is_flag=True, help="Forget workers that are stopped or lost, then show the rest.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool, prune: bool) -> None:
    with _redis(ctx) as conn:
        rows = control.fleet(conn)
        if prune:
            gone = control.forget(conn, [r.name for r in rows if not r.live])
            rows = [r for r in rows if r.live]
            if gone and not as_json:
                click.echo(f"forgot {len(gone)} stopped/lost worker(s): {', '.join(gone)}")
        # Which jobs each can serve: those for its server's model or `auto` (worker/models.py).
        jobs = list_jobs(conn)
        serves = {r.name: servable_jobs(conn, r.model, jobs) for r in rows if r.live}
    if as_json:
        click.echo(msgspec.json.encode([{**r.to_json(), "serves": serves.get(r.name)} for r in rows]).decode())
        return
    if not rows:
        click.echo("no workers have registered in this Redis (start one with `genq worker`)")
        return
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    console = _console()
    console.print(workers_table(rows, serves=serves))
    console.print(f"{len(rows)} worker(s): {summary}; "
                  f"{sum(r.tok_per_s for r in rows if r.live):,.0f} tok/s in all")


# ---------------------------------------------------------------- jobs


@click.group(invoke_without_command=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON array of jobs.")
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """Jobs with priority, share of the fleet, prompts total/done/failed, batches and paused state.

    share is the job's part of the requests running on the fleet now; priority (and
    weight, when not 1) decide it: docs/scheduling.md.

    done sums the workers' counters, failed is the dead-letter queue's size
    (`genq dlq`), remaining = total - done - failed. `genq jobs delete JOB`
    removes a job from Redis.
    """
    if ctx.invoked_subcommand is not None:
        return
    with _redis(ctx) as conn:
        rows = control.job_rows(conn)
        paused_all = control.globally_paused(conn)
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
        return
    if not rows:
        click.echo("no jobs (queue some with `genq enqueue`)")
        return
    table = Table(show_edge=False, header_style="bold")
    for col in ("job", "state", "priority", "share", "total", "done", "failed", "remaining", "batches", "workers",
                "output"):
        table.add_column(col, justify="right" if col in ("priority", "share", "total", "done", "failed",
                                                          "remaining") else "left", no_wrap=True)
    for r in rows:
        pct = f" ({_floor_percent(r.done, r.total)})" if r.total else ""
        prio = f"{r.priority}" + (f" w{r.weight:g}" if r.weight != 1 else "")
        table.add_row(r.name, r.state, prio, f"{100 * r.share:.0f}%" if r.running else "-", f"{r.total:,}",
                      f"{r.done:,}{pct}", f"{r.failed:,}", f"{r.remaining:,}", f"{r.batches_done}/{r.batches}",
                      str(len(r.workers)), r.output or "?")
    console = _console()
    console.print(table)
    for r in rows:
        if r.blocked is not None:
            console.print(describe_block(r.name, r.blocked), soft_wrap=True)
    if paused_all:
        console.print("all jobs are paused (genq resume)")


def _floor_percent(part: int, whole: int) -> str:
    """Rounded down: 1,995 of 2,000 is 99.7%, never "100%" beside prompts still missing or failed."""
    tenths = 1000 * part // whole
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


@jobs.command("delete")
@click.argument("job", type=JobName())
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Delete even while live workers hold the job's batches.")
@click.pass_context
def jobs_delete(ctx: click.Context, job: str, yes: bool, force: bool) -> None:
    """Remove job JOB from Redis: its keys, its name, and its RQ jobs.

    Removes everything under genq:job:JOB: (config, ids, batches, results not
    yet written, counters, dead letters), JOB from the job list, and the job's
    RQ jobs from the queue and RQ's registries. Shards already written under
    the job's output are kept. Refused while a live worker holds one of its
    batches (drain or stop it first), unless --force.
    """
    with _redis(ctx) as conn:
        found = control.find_job(conn, job)
        if not found.keys and not found.rq_jobs and job not in list_jobs(conn):
            jobs_known = list_jobs(conn)
            raise click.ClickException(f"no job named {job!r}; jobs: {', '.join(jobs_known) or 'none'}")
        if found.holders and not force:
            raise click.ClickException(
                f"live workers hold batches of job {job!r}: {', '.join(found.holders)}. Drain them "
                f"(genq drain --worker NAME) or wait, or pass --force to delete anyway.")
        what = _deletion_summary(found)
        if not yes and not click.confirm(f"delete job {job}: {what}?", default=False):
            raise click.ClickException("nothing deleted")
        control.delete_job(conn, found)
    click.echo(f"removed job {job}: {what}")


jobs.add_command(jobset.jobs_set)
jobs.add_command(jobset.jobs_show)


def _deletion_summary(found: control.JobDeletion) -> str:
    kinds: dict[str, int] = {}
    for key in found.keys:
        kind = key.split(":")[3]  # genq:job:JOB:batch:b0000001 -> batch (job names have no ':')
        kinds[kind] = kinds.get(kind, 0) + 1
    listing = ", ".join(f"{kind}" + (f" x{n}" if n > 1 else "") for kind, n in sorted(kinds.items()))
    places = ", ".join(f"{len(ids)} {place}" for place, ids in found.rq_jobs.items())
    return (f"{plural(len(found.keys), 'key')} {job_keys_shown(found.job)} ({listing or 'none'}), its name in the job list, "
            f"{plural(found.rq_count, 'RQ job')} ({places or 'none'})")


# ---------------------------------------------------------------- pause / resume


@click.command()
@click.option("--job", type=JobName(), default=None, help="Pause only this job. [default: every job]")
@click.pass_context
def pause(ctx: click.Context, job: str | None) -> None:
    """Stop sending new requests; requests in flight finish, held batches are kept.

    Without --job this also sets RQ's suspension flag (as `rq suspend` does),
    so no RQ work loop, genq's or a stock `rq worker`, takes a new batch.
    Workers notice within a second. `genq resume` undoes it.
    """
    with _redis(ctx) as conn:
        if job is not None:
            _check_job(conn, job)
        control.pause(conn, job)
    what = f"job {job}" if job else "all jobs"
    click.echo(f"paused {what}: workers send no new requests from now (in-flight ones finish, "
               f"batches stay held){'' if job else '; RQ workers suspended (rq suspend)'}. "
               f"Undo with `genq resume{f' --job {job}' if job else ''}`.")


@click.command()
@click.option("--job", type=JobName(), default=None, help="Resume only this job. [default: lift the global pause]")
@click.pass_context
def resume(ctx: click.Context, job: str | None) -> None:
    """Undo `genq pause` (global, or one job's)."""
    with _redis(ctx) as conn:
        if job is not None:
            _check_job(conn, job)
        queued = control.resume(conn, job)
        still = sorted(control.paused_jobs(conn, list_jobs(conn)))
        paused_all = control.globally_paused(conn)
    click.echo(f"resumed {f'job {job}' if job else 'all jobs'}"
               + (f"; {plural(queued, 'parked batch', 'parked batches')} queued again" if queued else ""))
    if still:
        click.echo(f"still paused on their own: {', '.join(still)} (genq resume --job NAME)")
    if paused_all:
        click.echo("note: everything is still paused globally (genq resume)")


# ---------------------------------------------------------------- drain / concurrency


def _selector_options(fn: Callable) -> Callable:
    fn = click.option("--all", "everyone", is_flag=True, help="Every live worker.")(fn)
    fn = click.option("--host", default=None, help="Every live worker on this host.")(fn)
    fn = click.option("--worker", "names", multiple=True, metavar="NAME",
                      help="A worker by name (see `genq workers`); repeatable.")(fn)
    return fn


def _select(conn: redis.Redis, names: tuple[str, ...], host: str | None, everyone: bool) -> list[control.WorkerRow]:
    given = sum([bool(names), host is not None, everyone])
    if given != 1:
        raise click.UsageError("name the workers with exactly one of --worker NAME, --host HOST or --all")
    try:
        chosen = control.select(control.fleet(conn), workers=names, host=host, everyone=everyone)
    except control.NoMatch as exc:
        raise click.ClickException(str(exc)) from None
    if not chosen:
        raise click.ClickException("no live workers")
    return chosen


@click.command()
@_selector_options
@click.option("--wait", is_flag=True, help="Show what each worker still holds until all have stopped.")
@click.option("--timeout", type=click.FloatRange(0, min_open=True), default=None,
              help="With --wait: give up waiting after this many seconds (exit 1); more than 0.")
@click.pass_context
def drain(ctx: click.Context, names: tuple[str, ...], host: str | None, everyone: bool, wait: bool,
          timeout: float | None) -> None:
    """Let workers finish what they hold, then exit (0); they take no new batches.

    A drained worker started by `genq worker --gpus` is not restarted; its
    server is stopped once the worker has exited.
    """
    with _redis(ctx) as conn:
        chosen = _select(conn, names, host, everyone)
        for row in chosen:
            control.update_control(conn, row.name, drain=True)
        click.echo(f"draining {len(chosen)} worker(s): {', '.join(r.name for r in chosen)}")
        if wait:
            ok = _wait_stopped(conn, [r.name for r in chosen], timeout)
            if not ok:
                raise click.ClickException(f"still running after {timeout:.0f}s (they keep draining)")


def _wait_stopped(conn: redis.Redis, names: list[str], timeout: float | None) -> bool:
    deadline = None if timeout is None else time.monotonic() + timeout
    tty = sys.stdout.isatty()
    last_line = ""

    def snapshot() -> list[control.WorkerRow]:
        rows = {r.name: r for r in control.fleet(conn)}
        return [rows.get(n) or control.WorkerRow(n, None, time.time()) for n in names]

    def table(rows: list[control.WorkerRow]) -> Table:
        t = Table(show_edge=False, header_style="bold", title="draining")
        for col in ("worker", "state", "batches held", "in flight", "queued"):
            t.add_column(col, no_wrap=True)
        for r in rows:
            t.add_row(r.name, r.state, _batches(r, 4), str(r.in_flight) if r.live else "",
                      str(r.queued) if r.live else "")
        return t

    live = Live(table(snapshot()), console=_console(), auto_refresh=False) if tty else None
    try:
        if live:
            live.start()
        while True:
            rows = snapshot()
            left = [r for r in rows if r.live]
            if live:
                live.update(table(rows), refresh=True)
            else:
                line = "; ".join(
                    f"{r.name} {r.state}" + (f" batches={len(r.batches)} in_flight={r.in_flight} queued={r.queued}"
                                             if r.live else "")
                    for r in rows)
                if line != last_line:
                    click.echo(line)
                    last_line = line
            if not left:
                click.echo("all drained: " + ", ".join(f"{r.name} {r.state}" for r in rows))
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(1.0)
    finally:
        if live:
            live.stop()


@click.command()
@_selector_options
@click.argument("value", type=Concurrency())
@click.pass_context
def concurrency(ctx: click.Context, names: tuple[str, ...], host: str | None, everyone: bool,
                value: int | None) -> None:
    """Cap requests in flight per worker at VALUE, live (auto: follow the server again).

    The worker keeps its automatic target below the cap; `genq workers` shows
    "in flight" as running/target and the cap.
    """
    with _redis(ctx) as conn:
        chosen = _select(conn, names, host, everyone)
        for row in chosen:
            control.update_control(conn, row.name, concurrency=value)
    click.echo(f"concurrency {'auto' if value is None else f'cap {value}'} for {len(chosen)} worker(s): "
               f"{', '.join(r.name for r in chosen)}")
