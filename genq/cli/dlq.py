"""`genq dlq`: list, show, requeue and purge what genq gave up on (the work is genq.ops.dlq's)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import click
import msgspec

from genq import cli
from genq.cli import EXIT_PARTLY_DONE, age, console, iso, job_option, json_option, redis_conn, table, yes_option
from genq.cli.control import generation_options
from genq.core.words import plural
from genq.ops import dlq as core


@click.group()
def dlq() -> None:
    """Inspect, requeue or purge what genq gave up on. See docs/failures.md.

    \b
    Three kinds of entries:
      prompts        a prompt failed for good: the server rejected it (bad_request)
                     or its attempts ran out. Id: the prompt id.
      batch_failed   a batch's RQ job failed; workers queue it again within
                     seconds. Id: batch:<batch id>.
      server_crash   the server went down --server-crash-limit times with this
                     prompt in flight.
    """


def _scope(job: str | None) -> str:
    return f"job {job}" if job else "any job"


def _to_json(entry: core.Entry, *, full: bool = False) -> dict[str, Any]:  # `at`: ISO 8601 UTC; `at_epoch`: seconds
    batch = (["rq_job", "prompts"] + (["traceback"] if full else [])) if entry.is_batch else []
    out = {k: getattr(entry, k) for k in ("id", "job", "batch", "attempts", "kind", "status", "message", "worker")}
    out |= {"at": iso(entry.at), "at_epoch": entry.at} | {k: getattr(entry, k) for k in batch}
    return out | ({"prompt": msgspec.to_builtins(entry.prompt)} if full and entry.prompt is not None else {})


@dlq.command("list")
@job_option()
@json_option("A JSON array, one object per entry (docs/failures.md).")
@click.option("--limit", type=click.IntRange(0), default=None, metavar="N",
              help="Show at most N entries, newest first (0: all). [default: 100 in the table, all with --json]")
def list_command(job: str | None, as_json: bool, limit: int | None) -> None:
    """List dead prompts and failed batches, newest first."""
    found = core.entries(redis_conn(), job)
    shown = found if not limit and (as_json or limit == 0) else found[: limit or 100]
    if as_json:
        return click.echo(json.dumps([_to_json(e) for e in shown], indent=2))
    if not found:
        return click.echo(f"the dead-letter queue is empty ({_scope(job)})")
    now = time.time()
    lines = [(e.message.strip().splitlines() or [""])[0] for e in shown]
    console().print(table(
        ("id", "job", "batch", "attempts", "kind", "HTTP", "message", "worker", "age"),
        ((e.id, e.job, e.batch, str(e.attempts), e.kind, str(e.status or "-"), line if len(line) <= 60 else
          line[:59] + "…", e.worker or "-", age(now - e.at)) for e, line in zip(shown, lines)),
        right={"attempts", "HTTP", "age"}, ruled=False))
    summary = ", ".join(f"{kind} {n:,}" for kind, n in Counter(e.kind for e in found).most_common())
    more = f" (showing the newest {len(shown):,}; --limit 0 for all)" if len(shown) < len(found) else ""
    click.echo(f"{plural(len(found), 'entry', 'entries')} in {_scope(job)}: {summary}{more}")
    click.echo("details: genq dlq show ID   retry: genq dlq requeue --all" + (f" --job {job}" if job else ""))


@dlq.command()
@click.argument("entry_id", metavar="ID")
@job_option()
@json_option("One JSON object, with the prompt and (failed batches) the traceback.")
def show(entry_id: str, job: str | None, as_json: bool) -> None:
    """Everything about one entry (prompt, full message, traceback). ID: a prompt id, or batch:<batch id>."""
    (entry,) = core.find(redis_conn(), [entry_id], job, traceback=True)
    if as_json:
        return click.echo(json.dumps(_to_json(entry, full=True), indent=2))
    fields: list[tuple[str, Any]] = [
        ("id", entry.id), ("job", entry.job), ("batch", entry.batch), ("kind", entry.kind),
        ("HTTP status", entry.status), ("attempts", entry.attempts), ("worker", entry.worker or "-"),
        ("at", f"{iso(entry.at)} ({age(time.time() - entry.at)} ago)")]
    if entry.is_batch:
        fields += [("RQ job", entry.rq_job),
                   ("prompts", entry.prompts if entry.prompts is not None else "(batch record gone)")]
    for name, value in fields:
        if value is not None:
            click.echo(f"{name + ':':<13}{value}")
    indent = "\n  ".join
    click.echo("message:\n  " + indent(entry.message.rstrip("\n").splitlines()))
    if (p := entry.prompt) is not None:
        view = {"index": p.index, "messages": p.messages, "prompt": p.prompt, "sampling": p.sampling,
                "metadata": p.metadata or None, "custom_id": p.custom_id}
        text = json.dumps({k: v for k, v in view.items() if v is not None}, indent=2, ensure_ascii=False)
        click.echo("prompt:\n  " + indent(text.splitlines()))
    if entry.is_batch:
        click.echo("traceback:\n  " + indent((entry.traceback or "(RQ stored none)").rstrip("\n").splitlines()))


def _chosen(conn: Any, verb: str, job: str | None, ids: tuple[str, ...] = ()) -> list[core.Entry]:
    """The entries with these ids, or (none given) all of the job's or all jobs'; none said."""
    if not (chosen := core.find(conn, ids, job) if ids else core.entries(conn, job)):
        click.echo(f"nothing to {verb}: the dead-letter queue is empty ({_scope(job)})")
    return chosen


def _said(verb: str, done: list[str], left_verb: str, left: list[tuple[str, str]]) -> None:
    """What was done, and each entry left as it was with why (then exit 3, partly done)."""
    click.echo("\n".join(done) or f"nothing was {verb}")
    for entry_id, why in left:
        click.echo(f"{left_verb} {entry_id}: {why}", err=True)
    if left:
        sys.exit(EXIT_PARTLY_DONE)


@dlq.command()
@click.argument("ids", nargs=-1, metavar="[ID]...")
@job_option()
@click.option("--all", "all_", is_flag=True, help="Every entry (of --job, or of all jobs).")
@generation_options
def requeue(ids: tuple[str, ...], job: str | None, all_: bool, **settings: Any) -> None:
    """Queue dead prompts and failed batches again. The options apply to these prompts only."""
    if all_ == bool(ids):
        raise click.UsageError("give either --all or one or more IDs")
    # Into each prompt's own request fields: --extra-body's fields are some of them, not one named extra_body.
    override = {**(settings.pop("extra_body") or {}), **{k: v for k, v in settings.items() if v is not None}}
    conn = redis_conn()
    core.check_override(conn, [job] if job else [], override)  # bad usage even with nothing to requeue
    if not (chosen := _chosen(conn, "requeue", job, ids)):
        return
    if override and any(e.is_batch for e in chosen):
        raise click.UsageError("--max-tokens/--temperature/--top-p/--extra-body apply to dead prompts, not to "
                               "failed batches: change the job's settings with `genq jobs set` instead")
    report = core.requeue(conn, chosen, override=override)
    _said("requeued", [f"job {name}: requeued {plural(report.prompts[name], 'prompt')} as "
                       f"{plural(len(batch_ids), 'new batch', 'new batches')}: {', '.join(batch_ids)}"
                       for name, batch_ids in report.new_batches.items()]
          + [f"job {name}: requeued failed batch {batch_id} ({plural(size, 'prompt')}) as a new RQ job"
             for name, batch_id, size in report.batches], "skipped", report.left)


@dlq.command()
@job_option()
@yes_option
def purge(job: str | None, yes: bool) -> None:
    """Forget dead prompts and failed batches (asks first). They are neither retried nor counted."""
    conn = redis_conn()
    if not (chosen := _chosen(conn, "purge", job)):
        return
    batches = sum(1 for e in chosen if e.is_batch)
    what = " and ".join(plural(n, *kind) for n, kind in ((len(chosen) - batches, ("dead prompt",)),
                                                         (batches, ("failed batch", "failed batches"))) if n)
    if not cli.confirmed(yes, f"Purge {what} of {f'job {job}' if job else 'all jobs'}? They will not be retried or "
                         "counted", "nothing purged"):
        return
    report = core.purge(conn, chosen)
    _said("purged", [f"job {name}: purged {plural(n, 'dead prompt')}" for name, n in report.prompts.items()]
          + [f"job {name}: purged failed batch {batch_id} ({plural(forgotten, 'unfinished prompt')} forgotten)"
             for name, batch_id, forgotten in report.batches], "kept", report.left)
