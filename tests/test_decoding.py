"""The worker's decode figures (worker/controller.py) and their fit (monitor/rates.py).

Pure: a fake clock stands in for time; the requests are Progress records fed as a stream
would feed them. Against real servers the figures are checked by scripts/vllm/bench.py.
"""

from __future__ import annotations

import pytest

from genq.core.records import DecodeBin
from genq.monitor.rates import fit_overhead
from genq.worker.controller import HALF_LIFE_S, DecodeMeter
from genq.worker.server import Progress


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_request_seconds_and_tokens_are_booked_to_the_count_decoding() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    a, b = Progress(meter=meter), Progress(meter=meter, sequences=2)
    a.advance(1)  # a's first token (the prefill's): from now a decodes, its token is not counted
    clock.t += 1.0
    a.advance(11)  # 10 tokens in 1 s alone
    b.advance(2)  # b (n=2) starts: 3 sequences decode
    clock.t += 2.0
    a.advance(21)  # 10 tokens in 2 s with b's two
    b.advance(42)  # 40 tokens over its two sequences
    meter.ended(a)
    clock.t += 1.0
    b.advance(62)
    meter.ended(b)
    meter.ended(b)  # twice: nothing more
    clock.t += 5.0  # nothing decoding: nothing booked
    bins = {round(x.decoding): x for x in meter.figures()}
    decay = 0.5 ** (9.0 / HALF_LIFE_S)  # the figures are 9 s old by now
    assert set(bins) == {1, 2, 3}
    assert (bins[1].busy_s, bins[1].tokens) == pytest.approx((1.0 * decay, 10.0 * decay), abs=0.05)
    assert (bins[3].busy_s, bins[3].tokens) == pytest.approx((6.0 * decay, 50.0 * decay), abs=0.05)  # 3 for 2 s
    assert (bins[2].busy_s, bins[2].tokens) == pytest.approx((2.0 * decay, 20.0 * decay), abs=0.05)
    assert a.tokens == 21 and b.tokens == 62 and meter.decoding == 0


def test_figures_merge_large_counts_and_decay() -> None:
    clock = Clock()
    meter = DecodeMeter(clock)
    reqs = [Progress(meter=meter) for _ in range(93)]
    for r in reqs:
        r.advance(1)
    clock.t += 1.0
    for r in reqs[:3]:  # a request ends: 92 decode, then 91, 90: one bin
        r.advance(20)
        meter.ended(r)
        clock.t += 1.0
    figures = meter.figures()
    assert len(figures) == 1 and figures[0].busy_s == pytest.approx(93 + 92 + 91 + 90, rel=1e-3)
    assert figures[0].decoding == pytest.approx((93 * 93 + 92 * 92 + 91 * 91 + 90 * 90) / 366, abs=0.01)
    assert figures[0].tokens == pytest.approx(3 * 19, rel=1e-3)
    clock.t += HALF_LIFE_S
    assert meter.figures()[0].busy_s == pytest.approx((366 + 90 * HALF_LIFE_S) / 2, rel=1e-3)


def bins_of(step_base: float, step_per: float, counts: list[int]) -> list[DecodeBin]:
    """What a server whose step costs base + per * d makes: one token per request a step."""
    return [DecodeBin(decoding=d, busy_s=d * 100 * (step_base + step_per * d), tokens=d * 100.0) for d in counts]


def test_the_overhead_is_the_step_time_line_through_the_figures() -> None:
    assert fit_overhead(bins_of(0.020, 0.001, [64, 96, 128])) == pytest.approx(20.0)
    assert fit_overhead(bins_of(0.0, 0.001, [8, 16])) == pytest.approx(0.0, abs=1e-6)  # compute-bound
    assert fit_overhead(bins_of(0.020, 0.0, [8, 64])) is None  # memory-bound: no dependence
    assert fit_overhead(bins_of(0.020, 0.001, [60, 64])) is None  # counts too close to tell
    assert fit_overhead(bins_of(0.020, 0.001, [64])) is None
    few = [DecodeBin(decoding=8, busy_s=1.0, tokens=10.0), *bins_of(0.020, 0.001, [64])]
    assert fit_overhead(few) is None  # a bin of 10 tokens is no evidence


def test_time_is_booked_apart_while_a_request_of_the_worker_waits_for_its_first_token() -> None:
    """#27: while the worker admits requests the server prefills them in the same steps as the
    decodes; once none waits (a job's drain) a request runs faster at the same count."""
    clock = Clock()
    meter = DecodeMeter(clock)
    a, b = Progress(meter=meter), Progress(meter=meter)
    meter.sent(a)
    meter.sent(b)
    a.advance(1)
    clock.t += 2.0
    a.advance(21)  # 20 tokens in 2 s while b waited: admitting
    b.advance(1)  # b's first token: nothing waits any more
    clock.t += 1.0
    a.advance(41)  # 20 tokens in 1 s beside b: clean
    b.advance(21)
    meter.ended(a)
    meter.ended(b)
    meter.sent(Progress(meter=meter))  # sent, never answered
    figures = {(round(x.decoding), x.clean): x for x in meter.figures()}
    assert set(figures) == {(1, False), (2, True)}, figures
    assert (figures[1, False].busy_s, figures[1, False].tokens) == pytest.approx((2.0, 20.0), rel=1e-3)
    assert (figures[2, True].busy_s, figures[2, True].tokens) == pytest.approx((2.0, 40.0), rel=1e-3)
    assert meter.waiting == 1 and meter.decoding == 0


def test_the_line_goes_through_the_bins_booked_with_nothing_admitted_where_they_tell() -> None:
    """#27: the steps that prefill a job's start (a few decoding, many admitted) read a request as
    slow at a small count, and flattened the line: on a compute-bound sim with 30-token prompts
    the overhead fitted 57-72 for 0.7. The bins booked while nothing waited (a drain) are the
    decode's own curve; the prefill's cost is played apart (Speed.prefill)."""
    clean = [DecodeBin(decoding=b.decoding, busy_s=b.busy_s, tokens=b.tokens, clean=True)
             for b in bins_of(0.020, 0.001, [16, 32, 64, 128])]
    bulk = [DecodeBin(decoding=b.decoding, busy_s=b.busy_s * 1.2, tokens=b.tokens)
            for b in bins_of(0.020, 0.001, [128])]
    ramp = [DecodeBin(decoding=8, busy_s=50.0, tokens=100.0)]  # the start of a job: prefill-laden
    assert fit_overhead(clean + bulk + ramp) == pytest.approx(20.0)
    # No drain seen yet: all the bins, and the ramp beside the bulk reads a slower request at a
    # smaller count, no line that rises: nothing assumed.
    assert fit_overhead(bulk + ramp) is None
