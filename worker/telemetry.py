"""GPU figures from NVML (nvidia-ml-py). Where there is no GPU or no driver, say so once."""

from __future__ import annotations

import logging

from genq.core.records import GpuSample

log = logging.getLogger("genq.worker")


class GpuProbe:
    def __init__(self, index: int | None) -> None:
        self.index = index
        self.note: str | None = None
        self._handle = None
        if index is None:
            self.note = "no GPU assigned (--gpu not given)"
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if index >= count:
                self.note = f"no GPU {index}: NVML sees {count} GPU(s)"
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        except Exception as exc:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            self.note = f"no GPU telemetry: {type(exc).__name__}: {exc}"
        if self.note:
            log.info("%s", self.note)

    def sample(self) -> GpuSample | None:
        if self._handle is None:
            return None
        import pynvml

        h = self._handle
        try:
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            name = pynvml.nvmlDeviceGetName(h)
            sample = GpuSample(
                index=self.index or 0,
                name=name.decode() if isinstance(name, bytes) else str(name),
                utilization_pct=float(util.gpu),
                memory_used_mib=mem.used / 2**20,
                memory_total_mib=mem.total / 2**20,
            )
        except Exception as exc:
            self.note = f"GPU telemetry failed: {type(exc).__name__}: {exc}"
            return None
        # Optional figures: some boards (and MIG slices) do not report them.
        for attr, read in (
            ("power_w", lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0),
            ("sm_clock_mhz", lambda: float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))),
            ("temperature_c", lambda: float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU))),
        ):
            try:
                setattr(sample, attr, read())
            except Exception:
                pass
        return sample
