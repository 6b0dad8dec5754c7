"""Prometheus metrics for `genq monitor --serve [HOST]:PORT`.

A custom collector: every scrape reads Redis through the same Monitor the
view uses (so the throughput samples and the ETA are shared), and turns the
reports into metric families labelled by job and worker. Nothing is cached
between scrapes except the monitor's throughput samples.

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
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from genq.monitor.progress import JobReport, Monitor, WorkerReport

log = logging.getLogger("genq.monitor")


def parse_listen(value: str) -> tuple[str, int]:
    """':9108' -> ('0.0.0.0', 9108); 'host:9108' -> ('host', 9108)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--serve {value!r}: expected [HOST]:PORT, e.g. :9108 or 127.0.0.1:9108")
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


class GenqCollector(Collector):
    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def collect(self) -> Iterator[Metric]:
        try:
            reports = self.monitor.refresh()
            up = 1.0
        except Exception as exc:  # a scrape must answer even when Redis does not
            log.warning("scrape: %s", exc)
            reports, up = [], 0.0
        g = GaugeMetricFamily("genq_monitor_redis_up", "1 when the last scrape could read Redis")
        g.add_metric([], up)
        yield g
        yield from job_metrics(reports)
        yield from worker_metrics(reports)


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def job_metrics(reports: list[JobReport]) -> Iterator[Metric]:
    J = ["job"]
    fams = {
        "total": _gauge("genq_job_prompts", "Prompts enqueued", J),
        "completed": _gauge("genq_job_prompts_completed", "Prompts with a result", J),
        "failed": _gauge("genq_job_prompts_failed", "Prompts in the dead-letter queue", J),
        "in_flight": _gauge("genq_job_prompts_in_flight", "Prompts being generated now", J),
        "queued": _gauge("genq_job_prompts_queued", "Prompts not started (queued or held by a worker)", J),
        "rate": _gauge("genq_job_prompts_per_second", "Prompts finished per second (recent window)", J),
        "tok_s": _gauge("genq_job_output_tokens_per_second", "Output tokens generated per second (recent window)", J),
        "eta": _gauge("genq_job_eta_seconds", "Estimated seconds until the job is done (median)", J),
        "eta_low": _gauge("genq_job_eta_low_seconds", "Low end of the ETA's 90% range", J),
        "eta_high": _gauge("genq_job_eta_high_seconds", "High end of the ETA's 90% range", J),
        "expected": _gauge("genq_job_expected_output_tokens", "Fitted mean completion length (running ones included)", J),
        "remaining": _gauge("genq_job_remaining_output_tokens", "Expected output tokens still to generate", J),
        "shards": _gauge("genq_job_shards", "Shards written", J),
        "shard_bytes": _gauge("genq_job_shard_bytes", "Bytes of shards written", J),
        "workers": _gauge("genq_job_workers", "Live workers working on the job", J),
        "lost": _gauge("genq_job_workers_lost", "Workers of the job whose heartbeat expired", J),
    }
    in_tok = CounterMetricFamily("genq_job_input_tokens", "Prompt tokens of finished prompts", labels=J)
    out_tok = CounterMetricFamily("genq_job_output_tokens", "Completion tokens of finished prompts", labels=J)
    info = GaugeMetricFamily("genq_job_info", "1, labelled with the job's status and ETA state",
                             labels=["job", "status", "eta_state"])
    for r in reports:
        p = r.progress
        lab = [p.job]
        values = {
            "total": p.total, "completed": p.completed, "failed": p.failed, "in_flight": p.in_flight,
            "queued": p.queued, "rate": p.rate_per_sec, "tok_s": p.output_tokens_per_sec,
            "eta": p.eta_s, "eta_low": p.eta_low_s, "eta_high": p.eta_high_s,
            "expected": p.expected_output_tokens, "remaining": p.remaining_output_tokens,
            "shards": p.shards, "shard_bytes": p.s3_bytes, "workers": p.workers, "lost": p.workers_lost,
        }
        for key, value in values.items():
            if value is not None:  # unknown stays absent rather than a made-up 0
                fams[key].add_metric(lab, float(value))
        in_tok.add_metric(lab, float(p.total_input_tokens))
        out_tok.add_metric(lab, float(p.total_output_tokens))
        info.add_metric([p.job, p.status, p.eta_state], 1.0)
    yield from fams.values()
    yield in_tok
    yield out_tok
    yield info


def worker_metrics(reports: list[JobReport]) -> Iterator[Metric]:
    W = ["worker"]
    JW = ["job", "worker"]
    G = ["worker", "gpu", "name"]
    up = _gauge("genq_worker_up", "1 while the worker heartbeats, 0 when lost", ["worker", "state"])
    fams = {
        "in_flight": _gauge("genq_worker_in_flight", "Requests in flight (all jobs)", W),
        "target": _gauge("genq_worker_concurrency_target", "In-flight target", W),
        "capacity": _gauge("genq_worker_server_capacity", "Server's max running requests", W),
        "running": _gauge("genq_worker_server_running", "Requests the server is decoding", W),
        "waiting": _gauge("genq_worker_server_waiting", "Requests waiting in the server's queue", W),
        "util": _gauge("genq_worker_slot_utilization", "server_running / server_capacity", W),
        "kv": _gauge("genq_worker_kv_cache_usage", "Share of the KV cache in use", W),
        "tok_s": _gauge("genq_worker_output_tokens_per_second", "Output tokens per second (worker's 30 s window)", W),
        "req_s": _gauge("genq_worker_requests_per_second", "Requests finished per second (worker's 30 s window)", W),
    }
    errors = CounterMetricFamily("genq_worker_errors", "Failed request attempts since the worker started", labels=W)
    bottleneck = _gauge("genq_worker_bottleneck", "1 per current bottleneck of the worker", ["worker", "reason"])
    job_done = CounterMetricFamily("genq_job_worker_prompts_completed", "Prompts completed by the worker", labels=JW)
    job_out = CounterMetricFamily("genq_job_worker_output_tokens", "Completion tokens by the worker", labels=JW)
    job_inflight = _gauge("genq_job_worker_in_flight", "The job's requests in flight on the worker", JW)
    gpu = {
        "util": _gauge("genq_gpu_utilization_percent", "GPU utilization (NVML)", G),
        "mem": _gauge("genq_gpu_memory_used_bytes", "GPU memory in use", G),
        "mem_total": _gauge("genq_gpu_memory_total_bytes", "GPU memory", G),
        "power": _gauge("genq_gpu_power_watts", "GPU power draw", G),
        "temp": _gauge("genq_gpu_temperature_celsius", "GPU temperature", G),
        "clock": _gauge("genq_gpu_sm_clock_hertz", "GPU SM clock", G),
    }
    seen: dict[str, WorkerReport] = {}
    for r in reports:
        for w in r.progress.worker_details:
            job_done.add_metric([r.progress.job, w.name], float(w.job_completed))
            job_out.add_metric([r.progress.job, w.name], float(w.job_output_tokens))
            job_inflight.add_metric([r.progress.job, w.name], float(w.job_in_flight))
            seen.setdefault(w.name, w)
    for w in seen.values():
        lab = [w.name]
        up.add_metric([w.name, w.state], 0.0 if w.state == "lost" else 1.0)
        for reason in w.bottlenecks:
            bottleneck.add_metric([w.name, reason], 1.0)
        if w.state == "lost":
            continue
        values = {
            "in_flight": w.in_flight, "target": w.concurrency_target, "capacity": w.server_capacity,
            "running": w.server_running, "waiting": w.server_waiting, "util": w.slot_utilization,
            "kv": w.kv_cache_usage, "tok_s": w.tok_per_s, "req_s": w.req_per_s,
        }
        for key, value in values.items():
            if value is not None:
                fams[key].add_metric(lab, float(value))
        errors.add_metric(lab, float(w.errors))
        if w.gpu is not None:
            s = w.gpu
            glab = [w.name, str(s.index), s.name]
            gpu["util"].add_metric(glab, s.utilization_pct)
            gpu["mem"].add_metric(glab, s.memory_used_mib * 2**20)
            gpu["mem_total"].add_metric(glab, s.memory_total_mib * 2**20)
            for key, value, scale in (("power", s.power_w, 1.0), ("temp", s.temperature_c, 1.0),
                                      ("clock", s.sm_clock_mhz, 1e6)):
                if value is not None:
                    gpu[key].add_metric(glab, value * scale)
    yield up
    yield from fams.values()
    yield errors
    yield bottleneck
    yield job_done
    yield job_out
    yield job_inflight
    yield from gpu.values()


def make_registry(monitor: Monitor) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(GenqCollector(monitor))
    return registry


def serve(monitor: Monitor, listen: str):
    """Start the HTTP endpoint in a background thread; returns (server, thread)."""
    from prometheus_client import start_http_server

    host, port = parse_listen(listen)
    return start_http_server(port, addr=host, registry=make_registry(monitor))
