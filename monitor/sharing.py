"""A job's share of the fleet, for the ETA (docs/scheduling.md).

Several jobs on one fleet share its slots (priorities, fair share: worker/shares.py). The ETA
simulation (monitor/simulate.py) plays one job on the workers it is given; it is not changed
here. What it is fed is: each worker's slots times the job's share of the fleet's running
requests now, so the job's remaining work goes through at the rate it gets, not at the whole
fleet's. The per-request speed stays the measured one (requests run beside the other jobs'
at the speed of the whole batch). A job alone on the fleet, or one that has nothing running
now, is fed the fleet as it is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from genq.monitor.playout import WorkerState


def shared_fleet(fleet: Sequence[WorkerState], share: float) -> list[WorkerState]:
    """The fleet as this job gets it: each worker's slots times `share` (0 < share < 1), at least one."""
    if not 0 < share < 1:
        return list(fleet)
    return [dataclasses.replace(w, slots=max(1, round(w.slots * share))) for w in fleet]
