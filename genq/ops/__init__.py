"""What operators do to a running system: plain synchronous Redis (and output) reads and writes that
the CLI and the monitor's web page share; workers pick the changes up within about a second."""

from __future__ import annotations

import redis

from genq.core.queueing import list_jobs


class Refused(Exception):
    """What the operator asked cannot be done (an unknown job or id, a change that changes nothing):
    the message says why and what to do; the CLI prints it in one line and exits 1."""


def jobs_named(conn: redis.Redis, job: str | None) -> list[str]:
    """The jobs a command covers: the named one, which must exist, or (None) all of them."""
    known = list_jobs(conn)
    if job is None:
        return known
    if job not in known:
        raise Refused(f"no job named {job!r} (known jobs: {', '.join(known) or 'none'})")
    return [job]
