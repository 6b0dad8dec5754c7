"""`genq jobs set` and `genq jobs show`: a job's generation settings, fixed in place, and their history.

Registered under `genq jobs` by genq.cli.control. The work is genq.ops.settings'.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import click
import msgspec

from genq.cli import job_argument, redis_conn
from genq.core.order import set_schedule
from genq.core.queueing import list_jobs, load_config
from genq.ops import control
from genq.ops.settings import SettingsError, block_of, describe_block, set_settings
from genq.producer.params import ParamError, check_params


def generation_options(fn: Any) -> Any:
    """The generation settings a command may change (jobs set; dlq requeue's per-requeue override)."""
    for option in reversed((
        click.option("--max-tokens", type=click.IntRange(min=1), default=None, help="Most tokens to generate."),
        click.option("--temperature", type=click.FloatRange(min=0), default=None, help="Sampling temperature."),
        click.option("--top-p", type=click.FloatRange(0, 1, min_open=True), default=None, help="Nucleus sampling."),
        click.option("--extra-body", default=None, metavar="JSON",
                     help='Extra request fields, replacing the job\'s (e.g. \'{"top_k": 20}\'; \'{}\' clears them).'),
    )):
        fn = option(fn)
    return fn


def given_generation(max_tokens: int | None, temperature: float | None, top_p: float | None,
                     extra_body: str | None) -> dict[str, Any]:
    """The generation options given, checked as enqueue checks them (a clear error naming the option)."""
    given: dict[str, Any] = {k: v for k, v in (("max_tokens", max_tokens), ("temperature", temperature),
                                                ("top_p", top_p)) if v is not None}
    if extra_body is not None:
        try:
            extra = json.loads(extra_body)
        except json.JSONDecodeError as exc:
            raise click.BadParameter(f"not valid JSON: {exc}", param_hint="--extra-body") from None
        if not isinstance(extra, dict):
            raise click.BadParameter("must be a JSON object", param_hint="--extra-body")
        try:
            check_params(extra, "--extra-body")
        except ParamError as exc:
            raise click.BadParameter(str(exc), param_hint="--extra-body") from None
        given["extra_body"] = extra
    return given


def _when(at: float) -> str:
    return datetime.fromtimestamp(at, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


@click.command("set", short_help="Change a job's generation settings, priority or weight.")
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
             extra_body: str | None, model: str | None, max_attempts: int | None, brake: bool | None,
             note: str | None, priority: int | None, weight: float | None) -> None:
    """Change JOB's generation settings for every prompt not yet done, or its priority and weight.

    Settings are stored as the job's next settings version (see `genq jobs show JOB`); workers
    send every prompt from then on with it (within a second), and each result records the
    version it was generated with. A blocked job stays blocked until `genq resume --job JOB`.
    --priority and --weight are how the job shares the fleet (docs/scheduling.md): they take
    effect within seconds on every worker and are no settings version.
    """
    changes = given_generation(max_tokens, temperature, top_p, extra_body)
    changes.update({k: v for k, v in (("model", model), ("max_attempts", max_attempts), ("brake", brake))
                    if v is not None})
    if not changes and priority is None and weight is None:
        raise click.UsageError("name at least one setting to change (see --help)")
    with redis_conn(ctx) as conn:
        try:
            if priority is not None or weight is not None:
                if job not in list_jobs(conn):
                    raise SettingsError(f"no job named {job!r}")
                sched = set_schedule(conn, job, priority, weight)
                click.echo(f"job {job}: priority {sched.priority}, weight {sched.weight:g}")
            if not changes:
                return
            config = set_settings(conn, job, changes, note)
            block = block_of(conn, job)
        except SettingsError as exc:
            raise click.ClickException(str(exc)) from None
    what = ", ".join(f"{k} {json.dumps(v)}" for k, v in changes.items())
    click.echo(f"job {job}: settings version {config.settings_version}: {what}; every prompt not yet done is "
               "sent with it")
    if block is not None:
        click.echo(f"the job is still blocked ({block.reason}): resume it with `genq resume --job {job}`")


@click.command("show", short_help="A job's settings, their history, its state and any block.")
@job_argument
@click.option("--json", "as_json", is_flag=True, help="The job's config, block and counts as one JSON object.")
@click.pass_context
def jobs_show(ctx: click.Context, job: str, as_json: bool) -> None:
    """JOB's settings, their version history, its state and why it is blocked."""
    with redis_conn(ctx) as conn:
        rows = control.job_rows(conn, [job]) if job in list_jobs(conn) else []
        config = load_config(conn, job)
    if not rows or config is None:
        raise click.ClickException(f"no job named {job!r}")
    row = rows[0]
    if as_json:
        click.echo(msgspec.json.encode({"config": config, "row": row}).decode())
        return
    click.echo(f"job {job}: {row.state}, {row.done:,} done, {row.failed:,} failed, {row.remaining:,} remaining "
               f"of {row.total:,}; batches {row.batches_done}/{row.batches}; output {config.output}")
    click.echo(f"priority {row.priority}, weight {row.weight:g}; {100 * row.share:.0f}% of the fleet's requests in "
               "flight now (docs/scheduling.md)")
    if row.blocked is not None:
        click.echo(describe_block(job, row.blocked))
        click.echo(f"  blocked at {_when(row.blocked.at)}")
    sent = {k: getattr(config, k) for k in ("endpoint", "model", "max_tokens", "temperature", "top_p",
                                             "extra_body", "max_attempts", "brake")}
    click.echo(f"settings version {config.settings_version}: "
               + ", ".join(f"{k} {json.dumps(v)}" for k, v in sent.items() if v is not None))
    click.echo(f"  version 1: enqueued at {_when(config.created_at)}" if config.created_at else "  version 1: enqueued")
    for change in config.settings_history:
        moved = ", ".join(f"{k} {json.dumps(change.previous.get(k))} -> {json.dumps(v)}"
                          for k, v in change.changed.items())
        click.echo(f"  version {change.version}: {_when(change.at)}: {moved}"
                   + (f" ({change.note})" if change.note else ""))

