"""Prometheus metrics for `genq monitor --serve [HOST]:PORT`.

A custom collector: every scrape reads Redis through the same Monitor the
view uses (so the throughput samples and the ETA are shared), and turns the
reports into metric families labelled by job and worker. Reports are cached
for one refresh interval: a second Prometheus (or a page poll) in between
does not recompute the ETA.

Label values never grow with time: workers and jobs are names, states and
bottlenecks are fixed sets of codes (an enum-style metric per set, every code
exported with 0 or 1, so a state change does not start a new series). A
stopped or lost worker is exported as down (genq_worker_up 0) without its last
figures, and not at all once it has been down for FORGET_AFTER_S: genq:workers
keeps every name that ever heartbeated, and Prometheus must not.

The genq job is the `job` label. Prometheus gives every target a `job` label
of its own (the scrape job) and renames a clashing one to `exported_job`
unless the scrape config says `honor_labels: true`, which it should here:

    scrape_configs:
      - job_name: genq
        honor_labels: true
        static_configs: [{targets: ["monitor-host:9108"]}]

dashboards/grafana-genq.json is built on these metric names.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from genq.core.decodebound import CAPS
from genq.core.health import CODES
from genq.core.refusals import NOTE_REASONS, RedisNote
from genq.core.state import JOB_STATUSES
from genq.monitor.progress import JobReport, Monitor, WorkerReport

log = logging.getLogger("genq.monitor")

FORGET_AFTER_S = 600.0
BLOCK_REASONS = ("preflight", "brake")  # JobBlock.reason: a fixed set, so no series appears with time
ETA_STATES = ("warming up", "estimating", "steady", "stalled", "paused", "done")
WORKER_STATES = ("starting", "busy", "idle", "paused", "draining", "server_down", "stopped", "lost")


def parse_listen(value: str, option: str = "--metrics") -> tuple[str, int]:
    """':9108' -> ('0.0.0.0', 9108); 'host:9108' -> ('host', 9108)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{option} {value!r}: expected [HOST]:PORT, e.g. :9108 or 127.0.0.1:9108")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class GenqCollector(Collector):
    def __init__(self, monitor: Monitor, *, max_age: float = 1.0, forget_after_s: float = FORGET_AFTER_S,
                 clock=time.time) -> None:
        self.monitor = monitor
        self.max_age = max_age
        self.forget_after_s = forget_after_s
        self.clock = clock
        self.down_since: dict[str, float] = {}  # worker -> when this exporter first saw it stopped or lost

    def collect(self) -> Iterator[Metric]:
        try:
            reports = self.monitor.current(self.max_age)
            up = 1.0
        except Exception as exc:  # a scrape must answer even when Redis does not
            log.warning("scrape: %s", exc)
            reports, up = [], 0.0
        g = GaugeMetricFamily("genq_monitor_redis_up", "1 when the last scrape could read Redis")
        g.add_metric([], up)
        yield g
        if up:
            rq = GaugeMetricFamily("genq_rq_queue_batches", "Batches in RQ's genq queue, every job (rq info)")
            rq.add_metric([], float(self.monitor.rq_queued))
            yield rq
            yield redis_warning(self.monitor.redis_note)
        fleet = self.monitor.fleet if up else []
        yield from job_metrics(reports)
        yield from worker_metrics(reports, fleet, self._shown(fleet))

    def _shown(self, fleet: list[WorkerReport]) -> set[str]:
        """Workers to export: live ones, and down ones until they have been down for forget_after_s."""
        now = self.clock()
        shown: set[str] = set()
        for w in fleet:
            if w.state not in ("stopped", "lost", "gone"):
                self.down_since.pop(w.name, None)
                shown.add(w.name)
                continue
            since = self.down_since.setdefault(w.name, now)
            if w.heartbeat_age_s is not None:  # a stopped worker says when it stopped
                since = min(since, now - w.heartbeat_age_s)
            if now - since < self.forget_after_s:
                shown.add(w.name)
        return shown


def redis_warning(note: RedisNote | None) -> GaugeMetricFamily:
    """1 for the reason Redis refuses genq's writes or would evict its keys now, 0 for the others:
    every reason always present, so an alert is a plain `== 1` (docs/monitoring.md)."""
    g = GaugeMetricFamily("genq_redis_warning", "1 while Redis refuses writes (full, no_disk, replica) or its "
                          "maxmemory-policy would evict genq's keys (evicting_policy)", labels=["reason"])
    for reason in NOTE_REASONS:
        g.add_metric([reason], float(note is not None and note.reason == reason))
    return g


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


# Each per-job gauge and the JobProgress field it shows: the one mapping from the monitor's record
# (which `--json`, the terminal view and the web page read as it is) to Prometheus.
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
    ("genq_job_batches_elsewhere", "Batches neither written, held nor queued (retrying, failed in RQ, orphaned)",
     "other_batches"),
    ("genq_job_prompts_per_second", "Prompts finished per second (recent window; whole run once done)",
     "rate_per_sec"),
    ("genq_job_output_tokens_per_second", "Output tokens per second (recent window; whole run once done)",
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
)


def job_metrics(reports: list[JobReport]) -> Iterator[Metric]:
    J = ["job"]
    fams = {field: _gauge(name, doc, J) for name, doc, field in JOB_GAUGES}
    tail = _gauge("genq_job_in_tail", "1 while the job is in its tail (nothing left to start, most slots idle)", J)
    in_tok = CounterMetricFamily("genq_job_input_tokens", "Prompt tokens of finished prompts", labels=J)
    out_tok = CounterMetricFamily("genq_job_output_tokens", "Completion tokens of finished prompts", labels=J)
    status = _gauge("genq_job_status", "1 for the job's status, 0 for the others", ["job", "status"])
    eta_state = _gauge("genq_job_eta_state", "1 for the ETA's state, 0 for the others", ["job", "state"])
    blocked = _gauge("genq_job_blocked", "1 while the job is blocked for this reason (docs/settings.md), 0 otherwise",
                     ["job", "reason"])
    for r in reports:
        p = r.progress
        lab = [p.job]
        for field, fam in fams.items():
            value = getattr(p, field)
            if value is not None:  # unknown stays absent rather than a made-up 0
                fam.add_metric(lab, float(value))
        tail.add_metric(lab, float(p.tail is not None))
        in_tok.add_metric(lab, float(p.total_input_tokens))
        out_tok.add_metric(lab, float(p.total_output_tokens))
        for job_state in JOB_STATUSES:
            status.add_metric([p.job, job_state], float(p.status == job_state))
        for eta_code in ETA_STATES:
            eta_state.add_metric([p.job, eta_code], float(p.eta_state == eta_code))
        for reason in BLOCK_REASONS:
            blocked.add_metric([p.job, reason], float(p.blocked_reason == reason))
    yield from fams.values()
    yield tail
    yield in_tok
    yield out_tok
    yield status
    yield eta_state
    yield blocked


def worker_metrics(reports: list[JobReport], fleet: list[WorkerReport], shown: set[str]) -> Iterator[Metric]:
    """Per worker from the fleet (every worker in genq:workers); per (job, worker) from the job reports."""
    W = ["worker"]
    JW = ["job", "worker"]
    G = ["worker", "gpu", "name"]
    up = _gauge("genq_worker_up", "1 while the worker heartbeats and runs; 0 when stopped or lost", W)
    state = _gauge("genq_worker_state", "1 for the worker's state, 0 for the others", ["worker", "state"])
    fams = {field: _gauge(name, doc, W) for name, doc, field in WORKER_GAUGES}
    errors = CounterMetricFamily("genq_worker_errors", "Failed request attempts since the worker started", labels=W)
    bound = _gauge("genq_worker_decode_bound_tokens_per_second",
                   "Decode bound: running x memory bandwidth / (weight + KV bytes read a step)", W)
    bound_share = _gauge("genq_worker_decode_bound_ratio", "Output tokens/s over the decode bound (0-1)", W)
    batch_cap = _gauge("genq_worker_batch_cap", "1 for what caps the server's running batch now, 0 for the others",
                       ["worker", "reason"])
    slow = _gauge("genq_worker_slow", "1 while the GPU is much slower than its peers (share of the bound)", W)
    bottleneck = _gauge("genq_worker_bottleneck", "1 for each code that limits the worker now, 0 for the others",
                        ["worker", "reason"])
    job_done = CounterMetricFamily("genq_job_worker_prompts_completed", "Prompts completed by the worker", labels=JW)
    job_out = CounterMetricFamily("genq_job_worker_output_tokens", "Completion tokens by the worker", labels=JW)
    job_inflight = _gauge("genq_job_worker_in_flight", "The job's requests in flight on the worker", JW)
    gpu = {
        "util": _gauge("genq_gpu_utilization_ratio", "GPU utilization (NVML, 0-1)", G),
        "mem": _gauge("genq_gpu_memory_used_bytes", "GPU memory in use", G),
        "mem_total": _gauge("genq_gpu_memory_total_bytes", "GPU memory", G),
        "power": _gauge("genq_gpu_power_watts", "GPU power draw", G),
        "temp": _gauge("genq_gpu_temperature_celsius", "GPU temperature", G),
        "clock": _gauge("genq_gpu_sm_clock_hertz", "GPU SM clock", G),
    }
    for r in reports:
        for w in r.progress.worker_details:
            if w.name not in shown:
                continue
            # Only pairs with something to say: not a zero for every live worker under every job ever run.
            if w.job_completed or w.job_failed or w.job_output_tokens or w.job_in_flight:
                job_done.add_metric([r.progress.job, w.name], float(w.job_completed))
                job_out.add_metric([r.progress.job, w.name], float(w.job_output_tokens))
                job_inflight.add_metric([r.progress.job, w.name], float(w.job_in_flight))
    for w in fleet:
        if w.name not in shown:
            continue
        lab = [w.name]
        worker_state = "lost" if w.state == "gone" else w.state
        live = worker_state not in ("stopped", "lost")
        up.add_metric(lab, float(live))
        for code in WORKER_STATES:
            state.add_metric([w.name, code], float(worker_state == code))
        if not live:
            continue  # its last figures are not figures of now
        for code in CODES:
            bottleneck.add_metric([w.name, code], float(code in w.bottleneck_codes))
        for field, fam in fams.items():
            value = getattr(w, field)
            if value is not None:
                fam.add_metric(lab, float(value))
        errors.add_metric(lab, float(w.errors))
        if w.bound is not None:
            if w.bound.bound.tok_per_s is not None:
                bound.add_metric(lab, w.bound.bound.tok_per_s)
            if w.bound.bound.share is not None:
                bound_share.add_metric(lab, w.bound.bound.share)
            for code in CAPS:
                batch_cap.add_metric([w.name, code], float(w.bound.cap is not None and w.bound.cap.code == code))
            slow.add_metric(lab, float(w.bound.slow is not None))
        if w.gpu is not None:
            s = w.gpu
            glab = [w.name, str(s.index), s.name]
            gpu["util"].add_metric(glab, s.utilization_pct / 100.0)
            gpu["mem"].add_metric(glab, s.memory_used_mib * 2**20)
            gpu["mem_total"].add_metric(glab, s.memory_total_mib * 2**20)
            for key, value, scale in (("power", s.power_w, 1.0), ("temp", s.temperature_c, 1.0),
                                      ("clock", s.sm_clock_mhz, 1e6)):
                if value is not None:
                    gpu[key].add_metric(glab, value * scale)
    yield up
    yield state
    yield from fams.values()
    yield errors
    yield bottleneck
    yield bound
    yield bound_share
    yield batch_cap
    yield slow
    yield job_done
    yield job_out
    yield job_inflight
    yield from gpu.values()


def make_registry(monitor: Monitor, max_age: float = 1.0, **options) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GenqCollector(monitor, max_age=max_age, **options))
    return registry


def serve(monitor: Monitor, listen: str, max_age: float = 1.0):
    """Start the HTTP endpoint in a background thread; returns (server, thread)."""
    from prometheus_client import start_http_server

    host, port = parse_listen(listen)
    return start_http_server(port, addr=host, registry=make_registry(monitor, max_age))
