"""GPU figures from NVML (nvidia-ml-py); where there is no GPU or no driver, a note that says so.

The memory bandwidth for the decode bound (genq.core.decodebound) is read once: bus width x the maximum
memory clock x 2 (NVML's GDDR and HBM clocks), checked against SPECS, the vendors' rated figures.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import msgspec

from genq.core.records import GpuSample, Hardware

if TYPE_CHECKING:
    from genq.worker.options import WorkerOptions
    from genq.worker.server import ServerInfo

log = logging.getLogger("genq.worker")
T = TypeVar("T")

# Rated memory bandwidth, bytes/s, by a piece of NVML's device name (most specific first), from
# NVIDIA's datasheets (2026-12): H100 SXM5 / PCIe / NVL, H200 SXM, B200, RTX PRO 6000 Blackwell,
# A100 80GB SXM4 / PCIe and 40GB, L40S, L4.
SPECS: tuple[tuple[str, float], ...] = (
    ("H100 NVL", 3.9e12), ("H100 PCIe", 2.0e12), ("H100", 3.35e12), ("H200", 4.8e12), ("B200", 8.0e12),
    ("RTX PRO 6000", 1.792e12), ("A100-SXM4-80GB", 2.039e12), ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12), ("L40S", 0.864e12), ("L4", 0.3e12),
)
SPEC_AGREES = 0.15  # NVML's figure within this of the rated one: they agree


def spec_bandwidth(name: str) -> tuple[str, float] | None:
    """(SPECS key, rated bytes/s) of a GPU NVML names so; None for one not in SPECS."""
    return next(((key, bw) for key, bw in SPECS if key in name), None)


def checked_bandwidth(name: str, bus_bits: int | None, max_mem_clock_mhz: float | None) -> tuple[float | None, str]:
    """(bytes/s, where it came from): NVML's bus x clock x 2, said against the rated figure."""
    spec = spec_bandwidth(name)
    rated = f"rated {spec[1] / 1e12:.2f} TB/s for {spec[0]}" if spec else f"{name} not in genq's table"
    if bus_bits and max_mem_clock_mhz:
        bw = bus_bits / 8 * max_mem_clock_mhz * 1e6 * 2
        told = f"NVML {bus_bits}-bit x {max_mem_clock_mhz:.0f} MHz x 2 = {bw / 1e12:.2f} TB/s"
        if spec and abs(bw - spec[1]) > SPEC_AGREES * spec[1]:
            return bw, f"{told}, not the {rated}"
        return bw, f"{told} ({rated})"
    if spec:
        return spec[1], f"{rated} (NVML gave no bus width or memory clock)"
    return None, f"unknown: NVML gave no bus width or memory clock and {rated}"


class GpuProbe:
    """One GPU's figures; `note` says why there are none."""

    def __init__(self, index: int | None) -> None:
        self.index, self._handle = index, None
        self.bandwidth: float | None = None
        self.bandwidth_from: str | None = None
        self.note: str | None = None if index is not None else "no GPU assigned (--gpu not given)"
        if index is None:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if index >= count:
                self.note = f"no GPU {index}: NVML sees {count} GPU(s)"
            else:
                self._handle = h = pynvml.nvmlDeviceGetHandleByIndex(index)
                bus = _optional(lambda: int(pynvml.nvmlDeviceGetMemoryBusWidth(h)))  # older drivers: none
                clock = _optional(lambda: float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_MEM)))
                self.bandwidth, self.bandwidth_from = checked_bandwidth(_name(h), bus, clock)
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
            sample = GpuSample(index=self.index or 0, name=_name(h), utilization_pct=float(util.gpu),
                               memory_used_mib=mem.used / 2**20, memory_total_mib=mem.total / 2**20)
        except Exception as exc:
            self.note = f"GPU telemetry failed: {type(exc).__name__}: {exc}"
            return None
        reasons = getattr(pynvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            pynvml.nvmlDeviceGetCurrentClocksThrottleReasons
        for key, read in {  # some boards (and MIG slices) do not report these
            "power_w": lambda: pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "sm_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM)),
            "temperature_c": lambda: float(pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)),
            "max_sm_clock_mhz": lambda: float(pynvml.nvmlDeviceGetMaxClockInfo(h, pynvml.NVML_CLOCK_SM)),
            "mem_clock_mhz": lambda: float(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM)),
            "power_limit_w": lambda: pynvml.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "throttled": lambda: throttle_reasons(int(reasons(h))),
        }.items():
            setattr(sample, key, _optional(read))
        return sample


def _name(handle: object) -> str:
    import pynvml

    name = pynvml.nvmlDeviceGetName(handle)
    return name.decode() if isinstance(name, bytes) else str(name)


def _optional(read: Callable[[], T]) -> T | None:
    """An NVML call's answer; None where it fails (not every board or MIG slice supports each)."""
    try:
        return read()
    except Exception:
        return None


# NVML's clock-event (throttle) reason bits that slow a GPU down (nvml.h), named as nvidia-smi does.
THROTTLES = ((0x2, "applications clocks"), (0x4, "power cap"), (0x8, "hw slowdown"), (0x20, "sw thermal"),
             (0x40, "hw thermal"), (0x80, "power brake"))


def throttle_reasons(mask: int) -> list[str]:
    return [name for bit, name in THROTTLES if mask & bit]


def hardware(opts: WorkerOptions, probe: GpuProbe, info: ServerInfo | None) -> Hardware:
    """What the decode bound needs: --gpu-bandwidth, else NVML's; --model-bytes, else the server's weights."""
    memory = info.memory if info is not None else Hardware()
    bandwidth, told = ((opts.gpu_bandwidth, "--gpu-bandwidth") if opts.gpu_bandwidth is not None
                       else (probe.bandwidth, probe.bandwidth_from or probe.note))
    weight, weight_from = memory.weight_bytes, memory.weight_from
    if opts.model_bytes is not None:
        weight, weight_from = opts.model_bytes, "--model-bytes"
    return msgspec.structs.replace(memory, engine=info.flavor if info else None, bandwidth=bandwidth,
                                   bandwidth_from=told, weight_bytes=weight, weight_from=weight_from)
