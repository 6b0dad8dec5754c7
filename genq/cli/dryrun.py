"""`genq enqueue --dry-run`: the input and the job's settings checked as a real enqueue checks
them, and what it would queue said; nothing is written (no job, no batch, no rejects file)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import redis

from genq.core.queueing import ID_NEW, ID_SAME, lookup_ids
from genq.core.records import JobConfig, Rejected
from genq.core.words import plural
from genq.producer.rows import Row, claim_digest

EXIT_REJECTED = 3
SHOWN = 10  # reasons printed
CHUNK = 1000  # ids looked up in Redis per round trip


def dry_run(conn: redis.Redis, config: JobConfig, create: bool, input_uri: str,
            rows: Iterator[Row | Rejected], state: str, closed: str | None = None) -> int:
    """The exit status a real enqueue would have (0, 1 nothing valid or refused, 3 some lines rejected),
    `state` saying what the job's name stands for now and `closed` why new prompts would be refused;
    with its rules: a repeated line (same id, same content) is skipped, the same id with other
    content is rejected; an id already queued with the same content is skipped, with other
    content rejected."""
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
    click.echo(f"dry run: job {config.name} ({state}): {plural(new, 'prompt')} would be queued in "
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
    return EXIT_REJECTED if rejected else 0


def _other_content(row: Row, where: str) -> Rejected:
    return Rejected(line=row.prompt.index + 1, text="",
                    reason=f"duplicate id {row.prompt.id!r} with different content ({where})")
