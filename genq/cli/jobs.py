"""`genq jobs` (list, show, set, delete), `genq pause` and `genq resume`: the jobs, and steering them
(the work is genq.ops.control's and genq.ops.settings')."""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import click
import msgspec

from genq.cli import console, extra_body, iso, job_argument, job_option, json_option, redis_conn, table, yes_option
from genq.core.ledger import jobs as ledger_jobs
from genq.core.order import set_schedule
from genq.core.queueing import list_jobs, load_config
from genq.core.words import plural
from genq.ops import Refused, control, jobs_named
from genq.ops.settings import describe_block, set_settings


@click.group(invoke_without_command=True, short_help="The jobs, their state and counts; show, set or delete one.")
@json_option("One JSON array of jobs.")
@click.pass_context
def jobs(ctx: click.Context, as_json: bool) -> None:
    """Jobs with priority, share of the fleet, prompts total/done/failed, batches and paused state.

    share is the job's part of the requests running on the fleet now, which priority and weight
    decide (docs/scheduling.md); failed is the dead-letter queue's size (`genq dlq`).
    """
    if ctx.invoked_subcommand is not None:
        return
    with redis_conn(ctx) as conn:
        rows = control.job_rows(conn)
        paused_all = ledger_jobs.paused_all(conn)
    if as_json:
        click.echo(msgspec.json.encode(rows).decode())
        return
    if not rows:
        click.echo("no jobs (queue some with `genq enqueue`)")
        return
    out = console()
    out.print(table(
        ("job", "state", "priority", "share", "total", "done", "failed", "remaining", "batches", "workers", "output"),
        ((r.name, r.state, f"{r.priority}" + (f" w{r.weight:g}" if r.weight != 1 else ""),
          f"{100 * r.share:.0f}%" if r.running else "-", f"{r.total:,}",
          f"{r.done:,}" + (f" ({_floor_percent(r.done, r.total)})" if r.total else ""), f"{r.failed:,}",
          f"{r.remaining:,}", f"{r.batches_done}/{r.batches}", str(len(r.workers)), r.output or "?") for r in rows),
        right={"priority", "share", "total", "done", "failed", "remaining"}))
    for r in rows:
        if r.blocked is not None:
            out.print(describe_block(r.name, r.blocked), soft_wrap=True)
    if paused_all:
        out.print("all jobs are paused (genq resume)")


def _floor_percent(part: int, whole: int) -> str:
    """Rounded down: 1,995 of 2,000 is 99.7%, never "100%" beside prompts still missing or failed."""
    tenths = 1000 * part // whole
    return f"{tenths // 10}%" if tenths % 10 == 0 else f"{tenths / 10:.1f}%"


@jobs.command("show", short_help="A job's settings, their history, its state and any block.")
@job_argument
@json_option("The job's config, block and counts as one JSON object.")
@click.pass_context
def jobs_show(ctx: click.Context, job: str, as_json: bool) -> None:
    """JOB's settings, their version history, its state and why it is blocked."""
    with redis_conn(ctx) as conn:
        (row,) = control.job_rows(conn, jobs_named(conn, job))
        config = load_config(conn, job)
    if config is None:
        raise Refused(f"job {job!r} has no stored settings")
    if as_json:
        click.echo(msgspec.json.encode({"config": config, "row": row}).decode())
        return
    click.echo(f"job {job}: {row.state}, {row.done:,} done, {row.failed:,} failed, {row.remaining:,} remaining "
               f"of {row.total:,}; batches {row.batches_done}/{row.batches}; output {config.output}")
    click.echo(f"priority {row.priority}, weight {row.weight:g}; {100 * row.share:.0f}% of the fleet's requests in "
               "flight now (docs/scheduling.md)")
    if row.blocked is not None:
        click.echo(describe_block(job, row.blocked))
        click.echo(f"  blocked at {iso(row.blocked.at)}")
    sent = {k: getattr(config, k) for k in ("endpoint", "model", "max_tokens", "temperature", "top_p",
                                             "extra_body", "max_attempts", "brake")}
    click.echo(f"settings version {config.settings_version}: "
               + ", ".join(f"{k} {json.dumps(v)}" for k, v in sent.items() if v is not None))
    click.echo(f"  version 1: enqueued at {iso(config.created_at)}" if config.created_at else "  version 1: enqueued")
    for change in config.settings_history:
        moved = ", ".join(f"{k} {json.dumps(change.previous.get(k))} -> {json.dumps(v)}"
                          for k, v in change.changed.items())
        click.echo(f"  version {change.version}: {iso(change.at)}: {moved}" + (f" ({change.note})" if change.note else ""))


def _extra_body(ctx: click.Context, param: click.Parameter, value: str | None) -> dict[str, Any] | None:
    try:
        return None if value is None else extra_body(value)
    except ValueError as exc:
        raise click.UsageError(str(exc), ctx) from None


def generation_options(fn: Any) -> Any:
    """The generation settings a command may change (jobs set; dlq requeue's override)."""
    for option in reversed((
        click.option("--max-tokens", type=click.IntRange(min=1), help="Most tokens to generate."),
        click.option("--temperature", type=click.FloatRange(min=0), help="Sampling temperature."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), help="Nucleus sampling."),
        click.option("--extra-body", metavar="JSON", callback=_extra_body,
                     help='Extra request fields, replacing the job\'s (e.g. \'{"top_k": 20}\'; \'{}\' clears them).'),
    )):
        fn = option(fn)
    return fn


def given(**options: Any) -> dict[str, Any]:
    """The options given (not None), by name."""
    return {k: v for k, v in options.items() if v is not None}


@jobs.command("set", short_help="Change a job's generation settings, priority or weight.")
@job_argument
@generation_options
@click.option("--model", default=None, help="Model name to send ('auto': the server's first).")
@click.option("--max-attempts", type=click.IntRange(min=1), default=None, help="Tries per prompt before its letter.")
@click.option("--brake/--no-brake", "brake", default=None,
              help="--no-brake: never block this job on repeated failures; each failing prompt is "
                   "dead-lettered on its own (for prompts that really fail on their own).")
@click.option("--note", default=None, help="Why (kept in the settings history).")
@click.option("--priority", type=int, default=None,
              help="Scheduling priority, higher first (not a settings version: nothing sent changes).")
@click.option("--weight", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Fair-share weight among jobs of equal priority.")
@click.pass_context
def jobs_set(ctx: click.Context, job: str, max_tokens: int | None, temperature: float | None, top_p: float | None,
             extra_body: dict[str, Any] | None, model: str | None, max_attempts: int | None, brake: bool | None,
             note: str | None, priority: int | None, weight: float | None) -> None:
    """Change JOB's generation settings for every prompt not yet done, or its priority and weight.

    Settings become the job's next version (`genq jobs show JOB`): workers send every prompt with
    it within a second, and each result records its version. A blocked job stays blocked until
    `genq resume --job JOB`. --priority and --weight (docs/scheduling.md) are no settings version.
    """
    changes = given(max_tokens=max_tokens, temperature=temperature, top_p=top_p, extra_body=extra_body, model=model,
                    max_attempts=max_attempts, brake=brake)
    if not changes and priority is None and weight is None:
        raise click.UsageError("name at least one setting to change (see --help)")
    with redis_conn(ctx) as conn:
        if priority is not None or weight is not None:
            jobs_named(conn, job)
            sched = set_schedule(conn, job, priority, weight)
            click.echo(f"job {job}: priority {sched.priority}, weight {sched.weight:g}")
        if not changes:
            return
        config = set_settings(conn, job, changes, note)
        block = ledger_jobs.jobs_now(conn, [job])[0].blocked
    what = ", ".join(f"{k} {json.dumps(v)}" for k, v in changes.items())
    click.echo(f"job {job}: settings version {config.settings_version}: {what}; every prompt not yet done is "
               "sent with it")
    if block is not None:
        click.echo(f"the job is still blocked ({block.reason}): resume it with `genq resume --job {job}`")


@jobs.command("delete", short_help="Remove a job from Redis (its shards stay).")
@job_argument
@yes_option
@click.option("--force", is_flag=True, help="Delete even while live workers hold the job's batches.")
@click.pass_context
def jobs_delete(ctx: click.Context, job: str, yes: bool, force: bool) -> None:
    """Remove job JOB from Redis: everything under genq:job:JOB:, its name, its RQ jobs.

    Its written shards stay, and its job.json is marked deleted: the name's next `genq enqueue`
    starts a new job (`genq recover --job JOB --output OUTPUT` brings this one back). Refused
    while a live worker holds one of its batches, unless --force.
    """
    with redis_conn(ctx) as conn:
        found = control.find_job(conn, job)
        if not found.keys and not found.rq_jobs:
            jobs_named(conn, job)
        if found.holders and not force:
            raise click.ClickException(
                f"live workers hold batches of job {job!r}: {', '.join(found.holders)}. Drain them "
                f"(genq drain --worker NAME) or wait, or pass --force to delete anyway.")
        kinds = Counter(key.split(":")[3] for key in found.keys)  # genq:job:JOB:batch:b0000001 -> batch
        listing = ", ".join(kind + (f" x{n}" if n > 1 else "") for kind, n in sorted(kinds.items()))
        places = ", ".join(f"{len(ids)} {place}" for place, ids in found.rq_jobs.items())
        what = (f"{plural(len(found.keys), 'key')} {ledger_jobs.job_keys_shown(job)} ({listing or 'none'}), its name "
                f"in the job list, {plural(found.rq_count, 'RQ job')} ({places or 'none'})")
        if not yes and not click.confirm(f"delete job {job}: {what}?", default=False):
            raise click.ClickException("nothing deleted")
        config = load_config(conn, job)
        control.delete_job(conn, found)
    click.echo(f"removed job {job}: {what}")
    if config is None:
        return
    if problem := control.mark_output_deleted(config):
        click.echo(f"warning: {problem}", err=True)
    else:
        click.echo(f"its shards stay in {config.output}/{job}; the name {job} is free for a new job "
                   f"(`genq recover --job {job} --output {config.output}` brings this one back instead)")


@click.command(short_help="Stop new requests (all jobs, or --job); in-flight ones finish.")
@job_option("Pause only this job. [default: every job]")
@click.pass_context
def pause(ctx: click.Context, job: str | None) -> None:
    """Stop sending new requests; requests in flight finish, held batches are kept.

    Without --job this also sets RQ's suspension flag (as `rq suspend` does),
    so no engine, and no stock `rq worker`, takes a new batch.
    Workers notice within a second. `genq resume` undoes it.
    """
    with redis_conn(ctx) as conn:
        jobs_named(conn, job)
        control.pause(conn, job)
    click.echo(f"paused {f'job {job}' if job else 'all jobs'}: workers send no new requests from now (in-flight ones "
               f"finish, batches stay held){'' if job else '; RQ workers suspended (rq suspend)'}. "
               f"Undo with `genq resume{f' --job {job}' if job else ''}`.")


@click.command(short_help="Undo genq pause (all jobs, or --job).")
@job_option("Resume only this job. [default: lift the global pause]")
@click.pass_context
def resume(ctx: click.Context, job: str | None) -> None:
    """Undo `genq pause` (global, or one job's); with --job, also lift the job's block
    (docs/settings.md) and queue the batches its workers parked."""
    with redis_conn(ctx) as conn:
        jobs_named(conn, job)
        queued = control.resume(conn, job)
        names = list_jobs(conn)
        still = sorted(j for j, now in zip(names, ledger_jobs.jobs_now(conn, names)) if now.paused)
        paused_all = ledger_jobs.paused_all(conn)
    click.echo(f"resumed {f'job {job}' if job else 'all jobs'}"
               + (f"; {plural(queued, 'parked batch', 'parked batches')} queued again" if queued else ""))
    if still:
        click.echo(f"still paused on their own: {', '.join(still)} (genq resume --job NAME)")
    if paused_all:
        click.echo("note: everything is still paused globally (genq resume)")
