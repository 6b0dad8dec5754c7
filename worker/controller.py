"""What the server can take (the concurrency window, docs/engines.md "Capacity"), how fast one request
decodes against how many decode at once (WorkerStatus.decode), and the GPU's figures from NVML.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from genq.core.ledger import fleet
from genq.core.records import DecodeBin, GpuSample, Hardware, ServerDecode
from genq.worker.engines import CAPACITY_START as UNKNOWN_CAPACITY_START
from genq.worker.engines import Metrics

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from redis.asyncio.client import Pipeline

    from genq.worker.held import Task
    from genq.worker.options import WorkerOptions
    from genq.worker.server import Progress, ServerInfo

log = logging.getLogger("genq.worker")
T = TypeVar("T")

MAX_TARGET = 100_000
KV_PRESSURE = 0.9  # token usage above which idle slots are the KV cache's doing, not ours
QUEUE_RUNAWAY_CHECKS = 3  # observations in a row with too long a queue before lowering
GENTLE_CHECKS = 30  # observations after a KV-pressure cut during which raises are small
# Looks with requests waiting and no higher running count before the highest is the capacity:
# while a server ramps up (vLLM admits by a token budget per step) the count still rises.
LEARN_LOOKS = 3
LOOK_S = 1.0  # between looks at /metrics
LEARN_LOOK_S = 0.25  # while the capacity is being learned: a step with no finish is soon seen
SETTLE_LOOKS = 40  # looks at LEARN_LOOK_S after the learned capacity rose (most counts are a bit below)


def headroom(capacity: int) -> int:
    """Requests waiting in the server's queue so a freed slot is refilled in the same step."""
    return max(2, math.ceil(capacity * 0.1))


class ConcurrencyController:
    """The window: the server's capacity (told, or learned off /metrics) plus a headroom in its queue. Raised
    while slots idle and prompts are held back, cut by a tenth when the server retracts (then raised gently),
    lowered when its queue keeps growing; --concurrency and `genq concurrency` cap it."""

    def __init__(self, capacity: int | None, cap: int | None = None) -> None:
        self.capacity = capacity  # from the server (None: unknown)
        self.learned: int | None = None  # capacity read off /metrics when the server does not tell
        self.start_cap = cap if cap and cap > 0 else None  # --concurrency N
        self.live_cap: int | None = None  # genq concurrency N (None: none set)
        self.auto = capacity + headroom(capacity) if capacity else UNKNOWN_CAPACITY_START  # before any cap
        self._last_retractions: float | None = None
        self._last_waiting = self._last_running = 0.0
        self._queue_high = self._gentle = self._backlog = 0  # _backlog: prompts held back at the last look
        # The highest running count seen while requests waited for a slot; looks since it rose; looks
        # since the learned capacity rose.
        self._seen_max = self._since_rise = self._since_learned = 0
        self.reason = "from server capacity" if capacity else "capacity unknown: starting value"
        self.target = 1
        self._update()

    @property
    def cap(self) -> int | None:
        return self.live_cap or self.start_cap

    @property
    def slots(self) -> int | None:
        """The server's capacity: as it tells (SGLang, llama.cpp), else as learned (vLLM)."""
        return self.capacity or self.learned

    def set_cap(self, cap: int | None) -> None:
        """A live limit from `genq concurrency`; None or 0 removes it (back to --concurrency, or auto)."""
        self.live_cap = cap if cap and cap > 0 else None
        self._update()

    @property
    def look_interval_s(self) -> float:
        """Until the next look: shorter while an untold capacity is learned (while prompts are held back)
        and SETTLE_LOOKS after it rose (a step in which nothing finished shows the exact count)."""
        if self.capacity is not None:
            return LOOK_S
        learning = self._backlog > 0 if self.learned is None else self._since_learned < SETTLE_LOOKS
        return LEARN_LOOK_S if learning else LOOK_S

    def set_capacity(self, capacity: int | None) -> None:
        """What the server tells after (re)discovery; one that tells nothing is learned again."""
        if capacity is None and self.learned is not None:
            self.learned = None
            self._seen_max = self._since_rise = 0
            self.reason = "server rediscovered: learning its capacity again"
        elif capacity and capacity != self.capacity:
            self.capacity = capacity
            self._set(capacity + headroom(capacity), "from server capacity")

    def _set(self, auto: int, reason: str) -> None:
        self.auto, self.reason, self._queue_high = auto, reason, 0
        self._update()

    def _update(self) -> None:
        # A plain attribute, not a property: the dispatcher reads it per request.
        self.auto = max(1, min(self.auto, MAX_TARGET))
        self.target = max(1, min(self.auto, self.cap or MAX_TARGET))

    def observe(self, m: Metrics, in_flight: int, backlog: int) -> None:
        """One look at the server's metrics; in_flight is ours, backlog the prompts we hold unsent."""
        if m.running is None:
            return
        running, waiting, self._backlog = m.running, m.waiting or 0.0, backlog
        self._since_learned += 1
        # Waiting for a slot (vLLM tells it apart from requests deferred for other reasons).
        queued = waiting if m.waiting_capacity is None else m.waiting_capacity
        growing, self._last_waiting = waiting > self._last_waiting, waiting
        ramping, self._last_running = running > self._last_running, running  # admitting, not full
        if m.retractions_total is None:  # retracted (SGLang) or preempted (vLLM) since the last look
            retracting = m.retracted is not None and m.retracted > 0
        else:
            last, self._last_retractions = self._last_retractions, m.retractions_total
            retracting = last is not None and m.retractions_total > last
        kv_pressure = m.kv_usage is not None and m.kv_usage >= KV_PRESSURE
        if self.capacity is None and not kv_pressure and not retracting:
            if queued > 0:  # requests wait with memory free: a slot limit, the most that runs
                if int(running) > self._seen_max:
                    self._seen_max, self._since_rise = int(running), 0
                self._since_rise += 1
                if self._since_rise >= LEARN_LOOKS and self._seen_max > (self.learned or 0):
                    self._commit(self._seen_max)
            elif self.learned is not None and running > self.learned:  # whatever runs fits
                self._seen_max = int(running)
                self._commit(self._seen_max)
        capacity = self.slots
        self._gentle = max(0, self._gentle - 1)
        if retracting:  # the KV cache cannot hold what runs: cut to what the server holds, less a tenth
            self._gentle = GENTLE_CHECKS
            self._set(max(1, min(self.auto, int(running + waiting)) - max(1, self.auto // 10)),
                      "lowered: KV cache full (server retracting requests)")
            return

        limited = backlog > 0 and in_flight >= self.target and (self.cap is None or self.auto < self.cap)
        if waiting == 0 and limited and not kv_pressure and (capacity is None or running < capacity):
            # Slots idle while we hold prompts back: feed the server more.
            if self._gentle:
                step = max(1, self.auto // 20)
            elif capacity:
                step = max(1, int(capacity - running))
            elif running + waiting >= 0.9 * self.target:
                step = max(1, self.auto // 2)  # unknown capacity: grow fast to find it
            else:  # what was sent has not all reached the server yet: look again before sending more
                return
            ceiling = 2 * capacity + headroom(capacity) if capacity else MAX_TARGET
            if self.auto < ceiling:
                self._set(min(ceiling, self.auto + step), "raised: server slots idle")
            self._queue_high = 0
            return

        base = capacity or int(running)
        room = headroom(max(base, 1))
        # Ours (once the capacity is known: before, what runs is no base for it) and a headroom more.
        queue_limit = (max(self.auto - base, room) if capacity else room) + room
        settling = capacity is None and ramping  # what runs is no capacity yet
        if waiting > queue_limit and (growing or self._queue_high) and not settling and self.auto > base + room:
            self._queue_high += 1
            if self._queue_high >= QUEUE_RUNAWAY_CHECKS:  # past what refilling slots needs: hold less
                self._set(max(1, base + room), "lowered: server queue growing")
        else:
            self._queue_high = 0

    def _commit(self, capacity: int) -> None:
        # The refill headroom waits in the server: more would only wait, less would idle a freed slot.
        self.learned, self._since_learned, limit = capacity, 0, capacity + headroom(capacity)
        verb = "lowered" if self.auto > limit else "raised" if self.auto < limit else "kept"
        self._set(limit, f"{verb}: learned server capacity {capacity}")


HALF_LIFE_S = 3600.0  # the figures of an hour ago weigh half of this minute's
STORED_TTL_S = 7 * 86400  # a server's stored figures are dropped after a week unused
BINS_PER_OCTAVE = 4  # published bins: exact counts up to 4, then four a doubling
MIN_BUSY_S = 0.05  # a bin with less than this many request-seconds is not published


class Running(dict["Task", "asyncio.Task[None]"]):
    """The requests in flight and the sequences they are on the server (each of n choices is one)."""

    def __init__(self) -> None:
        super().__init__()
        self.sequences = 0
        self.meter = DecodeMeter()

    def __setitem__(self, task: Task, aio: asyncio.Task[None]) -> None:
        if task not in self:
            self.sequences += task.progress.sequences
            self.meter.sent(task.progress)
        super().__setitem__(task, aio)

    def pop(self, task: Task, default: Any = None) -> Any:
        if task in self:
            self.sequences -= task.progress.sequences
            self.meter.ended(task.progress)
        return super().pop(task, default)


class DecodeMeter:
    """Request-seconds and streamed tokens by `d` sequences decoding (first token to end), apart while some
    request waits for its first token ("clean": none does); halved every HALF_LIFE_S."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.decoding = 0  # sequences between their first token and their end
        self.waiting = 0  # sequences sent that have no token yet
        self._since = self._decayed_at = clock()
        self.bins: dict[tuple[int, bool], list[float]] = {}  # (decoding, clean) -> [request-seconds, tokens]
        self.news = False  # tokens booked since the figures were last stored

    def _account(self, now: float) -> list[float] | None:
        d, since, self._since = self.decoding, self._since, now
        if d <= 0:
            return None
        b = self.bins.setdefault((d, self.waiting <= 0), [0.0, 0.0])
        b[0] += d * (now - since)
        return b

    def sent(self, progress: Progress) -> None:
        if not progress.decoding and not progress.waiting:
            self._account(self.clock())
            progress.waiting = True
            self.waiting += progress.sequences

    def advance(self, progress: Progress, tokens: int) -> None:
        """A streamed request has made `tokens` in all (a first chunk's tokens are the prefill's)."""
        if tokens <= progress.tokens:
            progress.tokens = tokens
            return
        b = self._account(self.clock())
        if progress.decoding:
            if b is not None:
                b[1] += tokens - progress.tokens
                self.news = True
        else:  # its first token: it decodes from now on
            self.decoding += progress.sequences
            self.waiting -= progress.sequences if progress.waiting else 0
            progress.decoding, progress.waiting = True, False
        progress.tokens = tokens

    def ended(self, progress: Progress) -> None:
        if progress.decoding or progress.waiting:
            self._account(self.clock())
        self.waiting -= progress.sequences if progress.waiting else 0
        self.decoding -= progress.sequences if progress.decoding else 0
        progress.decoding = progress.waiting = False

    def figures(self) -> list[DecodeBin]:
        """The bins merged to BINS_PER_OCTAVE a doubling, after the decay: what the worker publishes."""
        now = self.clock()
        self._account(now)
        factor = 0.5 ** ((now - self._decayed_at) / HALF_LIFE_S)
        self._decayed_at = now
        merged: dict[tuple[int, bool], list[float]] = {}
        for (d, clean), b in self.bins.items():
            b[0] *= factor
            b[1] *= factor
            key = (d if d <= BINS_PER_OCTAVE else round(BINS_PER_OCTAVE * math.log2(d)) + BINS_PER_OCTAVE * 8, clean)
            m = merged.setdefault(key, [0.0, 0.0, 0.0])
            m[0] += b[0]
            m[1] += b[1]
            m[2] += d * b[0]
        return [DecodeBin(decoding=round(m[2] / m[0], 2), busy_s=round(m[0], 3), tokens=round(m[1], 1), clean=clean)
                for (_, clean), m in sorted(merged.items()) if m[0] >= MIN_BUSY_S]


async def load(conn: aioredis.Redis, meter: DecodeMeter, server: str, model: str) -> None:
    """Begin from what earlier workers measured on this server, decayed by its age."""
    if (stored := await fleet.server_decode(conn, server, model)) is None:
        return
    factor = 0.5 ** (max(0.0, time.time() - stored.at) / HALF_LIFE_S)
    for b in stored.bins:
        mine = meter.bins.setdefault((max(1, round(b.decoding)), b.clean), [0.0, 0.0])
        mine[0] += b.busy_s * factor
        mine[1] += b.tokens * factor


def store(pipe: Pipeline, meter: DecodeMeter, bins: list[DecodeBin], server: str, model: str, worker: str) -> None:
    """Stores the figures in a beat's pipeline when tokens were booked since the last time."""
    if meter.news and bins:
        fleet.stage_server_decode(pipe, server, model, ServerDecode(at=time.time(), worker=worker, bins=bins),
                                  STORED_TTL_S)
        meter.news = False


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
    weight, weight_from = ((opts.model_bytes, "--model-bytes") if opts.model_bytes is not None
                           else (memory.weight_bytes, memory.weight_from))
    return msgspec.structs.replace(memory, engine=info.flavor if info else None, bandwidth=bandwidth,
                                   bandwidth_from=told, weight_bytes=weight, weight_from=weight_from)
