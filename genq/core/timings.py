"""The timings of a batch's life: one lease timeout, the rest derived from it; `check()` states their
order and runs at import (docs/exactly-once.md says why each inequality matters)."""

from __future__ import annotations

BEAT_S = 1.0  # an engine's heartbeat: alive key, status, lease checks
IDLE_BEAT_S = 20.0  # an idle worker's heartbeat and control read (worker/heartbeat.py IdlePace)
# No beat this long: the engine's alive key is gone, its batches are queued again (a key TTL: whole seconds).
LEASE_TIMEOUT_S = 10
# A sender frozen this long (SIGSTOP, a stalled host) sends nothing until a beat has checked its leases.
LEASE_CHECK_STALE_S = 0.8 * LEASE_TIMEOUT_S
# The fleet view calls a worker lost when its status record (renewed each beat) is this old.
STATUS_TTL_S = LEASE_TIMEOUT_S * 3 // 2
# The reconciler's pass (stranded batches, a lost holder's batches queued again) ...
RECONCILE_EVERY_S = LEASE_TIMEOUT_S
# ... and a batch must look stranded in two passes this far apart before it is queued again (a pass's reads
# are not one snapshot: a batch taken meanwhile can look stranded once).
STRANDED_CONFIRM_S = 0.4 * LEASE_TIMEOUT_S
# How long after a kill its batches run elsewhere, at most: the alive key expires, a pass may be a period
# away, the next confirms it and queues them again (docs/operations.md measured 32-36 s).
LOST_BATCH_BACK_S = LEASE_TIMEOUT_S + 3 * RECONCILE_EVERY_S


def check() -> None:
    rules = [
        (BEAT_S * 3 <= LEASE_TIMEOUT_S, "a lease must survive two missed beats"),
        (LEASE_CHECK_STALE_S < LEASE_TIMEOUT_S, "a frozen sender must stop before its lease can pass on"),
        (STATUS_TTL_S > LEASE_TIMEOUT_S, "a worker is shown lost only once its leases have lapsed"),
        (STRANDED_CONFIRM_S < RECONCILE_EVERY_S, "two passes must be able to confirm a stranded batch"),
    ]
    broken = [reason for ok, reason in rules if not ok]
    if broken:
        raise RuntimeError("genq.core.timings: " + "; ".join(broken))


check()
