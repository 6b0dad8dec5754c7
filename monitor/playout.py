"""The event simulation under the ETA: a fleet playing the rest of a job, request by request.

Each worker leases batches from one shared queue and holds a batch until all its prompts are
finished; it keeps up to `slots` requests decoding from what it holds and takes more batches
following genq worker's prefetch policy (WorkerState). monitor/simulate.py draws the lengths
and the speed and reads the finish times this plays.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass

YIELD_EVERY = 256  # events play() plays between yields (a monitor refresh's unit of work)


@dataclass(frozen=True)
class WorkerState:
    """One live worker as the simulation sees it (from its WorkerStatus and InFlight).

    Batch-taking policy (genq worker's): it holds at least `leases` batches
    while the queue lasts, and takes one more whenever its unsent prompts fall
    below `reserve` and it holds fewer than `max_leases` (None: = leases, a
    worker that only takes a batch when a held one is complete). A batch is
    held until all its prompts are finished.
    """

    slots: int  # requests it decodes at once: in-flight target, at most the server's capacity
    leases: int  # batches it holds at least (genq worker --prefetch)
    running: tuple[int, ...] = ()  # tokens so far of its running requests for the job
    ready: int = 0  # prompts of the job it holds but has not sent yet
    held: int = 0  # batches of the job it holds now
    # Unfinished prompts of each held batch, oldest batch first, when known
    # (batch size minus results stored): which batch frees a lease when.
    held_unfinished: tuple[int, ...] = ()
    max_leases: int | None = None
    reserve: int = 0


def play(starts: list[tuple[WorkerState, list[float], list[float]]], batches: list[list[float]],
         marks: list[tuple[float, float]] | None = None,
         shape: tuple[float, float] | None = None, prefill: float = 0.0) -> Generator[int, None, float]:
    """Event simulation of the fleet from now until the last request finishes.

    starts: per worker, its state, the remaining tokens of its running
    requests and the lengths of the prompts it holds unsent. batches: the
    queue, in order. Time is in token units. Returns the finish time; marks,
    when given, gets (time, tokens made so far) at each batch completion.

    shape (Speed.shape): a worker's requests all decode at the speed its count
    running allows, (overhead + decoding) / (overhead + d) times the measured one,
    so each worker keeps a clock of tokens made per running request ("progress"):
    a request ends when its worker's progress has grown by its length. None: every
    request at the measured speed, progress is time.

    prefill (with a shape only): the time, in token units, for which each request a worker
    starts holds up that worker's decoding (its prompt's prefill runs in the same steps).
    """
    heap: list[tuple[float, int]] = []  # (time of the worker's next finish, worker)
    doing: list[list[tuple[float, int, float]]] = []  # per worker: (progress at its end, batch, tokens)
    progress: list[float] = []  # per worker: its progress at its last event
    stalled: list[float] = []  # per worker: until when the prefills of the requests it started hold it up
    left: list[int] = []  # unfinished prompts per batch
    ready: list[deque] = []  # per worker: (batch, length) waiting for a slot
    free: list[int] = []  # per worker: free slots
    held: list[int] = []  # per worker: batches held
    policy: list[tuple[int, int, int]] = []  # per worker: (leases, max leases, reserve)
    slots = max((max(1, w.slots) for w, _, _ in starts), default=1)
    gain = None if shape is None else [1.0] + [(shape[0] + shape[1]) / (shape[0] + d) for d in range(1, slots + 1)]
    queue_pos = 0
    for w, running, unsent in starts:
        counts = list(w.held_unfinished)
        n_held = len(counts) or max(w.held, 1 if running or unsent else 0)
        ids = list(range(len(left), len(left) + n_held))
        left.extend([0] * n_held)
        # Prompts go out in order (FIFO over held batches), so the requests that have
        # run longest belong to the oldest batches, and unsent ones to the newest.
        order = [(r, True) for r in sorted(running, reverse=True)] + [(x, False) for x in unsent]
        if counts:
            owner = []
            for bid, n in zip(ids, counts):
                owner.extend([bid] * n)
        else:  # counts unknown: split the running ones evenly, unsent to the newest
            per = -(-len(running) // n_held) if n_held else 0
            owner = [ids[min(i // per, n_held - 1)] for i in range(len(running))] if per else []
        q: deque = deque()
        mine: list[tuple[float, int, float]] = []
        n_free = max(1, w.slots)
        for i, (x, is_running) in enumerate(order):
            bid = owner[i] if i < len(owner) else ids[-1]
            left[bid] += 1
            if is_running and n_free > 0:
                heapq.heappush(mine, (x, bid, x))
                n_free -= 1
            else:
                q.append((bid, x))
        doing.append(mine)
        progress.append(0.0)
        stalled.append(0.0)
        ready.append(q)
        free.append(n_free)
        # A held batch with nothing left is written and released now.
        held.append(sum(1 for bid in ids if left[bid] > 0))
        policy.append((max(1, w.leases), max(w.leases, w.max_leases or w.leases), w.reserve))
    now = 0.0

    def take(wi: int) -> None:
        nonlocal queue_pos
        leases, max_leases, reserve = policy[wi]
        q = ready[wi]
        while queue_pos < len(batches) and (
                held[wi] < leases or (held[wi] < max_leases and len(q) < reserve)):
            lengths = batches[queue_pos]
            queue_pos += 1
            if not lengths:
                continue
            bid = len(left)
            left.append(len(lengths))
            held[wi] += 1
            q.extend((bid, x) for x in lengths)

    def fill(wi: int) -> None:
        q = ready[wi]
        mine = doing[wi]
        at = progress[wi]
        while free[wi] > 0 and q:
            bid, length = q.popleft()
            heapq.heappush(mine, (at + length, bid, length))
            free[wi] -= 1
            if prefill:
                stalled[wi] = max(stalled[wi], now) + prefill
            if len(q) < policy[wi][2]:
                take(wi)

    def schedule(wi: int) -> None:
        mine = doing[wi]
        if mine:
            end = mine[0][0]
            heapq.heappush(heap, (end if gain is None else max(now, stalled[wi]) + (end - progress[wi]) / gain[len(mine)], wi))

    for wi in range(len(starts)):
        take(wi)
        fill(wi)
        schedule(wi)
    finished = 0.0
    played = 0
    while heap:
        played += 1
        if played == YIELD_EVERY:
            yield played
            played = 0
        now, wi = heapq.heappop(heap)
        progress[wi], bid, tokens = heapq.heappop(doing[wi])
        finished += tokens
        free[wi] += 1
        left[bid] -= 1
        if left[bid] == 0:
            held[wi] -= 1
            if marks is not None:
                # Tokens made, not finished: those lag while the running ones build up from the empty
                # start (#27: 128 slots, batches of 50 read a steady rate of 122 for 128).
                mine = doing[wi]
                made = finished + progress[wi] * len(mine) - sum(end - x for end, _, x in mine)
                marks.append((now, made))
            take(wi)
        fill(wi)
        schedule(wi)
    yield played
    return now
