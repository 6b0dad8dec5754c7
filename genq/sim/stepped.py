"""The engine's counts as vLLM's scheduler reports them (genq sim --flavor vllm).

vLLM computes its running and waiting gauges in make_stats(), called from
update_from_output() (vllm/v1/core/sched/scheduler.py, 0.32): after the step's
finished requests left the running set and before the requests that arrived during
the step join the waiting queue. So while requests wait for a slot the running count
is the capacity less the requests that just finished, and waiting counts only those
the step's admission left out. SGLang's and llama.cpp's figures are read live.
"""

from __future__ import annotations

from genq.sim.config import SimConfig
from genq.sim.engine import Engine


class SteppedEngine(Engine):
    def __init__(self, config: SimConfig) -> None:
        super().__init__(config)
        self.stepped_running = 0
        self.stepped_waiting = 0
        self._left_out = 0  # waiting right after the last admission

    def _admit(self) -> int | None:
        admitted = super()._admit()
        self._left_out = len(self._waiting)
        return admitted

    def _step(self) -> bool:
        progressed = super()._step()
        self.stepped_running = len(self._running)
        self.stepped_waiting = min(self._left_out, len(self._waiting))  # less any aborted meanwhile
        return progressed
