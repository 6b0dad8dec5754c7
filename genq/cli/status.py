"""`genq status JOB ID`: the fate of one prompt, read from where genq keeps it: dead-lettered > not in
the job > in a pending batch (done, sending, held or queued) > in a written shard (the record shown)."""

from __future__ import annotations

import gzip
import json
from typing import Any

import click
import msgspec
import redis

from genq.cli import JobName, json_option, redis_conn
from genq.core import ledger
from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger import letters
from genq.core.ledger.figures import prompt_state
from genq.core.queueing import load_batch, load_config
from genq.core.records import DeadLetter, Result, ShardInfo, unpack
from genq.output.truth import open_store


@click.command(short_help="One prompt's fate: queued, held, sending, done or failed.")
@click.argument("words", nargs=-1, metavar="JOB ID")
@click.option("--job", "job_option", type=JobName(), default=None, metavar="JOB",
              help="The job, as an option: genq status --job JOB ID.")
@json_option("One JSON object: {state, batch, record | letter | holder}.")
@click.pass_context
def status(ctx: click.Context, words: tuple[str, ...], job_option: str | None, as_json: bool) -> None:
    """The fate of prompt ID of JOB: queued, held, sending, done (with its record) or
    dead-lettered (with why). JOB is given first, or as --job JOB.

    \b
    Exit status: 0 found (whatever its state); 1 no such job or no such prompt in it.
    """
    job, prompt_id = _job_and_id(ctx, words, job_option)
    conn = redis_conn(ctx)
    if load_config(conn, job) is None:
        raise click.ClickException(f"no job named {job!r} (see `genq jobs`)")
    if (fate := find(conn, job, prompt_id)) is None:
        raise click.ClickException(f"job {job} has no prompt with id {prompt_id!r}")
    if as_json:
        return click.echo(json.dumps(fate))
    click.echo(f"{job} {prompt_id}: {fate['state']}" + (f" (batch {fate['batch']})" if fate.get("batch") else ""))
    click.echo(f"  {fate['why']}")
    for name in ("letter", "record"):
        if fate.get(name) is not None:
            click.echo(json.dumps(fate[name], indent=2))


def find(conn: redis.Redis, job: str, prompt_id: str) -> dict[str, Any] | None:
    if (letter := letters.read_some(conn, job, [prompt_id], DeadLetter)[0]) is not None:
        return {"state": "dead-lettered", "batch": letter.batch, "letter": msgspec.to_builtins(letter),
                "why": f"{letter.kind} after {letter.attempts} attempt(s): {letter.message}"}
    known, indexed = ledger_jobs.prompt_batch(conn, job, prompt_id)
    if not known:
        return None
    pending = ledger.pending_batches(conn, job)
    # The id index names the prompt's batch, whose record or shard is read; one it does not place (an older genq's,
    # or requeued from the DLQ: the index keeps the batch it failed in) is looked for everywhere.
    if indexed is not None and (fate := _pending(conn, job, [b for b in pending if b == indexed], prompt_id)
                                or _written(conn, job, prompt_id, [indexed])):
        return fate
    return _pending(conn, job, pending, prompt_id) or _written(conn, job, prompt_id) or {
        "state": "done", "batch": None,
        "why": "its batch is done, but no written shard holds it (see `genq export` and docs/operations.md)"}


def _pending(conn: redis.Redis, job: str, batches: list[str], prompt_id: str) -> dict[str, Any] | None:
    """In one of these pending batches: its state there."""
    batch = next((b for b in batches if (source := load_batch(conn, job, b)) is not None
                  and prompt_id in source.prompt_ids()), None)
    if batch is None:
        return None
    result, claimer, holder, holder_alive, paused = prompt_state(conn, job, batch, prompt_id)
    if result is not None:
        return {"state": "done", "batch": batch, "record": msgspec.to_builtins(unpack(result, Result)),
                "why": "its result is in Redis; the batch's shard is written when the whole batch is done"}
    if claimer is not None:  # a claim is taken just before the send: it covers the next prompts too
        return {"state": "sending", "batch": batch, "holder": claimer,
                "why": f"claimed by engine {claimer}: in flight, or among the next it sends"}
    if holder is not None and holder_alive:
        return {"state": "held", "batch": batch, "holder": holder,
                "why": f"its batch is held by engine {holder}" + (" (paused)" if paused else "; it is sent in turn")}
    gone = f"its batch's holder, engine {holder}, is gone (no heartbeat): a live worker queues the batch again " \
           f"20-40 s after it died; " if holder else ""
    return {"state": "queued", "batch": batch,
            "why": gone + "its batch waits for a worker" + (" (the job is paused)" if paused else "")}


def _written(conn: redis.Redis, job: str, prompt_id: str, batches: list[str] | None = None) -> dict[str, Any] | None:
    """In a written shard (of `batches`, else any; local or S3): the record itself."""
    endpoint = config.s3_endpoint_url if (config := load_config(conn, job)) else None
    written = msgspec.json.encode(prompt_id)[1:-1]  # as the shard holds it: a quote or a tab escaped
    for raw in ledger_jobs.shard_infos(conn, job, batches):
        info = unpack(raw, ShardInfo)
        for line in _lines(info.uri, endpoint):
            if written in line and (record := json.loads(line)).get("id") == prompt_id:
                return {"state": "done", "batch": info.batch, "record": record, "why": f"written to {info.uri}"}
    return None


def _lines(uri: str, endpoint: str | None) -> list[bytes]:
    folder, _, name = uri.rpartition("/")
    data = open_store(folder, endpoint).read(name) or b""  # a local path or s3://
    return (gzip.decompress(data) if data and uri.endswith(".gz") else data).splitlines()


def _job_and_id(ctx: click.Context, words: tuple[str, ...], job_option: str | None) -> tuple[str, str]:
    """JOB ID, or --job JOB and ID: bad usage (exit 2) otherwise."""
    if len(words) != (1 if job_option is not None else 2):
        raise click.UsageError("give JOB and ID (or --job JOB and ID)" if job_option is None else
                               f"with --job {job_option}, give only the prompt's ID", ctx)
    return (job_option, words[0]) if job_option is not None else (JobName().convert(words[0], None, ctx), words[1])
