"""`genq enqueue --dry-run`: the input and the job's settings checked as a real enqueue checks
them, and what it would queue said; nothing is written (no job, no batch, no rejects file)."""

from __future__ import annotations

from collections.abc import Iterator

import click
import redis

from genq.core import keys
from genq.core.records import JobConfig, Rejected
from genq.core.words import plural
from genq.producer.rows import Row

EXIT_REJECTED = 3
SHOWN = 10  # reasons printed
CHUNK = 1000  # ids looked up in Redis per round trip


def dry_run(conn: redis.Redis, config: JobConfig, create: bool, input_uri: str,
            rows: Iterator[Row | Rejected]) -> int:
    """The exit status a real enqueue would have (0, 1 nothing valid, 3 some lines rejected)."""
    seen: set[str] = set()
    known = 0
    rejected: list[Rejected] = []
    pending: list[str] = []

    def lookup() -> int:
        found = sum(v is not None for v in conn.hmget(keys.job_ids(config.name), pending)) if not create else 0
        pending.clear()
        return found

    for item in rows:
        if isinstance(item, Rejected):
            rejected.append(item)
            continue
        pid = item.prompt.id
        if pid in seen:
            rejected.append(Rejected(line=-1, reason=f"duplicate id {pid!r} (an earlier line has it)", text=""))
            continue
        seen.add(pid)
        pending.append(pid)
        if len(pending) >= CHUNK:
            known += lookup()
    known += lookup()
    new = len(seen) - known
    batches = -(-new // config.batch_size)
    for r in rejected[:SHOWN]:
        where = f"line {r.line}" if r.line > 0 else "a line"
        click.echo(f"  rejected {where}: {r.reason}", err=True)
    if len(rejected) > SHOWN:
        click.echo(f"  ... and {plural(len(rejected) - SHOWN, 'more line')}", err=True)
    state = "a new job" if create else "an existing job (its settings agree)"
    click.echo(f"dry run: job {config.name} ({state}): {plural(new, 'prompt')} would be queued in "
               f"{plural(batches, 'batch', 'batches')} of up to {config.batch_size:,} from {input_uri}"
               + (f"; {plural(known, 'prompt')} already queued or done would be skipped" if known else "")
               + (f"; {plural(len(rejected), 'line')} rejected" if rejected else "")
               + ". Nothing was written.")
    if not seen:
        return 1
    return EXIT_REJECTED if rejected else 0
