"""Prometheus metrics for `genq monitor --metrics [HOST]:PORT`, from the same Monitor as every view. Label
values never grow with time (fixed code sets, each 0 or 1); a down worker is exported as down without figures,
then not at all after FORGET_AFTER_S. The genq job is the `job` label (docs/monitoring.md)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from genq.core.decodebound import CAPS, CODES
from genq.core.ledger.figures import JOB_STATUSES
from genq.core.records import GpuSample
from genq.core.redisconn import NOTE_REASONS
from genq.monitor.progress import DOWN, ETA_STATES, WORKER_STATES, JobReport, Monitor, WorkerReport

log = logging.getLogger("genq.monitor")

FORGET_AFTER_S = 600.0
BLOCK_REASONS = ("preflight", "brake")  # JobBlock.reason: a fixed set, so no series appears with time

# Each per-job gauge and the JobProgress field it shows.
JOB_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("genq_job_prompts", "Prompts enqueued", "total"),
    ("genq_job_prompts_completed", "Prompts with a result", "completed"),
    ("genq_job_prompts_failed", "Prompts in the dead-letter queue", "failed"),
    ("genq_job_prompts_in_flight", "Prompts being generated now", "in_flight"),
    ("genq_job_prompts_queued", "Prompts not started (queued, held unsent, or elsewhere)", "queued"),
    ("genq_job_prompts_held", "Unsent prompts in batches workers hold", "held"),
    ("genq_job_batches", "Batches enqueued", "batches_total"),
    ("genq_job_batches_written", "Batches whose shard is written", "batches_done"),
    ("genq_job_batches_held", "Batches held by live workers", "held_batches"),
    ("genq_job_batches_queued", "The job's batches in RQ's queue", "queued_batches"),
    ("genq_job_batches_elsewhere", "Batches neither written, held nor queued (retrying, failed, orphaned)",
     "other_batches"),
    ("genq_job_prompts_per_second", "Prompts finished per second (recent; whole run once done)", "rate_per_sec"),
    ("genq_job_output_tokens_per_second", "Output tokens per second (recent; whole run once done)",
     "output_tokens_per_sec"),
    ("genq_job_eta_seconds", "Estimated seconds until the job is done (median)", "eta_s"),
    ("genq_job_eta_low_seconds", "Low end of the ETA's 90% range", "eta_low_s"),
    ("genq_job_eta_high_seconds", "High end of the ETA's 90% range", "eta_high_s"),
    ("genq_job_expected_output_tokens", "Fitted mean completion length (running ones included)",
     "expected_output_tokens"),
    ("genq_job_remaining_output_tokens", "Expected output tokens still to generate", "remaining_output_tokens"),
    ("genq_job_shards", "Shards written", "shards"),
    ("genq_job_shard_bytes", "Bytes of shards written", "s3_bytes"),
    ("genq_job_workers", "Live workers working on the job", "workers"),
    ("genq_job_workers_lost", "Workers of the job whose heartbeat expired", "workers_lost"),
    ("genq_job_input_tokens", "Prompt tokens of finished prompts", "total_input_tokens"),
    ("genq_job_output_tokens", "Completion tokens of finished prompts", "total_output_tokens"),
)
# The same for each live worker's gauges and the WorkerReport field each shows.
WORKER_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("genq_worker_in_flight", "Requests in flight (all jobs)", "in_flight"),
    ("genq_worker_concurrency_target", "In-flight target", "concurrency_target"),
    ("genq_worker_server_capacity", "Server's max running requests", "server_capacity"),
    ("genq_worker_server_running", "Requests the server is decoding", "server_running"),
    ("genq_worker_server_waiting", "Requests waiting in the server's queue", "server_waiting"),
    ("genq_worker_slot_utilization_ratio", "server_running / server_capacity (0-1)", "slot_utilization"),
    ("genq_worker_kv_cache_usage_ratio", "Share of the KV cache in use (0-1)", "kv_cache_usage"),
    ("genq_worker_output_tokens_per_second", "Output tokens per second (the server's generation counter over 5 s; "
     "finished answers over 30 s where it has none)", "tok_per_s"),
    ("genq_worker_requests_per_second", "Requests finished per second (worker's 30 s window)", "req_per_s"),
    ("genq_worker_errors", "Failed request attempts since the worker started", "errors"),
)
# The same for each (job, worker) pair and the WorkerReport field each shows.
PAIR_GAUGES: tuple[tuple[str, str, str], ...] = (
    ("genq_job_worker_prompts_completed", "Prompts completed by the worker", "job_completed"),
    ("genq_job_worker_prompts_failed", "The worker's dead letters still in the job's DLQ", "job_failed"),
    ("genq_job_worker_output_tokens", "Completion tokens by the worker", "job_output_tokens"),
    ("genq_job_worker_in_flight", "The job's requests in flight on the worker", "job_in_flight"),
)
# Those of the tables above that only grow: exported as counters (NAME_total).
COUNTERS = frozenset(("genq_job_input_tokens", "genq_job_output_tokens", "genq_worker_errors",
                      "genq_job_worker_prompts_completed", "genq_job_worker_output_tokens"))
# The same for each GPU: (metric, help, its figure from the worker's GpuSample, None when not measured).
GPU_GAUGES: tuple[tuple[str, str, Callable[[GpuSample], float | None]], ...] = (
    ("genq_gpu_utilization_ratio", "GPU utilization (NVML, 0-1)", lambda g: g.utilization_pct / 100.0),
    ("genq_gpu_memory_used_bytes", "GPU memory in use", lambda g: g.memory_used_mib * 2**20),
    ("genq_gpu_memory_total_bytes", "GPU memory", lambda g: g.memory_total_mib * 2**20),
    ("genq_gpu_power_watts", "GPU power draw", lambda g: g.power_w),
    ("genq_gpu_temperature_celsius", "GPU temperature", lambda g: g.temperature_c),
    ("genq_gpu_sm_clock_hertz", "GPU SM clock", lambda g: None if g.sm_clock_mhz is None else g.sm_clock_mhz * 1e6),
)


def parse_listen(value: str, option: str = "--metrics") -> tuple[str, int]:
    """':9108' -> ('0.0.0.0', 9108); 'host:9108' -> ('host', 9108)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{option} {value!r}: expected [HOST]:PORT, e.g. :9108 or 127.0.0.1:9108")
    return host.strip("[]") or "0.0.0.0", int(port)


def _gauge(name: str, doc: str, labels: list[str], rows: Iterable[tuple[list[str], float | None]]) -> Metric:
    """A family of these (labels, value) rows, a counter if in COUNTERS; an unknown value (None) stays absent."""
    fam = (CounterMetricFamily if name in COUNTERS else GaugeMetricFamily)(name, doc, labels=labels)
    for lab, value in rows:
        if value is not None:
            fam.add_metric(lab, float(value))
    return fam


def _one_of(name: str, doc: str, labels: list[str], label: str, codes: Iterable[str],
            rows: Iterable[tuple[list[str], Collection[str]]]) -> Metric:
    """An enum: every code exported, 1 for those that hold and 0 for the others (an alert is `== 1`)."""
    return _gauge(name, doc, [*labels, label], [([*lab, c], float(c in held)) for lab, held in rows for c in codes])


class GenqCollector(Collector):
    def __init__(self, monitor: Monitor, *, max_age: float = 1.0, forget_after_s: float = FORGET_AFTER_S) -> None:
        self.monitor, self.max_age, self.forget_after_s = monitor, max_age, forget_after_s
        self.down_since: dict[str, float] = {}  # worker -> when this exporter first saw it stopped or lost

    def collect(self) -> Iterator[Metric]:
        up: tuple[str, str, list[str]] = ("genq_monitor_redis_up", "1 when the last scrape could read Redis", [])
        try:
            reports = self.monitor.current(self.max_age)
        except Exception as exc:  # a scrape must answer even when Redis does not
            log.warning("scrape: %s", exc)
            yield _gauge(*up, [([], 0.0)])
            return
        yield _gauge(*up, [([], 1.0)])
        yield _gauge("genq_rq_queue_batches", "Batches in RQ's genq queue, every job (rq info)", [],
                     [([], float(self.monitor.queue.total))])
        note = self.monitor.redis_note
        yield _one_of("genq_redis_warning", "1 while Redis refuses writes (full, no_disk, replica) or its "
                      "maxmemory-policy would evict genq's keys (evicting_policy)", [], "reason", NOTE_REASONS,
                      [([], () if note is None else (note.reason,))])
        yield from job_metrics(reports)
        yield from worker_metrics(reports, self.monitor.fleet, self._shown(self.monitor.fleet))

    def _shown(self, fleet: list[WorkerReport]) -> set[str]:
        """Live workers, and down ones until they have been down for forget_after_s."""
        now = time.time()
        for w in fleet:
            if w.state not in DOWN:
                self.down_since.pop(w.name, None)
            elif w.heartbeat_age_s is not None:  # a stopped worker says when it stopped
                self.down_since[w.name] = min(self.down_since.get(w.name, now), now - w.heartbeat_age_s)
            else:
                self.down_since.setdefault(w.name, now)
        return {w.name for w in fleet
                if w.name not in self.down_since or now - self.down_since[w.name] < self.forget_after_s}


def job_metrics(reports: list[JobReport]) -> Iterator[Metric]:
    ps = [r.progress for r in reports]
    for name, doc, field in JOB_GAUGES:
        yield _gauge(name, doc, ["job"], [([p.job], getattr(p, field)) for p in ps])
    yield _gauge("genq_job_in_tail", "1 while the job is in its tail (nothing left to start, most slots idle)",
                 ["job"], [([p.job], p.tail is not None) for p in ps])
    yield _one_of("genq_job_status", "1 for the job's status, 0 for the others", ["job"], "status", JOB_STATUSES,
                  [([p.job], (p.status,)) for p in ps])
    yield _one_of("genq_job_eta_state", "1 for the ETA's state, 0 for the others", ["job"], "state", ETA_STATES,
                  [([p.job], (p.eta_state,)) for p in ps])
    yield _one_of("genq_job_blocked", "1 while the job is blocked for this reason (docs/settings.md), 0 otherwise",
                  ["job"], "reason", BLOCK_REASONS, [([p.job], (p.blocked_reason or "",)) for p in ps])


def worker_metrics(reports: list[JobReport], fleet: list[WorkerReport], shown: set[str]) -> Iterator[Metric]:
    """Per worker from the fleet (every worker in genq:workers); per (job, worker) from the job reports."""
    state = {w.name: "lost" if w.state == "gone" else w.state for w in fleet if w.name in shown}
    live = [w for w in fleet if w.name in state and state[w.name] not in DOWN]
    yield _gauge("genq_worker_up", "1 while the worker heartbeats and runs; 0 when stopped, silent or lost", ["worker"],
                 [([w.name], w in live) for w in fleet if w.name in state])
    yield _one_of("genq_worker_state", "1 for the worker's state, 0 for the others", ["worker"], "state",
                  WORKER_STATES, [([name], (s,)) for name, s in state.items()])
    for name, doc, field in WORKER_GAUGES:
        yield _gauge(name, doc, ["worker"], [([w.name], getattr(w, field)) for w in live])
    yield _one_of("genq_worker_bottleneck", "1 for each code that limits the worker now, 0 for the others",
                  ["worker"], "reason", CODES, [([w.name], w.bottleneck_codes) for w in live])
    judged = [(w.name, w.bound) for w in live if w.bound is not None]
    yield _gauge("genq_worker_decode_bound_tokens_per_second",
                 "Decode bound: running x memory bandwidth / (weight + KV bytes read a step)", ["worker"],
                 [([n], v.bound.tok_per_s) for n, v in judged])
    yield _gauge("genq_worker_decode_bound_ratio", "Output tokens/s over the decode bound (0-1)", ["worker"],
                 [([n], v.bound.share) for n, v in judged])
    yield _one_of("genq_worker_batch_cap", "1 for what caps the server's running batch now, 0 for the others",
                  ["worker"], "reason", CAPS, [([n], () if v.cap is None else (v.cap.code,)) for n, v in judged])
    yield _gauge("genq_worker_slow", "1 while the GPU is much slower than its peers (share of the bound)", ["worker"],
                 [([n], v.slow is not None) for n, v in judged])
    # Only (job, worker) pairs with something to say: not a zero for every live worker under every job ever run.
    pairs = [([r.progress.job, w.name], w) for r in reports for w in r.progress.worker_details if w.name in shown
             and (w.job_completed or w.job_failed or w.job_output_tokens or w.job_in_flight)]
    for name, doc, field in PAIR_GAUGES:
        yield _gauge(name, doc, ["job", "worker"], [(lab, getattr(w, field)) for lab, w in pairs])
    gpus = [([w.name, str(w.gpu.index), w.gpu.name], w.gpu) for w in live if w.gpu is not None]
    for name, doc, value in GPU_GAUGES:
        yield _gauge(name, doc, ["worker", "gpu", "name"], [(lab, value(g)) for lab, g in gpus])


def make_registry(monitor: Monitor, max_age: float = 1.0, **options) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GenqCollector(monitor, max_age=max_age, **options))
    return registry


def serve(monitor: Monitor, listen: str, max_age: float = 1.0):
    """Start the HTTP endpoint in a background thread; returns (server, thread)."""
    from prometheus_client import start_http_server

    host, port = parse_listen(listen)
    return start_http_server(port, addr=host, registry=make_registry(monitor, max_age))
