"""genq enqueue: read prompts, store the job's config once, queue batches."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator

import click
import msgspec
import redis

from genq.cli import settings
from genq.core import keys
from genq.core.queueing import load_config, save_config
from genq.core.records import JobConfig, Prompt, Rejected
from genq.core.redisconn import connect, describe_error
from genq.producer.enqueue import Enqueuer, EnqueueSummary
from genq.producer.sources import ColumnMap, SourceError, default_rejects_path, open_rows

EXIT_REJECTED = 3

# Options that make up the job's config; None means "not given on this command line".
CONFIG_OPTIONS = ("output", "endpoint", "model", "max_tokens", "temperature", "top_p", "extra_body",
                  "batch_size", "max_attempts", "compression", "s3_endpoint_url")


@click.command()
@click.argument("input_uri", metavar="INPUT")
@click.option("--job", required=True, help="Job name (letters, digits, . _ -). Re-using a name adds to that job.")
@click.option("--output", default=None, help="Where shards go: a directory or s3://bucket/prefix. [default: ./out]")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=None, help="Prompts per batch (one RQ job each). [default: 256]")
@click.option("--max-tokens", type=click.IntRange(1), default=None, help="max_tokens sent with every request (always sent: SGLang otherwise runs to the context limit). [default: 4096]")
@click.option("--temperature", type=float, default=None, help="Sampling temperature (server default if unset).")
@click.option("--top-p", type=float, default=None, help="Nucleus sampling top_p (server default if unset).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default=None, help="/v1/chat/completions or /v1/completions. [default: chat]")
@click.option("--model", default=None, help='Model name to send; "auto" takes the first id from the server\'s /v1/models. [default: auto]')
@click.option("--extra-body", default=None, metavar="JSON", help='Extra request fields, e.g. \'{"chat_template_kwargs": {"enable_thinking": true}}\'.')
@click.option("--max-attempts", type=click.IntRange(1, 100), default=None, help="Attempts per prompt before it goes to the dead-letter queue. [default: 5]")
@click.option("--compression", type=click.Choice(["none", "gzip"]), default=None, help="Shard compression. [default: none]")
@click.option("--s3-endpoint-url", default=None, help="S3-compatible endpoint for s3:// input and output (MinIO...); AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL also work.")
@click.option("--messages-column", default=None, metavar="COL", help="Parquet input: the column holding the messages (list of {role, content}, or a JSON string). [default: 'messages']")
@click.option("--prompt-column", default=None, metavar="COL", help="Parquet input: the column holding a plain prompt string (for --endpoint completions). [default: 'prompt']")
@click.option("--id-column", default=None, metavar="COL", help="Parquet input: the column holding the row id. [default: 'id' if present, else a content hash]")
@click.option("--rejects", "rejects_path", default=None, type=click.Path(dir_okay=False), help="Where malformed lines are written. [default: INPUT's name + .rejects.jsonl, beside it]")
@click.pass_context
def enqueue(ctx: click.Context, input_uri: str, job: str, rejects_path: str | None, messages_column: str | None,
            prompt_column: str | None, id_column: str | None, **options: object) -> None:
    """Queue the prompts in INPUT as batches of job JOB.

    INPUT is JSONL (.jsonl, .jsonl.gz) or Parquet (.parquet), a local path or
    s3://bucket/key (streamed; credentials and endpoint from the standard AWS
    chain, or --s3-endpoint-url). Parquet rows are mapped with --messages-column
    or --prompt-column and --id-column; other columns become metadata.

    \b
    Each line is one of:
      {"id": "a1", "messages": [{"role": "user", "content": "..."}]}
      {"id": "a2", "prompt": "...", "sampling": {"temperature": 0.2}}
      {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    "id" is optional (a stable hash of the content is used); "sampling" overrides
    the job's request parameters for that row; any other field is metadata,
    carried through to the result.

    Re-running is safe: ids already queued or done are skipped and counted.
    The job's settings are stored on the first enqueue; later enqueues into the
    same job must not contradict them.

    \b
    Exit status: 0 all lines queued or skipped; 3 some lines were rejected
    (each is reported with its line number and written to the rejects file;
    the valid lines were still queued); 1 nothing could be done (bad option,
    unreadable input, Redis unreachable).
    """
    url = settings(ctx).redis_url
    try:
        keys.check_job_name(job)
        conn = connect(url)
        config = _job_config(conn, job, options)
        columns = ColumnMap(messages=messages_column, prompt=prompt_column, id=id_column)
        rows = open_rows(input_uri, s3_endpoint_url=config.s3_endpoint_url, columns=columns)
        summary = _run(conn, config, input_uri, rows)
    except (ValueError, SourceError) as exc:
        raise click.ClickException(str(exc)) from None
    except redis.RedisError as exc:
        raise click.ClickException(describe_error(url, exc)) from None
    rejects = rejects_path or default_rejects_path(input_uri)
    _report(summary, rejects)
    if summary.rejected:
        sys.exit(EXIT_REJECTED)


def _job_config(conn: redis.Redis, job: str, options: dict[str, object]) -> JobConfig:
    given = {k: v for k, v in options.items() if k in CONFIG_OPTIONS and v is not None}
    if "extra_body" in given:
        try:
            extra = json.loads(str(given["extra_body"]))
        except json.JSONDecodeError as exc:
            raise ValueError(f"--extra-body is not valid JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        given["extra_body"] = extra
    if "output" in given and "://" not in str(given["output"]):
        given["output"] = os.path.abspath(str(given["output"]))
    stored = load_config(conn, job)
    if stored is None:
        given.setdefault("output", os.path.abspath("out"))
        config = JobConfig(name=job, created_at=time.time(), **given)  # type: ignore[arg-type]
        save_config(conn, config)
        return config
    differing = [f"--{k.replace('_', '-')} {given[k]!r} (job has {getattr(stored, k)!r})"
                 for k in given if getattr(stored, k) != given[k]]
    if differing:
        raise ValueError(
            f"job {job!r} already exists with other settings: " + "; ".join(differing)
            + ". Leave those options out to add to it, or use a new --job name."
        )
    return stored


def _run(conn: redis.Redis, config: JobConfig, input_uri: str, rows: Iterator[Prompt | Rejected]) -> EnqueueSummary:
    started = time.monotonic()
    show_progress = sys.stderr.isatty()

    def progress(summary: EnqueueSummary) -> None:
        if show_progress:
            rate = summary.read / max(time.monotonic() - started, 1e-9)
            click.echo(f"\r  read {summary.read:,} prompts ({rate:,.0f}/s), queued {summary.enqueued:,}", err=True, nl=False)

    summary = Enqueuer(conn, config).run(rows, on_progress=progress)
    if show_progress:
        click.echo("", err=True)
    summary_time = time.monotonic() - started
    click.echo(
        f"job {config.name}: queued {summary.enqueued:,} prompts in {summary.batches:,} batches "
        f"from {input_uri} in {summary_time:.1f}s"
    )
    return summary


def _report(summary: EnqueueSummary, rejects_path: str) -> None:
    if summary.skipped_existing:
        click.echo(f"  skipped {summary.skipped_existing:,} prompts already queued or done (same id, same content)")
    if summary.skipped_duplicate:
        click.echo(f"  skipped {summary.skipped_duplicate:,} repeated lines (same id and content earlier in this input)")
    if not summary.rejected:
        return
    with open(rejects_path, "wb") as out:
        for rejected in summary.rejected:
            out.write(msgspec.json.encode(rejected) + b"\n")
    click.echo(f"  rejected {len(summary.rejected):,} lines, written to {rejects_path}:", err=True)
    for rejected in summary.rejected[:20]:
        click.echo(f"    line {rejected.line}: {rejected.reason}", err=True)
    if len(summary.rejected) > 20:
        click.echo(f"    ... and {len(summary.rejected) - 20:,} more (see {rejects_path})", err=True)
