"""`genq enqueue --dry-run`: the input and the job's settings checked as a real enqueue checks
them, and what it would queue said; nothing is written (no job, no batch, no rejects file)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import redis

from genq.cli import EXIT_PARTLY_DONE
from genq.core.queueing import ID_NEW, ID_SAME, lookup_ids
from genq.core.records import JobConfig, Rejected
from genq.core.words import plural
from genq.ops.control import job_rows
from genq.output import truth
from genq.output.sink import open_store
from genq.producer.enqueue import revives
from genq.producer.rows import Row, claim_digest

SHOWN = 10  # reasons printed
CHUNK = 1000  # ids looked up in Redis per round trip


def dry_run(conn: redis.Redis, config: JobConfig, create: bool, input_uri: str,
            rows: Iterator[Row | Rejected], closed: str | None = None) -> int:
    """The exit status a real enqueue would have (0, 1 nothing valid or refused, 3 some lines rejected),
    saying what the job's name stands for now and `closed` why new prompts would be refused. As
    enqueue: an id repeated in the input or already queued is skipped with the same content,
    rejected with other content."""
    seen: dict[str, bytes] = {}
    rejected: list[Rejected] = []
    pending: list[tuple[Row, bytes]] = []
    counts = {"new": 0, "known": 0, "repeated": 0}

    def lookup() -> None:
        answers = ID_NEW * len(pending) if create else lookup_ids(conn, config.name, [(r.prompt.id, d) for r, d in pending])
        for (row, _), answer in zip(pending, answers):
            if answer == ID_NEW:
                counts["new"] += 1
            elif answer == ID_SAME:
                counts["known"] += 1
            else:
                rejected.append(_other_content(row, "queued earlier"))
        pending.clear()

    for item in rows:
        if isinstance(item, Rejected):
            rejected.append(item)
            continue
        digest = claim_digest(item.prompt)
        earlier = seen.get(item.prompt.id)
        if earlier is not None:
            if earlier == digest:
                counts["repeated"] += 1
            else:
                rejected.append(_other_content(item, "earlier in this input"))
            continue
        seen[item.prompt.id] = digest
        pending.append((item, digest))
        if len(pending) >= CHUNK:
            lookup()
    lookup()
    new, known, repeated = counts["new"], counts["known"], counts["repeated"]
    batches = -(-new // config.batch_size)
    for r in sorted(rejected, key=lambda r: r.line)[:SHOWN]:
        click.echo(f"  rejected line {r.line}: {r.reason}", err=True)
    if len(rejected) > SHOWN:
        click.echo(f"  ... and {plural(len(rejected) - SHOWN, 'more line')}", err=True)
    click.echo(f"dry run: job {config.name} ({_name_state(conn, config, create)}): {plural(new, 'prompt')} would be queued in "
               f"{plural(batches, 'batch', 'batches')} of up to {config.batch_size:,} from {input_uri}"
               + (f"; {plural(known, 'prompt')} already queued or done would be skipped" if known else "")
               + (f"; {plural(repeated, 'repeated line')} would be skipped" if repeated else "")
               + (f"; {plural(len(rejected), 'line')} rejected" if rejected else "")
               + ". Nothing was written.")
    if closed is not None and new:
        click.echo(f"the real enqueue would be refused: {closed}", err=True)
        return 1
    if not seen:
        return 1
    return EXIT_PARTLY_DONE if rejected else 0


def _other_content(row: Row, where: str) -> Rejected:
    return Rejected(line=row.prompt.index + 1, text="",
                    reason=f"duplicate id {row.prompt.id!r} with different content ({where})")


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
