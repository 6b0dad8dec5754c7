"""An engine going idle keeps its keys alive across the idle pace's longer gap between beats
(worker/heartbeat.py). The last busy beat wrote its alive key for LEASE_TIMEOUT_S and its status for
STATUS_TTL_S; the next beat came IDLE_BEAT_S later, so for seconds the worker showed as lost in
`genq workers` (a `genq drain --wait` then ended at once, "all drained: W lost")."""

from __future__ import annotations

from types import SimpleNamespace

from genq.core.timings import BEAT_S, LEASE_TIMEOUT_S, STATUS_TTL_S
from genq.worker import heartbeat as idle
from genq.worker.heartbeat import IDLE_AFTER_S, IDLE_BEAT_S, IdlePace
from genq.worker.held import Holdings


def test_an_engine_going_idle_is_never_without_a_live_heartbeat(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(idle.time, "monotonic", lambda: clock[0])
    dispatcher = SimpleNamespace(running={"request": 1}, unsent=0)
    pace = IdlePace(Holdings(), dispatcher)
    alive_until = status_until = 0.0
    beats = []
    # The heartbeat's loop (worker/heartbeat.py): each second beat_due(), and a beat writes the
    # alive key and the status with pace.ttl() of its busy TTLs.
    for second in range(int(3 * IDLE_BEAT_S + 10 * BEAT_S)):
        now = clock[0]
        if second == 5:
            dispatcher.running = {}  # its last request ends: idle after IDLE_AFTER_S
        assert now < alive_until or second == 0, f"alive key expired at {now - 1000:.0f}s; beats at {beats}"
        assert now < status_until or second == 0, f"status expired (shown lost) at {now - 1000:.0f}s; beats at {beats}"
        if pace.beat_due():
            beats.append(now - 1000)
            alive_until = now + pace.ttl(LEASE_TIMEOUT_S)
            status_until = now + pace.ttl(STATUS_TTL_S)
        clock[0] += BEAT_S
    assert pace.idle()
    idle_beats = [b for b in beats if b > 5 + IDLE_AFTER_S]
    gaps = [b - a for a, b in zip(idle_beats, idle_beats[1:])]
    assert gaps and min(gaps) >= IDLE_BEAT_S, f"idle, it still beats every second: {beats}"
