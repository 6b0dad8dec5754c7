"""A worker told to stop while its Redis is away stops in seconds and loses nothing.

The bug: a worker that got SIGTERM twice after its Redis had gone away kept waiting to write
the results it held (its log had promised "send again to stop now") and needed SIGKILL; one
SIGTERM waited forever too, past its --grace-period. What a stopped worker holds is not
recorded: its leases lapse, and another worker takes its batches once Redis is back
(docs/exactly-once.md), which the audit checks prompt by prompt.

Redis away two ways: stopped (connections refused at once) and frozen (SIGSTOP: connections
open, no answer ever comes, as in a network partition).
"""

from __future__ import annotations

import signal
import subprocess
import time

import pytest

from genq.core import keys
from tests.audit import audit
from tests.conftest import genq_cmd, wait_until
from tests.test_eo_exactly_once import OwnRedis, enqueue

GRACE_S = 3.0
STOP_WITHIN_S = 25.0  # after the second signal (or the grace period): seconds, not forever


@pytest.mark.parametrize("outage, signals", [("stopped", 2), ("frozen", 1)])
def test_a_worker_told_to_stop_while_its_redis_is_away_stops_in_seconds(sim, procs, tmp_path, outage, signals):
    own = OwnRedis(procs, tmp_path)
    server = sim(max_running_requests=8, mean_output_tokens=400, output_sigma=0.5, tokens_per_step=8,
                 step_ms_base=10)
    ids, out = enqueue(tmp_path, "away", 40, "--batch-size", "20", "--max-tokens", "1500", redis_url=own.url)
    first = procs(genq_cmd("worker", "--server", server, "--prefetch", "1", "--grace-period", str(GRACE_S),
                           "--name", "first", redis_url=own.url), name="first")
    wait_until(lambda: own.conn.hlen(keys.batch_results("away", "b0000001")) >= 2, 90, "results being recorded")
    if outage == "stopped":
        own.stop()
        wait_until(lambda: "kept in memory" in first.log(), 30, "the worker holding results it cannot write")
    else:
        own.proc.signal(signal.SIGSTOP)
        time.sleep(2)  # its writes hang on the open connection now
    first.signal(signal.SIGTERM)
    asked = time.monotonic()
    if signals == 2:
        time.sleep(1)
        first.signal(signal.SIGTERM)
    limit = STOP_WITHIN_S + (0 if signals == 2 else GRACE_S)
    try:
        code = first.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the worker did not stop within {limit:.0f}s:\n{first.log()[-4000:]}") from None
    took = time.monotonic() - asked
    assert code == 0, first.log()[-4000:]
    assert "send again to stop now" in first.log()
    assert "not handed back" in first.log(), first.log()[-4000:]
    # The engine's tasks ended cleanly.
    assert "was never retrieved" not in first.log() and "Task was destroyed" not in first.log(), first.log()[-4000:]

    # Redis back: the first worker's leases lapse, and a second worker does its batches once.
    if outage == "stopped":
        own.start()
    else:
        own.proc.signal(signal.SIGCONT)
    second = procs(genq_cmd("worker", "--server", server, "--name", "second", redis_url=own.url), name="second")
    wait_until(lambda: own.conn.scard(keys.job_done("away")) == 2, 180, "the second worker finishing the job")
    second.signal(signal.SIGTERM)
    assert second.wait(timeout=60) == 0, second.log()
    audit(own.conn, "away", out, ids)
    print(f"{outage}, {signals} signal(s): the worker stopped {took:.1f}s after the first")
