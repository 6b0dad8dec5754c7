"""A job's status: one vocabulary and one rule for every view (`genq jobs`, the monitor,
its JSON, Prometheus and the web page)."""

from __future__ import annotations

from typing import Literal, get_args

JobStatus = Literal["empty", "queued", "running", "paused", "blocked", "writing", "partial", "done"]
JOB_STATUSES: tuple[JobStatus, ...] = get_args(JobStatus)
# Nothing more will happen without an operator: `genq monitor --until-done` stops at these.
FINISHED_STATUSES: tuple[JobStatus, ...] = ("partial", "done")


def job_status(*, total: int, finished: int, batches: int, batches_done: int, paused: bool,
               started: bool, failed: int = 0, blocked: bool = False) -> JobStatus:
    """finished = results + dead letters (failed of them); started = anything finished, in
    flight or held.

    "done" only once every batch's shard is written (a script that exports on "done" gets
    every batch) and no prompt failed: a job with dead letters ends "partial" (see `genq dlq`),
    never "done". "writing" while the last shards are written. "blocked": its settings failed
    against the server (the preflight or the brake, docs/settings.md); its prompts wait.
    """
    if total == 0:
        return "empty"
    if blocked:
        return "blocked"
    if finished >= total:
        if batches_done < batches:
            return "writing"
        return "partial" if failed else "done"
    if paused:
        return "paused"
    return "running" if started else "queued"
