"""The rest of a job, played through genq's scheduling: Monte-Carlo finish times.

Each draw takes the length parameters and the speed from their uncertainty and plays the
fleet out (monitor/playout.py): slots can sit idle behind a batch's long tail, and the end
of a job drains at its own pace; a model of "slots x speed" gets both wrong. Time is
counted in token units (one request making one token) and divided by the measured
per-request speed at the end.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass, replace

from genq.monitor.lengths import LengthModel
from genq.monitor.playout import WorkerState, play

# What one prompt token of a prefill costs a server's step, over what one decoding sequence
# costs it (Speed.prefill). Measured on vLLM on CPU from its own counters, the drain's token rate
# over the bulk's, per prompt token the bulk processed: 0.30 to 0.99, median 0.56, in nine jobs
# (2026-12-05, docs/vllm.md). A decoding sequence costs more than a token of compute: its
# sampling and its output.
PREFILL_COST = 0.5


@dataclass(frozen=True)
class Speed:
    """Decode speed as measured over a recent window."""

    per_request: float  # output tokens/s of one decoding request
    rel_se: float  # relative standard error of per_request
    span_s: float  # length of the window
    samples: int
    tokens_per_s: float = 0.0  # the job's measured output tokens/s (shown, not used)
    source: str = ""
    # How one request's speed depends on d, the requests decoding at once on its worker's
    # server: a step costs in proportion to (overhead + d) (monitor/speedcurve.py fits it
    # from the workers' figures), and per_request was measured at about `decoding` per
    # worker. None: the same speed at any d (a GPU's memory-bound decode).
    overhead: float | None = None
    decoding: float = 0.0
    prompt_tokens: float = 0.0  # what a request's prefill processes: the job's mean prompt tokens
    running: float = 0.0

    def shape(self) -> tuple[float, float] | None:
        """(overhead, decoding) when the speed depends on d, else None."""
        if self.overhead is None or self.decoding <= 0:
            return None
        return (self.overhead, self.decoding)

    def prefill(self) -> float:
        """How long, in token units, a request's start holds up its server's decoding.

        Where a step's cost grows with what it processes (shape), a new request's prompt tokens
        are processed in the decoding requests' steps: while a server admits, its requests
        decode slower than once it has nothing left to start (vLLM on CPU, 19-token prompts
        and 84-token answers: 690-720 tok/s in a job's bulk, 750-860 in its drain, #27).
        0 where the speed does not depend on d: a GPU's decode step hardly notices a prefill of
        a few tokens beside it."""
        shape = self.shape()
        if shape is None or self.prompt_tokens <= 0:
            return 0.0
        return PREFILL_COST * self.prompt_tokens / (shape[0] + shape[1])

    def decoding_alone(self, mean_tokens: float) -> float:
        """Requests decode this many times per_request (measured while the server admitted one
        new request for every answer of mean_tokens) once nothing is started beside them."""
        return 1.0 + self.prefill() * self.decoding / max(mean_tokens, 1.0)


def _policy(w: WorkerState, b: int) -> tuple[int, int, int, int]:
    """(slots, leases, max leases, reserve) key of a worker's batch-taking behaviour."""
    return (max(1, w.slots), max(1, w.leases), max(w.leases, w.max_leases or w.leases), w.reserve)


# How many batches per worker at the end of the queue the event simulation plays
# out in full; earlier batches go through at the simulated steady rate of the
# fleet (a job of 654,676 prompts is not replayed prompt by prompt on every refresh).
TAIL_BATCHES_PER_WORKER = 3
# Workers whose end of the job is played out; in a larger fleet a spread-out
# sample of them takes a proportional share of the last batches, and the rest
# of the fleet's work goes into the bulk. (The finish of the slowest of 8 is a
# little earlier than that of the slowest of 64: a small optimism, for speed.)
MAX_SIM_WORKERS = 8
# Fewer queued prompts than this are all played out: a cached steady rate costs a few of
# its batches per new length parameter, more than playing a small queue itself.
TAIL_MIN = 512
STEADY_BATCHES = 10  # batches one worker plays at least, to measure its steady rate
MIN_SAMPLES = 20


@dataclass(frozen=True)
class Plan:
    """What every draw of one estimate shares: who is played out, the tail, the bulk."""

    model: LengthModel
    played: tuple[WorkerState, ...]  # workers whose end of the job is played event by event
    others: tuple[WorkerState, ...]  # the rest of a large fleet: their work goes into the bulk
    kinds: tuple[tuple[int, int, int, int], ...]  # the fleet's batch-taking policies (_policy)
    rate_weights: tuple[int, ...]  # workers of each kind
    others_running: tuple[int, ...]  # their running requests' tokens so far
    tail: int  # the played workers' share of the last batches of the queue
    bulk: int  # queued prompts before the tail: they go through at the steady rate
    batch_size: int
    speed: Speed
    samples: int  # draws of one estimate
    events: int  # events one draw plays, about (the budget's unit)


def plan(model: LengthModel, fleet: Sequence[WorkerState], queue: int, batch_size: int, speed: Speed, *,
         samples: int = 100, max_events: int = 300_000) -> Plan:
    b = max(1, batch_size)
    states = list(fleet)
    if len(states) > MAX_SIM_WORKERS:
        picks = sorted({round(i * (len(states) - 1) / (MAX_SIM_WORKERS - 1)) for i in range(MAX_SIM_WORKERS)})
        played = [states[i] for i in picks]
        others = [w for i, w in enumerate(states) if i not in set(picks)]
    else:
        played, others = states, []
    share = len(played) / len(states)
    tail_all = min(queue, max(b * TAIL_BATCHES_PER_WORKER * len(states), TAIL_MIN))
    tail = round(tail_all * share)
    bulk = queue - tail_all
    counts = Counter(_policy(w, b) for w in states)
    kinds = tuple(sorted(counts))
    events = tail + sum(len(w.running) + w.ready for w in played)
    if bulk or others:
        events += sum(_steady_batches(k) for k in kinds) * b
    samples = max(MIN_SAMPLES, min(samples, max_events // max(events, 1)))
    if bulk or others:  # the steady rates are cached (_cached_rate): most draws skip their events
        events -= sum(_steady_batches(k) for k in kinds) * b
    others_running = tuple(t for w in others for t in w.running)
    return Plan(model, tuple(played), tuple(others), kinds, tuple(counts[k] for k in kinds), others_running,
                tail, bulk, b, speed, samples, max(events, 1))


def simulate_remaining(
    model: LengthModel,
    fleet: Sequence[WorkerState],
    queue: int,
    batch_size: int,
    speed: Speed,
    *,
    samples: int = 100,
    seed: int = 1,
    max_events: int = 300_000,
) -> list[float]:
    """Monte-Carlo finish times (seconds from now) of the rest of the job, played through
    genq's scheduling (WorkerState; the module's docstring says why). Each draw takes the
    length parameters from the fit's uncertainty and the speed from its standard error. When
    many prompts remain, all but the last few batches per worker go through at the simulated
    steady rate of the fleet."""
    p = plan(model, fleet, queue, batch_size, speed, samples=samples, max_events=max_events)
    rng = random.Random(seed)  # fixed: the same data give the same answer on every refresh
    return [run(draw(p, rng)) for _ in range(p.samples)]


def run(steps: Generator[int, None, float]) -> float:
    """A draw (or any of its parts) played to the end at once."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def draw(p: Plan, rng: random.Random) -> Generator[int, None, float]:
    """One draw of an estimate, the next from rng: yields the events played every so often
    (so a live monitor can spread draws over its refreshes, monitor/etapool.py), returns the
    finish time in seconds."""
    m = p.model.with_params(*p.model.draw_params(rng))
    rel_se = max(p.speed.rel_se, 0.0)
    speed_draw = p.speed.per_request * math.exp(rng.gauss(0.0, rel_se) - rel_se * rel_se / 2)
    bulk_time = 0.0  # in token units (time for one request to make one token)
    if p.bulk or p.others:
        mean = m.mean()
        var = max(0.0, m.second_moment() - mean * mean)
        bulk_tokens = max(0.0, rng.gauss(p.bulk * mean, math.sqrt(p.bulk * var))) if p.bulk else 0.0
        # What the workers not played out hold goes through with the bulk: its expectation
        # under this draw's parameters (thousands of requests: their sum hardly varies).
        bulk_tokens += m.remaining_tokens(sum(w.ready for w in p.others), p.others_running)
        yield len(p.others_running) // 8
        fleet_rate = 0.0
        for kind, n in zip(p.kinds, p.rate_weights):
            fleet_rate += n * (yield from _cached_rate(m, kind, p.batch_size, p.speed.shape(), p.speed.prefill()))
        bulk_time = bulk_tokens / fleet_rate
    tail_lengths = m.draw(rng, p.tail)
    batches = [tail_lengths[i:i + p.batch_size] for i in range(0, p.tail, p.batch_size)]
    starts = [(w, m.draw_remaining(rng, w.running), m.draw(rng, w.ready)) for w in p.played]
    ended = yield from play(starts, batches, shape=p.speed.shape(), prefill=p.speed.prefill())
    return (bulk_time + ended) / (speed_draw * p.speed.decoding_alone(m.mean()))


def calibrate(speed: Speed, model: LengthModel, fleet: Sequence[WorkerState], batch_size: int,
              seed: int, reps: int = 5) -> Speed:
    """Per-request speed that makes the simulated fleet produce the measured tokens/s."""
    rng = random.Random(seed)
    b = max(1, batch_size)
    kinds = {_policy(w, b) for w in fleet}
    shape = speed.shape()
    rates = {k: sum(run(_steady_rate(model, rng, k, b, shape)) for _ in range(reps)) / reps for k in kinds}
    fleet_rate = sum(rates[_policy(w, b)] for w in fleet)  # tokens per token-time
    return replace(speed, per_request=speed.tokens_per_s / fleet_rate)


def _steady_batches(kind: tuple[int, int, int, int]) -> int:
    _, leases, max_leases, _ = kind
    return max(STEADY_BATCHES, leases + max_leases + 6)


# The steady rate depends on the shape of the length distribution (sigma, and mu
# only through the cap): a draw's parameters are rounded to these steps and the
# rate at the rounded ones is kept, measured over RATE_REPS times the batches
# one draw used to play. Draws then cost their tail, not a fresh steady run each.
RATE_MU_STEP = 0.05
RATE_SIGMA_STEP = 0.02
RATE_REPS = 3
_RATES: dict[tuple, float] = {}
MAX_RATES = 4096


def _cached_rate(m: LengthModel, kind: tuple[int, int, int, int], b: int,
                 shape: tuple[float, float] | None = None, prefill: float = 0.0) -> Generator[int, None, float]:
    key = (kind, b, round(m.mu / RATE_MU_STEP), round(m.sigma / RATE_SIGMA_STEP), m.cap, _shape_key(shape, prefill))
    rate = _RATES.get(key)
    if rate is None:
        at = LengthModel(mu=key[2] * RATE_MU_STEP, sigma=max(key[3] * RATE_SIGMA_STEP, 1e-3), cap=m.cap)
        rng = random.Random(repr(key))  # the key alone decides the value: no history in it
        rate = 0.0
        for _ in range(RATE_REPS):
            rate += (yield from _steady_rate(at, rng, kind, b, *_shape_of(key[-1]))) / RATE_REPS
        if len(_RATES) >= MAX_RATES:
            _RATES.clear()
        _RATES[key] = rate
    return rate


# The speed's shape in a cached rate's key: the overhead to 5 % (or 1 when small), the
# reference count to the unit, a start's prefill to 1 % of a token (Speed.prefill).
def _shape_key(shape: tuple[float, float] | None, prefill: float) -> tuple[int, int, int] | None:
    if shape is None:
        return None
    overhead, decoding = shape
    return (round(math.log1p(overhead) / 0.05), round(decoding), round(prefill / 0.01))


def _shape_of(key: tuple[int, int, int] | None) -> tuple[tuple[float, float] | None, float]:
    return (None, 0.0) if key is None else ((math.expm1(key[0] * 0.05), float(key[1])), key[2] * 0.01)


def _steady_rate(m: LengthModel, rng: random.Random, kind: tuple[int, int, int, int],
                 b: int, shape: tuple[float, float] | None = None, prefill: float = 0.0) -> Generator[int, None, float]:
    """Tokens per token-time one worker sustains while the queue lasts (the bulk of a big job)."""
    slots, leases, max_leases, reserve = kind
    n = _steady_batches(kind)
    batches = [m.draw(rng, b) for _ in range(n)]
    marks: list[tuple[float, float]] = []  # (time, tokens made) at each batch completion
    w = WorkerState(slots=slots, leases=leases, max_leases=max_leases, reserve=reserve)
    end = yield from play([(w, [], [])], batches, marks, shape, prefill)
    # Skip the start (the worker begins empty) and stop before the drain at the end.
    i, j = max(leases, 2) - 1, n - max_leases - 1
    if 0 <= i < j < len(marks) and marks[j][0] > marks[i][0]:
        return (marks[j][1] - marks[i][1]) / (marks[j][0] - marks[i][0])
    return sum(sum(x) for x in batches) / max(end, 1e-9)
