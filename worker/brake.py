"""The brake: a job whose requests keep failing the same way stops; its prompts wait.

A wrong setting (max_tokens over the context) fails every request of a job with the same 400;
dead-lettering them one by one would burn the whole job. So each engine keeps a job's last WINDOW
outcomes (a result, or a non-retryable failure under its signature: status and message with the
numbers blanked) and holds a failure back while its signature is most of the window. A full
window mostly one signature, from at least TRIP_PROMPTS prompts, trips: the job is blocked
(keys.job_blocked) and the held prompts stay unfinished for a resume. Otherwise held failures are
dead-lettered once other outcomes outnumber them, or after HOLD_S.

The preflight blocks a job whose settings can never fit before any of its requests is sent;
parking (worker/parking.py) is what every engine does with a blocked job. docs/settings.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from genq.core.records import JobBlock
from genq.worker.batches import ResultWriter
from genq.worker.held import Task
from genq.worker.server import Failure

log = logging.getLogger("genq.worker")

WINDOW = 24  # a job's recent outcomes on one engine that the brake looks at
TRIP_PROMPTS = 8  # different prompts failing the same way before a job is blocked
HOLD_S = 5.0  # longest a held failure waits for its verdict (the last prompts of a job)

_NUMBER = re.compile(r"\d+")


def signature(failure: Failure) -> str:
    """What makes two failures "the same answer": the status and the message, numbers aside."""
    return f"{failure.status} {_NUMBER.sub('N', failure.message)}"


@dataclass
class _Held:
    task: Task
    failure: Failure
    signature: str
    since: float


@dataclass
class JobWindow:
    """One job's recent outcomes on this engine: (signature, or None for a result; prompt id)."""

    outcomes: deque[tuple[str | None, str]] = field(default_factory=lambda: deque(maxlen=WINDOW))
    held: list[_Held] = field(default_factory=list)


class Brake:
    """Judges each job's outcomes on this engine; `writer.dead(task, failure)` dead-letters a prompt. A trip adds the job's block to `trips` and sets `tripped`: parking stores it and
    parks the job (worker/parking.py). The job counts as blocked here until `clear`."""

    def __init__(self, worker: str, writer: ResultWriter) -> None:
        self.worker = worker
        self.writer = writer
        self.windows: dict[str, JobWindow] = {}
        self.blocked: set[str] = set()  # jobs blocked as far as this engine knows
        self.trips: dict[str, JobBlock] = {}  # blocks tripped here, not yet taken by parking
        self.tripped = asyncio.Event()

    def succeeded(self, task: Task) -> None:
        job = task.batch.ref.job
        window = self.windows.get(job)
        if window is None:
            window = self.windows[job] = JobWindow()
        window.outcomes.append((None, task.prompt.id))
        if window.held:
            self.judge(job)

    def failed(self, task: Task, failure: Failure) -> bool:
        """A non-retryable failure: True if the brake takes it (held, or its job is blocked:
        the prompt stays unfinished), False to dead-letter it now."""
        job = task.batch.ref.job
        if job in self.blocked:
            return True  # the job's batches are being parked: this prompt waits with them
        if not task.batch.config.brake:
            return False  # `genq jobs set JOB --no-brake`: every failing prompt is its own
        window = self.windows.setdefault(job, JobWindow())
        sig = signature(failure)
        window.outcomes.append((sig, task.prompt.id))
        window.held.append(_Held(task, failure, sig, time.monotonic()))
        self.judge(job)
        return True

    def judge(self, job: str) -> None:
        """Trip, or let go of the held failures that are no longer most of the window."""
        window = self.windows.get(job)
        if window is None or job in self.blocked:
            return
        counts = Counter(sig for sig, _ in window.outcomes if sig is not None)
        n = len(window.outcomes)
        if counts:
            sig, failures = counts.most_common(1)[0]
            prompts = {pid for s, pid in window.outcomes if s == sig}
            if n >= WINDOW and len(prompts) >= TRIP_PROMPTS and 2 * failures > n:
                self._trip(job, window, sig, failures, n, len(prompts))
                return
        now = time.monotonic()
        keep = []
        for held in window.held:
            if 2 * counts.get(held.signature, 0) > n and now - held.since < HOLD_S:
                keep.append(held)
            else:
                self.writer.dead(held.task, held.failure)
        window.held = keep

    def judge_all(self) -> None:
        """Held failures past HOLD_S go to the dead-letter queue (called about once a second)."""
        for job in [j for j, w in self.windows.items() if w.held]:
            self.judge(job)

    def _trip(self, job: str, window: JobWindow, sig: str, failures: int, n: int, prompts: int) -> None:
        example = next(h for h in window.held if h.signature == sig)
        kept = len(window.held)
        window.held = []  # not dead-lettered: they stay unfinished, queued with the rest of the job
        self.blocked.add(job)
        record = JobBlock(reason="brake", message=example.failure.message, worker=self.worker, at=time.time(),
                          settings_version=example.task.batch.config.settings_version,
                          status=example.failure.status, failures=failures, outcomes=n, prompts=prompts)
        log.error("job %s blocked by the brake: %d of its last %d requests here failed the same way across %d "
                  "prompts (%s%s: %s); its prompts stay queued (%d held back from the dead-letter queue). "
                  "Fix the settings (genq jobs set %s ...), then genq resume --job %s",
                  job, failures, n, prompts, example.failure.kind,
                  f" {example.failure.status}" if example.failure.status else "", example.failure.message,
                  kept, job, job)
        self.trips[job] = record
        self.tripped.set()

    def clear(self, job: str) -> None:
        """The job runs again (resumed): its old outcomes are no evidence."""
        self.blocked.discard(job)
        self.reset(job)

    def reset(self, job: str) -> None:
        """New settings: outcomes under the old ones are no evidence."""
        window = self.windows.pop(job, None)
        if window is not None:
            for held in window.held:  # judged under the old settings: dead-lettered as they would have been
                self.writer.dead(held.task, held.failure)
