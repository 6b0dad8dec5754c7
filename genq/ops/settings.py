"""A job's generation settings changed in place, and a blocked job's way back (docs/settings.md).

OUTPUT/JOB/job.json is written before Redis: the output is the durable truth of the job's settings,
and whatever brings a job back from it (recover, the same enqueue, a worker catching up) takes them.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import msgspec
import redis

from genq.core.ledger import jobs as ledger_jobs
from genq.core.ledger.leasing import unqueue as unqueue  # worker/gate.py's import
from genq.core.queueing import list_jobs
from genq.core.records import JobBlock, JobConfig, JobRecord, SettingsChange
from genq.ops import Refused
from genq.output import truth
from genq.output.truth import open_store

# The settings `genq jobs set` may change: what is sent with each request. Not endpoint (rows were
# fitted to it at enqueue), output, batch size or compression (written batches and shards follow them).
SETTABLE = ("model", "max_tokens", "temperature", "top_p", "extra_body", "max_attempts", "brake")


def set_settings(conn: redis.Redis, job: str, changes: dict[str, Any], note: str | None = None) -> JobConfig:
    """Store `changes` as the job's next settings version; returns the new config. A change that
    changes nothing is refused, so every version in the history differs from the one before."""
    if unknown := sorted(set(changes) - set(SETTABLE)):
        raise Refused(f"cannot set {', '.join(unknown)}; settable: {', '.join(SETTABLE)}")

    def change(config: JobConfig | None) -> JobConfig:
        if config is None:
            raise Refused(f"no job named {job!r} (or it has no stored settings)")
        if not (differing := {k: v for k, v in changes.items() if getattr(config, k) != v}):
            raise Refused(f"job {job!r} has these settings already (version {config.settings_version})")
        version = config.settings_version + 1
        entry = SettingsChange(version=version, at=time.time(), changed=differing,
                               previous={k: getattr(config, k) for k in differing}, note=note)
        new = msgspec.structs.replace(config, **differing, settings_version=version,
                                      settings_history=[*config.settings_history, entry])
        write_settings(conn, new)  # the output first: Redis may lose the change, the output keeps it
        return new

    return ledger_jobs.change_config(conn, job, change)


def write_settings(conn: redis.Redis, config: JobConfig) -> None:
    """OUTPUT/JOB/job.json with `config` (its inputs and reserved batch numbers kept), replaced whole;
    Refused where the output cannot be written from here."""
    store = open_store(config.output, config.s3_endpoint_url)
    try:
        record = truth.read_job(store, config.name)
        if record is None or record.config.incarnation != config.incarnation:  # an output of a genq without job.json
            record = JobRecord(config=config, reserved=ledger_jobs.last_batch_number(conn, config.name))
        truth.write_job(store, msgspec.structs.replace(record, config=config))
    except redis.RedisError:
        raise
    except Exception as exc:  # OSError, botocore's errors: the output is unreachable from here
        raise Refused(f"cannot write {truth.job_uri(store, config.name)} ({type(exc).__name__}: {exc}): the "
                      "job's settings are kept there first, so nothing was changed; run this where the "
                      "output is reachable") from None


def settings_from_output(conn: redis.Redis, config: JobConfig, on_disk: JobConfig | None) -> None:
    """Redis's and job.json's settings brought to the latest of the two (same life of the job): Redis
    restored from a snapshot, or failed over to a lagging replica, may have lost a `jobs set` that
    job.json keeps; an output written before job.json carried settings is brought up to Redis."""
    if on_disk is None or on_disk.incarnation != config.incarnation or on_disk.settings_version == config.settings_version:
        return
    if on_disk.settings_version < config.settings_version:
        write_settings(conn, config)
        return

    def take(stored: JobConfig | None) -> JobConfig:
        if stored is None or stored.incarnation != on_disk.incarnation or stored.settings_version >= on_disk.settings_version:
            raise _Current
        return msgspec.structs.replace(stored, **{k: getattr(on_disk, k) for k in SETTABLE},
                                       settings_version=on_disk.settings_version,
                                       settings_history=on_disk.settings_history)

    with contextlib.suppress(_Current):
        ledger_jobs.change_config(conn, config.name, take)


class _Current(Exception):
    """Redis has the latest settings already (or lost the job meanwhile): nothing to store."""


def blocked_jobs(conn: redis.Redis) -> list[str]:
    names = list_jobs(conn)
    return sorted(job for job, now in zip(names, ledger_jobs.jobs_now(conn, names)) if now.blocked)


def describe_block(job: str, block: JobBlock) -> str:
    """One paragraph for `genq jobs`, `genq jobs show` and the monitor."""
    if block.reason == "preflight":
        why = f"preflight by {block.worker}"  # its message names the settings version
    else:
        why = (f"brake on {block.worker}: {block.failures} of its last {block.outcomes} requests failed the same "
               f"way across {block.prompts} prompts (settings version {block.settings_version}"
               f"{f', HTTP {block.status}' if block.status else ''})")
    return (f"job {job} is blocked ({why}): {block.message} -- its prompts stay queued; fix the settings "
            f"(genq jobs set {job} ...), then genq resume --job {job}")
