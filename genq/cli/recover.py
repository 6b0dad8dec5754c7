"""`genq recover`: a job's ledger in Redis rebuilt from its written output. See docs/recovery.md."""

from __future__ import annotations

import os
import sys

import click

from genq.cli import EXIT_PARTLY_DONE, JobName, local_or_s3, redis_conn
from genq.cli.enqueue import reference_uri
from genq.core.words import plural
from genq.ops import recover as recovering
from genq.producer.enqueue import enqueue_again
from genq.producer.sources import located


@click.command()
@click.option("--job", type=JobName(), required=True, help="The job to recover.")
@click.option("--output", default=None, metavar="OUTPUT", callback=local_or_s3,
              help="Where the job wrote its shards, when Redis no longer knows it. [default: the job's, from Redis]")
@click.option("--input", "inputs", multiple=True, metavar="INPUT",
              help="The job's input, to queue its prompts with no written outcome. [default: the ones job.json names]")
@click.option("--s3-endpoint-url", default=None, help="S3-compatible endpoint for an s3:// output.")
def recover(job: str, output: str | None, inputs: tuple[str, ...], s3_endpoint_url: str | None) -> None:
    """Rebuild a job's ledger in Redis from its written output. See docs/recovery.md."""
    if output and "://" not in output:
        output = os.path.abspath(output)
    try:  # an output or input that cannot be read (SourceError is the genq group's to print)
        conn, rejected = redis_conn(), 0
        found = recovering.recover(conn, job, output, s3_endpoint_url)
        if found.rebuilt:
            click.echo(f"job {job}: created again from {found.config.output}/{job}/job.json (incarnation "
                       f"{found.config.incarnation}); removed {plural(found.dropped_keys, 'key')} Redis held of it "
                       "without its config")
            if found.record.paused:
                click.echo(f"job {job}: paused, as job.json says (genq pause --job): `genq resume --job {job}` runs it")
        click.echo(f"job {job}: {plural(len(found.adopted), 'batch', 'batches')} written in the output marked done "
                   "from their markers")
        if not (sources := list(inputs) or found.record.inputs):
            click.echo("  no input given or recorded in job.json: prompts with no written outcome are not queued "
                       "again (give --input)", err=True)
        for source in sources:
            summary = enqueue_again(conn, found.config, located(source), reference_uri(source, None))
            rejected += summary.rejected
            click.echo(f"  {source}: queued {plural(summary.enqueued, 'prompt')} with no written outcome in "
                       f"{plural(summary.batches, 'batch', 'batches')}; {summary.skipped_existing:,} already "
                       "written or queued")
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:  # an output that is not a folder, a path this machine cannot read: the path named
        raise click.ClickException(f"{exc.strerror or exc}: {exc.filename or output}") from None
    if rejected:
        sys.exit(EXIT_PARTLY_DONE)
