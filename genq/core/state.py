"""A job's status: one vocabulary and one rule for every view (`genq jobs`, the monitor,
its JSON, Prometheus and the web page)."""

from __future__ import annotations

from typing import Literal

JobStatus = Literal["empty", "queued", "running", "paused", "writing", "done"]
JOB_STATUSES: tuple[JobStatus, ...] = ("empty", "queued", "running", "paused", "writing", "done")


def job_status(*, total: int, finished: int, batches: int, batches_done: int, paused: bool,
               started: bool) -> JobStatus:
    """finished = results + dead letters; started = anything finished, in flight or held.

    "done" only once every batch's shard is written (a script that exports on "done" gets
    every batch); "writing" while the last shards are written.
    """
    if total == 0:
        return "empty"
    if finished >= total:
        return "done" if batches_done >= batches else "writing"
    if paused:
        return "paused"
    return "running" if started else "queued"
