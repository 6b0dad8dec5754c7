"""The ETA estimator (monitor/eta.py) on synthetic data with a known answer.

No Redis here: the estimator is pure. The synthetic runs below are a plain
re-implementation of a genq worker's scheduling (batches leased from one queue,
held until all their prompts finish, a fixed number of decode slots), played
request by request, so the closed form is checked against a process it does not
model: it sees only what a monitor sees (lengths so far, the requests decoding).
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
import statistics
from collections import Counter
from dataclasses import dataclass, replace

import pytest

from genq.monitor.eta import (
    MIN_FINISHED,
    PREFILL_COST,
    LengthData,
    LengthModel,
    Speed,
    estimate,
    fit_lengths,
    length_bucket,
)

MEAN, SIGMA, CAP = 512.0, 1.2, 8192
MU = math.log(MEAN) - SIGMA**2 / 2
STEADY = Speed(per_request=1.0, rel_se=0.03, span_s=100.0, samples=100)  # time unit: one token


def lengths(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(CAP, int(round(rng.lognormvariate(MU, SIGMA))))) for _ in range(n)]


def hist_of(values: list[int]) -> dict[int, int]:
    return dict(Counter(length_bucket(v) for v in values))


@dataclass
class Snap:
    at: float  # simulated time of the snapshot
    hist: dict[int, int]
    done: int
    out_tokens: int
    running: list[int]  # tokens so far
    ready: int
    held_unfinished: tuple[int, ...]
    remaining_tokens: int  # the truth: tokens still to generate
    busy: float  # requests decoding on average so far (what a monitor measures over its window)
    true_left: float = 0.0  # the truth: time until the last request finishes

    def speed(self, **kw) -> Speed:
        """What a monitor measures at this moment: one token a time unit a request."""
        return replace(STEADY, **{"running": self.busy, **kw})


def run_job(lens: list[int], *, slots: int = 37, batch: int = 64, leases: int = 2, max_leases: int | None = None,
            reserve: int = 0, at_done: tuple[float, ...] = (0.05,)) -> list[Snap]:
    """Play a job through one worker; snapshot when these fractions are done. One token per time unit."""
    max_leases = max_leases or leases
    batches = [list(range(i, min(len(lens), i + batch))) for i in range(0, len(lens), batch)]
    queue_pos, held, ready = 0, [], []
    running: dict[int, float] = {}
    heap: list[tuple[float, int]] = []
    now, done = 0.0, []
    snaps: list[Snap] = []
    marks = list(at_done)
    area = [(0.0, 0.0)]  # (time, request-time decoding so far)

    def busy_over(window: float) -> float:
        t0 = max(0.0, now - window)
        i = bisect.bisect_right(area, (t0, math.inf)) - 1
        (ta, a), (tb, b) = area[i], area[min(i + 1, len(area) - 1)]
        at_t0 = a if tb <= ta else a + (b - a) * (t0 - ta) / (tb - ta)
        return (area[-1][1] - at_t0) / max(now - t0, 1e-9)

    def take() -> None:
        nonlocal queue_pos
        while queue_pos < len(batches) and (len(held) < leases or (len(held) < max_leases and len(ready) < reserve)):
            held.append(set(batches[queue_pos]))
            ready.extend(batches[queue_pos])
            queue_pos += 1

    def fill() -> None:
        while len(running) < slots and ready:
            i = ready.pop(0)
            running[i] = now
            heapq.heappush(heap, (now + lens[i], i))
            take()

    take()
    fill()
    while heap:
        if marks and len(done) >= marks[0] * len(lens):
            marks.pop(0)
            so_far = {i: int(now - start) for i, start in running.items()}
            unstarted = [i for i in range(len(lens)) if i not in running and i not in set(done)]
            snaps.append(Snap(
                at=now, hist=hist_of([lens[i] for i in done]), done=len(done),
                out_tokens=sum(lens[i] for i in done), running=list(so_far.values()), ready=len(ready),
                held_unfinished=tuple(len(h) for h in sorted(held, key=min)),
                remaining_tokens=sum(lens[i] for i in unstarted) + sum(lens[i] - t for i, t in so_far.items()),
                busy=busy_over(now),
            ))
        at, i = heapq.heappop(heap)
        area.append((at, area[-1][1] + len(running) * (at - now)))
        now = at
        del running[i]
        done.append(i)
        for h in held:
            if i in h:
                h.discard(i)
                if not h:
                    held.remove(h)
                break
        take()
        fill()
    for s in snaps:
        s.true_left = now - s.at
    return snaps


def inputs(s: Snap, total: int, **speed) -> dict:
    """estimate()'s inputs at a snapshot of one worker: what the monitor reads."""
    return dict(total=total, completed=s.done, failed=0, lengths=LengthData(hist=s.hist, running=s.running, cap=CAP),
                speed=s.speed(**speed), workers=1, unsent=s.ready)


# ---------------------------------------------------------------- the length model


def test_fit_recovers_lognormal_from_the_histogram() -> None:
    values = lengths(4000, seed=3)
    model = fit_lengths(LengthData(hist=hist_of(values), running=[], cap=CAP))
    assert model is not None
    assert model.mu == pytest.approx(MU, abs=0.06)
    assert model.sigma == pytest.approx(SIGMA, abs=0.05)
    assert model.mean() == pytest.approx(statistics.mean(values), rel=0.06)


def test_conditional_mean_matches_draws() -> None:
    model = LengthModel(mu=MU, sigma=SIGMA, cap=CAP)
    rng = random.Random(5)
    draws = [min(math.exp(rng.gauss(MU, SIGMA)) - 1, CAP) for _ in range(200_000)]
    for t in (0, 300, 2000, 6000):
        tail = [x for x in draws if x >= t]
        assert model.conditional_mean(t) == pytest.approx(statistics.mean(tail), rel=0.03), t
    assert model.conditional_mean(CAP) == CAP  # at the cap nothing more comes
    assert model.second_moment() == pytest.approx(statistics.mean(x * x for x in draws), rel=0.05)


def test_remaining_tokens_on_the_grid_match_the_exact_sum() -> None:
    model = LengthModel(mu=MU, sigma=SIGMA, cap=CAP)
    running = [random.Random(i).randint(0, 6000) for i in range(3000)]
    exact = sum(max(0.0, model.conditional_mean(t) - t) for t in running)
    assert model.remaining_tokens(0, running) == pytest.approx(exact, rel=0.01)


def test_running_requests_correct_the_short_bias() -> None:
    """At 5% done the finished ones are the short ones: the running (censored) ones fix that."""
    truth = LengthModel(mu=MU, sigma=SIGMA, cap=CAP)
    ours, naives, finished_only = [], [], []
    for seed in range(11, 19):
        lens = lengths(3000, seed=seed)
        (s,) = run_job(lens, at_done=(0.05,), leases=2, max_leases=16, reserve=64)
        unstarted = len(lens) - s.done - len(s.running)
        # The expected remainder under the true distribution: no luck of the draw in it.
        expected = truth.remaining_tokens(unstarted, s.running)
        model = fit_lengths(LengthData(hist=s.hist, running=s.running, cap=CAP))
        alone = fit_lengths(LengthData(hist=s.hist, running=[], cap=CAP))
        ours.append(model.remaining_tokens(unstarted, s.running) / expected)
        naives.append((len(lens) - s.done) * s.out_tokens / s.done / expected)  # the old monitor's figure
        finished_only.append(alone.remaining_tokens(unstarted, s.running) / expected)
    assert 0.9 < statistics.median(ours) < 1.1, ours
    assert all(0.75 < r < 1.3 for r in ours), ours
    assert statistics.median(naives) < 0.65, naives  # far too low
    assert statistics.median(finished_only) < 0.7, finished_only  # a fit without the running ones too
    assert all(abs(o - 1) < abs(n - 1) for o, n in zip(ours, naives)), (ours, naives)


# ---------------------------------------------------------------- remaining time


@pytest.mark.parametrize("policy,at_done", [
    # A worker that takes a batch only when one is complete (genq's while it drains) leaves slots
    # idle behind batches' tails: the ETA knows once the measured speed has seen a few of them.
    ({"leases": 2}, (0.5,)),
    ({"leases": 2, "max_leases": 16, "reserve": 64}, (0.10, 0.5)),  # genq worker's adaptive prefetch
])
def test_eta_range_covers_the_true_finish(policy: dict, at_done: tuple[float, ...]) -> None:
    inside, ratios = 0, []
    for seed in range(20, 28):
        lens = lengths(1000, seed)
        for s in run_job(lens, at_done=at_done, **policy):
            e = estimate(**inputs(s, 1000))
            assert e.state in ("estimating", "steady") and e.eta_low_s <= e.eta_s <= e.eta_high_s
            inside += e.eta_low_s <= s.true_left <= e.eta_high_s
            ratios.append(e.eta_s / s.true_left)
    assert inside >= 0.75 * len(ratios), ratios  # a 90% range; heavy tails make single runs wild
    assert 0.9 < statistics.median(ratios) < 1.1, ratios


def test_the_eta_is_within_10_percent_from_5_percent_done() -> None:
    """The closed form against jobs played request by request (3,000 prompts, 37 slots, genq
    worker's prefetch): the median over 8 jobs within 10 % of the truth at 5, 25, 50, 75 and 95 %
    done (single jobs vary with their longest answers, which no estimate can know)."""
    at = (0.05, 0.25, 0.5, 0.75, 0.95)
    ratios: dict[float, list[float]] = {x: [] for x in at}
    for seed in range(11, 19):
        for x, s in zip(at, run_job(lengths(3000, seed), at_done=at, leases=2, max_leases=16, reserve=64)):
            ratios[x].append(estimate(**inputs(s, 3000)).eta_s / s.true_left)
    medians = {x: statistics.median(r) for x, r in ratios.items()}
    assert all(0.9 < m < 1.1 for m in medians.values()), medians


def test_scheduling_gates_throughput() -> None:
    """A worker that waits for a batch's tail before taking the next leaves slots idle: the
    requests decoding that a monitor measures say so, and the ETA follows the job's own pace
    (once a few tails have shown: a closed form cannot foresee them from the first batches)."""
    lens = lengths(2000, seed=9)
    (gated,) = run_job(lens, at_done=(0.5,), leases=2)
    (fast,) = run_job(lens, at_done=(0.5,), leases=2, max_leases=16, reserve=64)
    slow_eta, fast_eta = estimate(**inputs(gated, 2000)).eta_s, estimate(**inputs(fast, 2000)).eta_s
    assert gated.true_left > 1.2 * fast.true_left  # the policies differ enough for the test to fail
    assert slow_eta > 1.2 * fast_eta
    assert slow_eta == pytest.approx(gated.true_left, rel=0.25)
    assert fast_eta == pytest.approx(fast.true_left, rel=0.25)


def test_more_workers_finish_sooner() -> None:
    """A worker joining: twice the requests decoding, measured over the last seconds."""
    lens = lengths(2000, seed=4)
    (s,) = run_job(lens, at_done=(0.2,), leases=2, max_leases=16, reserve=64)
    one = estimate(**inputs(s, 2000))
    two = estimate(**dict(inputs(s, 2000, running=2 * s.busy), workers=2))
    assert two.eta_s < 0.75 * one.eta_s


def test_a_job_sharing_the_fleet_gets_the_eta_of_its_share() -> None:
    """Several jobs on one fleet (docs/scheduling.md): a job's speed is its own requests'
    decoding, so with half the fleet's requests its ETA is about twice as long."""
    lens = lengths(2000, seed=4)
    (s,) = run_job(lens, at_done=(0.2,), leases=2, max_leases=16, reserve=64)
    alone = estimate(**inputs(s, 2000))
    half = estimate(**inputs(s, 2000, running=s.busy / 2))
    assert 1.6 * alone.eta_s < half.eta_s < 2.4 * alone.eta_s, (alone.eta_s, half.eta_s)


# A compute-bound server (overhead 0: its step costs in proportion to what it processes, a
# prompt token of a prefill PREFILL_COST of a decoding sequence's next token): its 128 requests
# decoded at 1 token/s each while it admitted, for every answer, a prompt that cost a quarter
# of the answer's tokens: alone, they make 1.25 x 128 tokens/s.
ADMITTING = Speed(per_request=1.0, rel_se=0.03, span_s=100.0, samples=100, overhead=0.0, decoding=128.0,
                  running=128.0)


def test_a_compute_bound_server_drains_faster_than_it_ran_while_admitting() -> None:
    """vLLM on CPU: 19-token prompts, 84-token answers; the job's rate rose 9-20 % once nothing
    was left to start. Nothing is left to start here: the 128 running requests' tokens to go
    are made at 1.25 x the rate measured while admitting."""
    finished = lengths(400, seed=3)
    running = [t for t in lengths(128, seed=4)]
    data = LengthData(hist=hist_of(finished), running=running, cap=CAP)
    common = dict(total=528, completed=400, failed=0, lengths=data, workers=1)
    mean = fit_lengths(data).mean()
    alone = estimate(speed=replace(ADMITTING, prompt_tokens=mean / 4 / PREFILL_COST), **common)
    assert alone.remaining_tokens is not None
    assert alone.eta_s == pytest.approx(alone.remaining_tokens / (128 * 1.25), rel=0.05)
    # Without the prompts' size the drain is timed at the admitting rate: 25 % longer.
    unknown = estimate(speed=ADMITTING, **common)
    assert unknown.eta_s == pytest.approx(alone.remaining_tokens / 128, rel=0.05)
    # Where a request's speed does not depend on the count (a GPU's memory-bound decode), a
    # prefill beside the decoding does not count: the same ETA either way, and the drain is the
    # longest request's remainder at one request's speed, longer than the work over the fleet's rate.
    flat = replace(ADMITTING, overhead=None)
    gpu = estimate(speed=flat, **common)
    assert estimate(speed=replace(flat, prompt_tokens=mean / 4 / PREFILL_COST), **common).eta_s == gpu.eta_s
    assert gpu.eta_s > 2 * alone.remaining_tokens / 128


def test_the_bulk_of_a_job_runs_at_the_speed_measured_while_admitting() -> None:
    """The prefill's cost speeds up only what runs with nothing started beside it: 20,000 prompts
    still queued go through at the measured rate, whatever the prompts' size."""
    finished = lengths(400, seed=3)
    running = [min(t, 300) for t in lengths(128, seed=4)]
    data = LengthData(hist=hist_of(finished), running=running, cap=CAP)
    common = dict(total=20_528, completed=400, failed=0, lengths=data, workers=1)
    mean = fit_lengths(data).mean()
    with_prompts = estimate(speed=replace(ADMITTING, prompt_tokens=mean / 4 / PREFILL_COST), **common)
    without = estimate(speed=ADMITTING, **common)
    assert with_prompts.eta_s == pytest.approx(without.eta_s, rel=0.02)
    assert without.eta_s == pytest.approx(without.remaining_tokens / 128, rel=0.05)


# ---------------------------------------------------------------- states


def test_warming_up_paused_stalled_done() -> None:
    few = lengths(MIN_FINISHED - 1, seed=1)
    running = [10, 20]
    e = estimate(total=100, completed=len(few), failed=0,
                 lengths=LengthData(hist=hist_of(few), running=running, cap=CAP),
                 workers=1, speed=STEADY)
    assert e.state == "warming up" and e.eta_s is None and "finished completions" in e.note

    enough = lengths(200, seed=1)
    data = LengthData(hist=hist_of(enough), running=running, cap=CAP)
    short = Speed(per_request=1.0, rel_se=0.03, span_s=1.0, samples=2)
    e = estimate(total=1000, completed=200, failed=0, lengths=data, workers=1, speed=short)
    assert e.state == "warming up" and e.eta_s is None and "window" in e.note
    e = estimate(total=1000, completed=200, failed=0, lengths=data, workers=1, speed=None)
    assert e.state == "warming up" and e.eta_s is None

    e = estimate(total=1000, completed=200, failed=0, lengths=data, workers=1, speed=STEADY, paused=True)
    assert e.state == "paused" and e.eta_s is None
    e = estimate(total=1000, completed=200, failed=0, lengths=data, workers=0, speed=STEADY)
    assert e.state == "stalled" and e.eta_s is None

    e = estimate(total=200, completed=190, failed=10, lengths=data, workers=0, speed=None)
    assert e.state == "done" and e.eta_s == e.eta_low_s == e.eta_high_s == 0.0

    e = estimate(total=1000, completed=200, failed=0, lengths=data, workers=1, speed=STEADY)
    assert e.state in ("estimating", "steady") and 0 < e.eta_low_s <= e.eta_s <= e.eta_high_s


def test_the_eta_is_shown_at_the_first_refresh_after_5_percent_done() -> None:
    """On a loaded head node the simulation's ETA read "warming up" from 5 % to 93 % done of a
    job of 20,000 prompts on 8 workers: its draws were spread over refreshes within a CPU
    budget. The closed form needs no history: at 5 % done of a million prompts on 64 workers, with
    20 completions and a 3-second throughput window, the first estimate shows an ETA."""
    rng = random.Random(1)
    done = 50_000
    hist = Counter(length_bucket(max(1, min(CAP, round(rng.lognormvariate(MU, SIGMA))))) for _ in range(done))
    running = [rng.randint(0, 3000) for _ in range(37 * 64)]
    speed = Speed(per_request=30.0, rel_se=0.2, span_s=3.0, samples=3, running=37.0 * 64)
    e = estimate(total=1_000_000, completed=done, failed=0, lengths=LengthData(dict(hist), running, CAP),
                 speed=speed, workers=64, unsent=64 * 64)
    assert e.state == "estimating" and e.eta_s is not None and e.eta_low_s < e.eta_s < e.eta_high_s


def test_a_moment_with_nothing_in_flight_keeps_the_eta() -> None:
    """Between two batches a worker's in-flight list can be empty: the requests that decode at
    once are the measured ones, not the none listed this instant."""
    lens = lengths(2000, seed=6)
    (s,) = run_job(lens, at_done=(0.3,), leases=2, max_leases=16, reserve=64)
    listed = estimate(**inputs(s, 2000))
    empty = inputs(s, 2000)
    empty["lengths"] = LengthData(hist=s.hist, running=[], cap=CAP)
    assert estimate(**empty).eta_s == pytest.approx(listed.eta_s, rel=0.2)


def test_once_reads_the_speed_from_tokens_per_second() -> None:
    """--once knows the fleet's tokens/s, not one request's speed: a request's is the tokens/s
    over the requests running."""
    lens = lengths(2000, seed=6)
    (s,) = run_job(lens, at_done=(0.3,), leases=2, max_leases=16, reserve=64)
    known = estimate(**inputs(s, 2000))
    once = estimate(**dict(inputs(s, 2000), speed=Speed(per_request=0.0, tokens_per_s=s.busy, rel_se=0.15,
                                                        span_s=60, samples=3)))
    assert once.eta_s == pytest.approx(known.eta_s, rel=0.1)
    assert once.eta_high_s - once.eta_low_s > known.eta_high_s - known.eta_low_s


# ---------------------------------------------------------------- speed from the monitor's own samples


def _snapshot(at: float, out_tok: int, published_at: float, tokens: list[int], done: int):
    from genq.core.ledger.figures import JobSnapshot, WorkerCounters, WorkerView
    from genq.core.records import InFlight, WorkerStatus

    status = WorkerStatus(name="w", host="h", pid=1, server="s", state="busy", started_at=0.0,
                          heartbeat_at=max(published_at, at - 0.6),  # on time: it beats every second
                          concurrency_target=40, server_capacity=37, in_flight=len(tokens))
    view = WorkerView(name="w", status=status, counters=WorkerCounters(done=done, out_tok=out_tok),
                      inflight=InFlight(worker="w", job="j", at=published_at, tokens=tokens, queued=10), at=at)
    return JobSnapshot(job="j", at=at, config=None, total=10**6, created_at=0.0, batches_total=1, batches_done=0,
                       batches_held=1, completed=done, failed=0, in_tokens=0, out_tokens=out_tok, hist={},
                       workers=[view], paused=False, shards=0, shard_bytes=0, shard_records=0)


def test_speed_comes_from_what_the_monitor_saw_not_from_the_job_start() -> None:
    """A resumed run: a million tokens were made before the monitor started, and its first
    read comes before the worker's first in-flight list. Then 37 requests decode at 100 tok/s
    each; each in-flight list is published 0.6 s before the read; finished tokens grow evenly."""
    from genq.monitor.rates import RateTracker

    tracker = RateTracker(window_s=60)
    start = 1000.0
    tracker.observe(_snapshot(start, 1_000_000, start - 5, [], done=4000))  # nothing published yet
    for k in range(1, 13):
        read_at = start + k
        running = [400 + (k * 7 + i * 13) % 200 - 100 for i in range(37)]  # mean 400 tokens each
        # Everything decoded since the monitor started is 3700 tok/s: finished + running.
        out_tok = round(1_000_000 + 3700 * (read_at - start) - sum(running) + 37 * 400)
        tracker.observe(_snapshot(read_at, out_tok, read_at - 0.6, running, done=4000 + 20 * k))
    speed = tracker.speed()
    assert speed is not None and speed.samples >= 10 and speed.span_s == pytest.approx(11)
    assert speed.per_request == pytest.approx(100, rel=0.05)
    assert speed.tokens_per_s == pytest.approx(3700, rel=0.05)
    assert speed.running == 37  # the requests decoding over the last RECENT_S: the fleet's speed now is 37 x 100
    assert tracker.prompts_per_s() == pytest.approx(20, rel=0.02)  # not 4000+ done / elapsed since creation


def test_a_job_alone_on_the_fleet_keeps_every_slot_through_its_drain() -> None:
    """The job's share of the fleet (JobSnapshot.share, shown in `genq jobs`) compares its requests
    in flight with the fleet's as of the same heartbeat. Near the end, results committed since that
    beat make fewer prompts left than the beat's running list: the count shown is capped there, and
    a share taken from it read 13 of 32 slots for a job alone on its server."""
    snap = _snapshot(1000.0, 0, 999.4, [40] * 30, done=10**6 - 12)  # 30 running a beat ago, 12 left now
    snap.fleet_running = 30  # the worker's status of that same beat: in_flight 30, every job's
    assert snap.in_flight == 12  # what the job shows: never more than is left
    assert snap.share == 1.0


def test_requests_finished_since_the_beat_are_not_played_again() -> None:
    """A worker's in-flight record (its running requests' tokens, the prompts it holds unsent) is
    up to a heartbeat old; results committed since are counted finished and still listed as
    running. The listed requests are trimmed to the prompts left, counting the unsent ones: they
    have not run, so what is listed beyond the prompts left is running requests that have ended.
    Real vLLM (2026-12-03): at 76 % done 145 listed running and 6 unsent for 143 left; counting
    151 read the ETA +10 % high."""
    rng = random.Random(5)
    finished = [max(1, round(rng.lognormvariate(math.log(100), 0.1))) for _ in range(400)]
    left, ready = 100, 20
    # 100 listed running (5 tokens each) + 20 unsent: 20 of the listed ones have finished since.
    # A compute-bound server (overhead 0): 100 decoding make 100 tokens a time unit whatever d is,
    # so the time left is the tokens left over 100.
    speed = Speed(per_request=1.0, rel_se=0.01, span_s=100.0, samples=100, overhead=0.0, decoding=100.0,
                  running=100.0)
    e = estimate(total=len(finished) + left, completed=len(finished), failed=0,
                 lengths=LengthData(hist=hist_of(finished), running=[5] * left, cap=1000), workers=1, unsent=ready,
                 speed=speed)
    assert e.eta_s is not None and e.remaining_tokens is not None
    # 100 prompts of ~100 tokens: 80 running with 5 made, 20 unsent.
    assert e.remaining_tokens == pytest.approx(80 * 95 + 20 * 100, rel=0.05)
    assert e.eta_s == pytest.approx(e.remaining_tokens / 100, rel=0.05)  # not 120 prompts' worth


def test_only_workers_that_can_serve_the_job_enter_its_speed() -> None:
    """A fleet of two models: the job's model on a memory-bound server (its step costs the same
    at any batch: no overhead), another model on a compute-bound one (its step grows with the
    batch). The job's ETA is fitted from the workers that can serve its model (JobConfig.served_by):
    neither the other model's step-cost line nor its slots coming and going enter it."""
    from genq.core.ledger.figures import WorkerView
    from genq.core.records import DecodeBin, JobConfig, WorkerStatus
    from genq.monitor.rates import RateTracker, once_speed

    def other(at: float) -> WorkerView:
        cpu = [DecodeBin(decoding=d, busy_s=d * 100 * 0.001 * d, tokens=d * 100.0, clean=True) for d in (8, 16)]
        return WorkerView(name="other", status=WorkerStatus(
            name="other", host="h", pid=2, server="s2", state="idle", started_at=0.0, heartbeat_at=at,
            concurrency_target=64, server_capacity=64, model="model-b", decode=cpu), at=at + 0.6)

    tracker = RateTracker(window_s=60)
    for k in range(12):
        snap = _snapshot(1000.0 + k, 10_000 + 3700 * k, 999.4 + k, [400] * 37, done=20 * k)
        snap.config = JobConfig(name="j", output="/tmp/out", model="model-a")
        snap.workers[0].status.model, snap.workers[0].status.tok_per_s = "model-a", 3700.0
        if k >= 6:  # the other model's worker joins half way: this job gains no slot
            snap.workers.append(other(999.4 + k))
        tracker.observe(snap)
    speed, (once, _) = tracker.speed(), once_speed(snap)
    assert speed is not None and once is not None
    assert speed.running == pytest.approx(37), "another model's slots scaled this job's speed"
    assert speed.overhead is None, "another model's server's step cost was fitted into this job's"
    assert once.overhead is None


def test_another_models_idle_slots_do_not_put_a_job_in_its_tail() -> None:
    """The tail note says the job's last requests leave most of its slots idle: slots of the workers
    that can serve its model. 30 requests left on its one 37-slot server are no tail, whatever
    another model's idle 64-slot server does."""
    from genq.core.ledger.figures import WorkerView
    from genq.core.records import JobConfig, WorkerStatus
    from genq.monitor.progress import tail_note

    snap = _snapshot(1000.0, 0, 999.4, [40] * 30, done=10**6 - 30)
    snap.config = JobConfig(name="j", output="/tmp/out", model="model-a")
    snap.workers[0].status.model = "model-a"
    assert tail_note(snap) is None
    snap.workers.append(WorkerView(name="other", status=WorkerStatus(
        name="other", host="h", pid=2, server="s2", state="idle", started_at=0.0, heartbeat_at=999.4,
        concurrency_target=64, server_capacity=64, model="model-b"), at=snap.at))
    assert tail_note(snap) is None, tail_note(snap)


def test_a_paused_job_whose_requests_ended_finishes_nothing_while_its_workers_run_another() -> None:
    """A paused job's rates read 0 once none of its requests run: its window's rate is of before the
    pause. Its workers running another job's requests (their in_flight, every job's) change nothing."""
    from genq.monitor.eta import Estimate
    from genq.monitor.progress import build_progress

    snap = _snapshot(1000.0, 50_000, 999.4, [], done=500)  # none of this job's requests run
    snap.paused, snap.workers[0].status.in_flight = True, 37  # 37 of another job's
    progress = build_progress(snap, Estimate(None, None, None, "paused"), STEADY, 5.0, {})
    assert (progress.rate_per_sec, progress.output_tokens_per_sec) == (0.0, 0.0), progress


def test_a_pause_is_not_counted_as_slots_left_idle() -> None:
    """The fleet's speed is one request's times the requests decoding over the window. While the job
    is paused its last requests end and nothing starts: those seconds say nothing of how many decode
    once it runs. Counted, 12 s of pause in a 24 s window read the ETA after the resume ~40 % high."""
    from genq.monitor.rates import RateTracker

    tracker = RateTracker(window_s=60)
    made = 0
    for k in range(24):
        paused = 6 <= k < 18
        running = [400] * (2 if paused else 37)
        made += 100 * len(running)
        snap = _snapshot(1000.0 + k, made, 999.4 + k, running, done=20 * k)
        snap.paused = paused
        tracker.observe(snap)
    speed = tracker.speed()
    assert speed is not None
    assert speed.running == pytest.approx(37), speed


@pytest.mark.parametrize("state", ["draining", "server_down"])
def test_a_draining_worker_s_slots_leave_the_fleet_s_speed_at_once(state: str) -> None:
    """A worker told to drain finishes what it holds and takes no more, one whose server is down runs
    nothing: the job's speed from then is that of the slots of the others, as when a worker leaves."""
    from msgspec import structs

    from genq.core.records import InFlight
    from genq.monitor.rates import RateTracker

    tracker = RateTracker(window_s=60)
    for k in range(12):
        snap = _snapshot(1000.0 + k, 7400 * k, 999.4 + k, [400] * 37, done=40 * k)
        second = replace(snap.workers[0], name="w2", inflight=InFlight(worker="w2", job="j", at=999.4 + k,
                                                                      tokens=[400] * 37, queued=10))
        second.status = structs.replace(snap.workers[0].status, name="w2", state=state if k == 11 else "busy")
        snap.workers.append(second)
        tracker.observe(snap)
    speed = tracker.speed()
    assert speed is not None
    assert speed.running == pytest.approx(37, rel=0.1), speed  # not 74


def test_a_finished_job_has_no_worker_on_it() -> None:
    """A worker's in-flight record lives a few seconds after its last request ends: a job done (every
    shard written) shows none in flight on any worker, and so no worker working on it (genq_job_workers)."""
    from genq.monitor.eta import Estimate
    from genq.monitor.progress import build_progress

    snap = _snapshot(1000.0, 50_000, 999.4, [40] * 3, done=10**6)  # the record of its last beat
    snap.batches_done = snap.batches_total  # every shard written
    progress = build_progress(snap, Estimate(0.0, 0.0, 0.0, "done"), STEADY, 5.0, {})
    assert (progress.in_flight, progress.worker_details[0].job_in_flight) == (0, 0)
    assert progress.workers == 0, progress


def test_once_gives_a_job_its_part_of_a_restarted_worker_s_rates() -> None:
    """--once after a worker restarted reads its last-30s rates, which are every job's it runs: a job with
    half of its requests in flight gets half of them, not all (each of two jobs read the whole worker's)."""
    from genq.monitor.rates import once_speed

    snap = _snapshot(1000.0, 50_000, 999.4, [40] * 20, done=500)
    snap.workers[0].counters.first_at = 100.0  # its first result for the job, before this process started
    status = snap.workers[0].status
    status.started_at, status.in_flight, status.tok_per_s, status.req_per_s = 900.0, 40, 1000.0, 4.0
    speed, prompts = once_speed(snap)
    assert speed is not None and (speed.tokens_per_s, prompts) == (500.0, 2.0), (speed, prompts)


def test_rates_after_a_resume_leave_the_pause_out() -> None:
    """Prompts/s and tokens/s are the monitor's recent rates: a minute paused in the window is not a
    minute of them at 0, or a job running at 20 prompts/s read 6 for the window's length after its resume."""
    from genq.monitor.rates import RateTracker

    tracker = RateTracker(window_s=120)
    done = made = 0
    for k in range(84):
        paused = 12 <= k < 72
        if not paused:
            done, made = done + 20, made + 3700
        snap = _snapshot(1000.0 + k, made, 999.4 + k, [] if paused else [400] * 37, done=done)
        snap.paused = paused
        tracker.observe(snap)
    speed = tracker.speed()
    assert speed is not None
    assert tracker.prompts_per_s() == pytest.approx(20, rel=0.1)
    assert speed.tokens_per_s == pytest.approx(3700, rel=0.1)


def test_the_first_tokens_per_second_is_right_with_workers_beating_out_of_phase() -> None:
    """Two workers, each 37 requests at 100 tok/s (7400 tok/s in all), publish their in-flight lists
    once a second, half a second apart, and commit each result as it ends; the monitor reads every
    0.5 s from a moment mid-run. A list predates results counted since: their tokens are running in
    it and finished too. The first reading (two samples) is the fleet's 7400 at any phase. The tokens
    finished at the first list's time are in no record: interpolated from the worker's first request,
    the reading spreads by about a beat's results either way. Taken as of the read, it was 0 to 7,200."""
    from genq.core.ledger.figures import WorkerCounters
    from genq.core.records import InFlight
    from genq.monitor.rates import RateTracker

    def requests(rng: random.Random) -> list[tuple[float, float, int]]:
        """One worker's requests (start, end, tokens): 37 slots since t=-30, each refilled as its request ends."""
        made = []
        for _ in range(37):
            at = -30 - 8 * rng.random()
            while at < 30:
                n = max(1, round(rng.lognormvariate(math.log(400), 0.5)))
                made.append((at, at + n / 100, n))
                at += n / 100
        return made

    def read(name: str, made: list[tuple[float, float, int]], read_at: float, beat: float):
        """A worker as the monitor reads it at read_at: results counted as they ended, its in-flight list of `beat`."""
        ended = [(e, n) for _, e, n in made if e <= read_at]
        view = replace(template.workers[0], name=name, counters=WorkerCounters(
            done=len(ended), out_tok=sum(n for _, n in ended), first_at=-38.0, last_at=max(e for e, _ in ended)))
        view.inflight = InFlight(worker=name, job="j", at=beat, queued=10,
                                 tokens=[int(100 * (beat - s)) for s, e, _ in made if s <= beat < e])
        return view

    template = _snapshot(0.0, 0, 0.0, [], done=0)
    rng = random.Random(7)
    readings = []
    for _ in range(40):
        fleet = [requests(rng), requests(rng)]
        tracker = RateTracker(window_s=60)
        first = 20 + rng.random()  # the monitor's first read, at any phase of the beats
        for read_at in (first, first + 0.5):
            beats = (math.floor(read_at), math.floor(read_at - 0.5) + 0.5)  # on the second, on the half
            workers = [read(f"w{i}", fleet[i], read_at, beats[i]) for i in range(2)]
            tracker.observe(replace(template, at=read_at, workers=workers,
                                    completed=sum(w.counters.done for w in workers)))
        speed = tracker.speed()
        assert speed is not None
        readings.append(speed.tokens_per_s)
    assert statistics.mean(readings) == pytest.approx(7400, rel=0.1), sorted(readings)
    assert statistics.quantiles(readings, n=4) == pytest.approx([7400] * 3, rel=0.25), sorted(readings)
