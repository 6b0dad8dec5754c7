"""`genq dlq`: list, show, requeue and purge what genq gave up on (the work is genq.ops.dlq's)."""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from typing import Any

import click
import msgspec

from genq.cli import EXIT_PARTLY_DONE, age, console, iso, job_option, json_option, redis_conn, table, yes_option
from genq.cli.control import generation_options, given
from genq.core.words import plural
from genq.ops import dlq as core


@click.group()
def dlq() -> None:
    """Inspect, requeue or purge what genq gave up on.

    \b
    Three kinds of entries:
      prompts        a prompt failed for good: the server rejected it (bad_request,
                     e.g. longer than the context) or its attempts ran out
                     (server_error, timeout, connection, protocol). Id: the prompt id.
      batch_failed   a batch's RQ job failed (the worker holding it was lost); workers
                     queue it again within seconds. Id: batch:<batch id>.
      server_crash   the server went down --server-crash-limit times with this
                     prompt in flight (sent alone after the second).
    The monitor's "failed" count is the number of dead prompts.
    """


def _scope(job: str | None) -> str:
    return f"job {job}" if job else "any job"


def _to_json(entry: core.Entry, *, full: bool = False) -> dict[str, Any]:
    """The --json shape: `at` as ISO 8601 UTC, `at_epoch` in seconds."""
    batch = (["rq_job", "prompts"] + (["traceback"] if full else [])) if entry.is_batch else []
    out = {k: getattr(entry, k) for k in ("id", "job", "batch", "attempts", "kind", "status", "message", "worker")}
    out |= {"at": iso(entry.at), "at_epoch": entry.at} | {k: getattr(entry, k) for k in batch}
    return out | ({"prompt": msgspec.to_builtins(entry.prompt)} if full and entry.prompt is not None else {})


@dlq.command("list", short_help="List dead prompts and failed batches, newest first.")
@job_option()
@json_option("A JSON array: one object per entry (id, job, batch, attempts, kind, status, message, worker, at as "
             "ISO 8601 UTC, at_epoch; failed batches add rq_job and prompts).")
@click.option("--limit", type=click.IntRange(0), default=None, metavar="N",
              help="Show at most N entries, newest first (0: all). [default: 100 in the table, all with --json]")
@click.pass_context
def list_command(ctx: click.Context, job: str | None, as_json: bool, limit: int | None) -> None:
    """List dead prompts and failed batches, newest first."""
    found = core.entries(redis_conn(ctx), job)
    shown = found if not limit and (as_json or limit == 0) else found[: limit or 100]
    if as_json:
        click.echo(json.dumps([_to_json(e) for e in shown], indent=2))
        return
    if not found:
        click.echo(f"the dead-letter queue is empty ({_scope(job)})")
        return
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


@dlq.command(short_help="Everything about one entry (prompt, full message, traceback).")
@click.argument("entry_id", metavar="ID")
@job_option()
@json_option("One JSON object, with the prompt and (failed batches) the traceback.")
@click.pass_context
def show(ctx: click.Context, entry_id: str, job: str | None, as_json: bool) -> None:
    """Everything about one entry: the prompt and the server's full message, or a failed batch's traceback.

    ID is a prompt id, or batch:<batch id> for a failed batch.
    """
    (entry,) = core.find(redis_conn(ctx), [entry_id], job, traceback=True)
    if as_json:
        click.echo(json.dumps(_to_json(entry, full=True), indent=2))
        return
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
    click.echo("message:\n" + _indent(entry.message))
    if (p := entry.prompt) is not None:
        view = {"index": p.index, "messages": p.messages, "prompt": p.prompt, "sampling": p.sampling,
                "metadata": p.metadata or None, "custom_id": p.custom_id}
        shown = {k: v for k, v in view.items() if v is not None}
        click.echo("prompt:\n" + _indent(json.dumps(shown, indent=2, ensure_ascii=False)))
    if entry.is_batch:
        click.echo("traceback:\n" + _indent(entry.traceback or "(RQ stored none)"))


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.rstrip("\n").splitlines())


@dlq.command(short_help="Queue dead prompts and failed batches again.")
@click.argument("ids", nargs=-1, metavar="[ID]...")
@job_option()
@click.option("--all", "all_", is_flag=True, help="Every entry (of --job, or of all jobs).")
@generation_options
@click.pass_context
def requeue(ctx: click.Context, ids: tuple[str, ...], job: str | None, all_: bool, max_tokens: int | None,
            temperature: float | None, top_p: float | None, extra_body: dict[str, Any] | None) -> None:
    """Queue dead prompts again (as new batches) and failed batches (as new RQ jobs).

    Each letter leaves the dead-letter queue in the transaction that queues it: none is lost or
    queued twice. A prompt whose batch has not finished yet is skipped (that batch could still
    regenerate it); a failed batch's finished prompts are not generated again. Prompts are sent
    with the job's current settings; --max-tokens, --temperature, --top-p or --extra-body
    override them for these prompts only (not for failed batches: use `genq jobs set`).

    Exit status: 0 all requeued; 3 some entries were skipped (each is named);
    1 an unknown job or id (nothing was requeued).
    """
    if all_ == bool(ids):
        raise click.UsageError("give either --all or one or more IDs")
    override = given(max_tokens=max_tokens, temperature=temperature, top_p=top_p, extra_body=extra_body)
    conn = redis_conn(ctx)
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
             for name, batch_id, size in report.batches], "skipped", report.skipped)


def _chosen(conn: Any, verb: str, job: str | None, ids: tuple[str, ...] = ()) -> list[core.Entry]:
    """The entries with these ids, or (none given) all of the job's or all jobs': said when there are none."""
    chosen = core.find(conn, ids, job) if ids else core.entries(conn, job)
    if not chosen:
        click.echo(f"nothing to {verb}: the dead-letter queue is empty ({_scope(job)})")
    return chosen


def _said(verb: str, done: list[str], left_verb: str, left: list[tuple[str, str]]) -> None:
    """What was done, and each entry left as it was with why: then exit 3 (partly done)."""
    click.echo("\n".join(done) or f"nothing was {verb}")
    for entry_id, why in left:
        click.echo(f"{left_verb} {entry_id}: {why}", err=True)
    if left:
        sys.exit(EXIT_PARTLY_DONE)


@dlq.command(short_help="Forget dead prompts and failed batches (asks first).")
@job_option()
@yes_option
@click.pass_context
def purge(ctx: click.Context, job: str | None, yes: bool) -> None:
    """Forget every dead prompt and failed batch (of --job, or of all jobs).

    Purged prompts are neither retried nor counted (enqueueing the same rows again queues them
    anew; the job's stats count them "purged"); so are a failed batch's unfinished prompts. A
    prompt whose batch has not finished, and a failed batch with finished prompts, are kept
    (and named): requeue those.

    \b
    Keep a record first:
      genq dlq list --job NAME --json > dead-letters.json
    """
    conn = redis_conn(ctx)
    if not (chosen := _chosen(conn, "purge", job)):
        return
    batches = sum(1 for e in chosen if e.is_batch)
    what = plural(len(chosen) - batches, "dead prompt") + (
        f" and {plural(batches, 'failed batch', 'failed batches')}" if batches else "")
    if not yes:
        click.confirm(f"Purge {what} of {f'job {job}' if job else 'all jobs'}? They will not be retried or counted",
                      abort=True)
    report = core.purge(conn, chosen)
    _said("purged", [f"job {name}: purged {plural(n, 'dead prompt')}" for name, n in report.letters.items()]
          + [f"job {name}: purged failed batch {batch_id} ({plural(forgotten, 'unfinished prompt')} forgotten)"
             for name, batch_id, forgotten in report.batches], "kept", report.kept)
