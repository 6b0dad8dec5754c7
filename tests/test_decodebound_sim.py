"""Each GPU against its decode bound, on simulated SGLang servers (real Redis, real `genq sim`, real
`genq worker` given a bandwidth where NVML has none): the figures genq shows against the sim's own.

- a GPU at half speed (double step time) is flagged slower than its peer, and each share of the bound
  genq shows agrees, within 10 %, with the share the sim's own counters and /server_info give;
- the tok/s genq shows agrees with the server's generation counter within 10 % at every sample after
  the first 10 s;
- a server whose KV cache caps its batch gets the KV advice, one whose running limit is below what its
  KV cache holds gets the advice to raise it; one that does not publish its weights (vLLM) has the
  missing figure named with the option that gives it.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

from prometheus_client import generate_latest

from genq.core import decodebound, keys
from genq.core.records import WorkerStatus, unpack
from genq.monitor.exporter import make_registry
from genq.monitor.progress import Monitor
from tests.conftest import run_genq, wait_until, write_prompts


def samples(text: str) -> dict[tuple[str, tuple], float]:
    """(name, sorted labels) -> value of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        pairs = tuple(sorted(tuple(p.split("=", 1)) for p in labels.rstrip("}").split(",") if p))
        out[(name, tuple((k, v.strip('"')) for k, v in pairs))] = float(value)
    return out

BANDWIDTH = 12e12  # given to the workers (--gpu-bandwidth): no NVML here
# Requests of ~7.5 s at full speed (3000 tokens, 32 a step of 80 ms), all alike: the batch stays full.
SIM = dict(max_running_requests=24, step_ms_base=80, step_ms_per_req=0, tokens_per_step=32,
           mean_output_tokens=3000, output_sigma=0.3, prefill_cost=0)
GIB = 2**30
WINDOW_S = 5.0  # the worker's counter window (genq.worker.held.COUNTER_WINDOW_S)


def server_figures(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang:"):
            name, value = line.split("{", 1)[0], float(line.rsplit(" ", 1)[1])
            out[name] = out.get(name, 0.0) + value  # its series summed, as genq reads them
    return out


def memory_usage(url: str) -> dict[str, float]:
    info = json.loads(urllib.request.urlopen(url + "/server_info", timeout=5).read())
    return info["internal_states"][0]["memory_usage"]


def workers_json(redis_url: str) -> dict[str, dict]:
    return {w["name"]: w for w in json.loads(run_genq("workers", "--json", redis_url=redis_url).stdout)}


def start_job(tmp_path: Path, redis_url: str, n: int) -> None:
    write_prompts(tmp_path / "p.jsonl", n)
    run_genq("enqueue", str(tmp_path / "p.jsonl"), "--job", "bound", "--output", str(tmp_path / "out"),
             "--batch-size", "8", "--max-tokens", "8000", redis_url=redis_url)


def test_half_speed_gpu_flagged_shares_and_speed_follow_the_server(tmp_path: Path, redis_url, rconn, sim,
                                                                   worker) -> None:
    fast = sim(**SIM)
    slow = sim(**{**SIM, "step_ms_base": 160})
    start_job(tmp_path, redis_url, 400)
    for url, name in ((fast, "fast"), (slow, "slow")):
        worker(url, "--name", name, "--gpu-bandwidth", "12TB/s", "--grace-period", "0")
    wait_until(lambda: server_figures(fast).get("sglang:generation_tokens_total", 0) > 0
               and server_figures(slow).get("sglang:generation_tokens_total", 0) > 0, 60, "both generating")
    started = time.monotonic()
    weight = memory_usage(fast)["weight"] * GIB
    kv_pool = memory_usage(fast)["kvcache"] * GIB
    readings: dict[str, list[tuple[float, dict]]] = {"fast": [], "slow": []}
    checked = 0
    while checked < 24:  # a dozen samples of each, after the first 10 s
        assert time.monotonic() - started < 90, f"{checked} samples in 90 s"
        time.sleep(1.0)
        for url, name in ((fast, "fast"), (slow, "slow")):
            readings[name].append((time.monotonic(), server_figures(url)))
        if time.monotonic() - started < 10:
            continue
        for name in ("fast", "slow"):
            at, now = readings[name][-1]
            then_at, then = next((t, r) for t, r in reversed(readings[name]) if at - t >= WINDOW_S)
            server_rate = ((now["sglang:generation_tokens_total"] - then["sglang:generation_tokens_total"])
                           / (at - then_at))
            status = unpack(rconn.get(keys.worker_status(name)), WorkerStatus)
            assert status.tok_per_s_from == "server"
            assert abs(status.tok_per_s - server_rate) <= 0.1 * server_rate, (name, status.tok_per_s, server_rate)
            # The share the sim's own figures give: its speed over running x bandwidth / (weights + KV in
            # use), with the running count and KV use at either end of the window (the worker read them
            # at its beat, between the two: on a loaded machine the count moves by a few meanwhile).
            shares = [server_rate / (r["sglang:num_running_reqs"] * BANDWIDTH
                                     / (weight + r["sglang:token_usage"] * kv_pool))
                      for r in (then, now)]
            # The share genq shows (`genq workers --json` below, the monitor), from the record just read: a
            # CLI run here took seconds on a loaded machine, and the sim's speed had moved meanwhile.
            shown = decodebound.bound(decodebound.figures_of(status))
            assert shown.share is not None, shown
            assert 0.9 * min(shares) <= shown.share <= 1.1 * max(shares), (name, shown, shares)
            checked += 1
    rows = workers_json(redis_url)
    assert rows["slow"]["bound"]["slow"], rows["slow"]["bound"]
    assert "slow" not in rows["fast"]["bound"], rows["fast"]["bound"]
    text = run_genq("workers", redis_url=redis_url).stdout
    assert "slow: much slower than its peers: at" in text, text
    assert "fleet at " in text and "of its bandwidth bound" in text, text
    # The monitor (its JSON is the web page's record), its terminal view and Prometheus show the same.
    doc = json.loads(run_genq("monitor", "--once", "--json", "--job", "bound", redis_url=redis_url).stdout)
    details = {w["name"]: w for w in doc["worker_details"]}
    assert details["slow"]["bound"]["slow"] and "slow" not in details["fast"]["bound"], details
    assert doc["bound_summary"].startswith("fleet at ") and "slow slowest at" in doc["bound_summary"], doc
    view = run_genq("monitor", "--once", "--job", "bound", redis_url=redis_url).stdout
    assert "slow GPU slow:" in view and "of bound" in view and "GPUs: fleet at" in view, view
    metrics = samples(generate_latest(make_registry(Monitor(rconn, once=True))).decode())
    assert metrics[("genq_worker_slow", (("worker", "slow"),))] == 1.0
    assert metrics[("genq_worker_slow", (("worker", "fast"),))] == 0.0
    share = metrics[("genq_worker_decode_bound_ratio", (("worker", "fast"),))]
    assert 0 < share < 1.5


def test_kv_cache_and_running_limit_advice(tmp_path: Path, redis_url, sim, worker) -> None:
    # A KV cache of 30,000 tokens where 64 may run: ~20 requests of ~1,500 tokens fill it.
    small_kv = sim(**{**SIM, "max_running_requests": 64, "max_total_num_tokens": 30_000})
    # A running limit of 8 where the KV cache (400,000 tokens) would hold ~260 at this context.
    low_limit = sim(**{**SIM, "max_running_requests": 8})
    # vLLM publishes no weight bytes: the bound names what is missing and the option that gives it.
    vllm = sim(**{**SIM, "flavor": "vllm", "max_running_requests": 8})
    start_job(tmp_path, redis_url, 300)
    worker(small_kv, "--name", "kv", "--gpu-bandwidth", "12TB/s", "--grace-period", "0")
    worker(low_limit, "--name", "limit", "--gpu-bandwidth", "12TB/s", "--grace-period", "0")
    worker(vllm, "--name", "vllm", "--gpu-bandwidth", "12TB/s", "--grace-period", "0")

    def capped() -> dict | None:
        rows = workers_json(redis_url)
        caps = {n: (rows.get(n, {}).get("bound") or {}).get("cap") for n in ("kv", "limit")}
        ok = (caps["kv"] or {}).get("code") == "kv_cache" and (caps["limit"] or {}).get("code") == "running_limit"
        return caps if ok else None

    caps = wait_until(capped, 60, "the KV cap on kv and the running limit on limit", interval=1.0)
    assert "--mem-fraction-static" in caps["kv"]["advice"], caps
    assert caps["limit"]["advice"].startswith("raise --max-running-requests to ~"), caps
    text = run_genq("workers", redis_url=redis_url).stdout
    assert "kv: batch capped by KV cache" in text and "fix: more KV cache: --mem-fraction-static" in text, text
    assert "limit: batch capped by 8 running at the server's limit 8" in text, text
    assert "vllm: bound unknown: model weight bytes (give them with genq worker --model-bytes" in text, text
