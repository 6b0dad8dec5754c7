"""Operator commands about jobs: genq jobs (list, delete, set), pause, resume.

They only read and write Redis (see genq.ops.control); workers pick changes up
within about a second, wherever they run.
"""

from __future__ import annotations

import click
import msgspec
import redis
from rich.table import Table

from genq.cli import JobName, console, job_argument, jobset, redis_conn
from genq.core.ledger.jobs import job_keys_shown
from genq.core.queueing import list_jobs, load_config
from genq.core.words import plural
from genq.ops import control
from genq.ops.settings import describe_block


def _check_job(conn: redis.Redis, job: str) -> None:
    jobs = list_jobs(conn)
    if job not in jobs:
        raise click.ClickException(f"no job named {job!r}; jobs: {', '.join(jobs) or 'none'}")


# ---------------------------------------------------------------- jobs


@click.group(invoke_without_command=True, short_help="The jobs, their state and counts; show, set or delete one.")
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
    with redis_conn(ctx) as conn:
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
    out = console()
    out.print(table)
    for r in rows:
        if r.blocked is not None:
            out.print(describe_block(r.name, r.blocked), soft_wrap=True)
    if paused_all:
        out.print("all jobs are paused (genq resume)")


def _floor_percent(part: int, whole: int) -> str:
    """Rounded down: 1,995 of 2,000 is 99.7%, never "100%" beside prompts still missing or failed."""
    tenths = 1000 * part // whole
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


@jobs.command("delete", short_help="Remove a job from Redis (its shards stay).")
@job_argument
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option("--force", is_flag=True, help="Delete even while live workers hold the job's batches.")
@click.pass_context
def jobs_delete(ctx: click.Context, job: str, yes: bool, force: bool) -> None:
    """Remove job JOB from Redis: its keys, its name, and its RQ jobs.

    Removes everything under genq:job:JOB: (config, ids, batches, results not
    yet written, counters, dead letters), JOB from the job list, and the job's
    RQ jobs from the queue and RQ's registries. Shards already written under
    the job's output are kept, and its job.json marked deleted: the name's
    next `genq enqueue` starts a new job there instead of taking this one up
    again (`genq recover --job JOB --output OUTPUT` brings it back). Refused
    while a live worker holds one of its batches (drain or stop it first),
    unless --force.
    """
    with redis_conn(ctx) as conn:
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
        config = load_config(conn, job)
        control.delete_job(conn, found)
    click.echo(f"removed job {job}: {what}")
    if config is not None:
        if problem := control.mark_output_deleted(config):
            click.echo(f"warning: {problem}", err=True)
        else:
            click.echo(f"its shards stay in {config.output}/{job}; the name {job} is free for a new job "
                       f"(`genq recover --job {job} --output {config.output}` brings this one back instead)")


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


@click.command(short_help="Stop new requests (all jobs, or --job); in-flight ones finish.")
@click.option("--job", type=JobName(), default=None, help="Pause only this job. [default: every job]")
@click.pass_context
def pause(ctx: click.Context, job: str | None) -> None:
    """Stop sending new requests; requests in flight finish, held batches are kept.

    Without --job this also sets RQ's suspension flag (as `rq suspend` does),
    so no RQ work loop, genq's or a stock `rq worker`, takes a new batch.
    Workers notice within a second. `genq resume` undoes it.
    """
    with redis_conn(ctx) as conn:
        if job is not None:
            _check_job(conn, job)
        control.pause(conn, job)
    what = f"job {job}" if job else "all jobs"
    click.echo(f"paused {what}: workers send no new requests from now (in-flight ones finish, "
               f"batches stay held){'' if job else '; RQ workers suspended (rq suspend)'}. "
               f"Undo with `genq resume{f' --job {job}' if job else ''}`.")


@click.command(short_help="Undo genq pause (all jobs, or --job).")
@click.option("--job", type=JobName(), default=None, help="Resume only this job. [default: lift the global pause]")
@click.pass_context
def resume(ctx: click.Context, job: str | None) -> None:
    """Undo `genq pause` (global, or one job's)."""
    with redis_conn(ctx) as conn:
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
