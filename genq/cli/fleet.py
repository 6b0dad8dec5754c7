"""`genq workers`, `genq drain` and `genq concurrency`: the fleet, and steering it (genq.ops.control)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

import click
import msgspec
import redis
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from genq.cli import Concurrency, age, console, json_option, redis_conn, table
from genq.core import decodebound
from genq.core.decodebound import NO_HEARTBEAT
from genq.core.ledger import fleet as ledger_fleet
from genq.core.queueing import list_jobs
from genq.core.redisconn import redis_note_of
from genq.core.timings import LOST_BATCH_BACK_S
from genq.core.words import plural
from genq.ops import control
from genq.worker.idle import IDLE_BEAT_S, IDLE_TTL_S
from genq.worker.models import servable_jobs


def _heartbeat(row: control.WorkerRow) -> str:
    """How long ago it beat; for an idle worker also how often it beats (IDLE_BEAT_S), so that a
    16 s gap reads as on time."""
    seconds = row.heartbeat_age_s
    if seconds is None:
        return "none" if row.state == control.LOST else "-"
    return age(seconds) + (f" (every {IDLE_BEAT_S:.0f}s)" if row.state == "idle" else "")


def _batches(row: control.WorkerRow, limit: int = 3) -> str:
    if not row.batches:
        return "-" if row.live else ""
    shown = " ".join(row.batches[:limit])
    more = f" +{len(row.batches) - limit}" if len(row.batches) > limit else ""
    return f"{len(row.batches)}: {shown}{more}"


STYLES = {"busy": "green", "idle": "cyan", "paused": "yellow", "draining": "yellow",
          "server_down": "red", "stopped": "dim", control.LOST: "bold red"}


def _cells(r: control.WorkerRow, serves: dict[str, list[str]], judged: dict[str, decodebound.Verdict]) -> dict[str, str]:
    live = r.live
    return {
        "worker": r.name,
        "state": f"[{STYLES[r.state]}]{r.state}[/]" if r.state in STYLES else r.state,
        "tok/s": f"{r.tok_per_s:,.0f}" if live else "",
        "of bound": _bound_cell(judged.get(r.name)),
        "in flight": (f"{r.in_flight}/{r.target}" + (f" limit {r.concurrency_limit}" if r.concurrency_limit else "")
                      if live else ""),
        "capacity": (str(r.server_capacity) if r.server_capacity else "?") if live else "",
        "heartbeat": _heartbeat(r),
        "done": f"{r.done:,}" if r.state != control.LOST else "",
        "queued": str(r.queued) if live else "",
        "batches": _batches(r),
        "model: jobs it serves": f"{r.model or '?'}: {', '.join(serves.get(r.name, [])) or '-'}" if live else "",
        "server": r.server or "",
        "gpu": r.gpu if r.gpu is not None else "-",
        "host": r.host or "?",
        "note": r.note or "",
    }


# Most wanted first. The first three are always shown whole (a name is what an operator types
# into --worker); the others are added in this order while the table fits the terminal, and
# the line under it names those left out (--json has every field).
COLUMNS = ("worker", "state", "tok/s", "in flight", "capacity", "heartbeat", "of bound", "done", "queued", "note",
           "model: jobs it serves", "batches", "server", "gpu", "host")
ALWAYS = 3
RIGHT = {"tok/s", "of bound", "in flight", "capacity", "heartbeat", "done", "queued", "gpu"}


def _table(cells: list[dict[str, str]], columns: list[str]) -> Table:
    shown = [col for col in COLUMNS if col in columns]
    fleet = table(shown, ([c[col] for col in shown] for c in cells), right=RIGHT)
    for column in fleet.columns:
        header = str(column.header)
        column.overflow = "ellipsis"
        if header == "note":  # a long note (a connection error) is cut: --json has it whole
            column.max_width = 60
        if COLUMNS.index(header) < ALWAYS:
            column.min_width = max([len(header)] + [len(Text.from_markup(c[header])) for c in cells])
    return fleet


_MEASURING = Console(width=10_000)


def print_workers(out: Console, rows: list[control.WorkerRow], serves: dict[str, list[str]]) -> None:
    """`genq workers` as a person reads it on `out`: the table with the columns that fit its width,
    the count by state, the decode-bound lines, each lost worker by name, the columns left out."""
    statuses = {r.name: r.status for r in rows if r.status is not None}
    judged = decodebound.judge(statuses)
    cells = [_cells(r, serves, judged) for r in rows]
    shown = list(COLUMNS[:ALWAYS])
    for col in COLUMNS[ALWAYS:]:  # a column no worker has anything in is not one left out
        wider = _table(cells, [*shown, col])
        if any(c[col] for c in cells) and Measurement.get(_MEASURING, _MEASURING.options, wider).maximum <= out.width:
            shown.append(col)
    out.print(_table(cells, shown))
    counts = Counter(r.state for r in rows)
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items()))
    out.print(f"{plural(len(rows), 'worker')}: {summary}; {fleet_tok_per_s(rows):,.0f} tok/s in all")
    for name, v in sorted(judged.items()):  # what caps each GPU's batch and the fix, a slow GPU, a missing figure
        if v.slow:
            out.print(f"{name}: much slower than its peers: {v.slow}", markup=False, highlight=False)
        if v.cap is not None:
            out.print(f"{name}: batch capped by {v.cap.text}" + (f"; fix: {v.cap.advice}" if v.cap.advice else ""),
                      markup=False, highlight=False)
        if v.bound.unknown and v.bound.tok_per_s is None:
            out.print(f"{name}: bound {v.bound.unknown}", markup=False, highlight=False)
    if line := decodebound.fleet_line(decodebound.working(statuses), judged):
        out.print(line, markup=False, highlight=False)
    for r in rows:
        if r.state == control.LOST:
            out.print(f"[bold red]lost[/]: {r.name} ({r.note})")
    if left_out := [c for c in COLUMNS if c not in shown and any(cell[c] for cell in cells)]:
        out.print(f"not shown at {out.width} columns: {', '.join(left_out)} (a wider terminal, or --json)")


def _bound_cell(v: decodebound.Verdict | None) -> str:
    """The share of the decode bound reached ("39% of 1,226"), "?" where a figure is missing."""
    if v is None:
        return ""
    b = v.bound
    if b.tok_per_s is None or b.share is None:
        return "?"
    return f"{'[red]' if v.slow else ''}{b.share:.0%} of {b.tok_per_s:,.0f}{'[/]' if v.slow else ''}"


def fleet_tok_per_s(rows: list[control.WorkerRow]) -> float:
    """The fleet's tokens/s: a server's own counter counts once however many workers drive it."""
    by_server: dict[str, float] = {}
    total = 0.0
    for r in rows:
        if not r.live:
            continue
        if r.status is not None and r.status.tok_per_s_from == "server":
            by_server[r.server or r.name] = r.tok_per_s
        else:
            total += r.tok_per_s
    return total + sum(by_server.values())


WORKERS_HELP = f"""The fleet: every worker with its host, GPU, server, state and load.

    \b
    States: busy, idle, paused, draining, server_down (its server fails
    /health), stopped (exited cleanly), lost ({NO_HEARTBEAT}; its batches
    run elsewhere within about {LOST_BATCH_BACK_S:.0f} s). "in flight" is running/target
    ("limit N" under `genq concurrency N`); "capacity" is what its server runs
    at once; "heartbeat" is how long ago it beat (an idle worker beats every
    {IDLE_BEAT_S:.0f} s, lost after {IDLE_TTL_S} s); "of bound" is its tok/s against the GPU's
    decode bound (docs/monitoring.md). Columns that do not fit the terminal
    are named under the table; --json has every field (docs/fleet.md).
    """


@click.command(help=WORKERS_HELP, short_help="The fleet: each worker's state, load, tok/s and heartbeat.")
@json_option("One JSON array of workers (machine-readable).")
@click.option("--prune", is_flag=True, help="Forget workers that are stopped or lost, then show the rest.")
@click.pass_context
def workers(ctx: click.Context, as_json: bool, prune: bool) -> None:
    with redis_conn(ctx) as conn:
        rows = control.fleet(conn)
        if note := redis_note_of(conn):  # refusing writes: its workers' heartbeats lapse, they are not dead
            click.echo(f"warning: {note.text}", err=True)
        if prune:
            gone = [r.name for r in rows if not r.live]
            ledger_fleet.forget_workers(conn, gone)
            rows = [r for r in rows if r.live]
            if gone and not as_json:
                click.echo(f"forgot {len(gone)} stopped/lost worker(s): {', '.join(gone)}")
        # Which jobs each can serve: those for its server's model or `auto` (worker/models.py).
        jobs = list_jobs(conn)
        serves = {r.name: servable_jobs(conn, r.model, jobs) for r in rows if r.live}
    if as_json:
        judged = decodebound.judge({r.name: r.status for r in rows if r.status is not None})
        click.echo(msgspec.json.encode([{**r.to_json(), "serves": serves.get(r.name),
                                         "bound": judged.get(r.name)} for r in rows]).decode())
        return
    if not rows:
        click.echo("no workers have registered in this Redis (start one with `genq worker`)")
        return
    print_workers(console(), rows, serves)


def _selector_options(fn: Callable) -> Callable:
    fn = click.option("--all", "everyone", is_flag=True, help="Every live worker.")(fn)
    fn = click.option("--host", default=None, help="Every live worker on this host.")(fn)
    return click.option("--worker", "names", multiple=True, metavar="NAME",
                        help="A worker by name (see `genq workers`); repeatable.")(fn)


def _steer(ctx: click.Context, names: tuple[str, ...], host: str | None, everyone: bool, **change: object) -> list[str]:
    """Change the Control record of the live workers named by --worker, --host or --all: their names."""
    if sum([bool(names), host is not None, everyone]) != 1:
        raise click.UsageError("name the workers with exactly one of --worker NAME, --host HOST or --all")
    with redis_conn(ctx) as conn:
        chosen = [r.name for r in control.select(control.fleet(conn), workers=names, host=host, everyone=everyone)]
        if not chosen:
            raise click.ClickException("no live workers")
        for name in chosen:
            control.update_control(conn, name, **change)  # type: ignore[arg-type]
    return chosen


@click.command(short_help="Let workers finish what they hold, then exit.")
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
    chosen = _steer(ctx, names, host, everyone, drain=True)
    click.echo(f"draining {len(chosen)} worker(s): {', '.join(chosen)}")
    if wait:
        with redis_conn(ctx) as conn:
            if not _wait_stopped(conn, chosen, timeout):
                raise click.ClickException(f"still running after {timeout:.0f}s (they keep draining)")


def _wait_stopped(conn: redis.Redis, names: list[str], timeout: float | None) -> bool:
    """Until every named worker has stopped (True) or `timeout` has passed: a line whenever what
    they hold changes."""
    deadline = None if timeout is None else time.monotonic() + timeout
    said = ""
    while True:
        now = {r.name: r for r in control.fleet(conn)}
        rows = [now.get(n) or control.WorkerRow(n, None, time.time()) for n in names]
        line = "; ".join(f"{r.name} {r.state}" + (
            f" batches={len(r.batches)} in_flight={r.in_flight} queued={r.queued}" if r.live else "") for r in rows)
        if line != said:
            click.echo(line)
            said = line
        if not any(r.live for r in rows):
            click.echo("all drained: " + ", ".join(f"{r.name} {r.state}" for r in rows))
            return True
        if deadline is not None and time.monotonic() > deadline:
            return False
        time.sleep(1.0)


@click.command(short_help="Cap the requests in flight per worker, live (or auto).")
@_selector_options
@click.argument("value", type=Concurrency())
@click.pass_context
def concurrency(ctx: click.Context, names: tuple[str, ...], host: str | None, everyone: bool,
                value: int | None) -> None:
    """Cap requests in flight per worker at VALUE, live (auto: follow the server again).

    The worker keeps its automatic target below the cap; `genq workers` shows
    "in flight" as running/target and "limit N", beside the server's capacity.
    """
    chosen = _steer(ctx, names, host, everyone, concurrency=value)
    click.echo(f"concurrency {'auto' if value is None else f'cap {value}'} for {len(chosen)} worker(s): "
               f"{', '.join(chosen)}")
