"""`genq monitor --metrics`: Prometheus metrics read from Redis on every scrape."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from genq.core import keys  # noqa: E402
from genq.core.decodebound import CAPS, CODES
from genq.core.queueing import save_config  # noqa: E402
from genq.core.records import BatchRef, DeadLetter, GpuSample, InFlight, JobConfig, ShardInfo, WorkerStatus, pack  # noqa: E402
from genq.core.redisconn import NOTE_REASONS
from genq.monitor.exporter import BLOCK_REASONS, ETA_STATES, JOB_STATUSES, WORKER_STATES, make_registry, parse_listen  # noqa: E402
from genq.monitor.progress import Monitor  # noqa: E402
from tests.conftest import free_port, genq_cmd, read_results, run_genq, wait_http, wait_until, write_prompts


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the exposition text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def put_job(conn, now: float) -> None:
    """A job in mid-run, written the way producer and workers write it."""
    save_config(conn, JobConfig(name="exp", output="/tmp/unused", max_tokens=2048, batch_size=50, created_at=now - 600))
    conn.hset(keys.job_stats("exp"), mapping={"total": 1000, "batches": 20})
    conn.zadd(keys.job_batches("exp"), {f"b{i:07d}": i for i in range(1, 21)})
    conn.sadd(keys.job_done("exp"), "b0000001", "b0000002")
    for i in (1, 2):
        info = ShardInfo(batch=f"b{i:07d}", uri=f"/tmp/unused/exp/shards/b{i:07d}.jsonl", records=50,
                         bytes=10_000 + i, at=now - 100)
        conn.hset(keys.job_shards("exp"), info.batch, pack(info))
    for name, done, failed, in_tok, out_tok in (("gpu-a", 250, 1, 5000, 90_000), ("gpu-b", 150, 2, 3000, 60_000)):
        conn.hset(keys.worker_stats("exp", name), mapping={
            "done": done, "failed": failed, "in_tok": in_tok, "out_tok": out_tok,
            "first_at": repr(now - 500), "last_at": repr(now - 1)})
        conn.sadd(keys.job_workers("exp"), name)
        conn.sadd(keys.WORKERS, name)
    for i in range(3):  # the DLQ holds 3 letters: failed = HLEN, not the counters
        letter = DeadLetter(id=f"p{i}", job="exp", batch="b0000003", attempts=5, kind="server_error",
                            message="500", worker="gpu-a", at=now)
        conn.hset(keys.job_dlq("exp"), letter.id, pack(letter))
    conn.hset(keys.job_hist("exp"), mapping={str(b): n for b, n in ((28, 100), (32, 150), (36, 120), (40, 30))})
    gpu = GpuSample(index=0, name="NVIDIA H100 80GB HBM3", utilization_pct=97.0, memory_used_mib=70_000.0,
                    memory_total_mib=81_559.0, power_w=612.5, sm_clock_mhz=1980.0, temperature_c=71.0)
    a = WorkerStatus(name="gpu-a", host="node1", pid=11, server="http://127.0.0.1:30000", state="busy",
                     started_at=now - 550, heartbeat_at=now - 0.5, gpu="0", concurrency_target=70,
                     server_capacity=64, in_flight=70, queued=30,
                     batches=[BatchRef("exp", "b0000003"), BatchRef("exp", "b0000004")],
                     tok_per_s=2150.5, req_per_s=3.2, done=250, errors=4, server_running=64.0,
                     server_waiting=6.0, server_token_usage=0.83, gpu_sample=gpu)
    b = WorkerStatus(name="gpu-b", host="node2", pid=12, server="http://127.0.0.1:30001", state="busy",
                     started_at=now - 550, heartbeat_at=now - 0.2, concurrency_target=40, concurrency_limit=40,
                     server_capacity=64, in_flight=40, queued=10, batches=[BatchRef("exp", "b0000005")],
                     tok_per_s=1200.0,
                     req_per_s=2.0, done=150, errors=0, server_running=40.0, server_waiting=0.0,
                     server_token_usage=0.5, gpu_note="no GPU telemetry: NVMLError_LibraryNotFound")
    for s, tokens in ((a, [300, 120, 2000] + [50] * 67), (b, [10] * 40)):
        conn.set(keys.worker_status(s.name), pack(s), ex=60)
        conn.set(keys.job_inflight("exp", s.name),
                 pack(InFlight(worker=s.name, job="exp", at=now - 0.5, tokens=tokens, queued=s.queued)), ex=60)
    # A third worker of the job whose heartbeat expired: lost.
    conn.sadd(keys.WORKERS, "gpu-c")
    conn.sadd(keys.job_workers("exp"), "gpu-c")
    conn.hset(keys.worker_stats("exp", "gpu-c"), mapping={"done": 7, "failed": 0, "in_tok": 70, "out_tok": 900})
    # An idle live worker that never worked on the job, and one that stopped (its record kept, no TTL).
    idle = WorkerStatus(name="gpu-d", host="node3", pid=13, server="http://127.0.0.1:30002", state="idle",
                        started_at=now - 50, heartbeat_at=now - 0.3, concurrency_target=8, server_capacity=64,
                        tok_per_s=0.0)
    stopped = WorkerStatus(name="gpu-e", host="node4", pid=14, server="http://127.0.0.1:30003", state="stopped",
                           started_at=now - 900, heartbeat_at=now - 120, concurrency_target=8, server_capacity=64,
                           tok_per_s=999.0, server_running=3.0)
    for s in (idle, stopped):
        conn.set(keys.worker_status(s.name), pack(s))
        conn.sadd(keys.WORKERS, s.name)
    conn.sadd(keys.job_workers("exp"), "gpu-e")
    conn.hset(keys.worker_stats("exp", "gpu-e"), mapping={"done": 0, "failed": 0, "in_tok": 0, "out_tok": 0})


def test_collector_reports_what_redis_holds(rconn) -> None:
    put_job(rconn, time.time())
    monitor = Monitor(rconn, once=True)
    text = generate_latest(make_registry(monitor)).decode()
    m = samples(text)
    (report,) = monitor.last  # the reports this very scrape was built from
    job = (("job", "exp"),)

    assert m[("genq_monitor_redis_up", ())] == 1
    assert m[("genq_job_prompts", job)] == 1000
    assert m[("genq_job_prompts_completed", job)] == 250 + 150 + 7
    assert m[("genq_job_prompts_failed", job)] == 3
    assert m[("genq_job_prompts_in_flight", job)] == 70 + 40
    assert m[("genq_job_prompts_queued", job)] == 1000 - 407 - 3 - 110
    assert m[("genq_job_input_tokens_total", job)] == 5000 + 3000 + 70
    assert m[("genq_job_output_tokens_total", job)] == 90_000 + 60_000 + 900
    assert m[("genq_job_shards", job)] == 2 and m[("genq_job_shard_bytes", job)] == 20_003
    assert m[("genq_job_workers", job)] == 2 and m[("genq_job_workers_lost", job)] == 1
    assert m[("genq_job_status", (("job", "exp"), ("status", "running")))] == 1
    assert m[("genq_job_status", (("job", "exp"), ("status", "done")))] == 0
    assert m[("genq_job_eta_state", (("job", "exp"), ("state", report.progress.eta_state)))] == 1
    assert m[("genq_job_batches", job)] == 20 and m[("genq_job_batches_written", job)] == 2
    # No RQ jobs and no batch records were written here: nothing queued or held, the rest elsewhere.
    assert m[("genq_job_batches_queued", job)] == m[("genq_job_batches_held", job)] == 0
    assert m[("genq_job_batches_elsewhere", job)] == 18 and m[("genq_rq_queue_batches", ())] == 0
    # The ETA (one look: --once rates) is there with its range, as the JSON has it.
    assert report.progress.eta_s is not None
    assert m[("genq_job_eta_seconds", job)] == pytest.approx(report.progress.eta_s)
    assert m[("genq_job_eta_low_seconds", job)] == pytest.approx(report.progress.eta_low_s)
    assert m[("genq_job_eta_high_seconds", job)] == pytest.approx(report.progress.eta_high_s)
    assert (m[("genq_job_eta_low_seconds", job)] <= m[("genq_job_eta_seconds", job)]
            <= m[("genq_job_eta_high_seconds", job)])

    a, b, c = (("worker", "gpu-a"),), (("worker", "gpu-b"),), (("worker", "gpu-c"),)
    d, e = (("worker", "gpu-d"),), (("worker", "gpu-e"),)
    # Up without a state label (a state change would start a new series); the state is an enum beside it.
    assert m[("genq_worker_up", a)] == 1 and m[("genq_worker_up", d)] == 1
    assert m[("genq_worker_up", c)] == 0 and m[("genq_worker_up", e)] == 0  # lost, stopped: down
    assert m[("genq_worker_state", (("state", "busy"), ("worker", "gpu-a")))] == 1
    assert m[("genq_worker_state", (("state", "idle"), ("worker", "gpu-a")))] == 0
    assert m[("genq_worker_state", (("state", "lost"), ("worker", "gpu-c")))] == 1
    assert m[("genq_worker_state", (("state", "stopped"), ("worker", "gpu-e")))] == 1
    # A stopped worker's last figures are not figures of now.
    assert not [k for k in m if k[1] == e and k[0] not in ("genq_worker_up",)]
    assert m[("genq_worker_output_tokens_per_second", a)] == 2150.5
    assert m[("genq_worker_output_tokens_per_second", b)] == 1200.0
    assert m[("genq_worker_slot_utilization_ratio", a)] == 1.0
    assert m[("genq_worker_slot_utilization_ratio", b)] == pytest.approx(40 / 64)
    assert m[("genq_worker_server_running", a)] == 64 and m[("genq_worker_server_waiting", a)] == 6
    assert m[("genq_worker_kv_cache_usage_ratio", a)] == 0.83
    assert m[("genq_worker_in_flight", a)] == 70 and m[("genq_worker_concurrency_target", b)] == 40
    assert m[("genq_worker_errors_total", a)] == 4
    assert ("genq_worker_output_tokens_per_second", c) not in m  # lost: no figures made up
    # Fixed codes in the label, never the numbers.
    assert m[("genq_worker_bottleneck", (("reason", "cap_below_capacity"), ("worker", "gpu-b")))] == 1
    assert m[("genq_worker_bottleneck", (("reason", "kv_cache_full"), ("worker", "gpu-b")))] == 0
    assert m[("genq_worker_bottleneck", (("reason", "no_prompts"), ("worker", "gpu-d")))] == 1
    reasons = {dict(k[1])["reason"] for k in m if k[0] == "genq_worker_bottleneck"}
    assert reasons == set(CODES)
    jw = (("job", "exp"), ("worker", "gpu-a"))
    assert m[("genq_job_worker_prompts_completed_total", jw)] == 250
    assert m[("genq_job_worker_output_tokens_total", jw)] == 90_000
    assert m[("genq_job_worker_in_flight", jw)] == 70
    # Its dead letters still in the DLQ, as the monitor's failed column: a gauge (a requeue or purge lowers it).
    assert m[("genq_job_worker_prompts_failed", jw)] == 1
    assert m[("genq_job_worker_prompts_failed", (("job", "exp"), ("worker", "gpu-b")))] == 2
    # Pairs only where the worker worked on the job: not the idle gpu-d, not gpu-e (nothing done).
    pairs = {dict(k[1])["worker"] for k in m if k[0] == "genq_job_worker_in_flight"}
    assert pairs == {"gpu-a", "gpu-b", "gpu-c"}

    g = (("gpu", "0"), ("name", "NVIDIA H100 80GB HBM3"), ("worker", "gpu-a"))
    assert m[("genq_gpu_utilization_ratio", g)] == 0.97
    assert m[("genq_gpu_memory_used_bytes", g)] == 70_000 * 2**20
    assert m[("genq_gpu_memory_total_bytes", g)] == 81_559 * 2**20
    assert m[("genq_gpu_power_watts", g)] == 612.5
    assert m[("genq_gpu_temperature_celsius", g)] == 71.0
    assert m[("genq_gpu_sm_clock_hertz", g)] == 1980e6
    assert not [k for k in m if k[0].startswith("genq_gpu_") and ("worker", "gpu-b") in k[1]]  # no GPU there


def test_scrapes_share_a_refresh_and_down_workers_are_forgotten(rconn) -> None:
    put_job(rconn, time.time())
    monitor = Monitor(rconn, once=True)
    registry = make_registry(monitor, max_age=3600)
    generate_latest(registry)
    first, first_at = monitor.last, monitor.last_at
    generate_latest(registry)
    assert monitor.last is first and monitor.last_at == first_at, "a second scrape recomputed the ETA"
    # Down (lost gpu-c, stopped gpu-e) for longer than forget_after_s: not exported at all.
    m = samples(generate_latest(make_registry(Monitor(rconn, once=True), forget_after_s=0)).decode())
    workers = {dict(k[1]).get("worker") for k in m} - {None}
    assert workers == {"gpu-a", "gpu-b", "gpu-d"}


def test_dashboard_uses_only_exported_metrics(rconn) -> None:
    import re

    put_job(rconn, time.time())
    exported = {name for name, _ in samples(generate_latest(make_registry(Monitor(rconn, once=True))).decode())}
    dashboard = json.loads((Path(__file__).parent.parent / "dashboards" / "grafana-genq.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {name for e in exprs for name in re.findall(r"\bgenq_[a-z_]+", e)}
    assert used and used <= exported, used - exported
    # Every range is Grafana's $__rate_interval (a fixed [5m] is too coarse at a 1-2 s scrape, too fine at 1 m).
    assert not [e for e in exprs if re.search(r"\[(?!\$__rate_interval\])[^\]]*\]", e)]
    # Shares are 0-1 ratios named so; percent would need a different unit on every panel.
    assert not [n for n in exported if re.search(r"utilization|usage|percent", n) and not n.endswith("_ratio")]
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert all(re.search(r"genq_[a-z_]+", v)[0] in exported for v in variables)


def test_serve_over_http_during_and_after_a_real_run(tmp_path: Path, redis_url, sim, worker, procs) -> None:
    # About 4 s of work (60 x ~200 tokens, 4 slots at 800 tok/s): scrapes see it running.
    url = sim(step_ms_base=10, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=200, output_sigma=1.0,
              max_running_requests=4)
    write_prompts(tmp_path / "p.jsonl", 60)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "served", "--output", str(tmp_path / "out"),
             "--batch-size", "16")
    port = free_port()
    mon = procs(genq_cmd("monitor", "--metrics", f"127.0.0.1:{port}", "--json", "--interval", "0.5"), name="monitor")

    def scrape() -> dict:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return samples(resp.read().decode())
        except OSError:
            return {}

    before = wait_until(scrape, 20, "the metrics endpoint")
    job = (("job", "served"),)
    assert before[("genq_job_prompts", job)] == 60 and before[("genq_job_prompts_completed", job)] == 0
    assert ("genq_job_eta_seconds", job) not in before  # nothing known yet: no number
    w = worker(url, "--burst", "--name", "served-w")
    seen_running = wait_until(lambda: (s := scrape()).get(("genq_job_prompts_in_flight", job), 0) > 0 and s,
                              30, "a scrape with requests in flight")
    assert seen_running[("genq_worker_up", (("worker", "served-w"),))] == 1
    assert w.wait(90) == 0, w.log()

    # Reports are cached for a second: the scrape after the end may come from just before it
    # (status "writing" while the last shard is written).
    after = wait_until(lambda: (s := scrape()).get(("genq_job_status", (("job", "served"), ("status", "done")))) == 1
                       and s, 10, "a scrape after the end")
    rows = read_results(tmp_path / "out", "served")
    assert after[("genq_job_prompts_completed", job)] == len(rows) == 60
    assert after[("genq_job_output_tokens_total", job)] == sum(r["usage"]["completion_tokens"] for r in rows)
    assert after[("genq_job_input_tokens_total", job)] == sum(r["usage"]["prompt_tokens"] for r in rows)
    assert after[("genq_job_eta_seconds", job)] == 0
    assert after[("genq_job_status", (("job", "served"), ("status", "done")))] == 1
    assert after[("genq_job_eta_state", (("job", "served"), ("state", "done")))] == 1
    assert after[("genq_job_shards", job)] == 4
    # The JSON lines the same monitor printed agree with the scrape.
    last = [json.loads(line) for line in mon.log().splitlines() if line.startswith("{")][-1]
    assert last["total"] == 60


def test_every_gauge_shows_a_field_of_the_monitor_record() -> None:
    """The gauge tables are the one mapping from the monitor's records (which --json, the terminal
    view and the web page read as they are) to Prometheus: a renamed or removed field must fail here,
    not as an AttributeError at a scrape."""
    import msgspec

    from genq.monitor.exporter import JOB_GAUGES, PAIR_GAUGES, WORKER_GAUGES
    from genq.monitor.progress import JobProgress, WorkerReport

    for table, record in ((JOB_GAUGES, JobProgress), (WORKER_GAUGES, WorkerReport), (PAIR_GAUGES, WorkerReport)):
        fields = {f.name for f in msgspec.structs.fields(record)}
        assert [field for _, _, field in table if field not in fields] == [], record.__name__
        names = [name for name, _, _ in table]
        assert len(set(names)) == len(names), f"a metric named twice in the {record.__name__} table"


def test_a_workers_state_is_judged_at_the_snapshots_time(rconn, monkeypatch) -> None:
    """Prometheus' genq_worker_state is the job row's state, judged at the snapshot's one time: beats 2.9 s and
    3.1 s late then read busy and silent in both, however far the clock moves during the refresh (here 0.08 s a
    read, so a second read would see the first worker late too)."""
    import types

    from genq.core.ledger import figures
    from genq.monitor import progress

    t0 = time.time()
    reads = iter(t0 + 0.08 * i for i in range(1000))
    clock = types.SimpleNamespace(time=lambda: next(reads), monotonic=time.monotonic)
    monkeypatch.setattr(progress, "time", clock)
    monkeypatch.setattr(figures, "time", clock)
    save_config(rconn, JobConfig(name="t", output="/tmp/unused", max_tokens=2048, batch_size=50))
    rconn.hset(keys.job_stats("t"), mapping={"total": 100, "batches": 2})
    for name, late in (("on-time", 2.9), ("late", 3.1)):  # busy: a beat due every second
        s = WorkerStatus(name=name, host="h", pid=1, server="http://s", state="busy", started_at=t0 - 60,
                         heartbeat_at=t0 - 1 - late, concurrency_target=4, in_flight=4)
        rconn.set(keys.worker_status(name), pack(s), ex=60)
        rconn.sadd(keys.WORKERS, name)
        rconn.sadd(keys.job_workers("t"), name)
    monitor = Monitor(rconn, "t")
    m = samples(generate_latest(make_registry(monitor)).decode())
    rows = {w.name: w.state for w in monitor.last[0].progress.worker_details}
    exported = {dict(k[1])["worker"]: dict(k[1])["state"] for k, v in m.items() if k[0] == "genq_worker_state" and v}
    assert rows == {"on-time": "busy", "late": "silent"} and exported == rows, (rows, exported)


@pytest.mark.e2e  # starts a process
def test_listen_addresses() -> None:
    assert parse_listen(":9108") == ("0.0.0.0", 9108)
    assert parse_listen("127.0.0.1:9108") == ("127.0.0.1", 9108)
    assert parse_listen("[::1]:9108") == ("::1", 9108)
    for bad in ("9108", "host:", "host:99999", ":http"):
        with pytest.raises(ValueError, match="HOST"):
            parse_listen(bad)
    proc = run_genq("monitor", "--metrics", "nonsense", check=False)
    assert proc.returncode != 0 and "[HOST]:PORT" in proc.stderr
    proc = run_genq("monitor", "--metrics", ":9108", "--once", check=False)
    assert proc.returncode != 0 and "--once" in proc.stderr


# ---------------------------------------------------------------- a real Prometheus


SCRAPE_JOB = "genq-monitor"  # Prometheus' own job label, on series without a genq job (workers)


class Prometheus:
    """Debian's prometheus on a free loopback port, scraping targets every second (honor_labels: true)."""

    def __init__(self, procs, tmp_path: Path, target: str) -> None:
        import shutil

        binary = shutil.which("prometheus")
        if binary is None:
            pytest.fail("this test needs a real Prometheus: apt-get install prometheus")
        self.port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            f"  - job_name: {SCRAPE_JOB}\n"
            "    honor_labels: true\n"
            "    scrape_timeout: 1s\n"
            f"    static_configs: [{{targets: ['{target}']}}]\n")
        self.proc = procs([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                           f"--web.listen-address=127.0.0.1:{self.port}"], name="prometheus")
        wait_http(f"http://127.0.0.1:{self.port}/-/ready", timeout=30)

    def api(self, path: str, **params: str) -> dict | list:
        from urllib.parse import urlencode

        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> dict[tuple, float]:
        """{sorted labels: value} of an instant query, without __name__, instance and the scrape job."""
        data = self.api("query", query=expr)
        return {tuple(sorted((k, v) for k, v in r["metric"].items()
                             if k not in ("__name__", "instance")
                                and (k, v) != ("job", SCRAPE_JOB))): float(r["value"][1])
                for r in data["result"]}

    def one(self, expr: str) -> float | None:
        result = self.query(expr)
        assert len(result) <= 1, (expr, result)
        return next(iter(result.values()), None)


def dashboard_queries(job: str) -> dict[str, list[str]]:
    """Every panel's expressions with Grafana's variables substituted: {panel title: [expr, ...]}."""
    dashboard = json.loads((Path(__file__).parent.parent / "dashboards" / "grafana-genq.json").read_text())
    subs = {"$__rate_interval": "4s", "$job": job, "$worker": ".*"}  # 4 x the 1 s scrape, as Grafana picks it
    out = {}
    for panel in dashboard["panels"]:
        exprs = []
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in subs.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, expr
            exprs.append(expr)
        out[panel["title"]] = exprs
    return out


def test_real_prometheus_answers_the_dashboard(tmp_path: Path, redis_url, sim, worker, procs) -> None:
    # About 5 s of work (80 x ~200 tokens, 4 slots at 800 tok/s): several scrapes see it running.
    url = sim(step_ms_base=10, step_ms_per_req=0, tokens_per_step=8, mean_output_tokens=200, output_sigma=0.8,
              max_running_requests=4)
    write_prompts(tmp_path / "p.jsonl", 80)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "pj", "--output", str(tmp_path / "out"),
             "--batch-size", "16")
    port = free_port()
    procs(genq_cmd("monitor", "--metrics", f"127.0.0.1:{port}", "--json", "--interval", "0.5"), name="monitor")
    prom = Prometheus(procs, tmp_path, f"127.0.0.1:{port}")
    wait_until(lambda: prom.one(f'up{{job="{SCRAPE_JOB}"}}') == 1, 30, "Prometheus to scrape the monitor")
    queries = dashboard_queries("pj")
    assert prom.one(queries["Done"][0]) == 0

    w = worker(url, "--burst", "--name", "pj-w")
    slots = queries["Slot utilization per worker (server running / capacity)"][0]
    wait_until(lambda: (prom.one(queries["Prompts"][2]) or 0) > 0 and prom.query(slots), 30,
               "Prometheus to see requests in flight and the server's slots")
    running = {title: [prom.query(e) for e in exprs] for title, exprs in queries.items()}
    assert 0 <= next(iter(running["Done"][0].values())) < 100
    assert running["Workers"][0] == {(("state", "busy"), ("worker", "pj-w")): 1.0}
    assert running["Output tok/s per worker"][0]
    assert 0 < running["Slot utilization per worker (server running / capacity)"][0][(("worker", "pj-w"),)] <= 1
    assert w.wait(90) == 0, w.log()

    rows = read_results(tmp_path / "out", "pj")
    assert len(rows) == 80
    wait_until(lambda: prom.one(queries["Done"][0]) == 100 and prom.one('genq_job_status{job="pj",status="done"}') == 1,
               30, "Prometheus to see the job done")
    assert prom.one(queries["ETA"][0]) == 0
    assert prom.one(queries["Failed"][0]) == 0
    assert prom.one('genq_job_prompts_completed{job="pj"}') == 80
    assert prom.one('genq_job_worker_prompts_failed{job="pj",worker="pj-w"}') == 0
    assert prom.one('genq_job_output_tokens_total{job="pj"}') == sum(r["usage"]["completion_tokens"] for r in rows)
    assert prom.one('genq_job_shards{job="pj"}') == 5
    batches = [prom.one(e) for e in queries["Batches: written, held, in RQ's queue, elsewhere"]]
    assert batches == [5, 0, 0, 0, 0], batches  # written, held, queued, elsewhere, RQ's whole queue
    # rate() over $__rate_interval has points to work with at a 1 s scrape.
    assert prom.query(queries["Completed prompts per worker (rate)"][0])
    # The burst worker exited: down, with none of its last figures left.
    wait_until(lambda: prom.one('genq_worker_up{worker="pj-w"}') == 0, 30, "the stopped worker down")
    assert prom.query(queries["Workers"][0]) == {(("state", "stopped"), ("worker", "pj-w")): 1.0}
    assert prom.query('genq_worker_output_tokens_per_second{worker="pj-w"}') == {}

    # A worker that never worked on the job: not in the job's worker picker; killed, it goes down.
    idle = worker(url, "--name", "pj-idle")
    wait_until(lambda: prom.one('genq_worker_up{worker="pj-idle"}') == 1, 30, "the idle worker up")
    picker = prom.api("label/worker/values", **{"match[]": 'genq_job_worker_in_flight{job=~"pj"}'})
    assert picker == ["pj-w"]
    idle.kill_tree()
    wait_until(lambda: prom.one('genq_worker_up{worker="pj-idle"}') == 0, 40, "the killed worker down (lost)")
    assert prom.one('genq_worker_state{worker="pj-idle",state="lost"}') == 1
    assert prom.query('genq_worker_in_flight{worker="pj-idle"}') == {}

    # No label whose values grow with time: besides names, only fixed sets of codes.
    series = prom.api("series", **{"match[]": '{__name__=~"genq_.*"}'})
    fixed = {"state": set(WORKER_STATES) | set(ETA_STATES), "status": set(JOB_STATUSES),
             "reason": set(CODES) | set(BLOCK_REASONS) | set(NOTE_REASONS) | set(CAPS)}
    names = {"__name__", "job", "worker", "instance", "gpu", "name"}
    for s in series:
        for label, value in s.items():
            assert label in names or value in fixed.get(label, ()), (label, value, s)
