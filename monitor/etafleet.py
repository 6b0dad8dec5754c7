"""The fleet as the ETA simulation sees it: the workers that will work on a job from now on.

Each worker is played with genq worker's batch-taking policy (worker/loops.py RqLoops.desired, its
rule in genq.core.prefetch): it holds --prefetch batches (published in WorkerStatus.prefetch), and
takes one more, up to max_loops, while its unsent prompts are below the reserve.
"""

from __future__ import annotations

from genq.core.prefetch import max_loops, reserve
from genq.monitor.playout import WorkerState
from genq.monitor.snapshot import JobSnapshot


def fleet_of(snap: JobSnapshot) -> list[WorkerState]:
    """The workers that will work on this job from now on, as the ETA simulation sees them.

    Live workers holding the job's prompts, plus idle ones (the queue is
    shared: they take its next batches). Paused and server-down workers add
    nothing until they come back; a draining one only finishes what it holds.
    """
    size = snap.config.batch_size if snap.config else 256
    fleet = []
    for w in snap.workers:
        s = w.live_status
        if s is None:
            continue
        holds = w.inflight is not None and (w.inflight.tokens or w.inflight.queued or w.held_unfinished)
        if not holds and s.state not in ("idle", "busy", "starting"):
            continue
        if s.state in ("paused", "server_down"):
            continue
        draining = s.state == "draining"
        prefetch = s.prefetch
        leases = len(w.held_unfinished) if draining else prefetch
        fleet.append(WorkerState(
            slots=w.slots,
            leases=leases,
            max_leases=leases if draining else max_loops(leases),
            reserve=0 if draining else reserve(prefetch, size),
            running=tuple(w.running_tokens),
            ready=w.inflight.queued if w.inflight is not None else 0,
            held=len(w.held_unfinished),
            held_unfinished=tuple(w.held_unfinished),
        ))
    return fleet
