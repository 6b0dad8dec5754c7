"""The fleet and the jobs, seen and steered: `genq workers`, `drain`, `concurrency`, `pause`, `resume` and
`jobs` (list, show, set, delete); the work is genq.ops.control's."""

from __future__ import annotations

import json
import time
from collections import Counter
from typing import Any

import click
import msgspec
from rich.console import Console
from rich.measure import Measurement
from rich.text import Text

from genq import cli
from genq.cli import age, iso, job_argument, job_option, json_option, redis_conn
from genq.core import decodebound
from genq.core.ledger import fleet as ledger_fleet
from genq.core.ledger import jobs as ledger_jobs
from genq.core.queueing import list_jobs, load_config
from genq.core.redisconn import redis_note_of
from genq.core.timings import IDLE_BEAT_S
from genq.core.words import plural
from genq.ops import control
from genq.ops.control import LOST, SETTABLE, Refused, WorkerRow, describe_block, jobs_named, set_settings
from genq.output import truth
from genq.worker.gate import servable_jobs

STYLES = {"busy": "green", "idle": "cyan", "paused": "yellow", "draining": "yellow", "server_down": "red",
          "stopped": "dim", "silent": "bold red", LOST: "bold red"}
# Most wanted first. The first three are always shown whole (a name is what an operator types into
# --worker); the others join in this order while the table fits the terminal, and a line names the rest.
COLUMNS = ("worker", "state", "tok/s", "in flight", "capacity", "heartbeat", "of bound", "done", "queued", "note",
           "model: jobs it serves", "batches", "server", "gpu", "host")
RIGHT = {"tok/s", "of bound", "in flight", "capacity", "heartbeat", "done", "queued", "gpu"}


def _cells(r: WorkerRow, serves: list[str] | None, v: decodebound.Verdict | None) -> dict[str, str | Text]:
    live, b = r.beating, v.bound if v else None
    heartbeat = ("none" if r.state == LOST else "-") if r.heartbeat_age_s is None else age(r.heartbeat_age_s) + (
        f" (every {IDLE_BEAT_S:.0f}s)" if r.state == "idle" else " (overdue)" if r.state == "silent" else "")
    batches = f"{len(r.batches)}: {' '.join(r.batches[:3])}" + (f" +{len(r.batches) - 3}" if len(r.batches) > 3 else "")
    return {
        "worker": r.name,
        "state": Text(r.state, STYLES.get(r.state, "")),
        "tok/s": f"{r.tok_per_s:,.0f}" if live else "",
        "of bound": "" if b is None else "?" if b.tok_per_s is None or b.share is None else
                    Text(f"{b.share:.0%} of {b.tok_per_s:,.0f}", "red" if v and v.slow else ""),
        "in flight": (f"{r.in_flight}/{r.target}" + (f" limit {r.cap}" if r.cap else "")) if live else "",
        "capacity": str(r.server_capacity or "?") if live else "",
        "heartbeat": heartbeat,
        "done": f"{r.done:,}" if r.state != LOST else "",
        "queued": str(r.queued) if live else "",
        "batches": (batches if r.batches else "-") if live else "",  # a silent one holds nothing (monitoring.md)
        "model: jobs it serves": f"{r.model or '?'}: {', '.join(serves or []) or '-'}" if live else "",
        "server": r.server or "", "gpu": r.gpu if r.gpu is not None else "-", "host": r.host or "?",
        "note": r.note or "",
    }


def _table(cells: list[dict[str, str | Text]], shown: list[str]):
    fleet = cli.table([c for c in COLUMNS if c in shown], ([c[col] for col in COLUMNS if col in shown] for c in cells),
                      right=RIGHT)
    for column in fleet.columns:
        column.overflow = "ellipsis"
        column.max_width = 60 if column.header == "note" else None  # a long note (a connection error) is cut
        if (header := str(column.header)) in COLUMNS[:3]:
            column.min_width = max([len(header)] + [len(c[header]) for c in cells])
    return fleet


def print_workers(out: Console, rows: list[WorkerRow], serves: dict[str, list[str]]) -> None:
    """`genq workers` for a person: the columns that fit `out`, counts by state, decode-bound lines, lost workers."""
    statuses = {r.name: r.status for r in rows if r.status and r.beating}  # a silent one's figures are not of now
    judged = decodebound.judge(statuses)
    cells = [_cells(r, serves.get(r.name), judged.get(r.name)) for r in rows]
    measuring, shown = Console(width=10_000), list(COLUMNS[:3])
    for col in COLUMNS[3:]:  # a column no worker has anything in is not one left out
        wider = _table(cells, [*shown, col])
        if any(c[col] for c in cells) and Measurement.get(measuring, measuring.options, wider).maximum <= out.width:
            shown.append(col)
    out.print(_table(cells, shown))
    summary = ", ".join(f"{n} {state}" for state, n in sorted(Counter(r.state for r in rows).items()))
    by_server = {(r.server or r.name): r.tok_per_s for r in rows  # a server's own counter counts once
                 if r.beating and r.status is not None and r.status.tok_per_s_from == "server"}
    total = sum(by_server.values()) + sum(r.tok_per_s for r in rows if r.beating and (
        r.status is None or r.status.tok_per_s_from != "server"))
    out.print(f"{plural(len(rows), 'worker')}: {summary}; {total:,.0f} tok/s in all")
    lines = [line for name, v in sorted(judged.items()) for line in (  # a slow GPU, its batch's cap, a figure missing
        v.slow and f"{name}: much slower than its peers: {v.slow}",
        v.cap and f"{name}: batch capped by {v.cap.text}" + (f"; fix: {v.cap.advice}" if v.cap.advice else ""),
        v.bound.unknown and v.bound.tok_per_s is None and f"{name}: bound {v.bound.unknown}")]
    for line in [*lines, decodebound.fleet_line(decodebound.working(statuses), judged)]:
        if line:
            out.print(line, markup=False, highlight=False)
    for r in rows:
        if r.state == LOST:
            out.print(f"[bold red]lost[/]: {r.name} ({r.note})")
    if left_out := [c for c in COLUMNS if c not in shown and any(cell[c] for cell in cells)]:
        out.print(f"not shown at {out.width} columns: {', '.join(left_out)} (a wider terminal, or --json)")


@click.command()
@json_option("One JSON array of workers (machine-readable).")
@click.option("--prune", is_flag=True, help="Forget workers that are stopped or lost, then show the rest.")
def workers(as_json: bool, prune: bool) -> None:
    """The fleet: each worker's state, load, tok/s and heartbeat. See docs/fleet.md."""
    conn = redis_conn()
    rows = control.fleet(conn)
    if note := redis_note_of(conn):  # refusing writes: its workers' heartbeats lapse, they are not dead
        click.echo(f"warning: {note.text}", err=True)
    if prune:
        ledger_fleet.forget_workers(conn, gone := [r.name for r in rows if not r.live])
        rows = [r for r in rows if r.live]
        if gone and not as_json:
            click.echo(f"forgot {len(gone)} stopped/lost worker(s): {', '.join(gone)}")
    jobs = list_jobs(conn)  # which each can serve: those for its server's model or `auto` (worker/gate.py)
    serves = {r.name: servable_jobs(conn, r.model, jobs) for r in rows if r.live}
    if as_json:
        judged = decodebound.judge({r.name: r.status for r in rows if r.status and r.beating})
        click.echo(msgspec.json.encode([{**r.to_json(), "serves": serves.get(r.name), "bound": judged.get(r.name)}
                                        for r in rows]).decode())
    elif not rows:
        click.echo("no workers have registered in this Redis (start one with `genq worker`)")
    else:
        print_workers(cli.console(), rows, serves)


def steering(fn: Any) -> Any:
    """A command that changes the Control record of the live workers named by --worker, --host or --all."""
    fn = click.option("--all", "everyone", is_flag=True, help="Every live worker.")(fn)
    fn = click.option("--host", default=None, help="Every live worker on this host.")(fn)
    return click.option("--worker", "names", multiple=True, metavar="NAME",
                        help="A worker by name (see `genq workers`); repeatable.")(fn)


def _steer(names: tuple[str, ...], host: str | None, everyone: bool, **change: object) -> list[str]:
    if sum([bool(names), host is not None, everyone]) != 1:
        raise click.UsageError("name the workers with exactly one of --worker NAME, --host HOST or --all")
    conn, drain = redis_conn(), change.get("drain") is True  # a drain is done once the worker is gone
    if not (chosen := control.select(control.fleet(conn), workers=names, host=host, everyone=everyone,
                                     gone_too=drain)) and not drain:
        raise Refused("no live workers")
    for r in chosen:
        if not r.live:
            click.echo(f"{r.name} is {r.state} already: nothing to drain")
            continue
        control.update_control(conn, r.name, **change)
        if r.state == "silent":  # killed, frozen or cut off: told, but it may never read it
            click.echo(f"note: {r.name} is silent (no heartbeat for {age(r.heartbeat_age_s or 0)}): it acts on this "
                       "only if it wakes", err=True)
    return [r.name for r in chosen if r.live]


@click.command()
@steering
@click.option("--wait", is_flag=True, help="Show what each worker still holds until all have stopped.")
@click.option("--timeout", type=cli.Finite(0, min_open=True), default=None,
              help="With --wait: give up waiting after this many seconds (exit 1); more than 0.")
def drain(names: tuple[str, ...], host: str | None, everyone: bool, wait: bool, timeout: float | None) -> None:
    """Let workers finish what they hold, then exit. They take no new batches."""
    if timeout is not None and not wait:
        raise click.UsageError("--timeout is how long --wait waits: give --wait too")
    if not (chosen := _steer(names, host, everyone, drain=True)):
        return None if names else click.echo("no live workers: nothing to drain")
    click.echo(f"draining {len(chosen)} worker(s): {', '.join(chosen)}")
    deadline, said = None if timeout is None else time.monotonic() + timeout, ""
    while wait:  # a line whenever what they hold changes
        now = {r.name: r for r in control.fleet(redis_conn())}
        rows = [now.get(n) or WorkerRow(n, None, time.time()) for n in chosen]
        line = "; ".join(f"{r.name} {r.state}" + (
            f" batches={len(r.batches)} in_flight={r.in_flight} queued={r.queued}" if r.live else "") for r in rows)
        if line != said:
            click.echo(said := line)
        if not any(r.live for r in rows):  # a lost one did not drain: said so
            died = " (it died before it drained: its batches run elsewhere)"
            ends = ", ".join(f"{r.name} {r.state}{died if r.state == LOST else ''}" for r in rows)
            return click.echo(f"{'all drained' if all(r.state == 'stopped' for r in rows) else 'none running'}: {ends}")
        if deadline is not None and time.monotonic() > deadline:
            raise Refused(f"still running after {timeout:.0f}s (they keep draining)")
        time.sleep(1.0)


@click.command()
@steering
@click.argument("value", type=cli.concurrency)
def concurrency(names: tuple[str, ...], host: str | None, everyone: bool, value: int | None) -> None:
    """Cap the requests in flight per worker, live (or auto). With auto it follows the server."""
    chosen = _steer(names, host, everyone, concurrency=value)
    click.echo(f"concurrency {'auto' if value is None else f'cap {value}'} for {len(chosen)} worker(s): "
               f"{', '.join(chosen)}")


@click.command()
@job_option("Pause only this job. [default: every job, and RQ's workers (rq suspend)]")
def pause(job: str | None) -> None:
    """Stop sending new requests (all jobs, or --job). In-flight ones finish."""
    conn = redis_conn()
    jobs_named(conn, job)
    control.pause(conn, job)
    kept = ("then its batches are parked, out of RQ's queue and off the workers" if job
            else "batches stay held); RQ workers suspended (rq suspend")
    click.echo(f"paused {f'job {job}' if job else 'all jobs'}: workers send no new requests from now (in-flight ones "
               f"finish, {kept}). Undo with `genq resume{f' --job {job}' if job else ''}`.")


@click.command()
@job_option("Resume only this job, lifting its block too. [default: lift the global pause]")
def resume(job: str | None) -> None:
    """Undo genq pause (all jobs, or --job). --job also lifts its block (docs/settings.md)."""
    conn = redis_conn()
    jobs_named(conn, job)
    now = None if job is None else ledger_jobs.jobs_now(conn, [job])[0]
    was = ledger_jobs.paused_all(conn) if now is None else now.paused or now.blocked is not None
    if not (queued := control.resume(conn, job)) and not was:  # said as it was, not "resumed"
        click.echo((f"job {job} was neither paused nor blocked" if job else "the fleet was not paused (genq pause)")
                   + ": nothing to resume")
    else:
        click.echo(f"resumed {f'job {job}' if job else 'all jobs'}"
                   + (f"; {plural(queued, 'parked batch', 'parked batches')} queued again" if queued else ""))
    names = list_jobs(conn)
    if still := sorted(j for j, now in zip(names, ledger_jobs.jobs_now(conn, names)) if now.paused):
        click.echo(f"still paused on their own: {', '.join(still)} (genq resume --job NAME)")
    if ledger_jobs.paused_all(conn):
        click.echo("note: everything is still paused globally (genq resume)")


@click.group(invoke_without_command=True)
@json_option("One JSON array of jobs.")
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """The jobs, their state and counts; show, set or delete one. Share: docs/scheduling.md."""
    if ctx.invoked_subcommand is not None:
        return
    conn = redis_conn()
    rows = control.job_rows(conn)
    if as_json or not rows:
        return click.echo(msgspec.json.encode(rows).decode() if as_json else "no jobs (queue some with `genq enqueue`)")
    out = cli.console()
    out.print(cli.table(
        ("job", "state", "priority", "share", "total", "done", "failed", "remaining", "batches", "workers", "output"),
        ((r.name, r.state, f"{r.priority}" + (f" w{r.weight:g}" if r.weight != 1 else ""),
          f"{100 * r.share:.0f}%" if r.running else "-", f"{r.total:,}",
          f"{r.done:,}" + (f" ({_floor_percent(r.done, r.total)})" if r.total else ""), f"{r.failed:,}",
          f"{r.remaining:,}", f"{r.batches_done}/{r.batches}", str(len(r.workers)), r.output or "?") for r in rows),
        right={"priority", "share", "total", "done", "failed", "remaining"}))
    for r in rows:
        if r.blocked is not None:
            out.print(describe_block(r.name, r.blocked), soft_wrap=True, markup=False)
    if ledger_jobs.paused_all(conn):
        out.print("all jobs are paused (genq resume)")


def _floor_percent(part: int, whole: int) -> str:
    """Rounded down: 1,995 of 2,000 is 99.7%, never "100%" beside prompts still missing or failed."""
    tenths = 1000 * part // whole
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


@jobs.command("show")
@job_argument
@json_option("The job's config, block and counts as one JSON object.")
def jobs_show(job: str, as_json: bool) -> None:
    """A job's settings, their history, its state and any block."""
    conn = redis_conn()
    (row,) = control.job_rows(conn, jobs_named(conn, job))
    if (config := load_config(conn, job)) is None:
        raise Refused(f"job {job!r} has no stored settings")
    if as_json:
        return click.echo(msgspec.json.encode({"config": config, "row": row}).decode())
    click.echo(f"job {job}: {row.state}, {row.done:,} done, {row.failed:,} failed, {row.remaining:,} remaining "
               f"of {row.total:,}; batches {row.batches_done}/{row.batches}; output {config.output}")
    click.echo(f"priority {row.priority}, weight {row.weight:g}; {100 * row.share:.0f}% of the fleet's requests in "
               "flight now (docs/scheduling.md)")
    if row.blocked is not None:
        click.echo(f"{describe_block(job, row.blocked)}\n  blocked at {iso(row.blocked.at)}")
    sent = {k: getattr(config, k) for k in ("endpoint", *SETTABLE)}
    click.echo(f"settings version {config.settings_version}: "
               + ", ".join(f"{k} {json.dumps(v)}" for k, v in sent.items() if v is not None))
    click.echo(f"  version 1: enqueued at {iso(config.created_at)}" if config.created_at else "  version 1: enqueued")
    for change in config.settings_history:
        moved = ", ".join(f"{k} {json.dumps(change.previous.get(k))} -> {json.dumps(v)}"
                          for k, v in change.changed.items())
        click.echo(f"  version {change.version}: {iso(change.at)}: {moved}{f' ({change.note})' if change.note else ''}")


def _extra_body(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any] | None:
    try:
        return None if value is None else cli.extra_body(value, prompts=ctx.info_name == "requeue")
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx) from None


def generation_options(fn: Any) -> Any:
    """The generation settings a command may change (jobs set; dlq requeue's override)."""
    fn = click.option("--extra-body", metavar="JSON", callback=_extra_body,
                      help="""Extra request fields, replacing the job's ('{}' clears them).""")(fn)
    fn = click.option("--top-p", type=cli.Finite(0, 1, min_open=True), help="Nucleus sampling.")(fn)
    fn = click.option("--temperature", type=cli.Finite(min=0), help="Sampling temperature.")(fn)
    return click.option("--max-tokens", type=click.IntRange(1, cli.INT32), help="Most tokens to generate.")(fn)


@jobs.command("set")
@job_argument
@generation_options
@click.option("--model", default=None, callback=cli.model_name, help="Model name to send ('auto': the server's first).")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=None, help="Tries per prompt before its letter.")
@click.option("--brake/--no-brake", "brake", default=None,
              help="--no-brake: never block this job on repeated failures; each failing prompt is dead-lettered.")
@click.option("--note", default=None, help="Why (kept in the settings history).")
@click.option("--priority", type=click.IntRange(-cli.INT32, cli.INT32), default=None,
              help="Scheduling priority, higher first (no settings version).")
@click.option("--weight", type=cli.Finite(min=0, min_open=True), default=None,
              help="Fair-share weight among jobs of equal priority.")
def jobs_set(job: str, note: str | None, priority: int | None, weight: float | None, **settings: Any) -> None:
    """Change a job's generation settings, priority or weight. See docs/settings.md."""
    order = ("max_tokens", "temperature", "top_p", "extra_body", "model", "max_attempts", "brake")
    changes = {k: settings[k] for k in order if settings[k] is not None}
    if not changes and priority is None and weight is None:
        raise click.UsageError("name at least one setting to change (see --help)")
    conn = redis_conn()
    if changes:  # first: what may be refused (the output unwritable, Redis full) is, before anything changed
        config, changed = set_settings(conn, job, changes, note)
        had = ", ".join(f"{k} {json.dumps(v)}" for k, v in changes.items() if k not in changed)
        if changed:
            what = ", ".join(f"{k} {json.dumps(v)}" for k, v in changed.items())
            click.echo(f"job {job}: settings version {config.settings_version}: {what}; every prompt not yet done is "
                       f"sent with it{f' ({had} already)' if had else ''}")
        else:
            click.echo(f"job {job}: {had} already (settings version {config.settings_version}): no new version")
        if (block := ledger_jobs.jobs_now(conn, [job])[0].blocked) is not None:
            click.echo(f"the job is still blocked ({block.reason}): resume it with `genq resume --job {job}`")
    if priority is not None or weight is not None:
        jobs_named(conn, job)
        sched = control.set_schedule(conn, job, priority, weight)
        click.echo(f"job {job}: priority {sched.priority}, weight {sched.weight:g}")


@jobs.command("delete")
@job_argument
@cli.yes_option
@click.option("--force", is_flag=True, help="Delete even while live workers hold the job's batches.")
def jobs_delete(job: str, yes: bool, force: bool) -> None:
    """Remove a job from Redis (its shards stay). See docs/recovery.md."""
    conn = redis_conn()
    found = control.find_job(conn, job)
    if not found.keys and not found.rq_jobs:
        jobs_named(conn, job)
    if found.holders and not force:
        held = ", ".join(f"{name} ({state})" for name, state in found.holders.items())
        silent = [name for name, state in found.holders.items() if state == "silent"]  # killed or frozen
        helps = "Drain them (genq drain --worker NAME) or wait" if not silent else (
            f"Silent ones ({', '.join(silent)}) cannot be drained: wait until `genq workers` shows them lost (their "
            "batches then go back to the queue)" + ("; drain the others" if len(silent) < len(found.holders) else ""))
        raise Refused(f"live workers hold batches of job {job!r}: {held}. {helps}, or pass --force to delete anyway.")
    kinds = Counter(key.split(":")[3] for key in found.keys)  # genq:job:JOB:batch:b0000001 -> batch
    listing = ", ".join(kind + (f" x{n}" if n > 1 else "") for kind, n in sorted(kinds.items()))
    places = ", ".join(f"{len(ids)} {place}" for place, ids in found.rq_jobs.items())
    rq_count = len({i for ids in found.rq_jobs.values() for i in ids})
    what = (f"{plural(len(found.keys), 'key')} {ledger_jobs.job_keys_shown(job)} ({listing or 'none'}), its name "
            f"in the job list, {plural(rq_count, 'RQ job')} ({places or 'none'})")
    if not cli.confirmed(yes, f"delete job {job}: {what}?", "nothing deleted"):
        return
    config = load_config(conn, job)
    control.delete_job(conn, found)
    click.echo(f"removed job {job}: {what}")
    if config is None:
        return
    try:  # job.json marked deleted: the name's next enqueue starts a new job (genq recover still can)
        truth.mark_deleted(truth.open_store(config.output, config.s3_endpoint_url), job, time.time(),
                           config.incarnation)
    except Exception as exc:  # OSError, botocore's: the output is not reachable from here
        return click.echo(f"warning: could not mark {config.output}/{job}/job.json deleted ({type(exc).__name__}: "
                          f"{exc}): an enqueue of the name {job} will take the old job up again from its shards",
                          err=True)
    click.echo(f"its shards stay in {config.output}/{job}; the name {job} is free for a new job "
               f"(`genq recover --job {job} --output {config.output}` brings this one back instead)")
