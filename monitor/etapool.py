"""The live monitor's ETA within a fixed CPU budget a refresh (issue #29).

One estimate (monitor/eta.py) fits the output lengths and plays about a
hundred Monte-Carlo draws of the rest of the job: at a million prompts and a
fleet of 64 workers that is a few hundred thousand simulated events, 0.2-0.6 s
of CPU, and the live view refreshes twice a second per viewer. An EtaPool
keeps that work between the refreshes of one job instead: each refresh plays
at most `budget` units (one simulated event, or one likelihood term of the
fit; about a microsecond each) and resumes there at the next. What it keeps:

* the length fit, redone (spread over refreshes, starting from the last
  fit) whenever the finished histogram or the running requests have changed,
  REFIT_S apart at most often, or at once when the finished completions have
  grown REFIT_GROWTH-fold since the last fit: the first fit (MIN_FINISHED, the
  earliest and shortest completions) is soon outdated, and on a job of a few
  minutes REFIT_S alone kept it from 10 % to 28 % done (#27: the ETA 22-39 %
  low at 25 %). The draws use the last finished fit;
* the last draw of each of the estimate's `samples` slots: its seconds to go
  and the output tokens expected to be left (Estimate.remaining_tokens) when it
  was made. It is read as seconds per token of work left, times the work left
  now (Kept.to_go). Each cycle through the slots is one run of the random stream
  `estimate()` uses (Random(seed)), so on unchanging data a full pool holds
  exactly the one-shot estimate's draws.

The ETA is read from the slots filled within MAX_AGE_S; until MIN_DRAWS are,
there is none ("warming up"), and until then a refresh may play WARM_BUDGET
units rather than `budget`, within WARM_CPU_S of CPU (so that a refresh still costs
about 10 ms at a million prompts, #29): on a fast server a draw costs a few thousand units
(the bulk's steady rate is measured afresh for each new length parameter), and
at `budget` alone a job of 8,000 prompts that took 61 s on an H200 showed no ETA
at 25, 50 or 75 % (#27: about 0.3 draws a refresh, 20 needed). The warm-up is a
few refreshes, after the start and after each change of fleet. A fit whose mean length differs by more than
STALE_MEAN from the one the draws were made with makes them stale: once
MIN_DRAWS slots hold draws of the new fit, only those are read (before, the
old draws stayed until their slot came round again, a whole cycle). A change in what the simulation is of (the
number of workers, their batch-taking policies, the batch size) empties the
pool: draws of another fleet are not this one's. The cost of all this: the
draws are up to one cycle through the slots old (a few seconds at a fleet of
8, a minute at 64 with a million prompts left; half a minute in a vLLM job of
80 s), so a change of speed or of the lengths' shape shows in the ETA over
that time rather than at the next refresh; the work left, which moves most,
shows at once.
"""

from __future__ import annotations

import random
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from genq.monitor.lengths import LengthData, LengthModel, fit_steps
from genq.monitor.playout import WorkerState
from genq.monitor.simulate import MIN_SAMPLES, Plan, Speed, draw, plan

BUDGET = 2000  # units of work a refresh plays (simulated events, likelihood terms)
WARM_BUDGET = 15 * BUDGET  # ... while fewer than MIN_DRAWS current draws are held (no ETA yet)
WARM_CPU_S = 0.008  # ... and then for at most this much CPU a refresh
REFIT_S = 5.0  # a new length fit starts at most this often (it starts from the last one)
REFIT_GROWTH = 1.2  # ... unless the finished completions have grown this much since the last fit
STALE_MEAN = 0.05  # a fit whose mean length moved this much (relative) makes the draws before it stale
MAX_AGE_S = 300.0  # a draw older than this is not used
MIN_DRAWS = MIN_SAMPLES  # draws needed before an ETA is shown (the one-shot estimate's minimum too)


class Kept(NamedTuple):
    """A slot's last draw."""

    made_at: float
    seconds: float  # to go, as played from the state of the job at made_at
    generation: int  # of the fit it was drawn with
    work: float  # output tokens expected to be left at made_at (0: unknown)

    def to_go(self, now: float, work: float) -> float:
        """Its seconds to go now. It was played from the job as it was up to a cycle through the
        slots ago; since then the work left has changed, by the tokens made and by refits of the
        lengths (a fit 4 % high for a second kept the ETA 20 % high for the 30 s its draws lasted,
        #27). So its seconds per token of work left then are applied to the work left now. With
        either figure unknown: its finish time as made."""
        if work > 0 and self.work > 0:
            return self.seconds * work / self.work
        return self.made_at + self.seconds - now


@dataclass
class EtaPool:
    budget: int = BUDGET
    warm_budget: int = WARM_BUDGET
    warm_cpu_s: float = WARM_CPU_S
    deadline: float | None = None  # process_time() at which a warming refresh stops playing
    model: LengthModel | None = None
    fit_key: tuple | None = None  # the data of `model`
    fit_started: float = -1e18
    fit_finished: int = 0  # finished completions behind `model` (or the fit under way)
    generation: int = 0  # bumped when a fit makes the draws before it stale (STALE_MEAN)
    generation_mean: float = 0.0  # the mean length of the fit that started this generation
    fitting: Generator[int, None, LengthModel | None] | None = None
    fitting_key: tuple | None = None
    regime: tuple | None = None
    kept: dict[int, Kept] = field(default_factory=dict)  # slot -> its last draw
    next_slot: int = 0
    # (slot, made at, generation, work left then, draw)
    drawing: tuple[int, float, int, float, Generator[int, None, float]] | None = None
    rng: random.Random = field(default_factory=random.Random)  # this cycle's stream
    rounds: int = 0  # times round all the slots
    spent: int = 0  # units played at the last refresh (tests and benches read it)

    def fit(self, data: LengthData, now: float) -> tuple[LengthModel | None, int]:
        """The latest finished fit (None before the first) and units spent on fitting now."""
        key = (tuple(sorted(data.hist.items())), tuple(sorted(data.running)), data.cap)
        spent = 0
        finished = data.finished
        due = now - self.fit_started >= REFIT_S or finished >= REFIT_GROWTH * self.fit_finished
        if self.fitting is None and key != self.fit_key and due:
            self.fitting, self.fitting_key, self.fit_started = fit_steps(data, self.model), key, now
            self.fit_finished = finished
        # A refit shares the budget with the draws; the first fit takes all of it.
        self.deadline = None  # a new refresh: its CPU allowance starts once it warms up
        budget = self._budget(now)
        share, floor = (budget, self.budget) if self.model is None else (budget // 2, self.budget // 2)
        while self.fitting is not None and spent < share and not (spent >= floor and self._past_deadline()):
            try:
                spent += next(self.fitting)
            except StopIteration as done:
                self.model, self.fit_key, self.fitting = done.value, self.fitting_key, None
                self._new_generation()
        return self.model, spent

    def _new_generation(self) -> None:
        """A new generation of draws when the fit's mean length has moved by STALE_MEAN."""
        mean = self.model.mean() if self.model is not None else 0.0
        if self.generation and abs(mean - self.generation_mean) <= STALE_MEAN * self.generation_mean:
            return
        self.generation, self.generation_mean = self.generation + 1, mean
        self.drawing = None  # a draw half-played with the old fit is not finished

    def draws(self, model: LengthModel, fleet: Sequence[WorkerState], queue: int, batch_size: int, speed: Speed,
              *, now: float, spent: int, samples: int, seed: int, max_events: int, work: float = 0.0) -> list[float]:
        """Seconds to go of the slots filled recently, after playing what is left of the budget.
        work: the output tokens expected to be left now (Estimate.remaining_tokens); 0: unknown."""
        p = plan(model, fleet, queue, batch_size, speed, samples=samples, max_events=max_events)
        regime = (p.kinds, p.rate_weights, p.batch_size, p.samples)
        if regime != self.regime:
            self.regime, self.kept, self.drawing, self.next_slot = regime, {}, None, 0
        spent = self._play(p, now, spent, seed, self._budget(now), work)  # the fit may just have made them stale
        self.spent = spent
        recent = [(d.to_go(now, work), d.generation) for d in self.kept.values() if now - d.made_at <= MAX_AGE_S]
        current = [s for s, gen in recent if gen == self.generation]
        return sorted(current if len(current) >= MIN_DRAWS else [s for s, _ in recent])

    def _budget(self, now: float) -> int:
        """Units this refresh plays: `budget` once MIN_DRAWS current draws are held, else warm_budget,
        within warm_cpu_s of CPU from the moment this refresh found the pool warming."""
        current = sum(1 for d in self.kept.values() if d.generation == self.generation and now - d.made_at <= MAX_AGE_S)
        if current >= MIN_DRAWS:
            return self.budget
        if self.deadline is None:
            self.deadline = time.process_time() + self.warm_cpu_s
        return max(self.budget, self.warm_budget)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.process_time() >= self.deadline

    def _play(self, p: Plan, now: float, spent: int, seed: int, budget: int, work: float) -> int:
        while spent < budget and not (spent >= self.budget and self._past_deadline()):
            if self.drawing is None:
                slot = self.next_slot
                if slot == 0:  # each cycle through the slots is the one-shot estimate's random stream
                    self.rng = random.Random(seed)
                self.next_slot = (slot + 1) % p.samples
                self.drawing = (slot, now, self.generation, work, draw(p, self.rng))
            slot, made, gen, work_then, steps = self.drawing
            try:
                spent += max(1, next(steps))  # a draw of no events still costs its set-up
            except StopIteration as done:
                self.kept[slot] = Kept(made, done.value, gen, work_then)
                self.drawing = None
                self.rounds += slot == p.samples - 1
        return spent

