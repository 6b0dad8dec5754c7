"""genq export: one file from a job's finished shards (local or S3), in input order."""

from __future__ import annotations

import sys
from pathlib import Path

import click
import redis

from genq.cli import EXIT_PARTLY_DONE, JobName, redis_conn, redis_url
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import letters as ledger_letters
from genq.core.ledger.jobs import JobCounts
from genq.core.queueing import load_batch, load_config
from genq.core.records import DeadLetter, Prompt
from genq.core.redisconn import mask_url
from genq.core.words import plural
from genq.ops.dlq import failed_batches
from genq.output import export as exporting
from genq.output.export import FORMATS, ORDERS, ExportSummary, default_file_name, format_for
from genq.producer.sources import read_prompts


@click.command(short_help="Merge a job's shards into one JSONL, Parquet or Batch file.")
@click.option("--job", type=JobName(), required=True, help="The job to export.")
@click.option("--to", "dest", required=True, metavar="FILE|DIR",
              help="Output file (local or s3://bucket/key), or a directory to write JOB.<format> into.")
@click.option("--format", "fmt", type=click.Choice(list(FORMATS)), default=None,
              help="jsonl (Result lines, as in the shards), parquet, or openai-batch (OpenAI Batch "
                   "output lines; dead letters go to an errors file). [default: from --to's suffix, else jsonl]")
@click.option("--order", type=click.Choice(ORDERS), default="input", show_default=True,
              help="input: sorted by the prompt's position in the input; batch: shard by shard.")
@click.option("--errors", "errors_path", default=None, metavar="FILE",
              help="openai-batch: where dead letters go. [default: FILE with .errors.jsonl]")
@click.option("--from", "source_named_from", default=None, hidden=True)  # --output's first name (docs/recovery.md)
@click.option("--output", "source", default=None, metavar="OUTPUT",
              help="Read shards from OUTPUT (a directory or s3://bucket/prefix, as enqueue's --output) instead "
                   "of the job's configured output, e.g. after copying it.")
@click.option("--s3-endpoint-url", default=None, metavar="URL",
              help="S3-compatible endpoint for reading and writing. [default: the job's, or the AWS env/config]")
@click.pass_context
def export(ctx: click.Context, job: str, dest: str, fmt: str | None, order: str, errors_path: str | None,
                   source: str | None, source_named_from: str | None, s3_endpoint_url: str | None) -> None:
    """Merge JOB's finished shards into one JSONL, Parquet or OpenAI Batch file.

    Only shards named by the manifest (JOB/manifest/*.json) are read, each checked
    against its marker; records are deduplicated by id and, with --order input,
    sorted by their line in the input. Prints what it wrote. Exit status 3
    (partly done) when the job has batches whose shards are not written yet:
    the file holds what is finished so far; run it again once the job is done.

    \b
    Examples:
      genq export --job expansion --to expansion.jsonl
      genq export --job expansion --to ./exports/ --format parquet
      genq export --job batch1 --to out.jsonl --format openai-batch   # + out.errors.jsonl
    """
    conn, source = redis_conn(ctx), source or source_named_from
    config = load_config(conn, job)
    if config is None and source is None:
        raise click.ClickException(f"no job named {job!r} in Redis at {mask_url(redis_url(ctx))}; "
                                   "give --output OUTPUT to export shards without it")
    output = source or config.output  # type: ignore[union-attr]
    endpoint = s3_endpoint_url or (config.s3_endpoint_url if config else None)
    fmt = format_for(dest, fmt)
    if dest.endswith("/") or (not dest.startswith("s3://") and Path(dest).is_dir()):
        dest = dest.rstrip("/") + "/" + default_file_name(job, fmt)
    try:  # ExportError is the genq group's to print
        summary = exporting.export(output=output, job=job, dest=dest, fmt=fmt, order=order,
                                   letters=_letters(conn, job) if FORMATS[fmt].errors_file else [],
                                   errors_path=errors_path, endpoint_url=endpoint, dest_endpoint_url=endpoint,
                                   incarnation=config.incarnation if config and not source else None)
    except Exception as exc:
        if type(exc).__module__.startswith(("botocore", "boto3")):
            from genq.output import s3

            raise click.ClickException(f"S3: {s3.describe(exc, output)}") from None
        raise
    if _report(summary, fmt, ledger_jobs.counts(conn, job) if config is not None else None):
        sys.exit(EXIT_PARTLY_DONE)


def _letters(conn: redis.Redis, job: str) -> list[DeadLetter]:
    """The job's dead letters, plus the unfinished prompts of batches RQ gave up on
    (so that every input id lands in the output or the errors file)."""
    letters = ledger_letters.read_all(conn, job, DeadLetter)
    dead = {d.id for d in letters}
    config = load_config(conn, job)
    for entry in failed_batches(conn, [job]):
        batch = load_batch(conn, job, entry.batch)
        if batch is None:
            continue
        done = ledger_jobs.result_ids(conn, job, entry.batch)
        try:
            prompts: dict[str, Prompt | None] = {p.id: p for p in read_prompts(batch, config)} if config else {}
        except Exception:  # its input is gone or unreadable: the letters carry the ids alone
            prompts = {}
        for prompt_id in batch.prompt_ids():
            if prompt_id in dead or prompt_id in done:
                continue
            letters.append(DeadLetter(id=prompt_id, job=job, batch=entry.batch, attempts=entry.attempts,
                                      kind=entry.kind, message=entry.message, worker=entry.worker, at=entry.at,
                                      prompt=prompts.get(prompt_id)))
    return letters


def _report(s: ExportSummary, fmt: str, status: JobCounts | None) -> bool:
    """Says what was written; True when the job is not finished (the export is partial)."""
    click.echo(f"wrote {plural(s.records, 'record')} ({_size(s.bytes)}, {s.bytes:,} bytes) to {s.path} "
               f"from {plural(s.shards, 'shard')}")
    if s.duplicates:
        click.echo(f"  dropped {s.duplicates:,} duplicate records (same id in more than one shard; first kept)")
    if s.errors_path is not None:
        click.echo(f"  wrote {s.errors:,} error lines to {s.errors_path}")
    if s.skipped_errors:
        click.echo(f"  left out {s.skipped_errors:,} dead letters whose id also has a result")
    if status is None:
        return False
    partial = status.done < status.batches_total
    if partial:
        click.echo(f"  note: job has {plural(status.batches_total, 'batch', 'batches')}, {status.done:,} with shards written: "
                   f"the rest are not in this export yet (exit {EXIT_PARTLY_DONE}: partly done)", err=True)
    if status.dead and not FORMATS[fmt].errors_file:
        click.echo(f"  note: {status.dead:,} prompts are in the dead-letter queue, not in this export "
                   "(see `genq dlq`)", err=True)
    missing = status.total - s.records - s.errors
    if FORMATS[fmt].errors_file and missing > 0:
        click.echo(f"  note: {missing:,} of {status.total:,} prompts are in neither file (not finished yet)",
                   err=True)
    return partial


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"
