"""`genq enqueue`: read prompts, check them and the job's settings, queue batches. Nothing is
written to Redis until a line is queued: the job's config goes in with its first batches."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import click
import redis

from genq.cli import EXIT_PARTLY_DONE, INT32, Finite, JobName, extra_body, local_or_s3, model_name, redis_url
from genq.core.ledger.figures import FINISHED_STATUSES
from genq.core.ledger.jobs import counts
from genq.core.order import order_queue
from genq.core.queueing import load_config
from genq.core.records import JobConfig, new_incarnation
from genq.core.redisconn import connect, describe_error, redis_note_of
from genq.core.words import plural
from genq.monitor.view import duration
from genq.ops.control import job_rows, set_schedule
from genq.output import truth
from genq.output.truth import open_store
from genq.producer.enqueue import SHOWN, Enqueuer, EnqueueSummary, RejectsFile, revives
from genq.producer.rows import RowError, check_params
from genq.producer.sources import ColumnMap, Meter, default_rejects_path, is_parquet, is_s3, located, open_rows


@click.command(short_help="Queue a JSONL or Parquet file's prompts as a job's batches.")
@click.argument("input_uri", metavar="INPUT", callback=local_or_s3)
@click.option("--job", type=JobName(), required=True,
              help="Job name (letters, digits, . _ -). An existing job's name adds to it (a finished one with --add).")
@click.option("--output", default=None, callback=local_or_s3,
              help="Where shards go: a directory or s3://bucket/prefix. [default: ./out]")
@click.option("--batch-size", type=click.IntRange(1, 100_000), default=None,
              help="Prompts per batch (one RQ job each). [default: 256]")
@click.option("--max-tokens", type=click.IntRange(1, INT32), default=None,
              help="Sent with every request (always: SGLang otherwise runs to the context limit). [default: 4096]")
@click.option("--temperature", type=Finite(0), default=None, help="Sampling temperature (server's if unset).")
@click.option("--top-p", type=Finite(0, 1, min_open=True), default=None,
              help="Nucleus sampling top_p, in (0, 1] (server's if unset).")
@click.option("--endpoint", type=click.Choice(["chat", "completions"]), default=None,
              help="/v1/chat/completions or /v1/completions. [default: chat]")
@click.option("--model", default=None, callback=model_name,
              help="Model name to send; auto: the server's first. [default: auto]")
@click.option("--extra-body", default=None, metavar="JSON", help="Extra request fields (known OpenAI/SGLang/vLLM ones, "
              """checked here), e.g. '{"chat_template_kwargs": {"enable_thinking": true}}'.""")
@click.option("--max-attempts", type=click.IntRange(1, 100), default=None,
              help="Attempts per prompt before its dead letter. [default: 5]")
@click.option("--compression", type=click.Choice(["none", "gzip"]), default=None,
              help="Shard compression. [default: none]")
@click.option("--s3-endpoint-url", default=None,
              help="S3-compatible endpoint for s3:// input and output (or AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL).")
@click.option("--messages-column", default=None, metavar="COL",
              help="Parquet: the messages (a list of {role, content}, or its JSON). [default: 'messages']")
@click.option("--prompt-column", default=None, metavar="COL",
              help="Parquet: a plain prompt (for --endpoint completions). [default: 'prompt']")
@click.option("--id-column", default=None, metavar="COL",
              help="Parquet: the row id. [default: 'id' if present, else a content hash]")
@click.option("--rejects", "rejects_path", default=None, type=click.Path(dir_okay=False),
              help="Where rejected lines go. [default: OUTPUT/JOB/rejects/NAME.rejects.jsonl for input "
              "NAME.jsonl; ./genq-rejects/JOB/NAME.rejects.jsonl for s3:// output]")
@click.option("--input-by-reference/--input-inline", "by_reference", default=None,
              help="By reference: Redis holds each batch's line range of INPUT (uncompressed JSONL), which workers "
                   "read themselves (a local path at the same absolute path). Inline: the prompts go into Redis, "
                   "compressed. [default: by reference for an s3:// .jsonl input, inline otherwise]")
@click.option("--priority", type=click.IntRange(-INT32, INT32), default=None,
              help="Scheduling priority, higher first: no worker starts a lower-priority prompt while one of this job "
                   "waits (docs/scheduling.md). Changeable: genq jobs set JOB --priority N. [default: 0]")
@click.option("--weight", type=Finite(min=0, min_open=True), default=None,
              help="Fair-share weight among jobs of equal priority (prompts in proportion to it). [default: 1]")
@click.option("--add", "add_to_finished", is_flag=True,
              help="Add INPUT's new prompts to JOB though it is finished (done or partial): it runs again into the "
                   "same output. Without it they are refused unless INPUT is one of the job's own inputs.")
@click.option("--dry-run", is_flag=True, help="Check INPUT and the settings as a real enqueue does and say what it "
              "would queue; write nothing (no job, no batch, no rejects file). Same exit status.")
@click.pass_context
def enqueue(ctx: click.Context, input_uri: str, job: str, rejects_path: str | None, messages_column: str | None,
            prompt_column: str | None, id_column: str | None, by_reference: bool | None, dry_run: bool,
            priority: int | None, weight: float | None, add_to_finished: bool, **options: object) -> None:
    """Queue the prompts in INPUT as batches of job JOB.

    INPUT is JSONL (.jsonl, .jsonl.gz) or Parquet (.parquet), a local path or s3://bucket/key
    (streamed; AWS credentials, or --s3-endpoint-url). Parquet columns map with --messages-column
    or --prompt-column and --id-column; other columns become metadata.

    \b
    Each line is one of:
      {"id": "a1", "messages": [{"role": "user", "content": "..."}]}
      {"id": "a2", "prompt": "...", "sampling": {"temperature": 0.2}}
      {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}
    "id" is optional (a stable hash of the content is used); "sampling" overrides the job's
    request parameters for that row; any other field is metadata, carried to the result. With
    --endpoint chat a "prompt" row is sent as one user message; with --endpoint completions a
    "messages" row is rejected. Settings and "sampling" are checked here.

    Re-running is safe: ids already queued or done are skipped and counted. Later enqueues into
    a job must not contradict its settings. Nothing is created when nothing is queued.

    \b
    Exit status: 0 every line queued or skipped; 3 some lines were rejected (each named, and
    written to the rejects file; the valid ones were queued); 1 nothing was queued (unreadable,
    empty or invalid input, settings that contradict the job, Redis unreachable), or Redis failed
    part way (the same command again queues the rest); 2 bad usage; 130 interrupted (Ctrl-C).
    """
    if rejects_path and os.path.realpath(rejects_path) == os.path.realpath(input_uri):
        raise click.UsageError(f"--rejects {rejects_path} is the input: the rejected lines would be written over it")
    url, enqueuer = redis_url(ctx), None
    try:
        given = _given_settings(options)  # options: those of the job's config
        columns = ColumnMap(messages=messages_column, prompt=prompt_column, id=id_column)
        conn = connect(url)
        if note := redis_note_of(conn):  # before a prompt is queued: this Redis would lose them
            click.echo(f"warning: {note.text}", err=True)
        reference = reference_uri(input_uri, by_reference)
        config, create = _job_config(conn, job, given)
        closed = None if create or add_to_finished else _finished(conn, job, config, input_uri)
        meter = Meter()
        rows = open_rows(input_uri, endpoint=config.endpoint, s3_endpoint_url=config.s3_endpoint_url, columns=columns,
                         meter=meter, job=config.extra_body)
        path = None if dry_run else os.path.abspath(rejects_path or default_rejects_path(input_uri, config.output, job))
        rejects, started = RejectsFile(path), time.monotonic()
        enqueuer = Enqueuer(conn, config, create=create, rejects=rejects, reference=reference,
                            input_uri=None if dry_run else located(input_uri), closed=None if dry_run else closed,
                            dry_run=dry_run, model=config.model if create or "model" in given else None)
        try:
            summary = enqueuer.run(rows, on_progress=None if dry_run else _progress(started, meter), meter=meter)
        except BaseException:
            rejects.discard()
            raise
        if dry_run:
            sys.exit(_dry_run(conn, config, create, input_uri, summary, rejects, closed))
        if sys.stderr.isatty():
            click.echo("", err=True)
        if summary.read:
            click.echo(f"job {config.name}: queued {plural(summary.enqueued, 'prompt')} in "
                       f"{plural(summary.batches, 'batch', 'batches')} "
                       f"({f'by reference to {reference}' if reference else 'inline'}) "
                       f"from {input_uri} in {time.monotonic() - started:.1f}s")
        if summary.enqueued or ((not create or summary.rebuilt) and (priority is not None or weight is not None)):
            if priority is not None or weight is not None:
                set_schedule(conn, job, priority, weight)  # job.json, then Redis; the queue in order again
            else:
                order_queue(conn)  # its batches take their turns among the other jobs' (genq.core.order)
    except RowError as exc:  # --extra-body's: bad usage
        raise click.UsageError(str(exc)) from None
    except ValueError as exc:  # SourceError is the genq group's to print
        raise click.ClickException(str(exc)) from None
    except redis.RedisError as exc:
        raise click.ClickException(describe_error(url, exc) + _held_so_far(url, job, started=bool(enqueuer))) from None
    except KeyboardInterrupt:  # the group says "interrupted" and exits 130; this adds what the job holds
        raise KeyboardInterrupt(_held_so_far(url, job, "to queue the rest") or ": nothing was queued") from None
    if summary.read == 0:
        rejects.discard()
        _nothing_valid(summary, rejects, input_uri)
    rejects.close()
    _report(summary, rejects)
    if summary.rejected:
        sys.exit(EXIT_PARTLY_DONE)


def _held_so_far(url: str, job: str, when: str = "once Redis takes writes", started: bool = True) -> str:
    """After Redis failed part way (full, away, failing over) or Ctrl-C: what the job holds, and how to go on."""
    try:
        held: int | None = counts(connect(url), job).total
    except redis.RedisError:  # away: what it holds is not known (if `started`), and the same command is as safe
        held = None if started else 0
    if held == 0:
        return ""
    holds = f"job {job} holds {plural(held, 'prompt')} now (queued: workers run them); " if held else ""
    return (f"\n{holds}{when}, run the same command again: the prompts already queued are skipped, the rest queued, "
            "each prompt once")


def _given_settings(options: dict[str, object]) -> dict[str, object]:
    """The job config's options given on the command line (not None), checked and normalised (no Redis needed)."""
    given = {k: v for k, v in options.items() if v is not None}
    if "extra_body" in given:
        given["extra_body"] = extra_body(str(given["extra_body"]), given.get("endpoint"))  # type: ignore[arg-type]
    if "output" in given and "://" not in str(given["output"]):
        given["output"] = os.path.abspath(str(given["output"]))
    return given


def _job_config(conn: redis.Redis, job: str, given: dict[str, object]) -> tuple[JobConfig, bool]:
    """The job's config and whether it is new (stored only with the first batch queued)."""
    if (stored := load_config(conn, job)) is None:
        given.setdefault("output", os.path.abspath("out"))
        given |= {"name": job, "created_at": time.time(), "incarnation": new_incarnation()}
        config = JobConfig(**given)  # type: ignore[arg-type]
        check_params(config.extra_body, "--extra-body", config.endpoint)  # the default endpoint's rules too
        return config, True
    if differing := [f"--{k.replace('_', '-')} {given[k]!r} (job has {getattr(stored, k)!r})"
                     for k in given if getattr(stored, k) != given[k]]:
        raise ValueError(f"job {job!r} already exists with other settings: {'; '.join(differing)}. Leave those "
                         f"options out to add to it, change the job's generation settings with `genq jobs set {job} "
                         "...` (docs/settings.md), or use a new --job name.")
    return stored, False


def reference_uri(input_uri: str, by_reference: bool | None) -> str | None:
    """The input as workers will read it when its batches are queued by reference; None for inline."""
    plain_jsonl = not (is_parquet(input_uri) or input_uri.endswith(".gz"))
    if by_reference is None:
        by_reference = is_s3(input_uri) and plain_jsonl
    if by_reference and not plain_jsonl:
        raise ValueError(f"--input-by-reference needs an uncompressed JSONL input (workers read byte ranges of it); "
                         f"{input_uri} is {'Parquet' if is_parquet(input_uri) else 'gzip-compressed'}: "
                         "use --input-inline, or decompress it")
    return located(input_uri) if by_reference else None


def _finished(conn: redis.Redis, job: str, config: JobConfig, input_uri: str) -> str | None:
    """Why new prompts from INPUT are refused without --add: the job is finished and INPUT not one of its inputs."""
    row = job_rows(conn, [job])[0]
    if row.state not in FINISHED_STATUSES:
        return None
    try:
        record = truth.read_job(open_store(config.output, config.s3_endpoint_url), job)
    except Exception:  # the output unreachable: the enqueue stops on it, saying so
        record = None
    if record is not None and located(input_uri) in record.inputs:
        return None
    return (f"job {job} is {row.state} ({plural(row.total, 'prompt')}, output {config.output}) and {input_uri}, "
            f"not one of its inputs, has prompts it does not hold: adding them would run it again, writing into "
            f"the same output. Give a new --job name for a new job, or --add to add them to {job}")


def _progress(started: float, meter: Meter) -> Callable[[EnqueueSummary], None] | None:
    """On a terminal: prompts read and their rate; for an input of known size the percent and an ETA."""
    def progress(summary: EnqueueSummary) -> None:
        elapsed = max(time.monotonic() - started, 1e-9)
        line = f"read {summary.read:,} prompts ({summary.read / elapsed:,.0f}/s), queued {summary.enqueued:,}"
        if (fraction := meter.fraction()) is not None:
            line += f" · {100 * fraction:.1f}% of {meter.of_what()}"
            if fraction > 0:
                line += f", ETA {duration(elapsed * (1 - fraction) / fraction)}"
        click.echo(f"\r  {line}", err=True, nl=False)

    return progress if sys.stderr.isatty() else None


def _dry_run(conn: redis.Redis, config: JobConfig, create: bool, input_uri: str, summary: EnqueueSummary,
             rejects: RejectsFile, closed: str | None) -> int:
    """`--dry-run` says what the real enqueue would do (refused: `closed` says why); its exit status."""
    _show_reasons(rejects, None)
    skips = ((summary.skipped_existing, "prompt", " already queued or done would be skipped"),
             (summary.skipped_duplicate, "repeated line", " would be skipped"), (summary.rejected, "line", " rejected"))
    click.echo(f"dry run: job {config.name} ({_name_state(conn, config, create)}): {plural(summary.enqueued, 'prompt')}"
               f" would be queued in {plural(summary.batches, 'batch', 'batches')} of up to {config.batch_size:,} "
               f"from {input_uri}" + "".join(f"; {plural(n, noun)}{what}" for n, noun, what in skips if n)
               + ". Nothing was written.")
    if closed is not None and summary.enqueued:
        click.echo(f"the real enqueue would be refused: {closed}", err=True)
        return 1
    return 1 if not summary.read else EXIT_PARTLY_DONE if summary.rejected else 0


def _name_state(conn: redis.Redis, config: JobConfig, create: bool) -> str:
    """What the job's name stands for now, as --dry-run says it."""
    if not create:
        row = job_rows(conn, [config.name])[0]
        return f"an existing job, {row.state}, {plural(row.total, 'prompt')}; its settings agree"
    store = open_store(config.output, config.s3_endpoint_url)
    try:
        on_disk = truth.read_job(store, config.name)
    except Exception as exc:  # the output unreachable: the real enqueue stops on it, saying so
        return f"a new job, unless {config.output} (unreadable from here: {type(exc).__name__}) holds it"
    if on_disk is None:
        return "a new job"
    if revives(on_disk, config):
        return (f"not in Redis, but {truth.job_uri(store, config.name)} holds it: it would be created again from "
                "there, its written batches counted as done (below, prompts are counted against Redis alone)")
    return (f"a new job; {truth.job_uri(store, config.name)} holds an earlier job of this name "
            f"({'deleted' if on_disk.deleted_at is not None else 'other settings'}), whose shards stay")


def _nothing_valid(summary: EnqueueSummary, rejects: RejectsFile, input_uri: str) -> None:
    """No valid line: a plain error, and nothing written (no job, no rejects file)."""
    if not summary.rejected:
        if "://" in input_uri or not os.path.isfile(input_uri):
            what = "it is empty or holds only blank lines"
        elif input_uri.endswith(".parquet"):
            what = "it has no rows"
        else:
            what = "it is empty" if os.path.getsize(input_uri) == 0 else "it holds only blank lines (whitespace)"
        raise click.ClickException(f"{input_uri} has no prompts ({what}): nothing queued, no job created")
    _show_reasons(rejects, None, limit=5)  # often a binary or a non-JSONL file: a few say enough
    raise click.ClickException(f"no valid line in {input_uri} ({summary.rejected:,} rejected, reasons above): nothing "
                               "queued, no job created. Input is JSONL, one object a line (see `genq enqueue --help`).")


def _report(summary: EnqueueSummary, rejects: RejectsFile) -> None:
    if summary.converted:
        click.echo(f"  {summary.converted:,} 'prompt' rows sent as one user message each "
                   "(--endpoint chat takes messages)")
    if summary.unsent:
        fields = ", ".join(f"{k} ({plural(n, 'row')})" for k, n in sorted(summary.unsent.items()))
        click.echo(f"  note: request fields at a row's top level are kept as its metadata and not sent: {fields}; "
                   "to send them, put them under \"sampling\"")
    if summary.models:
        named = ", ".join(f"{k}: {plural(n, 'row')}" for k, n in sorted(summary.models.items()))
        click.echo(f"  note: OpenAI Batch bodies name a model ({named}); the job's (--model auto: the first "
                   "server's) is sent instead, and each record's model says which answered")
    if summary.rebuilt or summary.recovered_batches:  # the output is the truth (docs/recovery.md)
        click.echo(f"  {'job created again from its output (it was not in Redis); ' if summary.rebuilt else ''}"
                   f"{plural(summary.recovered_batches, 'batch', 'batches')} already written there counted as done")
    if summary.note:
        click.echo(f"  note: {summary.note}")
    if summary.skipped_existing:
        click.echo(f"  skipped {plural(summary.skipped_existing, 'prompt')} already queued or done (same id, same "
                   "content)")
    if summary.skipped_duplicate:
        click.echo(f"  skipped {plural(summary.skipped_duplicate, 'repeated line')} (same id and content earlier in "
                   "this input)")
    if summary.rejected:
        where = (f"written to {rejects.path}" if rejects.error is None else
                 f"NOT written ({rejects.error}; give another place with --rejects)")
        click.echo(f"  rejected {plural(summary.rejected, 'line')}, {where}:", err=True)
        _show_reasons(rejects, rejects.path if rejects.error is None else None)


def _show_reasons(rejects: RejectsFile, rejects_path: str | None, limit: int = SHOWN) -> None:
    for item in rejects.first[:limit]:
        click.echo(f"    line {item.line}: {item.reason}", err=True)
    if rejects.count > limit:
        click.echo(f"    ... and {rejects.count - limit:,} more" + (f" (see {rejects_path})" if rejects_path else ""),
                   err=True)
