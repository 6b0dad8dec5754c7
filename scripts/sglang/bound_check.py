"""genq's decode bound against real SGLang: the figures SGLang publishes are read, the one it lacks is
named, and the speed genq shows follows SGLang's own generation counter.

    .venv/bin/python scripts/sglang/bound_check.py    # its own SGLang (CPU, scripts/sglang/install.sh)
                                                      # and Redis; ~8 minutes on 2 busy cores (SGLang
                                                      # starts in 3-6 of them); exit 1 on a problem
    make test-sglang                                  # check() on its server (scripts/sglang/checks.py)
    .venv/bin/python scripts/sglang/bound_check.py --gpu --python P --model M   # scripts/sglang/gpu_check.sh

A `genq worker` runs a job on the server twice, each watched by a `genq monitor --metrics`:

1. without a memory bandwidth (no GPU, no NVML): the weights, the KV cache and its token capacity
   are /server_info's memory_usage (GB = 2^30 bytes) and the KV in use is sglang:token_usage; the
   bound is "unknown: memory bandwidth (give it with genq worker --gpu-bandwidth ...)" in
   `genq workers` (text and --json), in the monitor (its JSON, the web page's record) and its
   Prometheus page has no bound for the worker; nothing else is named missing;
2. given one (--gpu-bandwidth, BANDWIDTH; with --gpu, NVML's through genq worker --gpu 0): the bound
   genq shows is running x bandwidth / (weights + token_usage x KV cache) by SGLang's own figures,
   its share the server's counter speed over it, within 10 %; the same on /metrics; the job's
   summary names the fleet's share. On a GPU that share is the small model's measured decode
   against its bound (a tiny model is far below it: its steps are not memory-bound).
   SGLang on a shared CPU measures the weights badly (0.016-0.028 GB for a 39 MB checkpoint, once
   -0.005): a figure of 0 or less must be named missing, with --model-bytes, in both phases.

In both, the tok/s genq shows agrees with sglang:generation_tokens_total within 10 % at every
heartbeat after the first 10 s of generation. genq's figure is the counter's rise between its
readings (a look a second) 5-6 s apart, the last of them up to a look and a heartbeat before the
heartbeat, later on a loaded machine: so it is set against the counter's rise over windows of
5-7 s ending in the 3 s before the heartbeat (the counter read here every quarter second).
SGLang 0.5.23 adds a request's tokens to that counter when the request ends
(observe_one_finished_request): a window's rise moves in steps of whole answers, and the window's
placement matters.
"""

from __future__ import annotations

import bisect
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "vllm"), str(HERE.parent / "llamacpp")]
from runs import ROOT, flush, genq, load  # noqa: E402
from stack import Stack  # noqa: E402

from genq.core import keys  # noqa: E402
from genq.core.records import WorkerStatus, unpack  # noqa: E402
from genq.core.redisconn import connect, free_port  # noqa: E402

GIB = 2**30  # SGLang's "GB" in memory_usage
BANDWIDTH = 50e9  # bytes/s given in phase 2: a figure for a CPU's DRAM; what matters is that it is used
WINDOW_S = 5.0  # the worker's counter window (genq.worker.held.COUNTER_WINDOW_S)
AGREE = 0.10
WARM_S = 10.0


def memory_usage(server: str) -> dict[str, float]:
    with urllib.request.urlopen(server + "/server_info", timeout=10) as resp:
        info = json.loads(resp.read())
    return info["internal_states"][0]["memory_usage"]


def prometheus(url: str, worker: str) -> dict[str, float]:
    """The decode-bound samples of one worker on genq's Prometheus page: "name{labels}" -> value."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(("genq_worker_decode_bound", "genq_worker_batch_cap", "genq_worker_slow"))
            and f'worker="{worker}"' in line}


class Counter:
    """SGLang's /metrics (sglang:generation_tokens_total, token_usage, num_running_reqs) every quarter
    second (wall time), on a thread of its own while the views are read."""

    def __init__(self, stack: Stack) -> None:
        self.at: list[float] = []
        self.rows: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stack,), daemon=True)
        self._thread.start()

    def _run(self, stack: Stack) -> None:
        while not self._stop.wait(0.25):
            try:
                m = stack.metrics()
            except OSError:
                continue
            self.rows.append(m)
            self.at.append(time.time())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def total_at(self, t: float) -> float | None:
        """The counter at wall time t, interpolated between readings."""
        at, rows = self.at[:], self.rows[:len(self.at)]
        i = bisect.bisect_left(at, t)
        if i == 0 or i >= len(at):
            return None
        (t0, t1), (c0, c1) = at[i - 1:i + 1], [r.get("sglang:generation_tokens_total", 0.0) for r in rows[i - 1:i + 1]]
        return c0 + (c1 - c0) * (t - t0) / (t1 - t0)

    def rate(self, end: float, window: float = WINDOW_S) -> float | None:
        a, b = self.total_at(end - window), self.total_at(end)
        return None if a is None or b is None else (b - a) / window

    def rates_near(self, beat: float) -> list[float]:
        """The counter's speed over the windows a heartbeat at `beat` may have used (see the module)."""
        ends = [beat - 0.25 * i for i in range(13)]
        found = [self.rate(e, w) for e in ends for w in (WINDOW_S, WINDOW_S + 0.5, WINDOW_S + 1.0, WINDOW_S + 2.0)]
        return [r for r in found if r is not None]

    def values(self, name: str, end: float) -> list[float]:
        """The gauge's readings over the window ending at `end` (and the one before, for a short one)."""
        pairs = list(zip(self.at[:], self.rows))
        inside = [r.get(name, 0.0) for t, r in pairs if end - WINDOW_S - 1.5 <= t <= end]
        return inside or [0.0]


def phase(stack: Stack, work: Path, name: str, worker_args: tuple[str, ...], n: int, max_tokens: int,
          seconds: float, problems: list[str]) -> dict[str, Any]:
    """One job through one worker: its speed against the counter, and the views' bound at mid-run."""
    flush(stack)
    rows = [{"id": f"{name}{i:04d}", "messages": [{"role": "user", "content": f"Write about item {i}."}]}
            for i in range(n)]
    src = work / f"{name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = genq(stack, "enqueue", str(src), "--job", name, "--batch-size", "16", "--max-tokens", str(max_tokens),
             "--output", str(work / f"out-{name}"))
    if p.returncode:
        problems.append(f"{name}: enqueue failed: {p.stderr.strip()[-500:]}")
        return {}
    port = free_port()
    env = dict(os.environ, COLUMNS="200")
    monitor = subprocess.Popen([sys.executable, "-m", "genq", "--redis", stack.redis, "monitor", "--job", name,
                                "--metrics", f"127.0.0.1:{port}", "--json", "--interval", "1"], cwd=ROOT,
                               stdout=open(work / f"monitor-{name}.jsonl", "w"), stderr=subprocess.STDOUT)
    worker = subprocess.Popen([sys.executable, "-m", "genq", "--redis", stack.redis, "worker", "--server",
                               stack.server, "--burst", "--name", name, "--grace-period", "0", *worker_args], cwd=ROOT,
                              stdout=open(work / f"worker-{name}.log", "w"), stderr=subprocess.STDOUT)
    conn = connect(stack.redis)
    counter, samples, views = Counter(stack), [], {}  # type: tuple[Counter, list[dict], dict[str, Any]]
    began = generating = None
    seen_beat = 0.0
    try:
        began = time.monotonic()
        while worker.poll() is None and time.monotonic() - began < seconds + 120:
            read = counter.rows[:]
            if generating is None and len(read) > 1 and read[-1].get("sglang:generation_tokens_total", 0) > \
                    read[0].get("sglang:generation_tokens_total", 0):
                generating = time.time()
            raw = conn.get(keys.worker_status(name))
            s = unpack(raw, WorkerStatus) if raw else None
            if s is not None and s.heartbeat_at > seen_beat and generating is not None:
                seen_beat = s.heartbeat_at
                near = counter.rates_near(s.heartbeat_at)
                if s.heartbeat_at - generating >= WARM_S and near:
                    samples.append({"at": round(s.heartbeat_at - generating, 1), "shown": s.tok_per_s,
                                    "from": s.tok_per_s_from, "server": round(counter.rate(s.heartbeat_at) or 0, 1),
                                    "low": round(min(near), 1), "high": round(max(near), 1)})
            # The views once it runs (the bound is shown for a server running requests) and makes tokens.
            if not views and generating is not None and time.time() - generating >= WARM_S + 5 and \
                    s is not None and s.tok_per_s and s.server_running:
                views = look(stack, conn, name, port, env, counter, problems)
            if views and generating is not None and time.time() - generating >= seconds:
                break
            time.sleep(0.25)
    finally:
        counter.stop()
        if worker.poll() is None:
            worker.terminate()
        worker.wait(timeout=120)
        summary = genq(stack, "monitor", "--once", "--json", "--job", name).stdout
        monitor.terminate()
        monitor.wait(timeout=30)
    off = [s for s in samples if s["from"] != "server" or not
           (1 - AGREE) * s["low"] <= s["shown"] <= (1 + AGREE) * s["high"]]
    if not samples:
        problems.append(f"{name}: no heartbeat to compare after the first {WARM_S:.0f} s of generation")
    if off:
        problems.append(f"{name}: tok/s off the server's counter by more than 10 % at {len(off)} of "
                        f"{len(samples)} samples: {off[:3]}")
    if not views:
        problems.append(f"{name}: the views were not read (generation began: {generating is not None})")
    bound_summary = json.loads(summary or "{}").get("bound_summary") if summary else None
    return {"samples": samples, "off": len(off), "views": views, "bound_summary": bound_summary,
            "load": round(load(), 1)}


def look(stack: Stack, conn: Any, name: str, port: int, env: dict[str, str], counter: Counter,
         problems: list[str]) -> dict[str, Any]:
    """What the worker publishes of its server (its status record), and what `genq workers` (text and
    --json), the monitor's JSON and its Prometheus page show for its bound, checked against SGLang's
    own figures."""
    usage = memory_usage(stack.server)
    for _ in range(5):  # a heartbeat that saw SGLang between batches (0 running) has no bound to show
        text = subprocess.run([sys.executable, "-m", "genq", "--redis", stack.redis, "workers"], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=60).stdout
        if any(line.startswith(f"{name}: bound ") or line.startswith("fleet at") for line in text.splitlines()):
            break
        time.sleep(1)
    for _ in range(5):  # `genq workers --json` and the status record of the same heartbeat
        before = conn.get(keys.worker_status(name))
        rows = {w["name"]: w for w in json.loads(genq(stack, "workers", "--json").stdout or "[]")}
        if before == conn.get(keys.worker_status(name)):
            break
    status = unpack(before, WorkerStatus) if before else None
    doc = json.loads(genq(stack, "monitor", "--once", "--json", "--job", name).stdout or "{}")
    prom = prometheus(f"http://127.0.0.1:{port}/metrics", name)
    hw = json.loads(msgspec.json.encode(status.hardware)) if status is not None and status.hardware else {}
    verdict = (rows.get(name) or {}).get("bound") or {}
    bound = verdict.get("bound") or {}
    detail: dict[str, Any] = next((w for w in doc.get("worker_details", []) if w.get("name") == name), {})
    monitor_bound = (detail.get("bound") or {}).get("bound")
    seen: dict[str, Any] = {
        "memory_usage": usage, "hardware": hw, "bound": bound, "cap": verdict.get("cap"),
        "monitor_bound": monitor_bound, "prometheus": {k: v for k, v in prom.items() if "batch_cap" not in k or v},
        "workers_lines": [line for line in text.splitlines() if line.startswith(f"{name}:") or "fleet at" in line]}
    told = {"weight_bytes": usage.get("weight"), "kv_pool_bytes": usage.get("kvcache")}
    for field, gb in told.items():
        if gb is not None and gb <= 0:  # SGLang on a shared CPU once said -0.005 GB: no figure, genq says so
            if hw.get(field) is not None:
                problems.append(f"{name}: {field} {hw.get(field)} taken from /server_info's {gb} GB")
        elif gb is None or hw.get(field) is None or abs(hw[field] - gb * GIB) > 0.01 * gb * GIB:
            problems.append(f"{name}: {field} {hw.get(field)} where /server_info says {gb} GB")
    no_weights = (usage.get("weight") or 0) <= 0
    if hw.get("token_capacity") != usage.get("token_capacity"):
        problems.append(f"{name}: token_capacity {hw.get('token_capacity')} where /server_info says "
                        f"{usage.get('token_capacity')}")
    bandwidth = hw.get("bandwidth")
    bound_gauge = prom.get(f'genq_worker_decode_bound_tokens_per_second{{worker="{name}"}}')
    if bandwidth is None or no_weights:
        unknown = bound.get("unknown") or ""
        named = (["memory bandwidth"] if bandwidth is None else []) + (["model weight bytes"] if no_weights else [])
        if not unknown.startswith("unknown: " + named[0]) or unknown.count(";") != len(named) - 1 \
                or not all(n in unknown for n in named):
            problems.append(f"{name}: the bound says {unknown!r}, not just {' and '.join(named)} missing")
        if ((monitor_bound or {}).get("unknown") or "") != unknown:
            problems.append(f"{name}: the monitor's bound {monitor_bound} is not genq workers' {bound}")
        if not any(line.startswith(f"{name}: bound {unknown}") for line in text.splitlines()):
            problems.append(f"{name}: genq workers does not name what is missing:\n{text}")
        if bound_gauge is not None:
            problems.append(f"{name}: /metrics has a bound ({bound_gauge}) without a bandwidth")
        return seen
    # The running count and KV usage over the worker's window (its readings of SGLang's gauges, which
    # swing between 0 and the limit as batches are prefilled), with SGLang's own byte figures.
    assert status is not None
    now = time.time()
    running, used = status.window_running or 0.0, status.window_token_usage or 0.0
    expected = running * bandwidth / (usage["weight"] * GIB + used * usage["kvcache"] * GIB)
    # The share is the speed of the same record over its bound (the speed is checked on its own).
    row_speed = (rows.get(name) or {}).get("tok_per_s")
    share = row_speed / bound["tok_per_s"] if row_speed is not None and bound.get("tok_per_s") else None
    seen["expected"] = {"bound": round(expected, 1), "share": share, "running": running, "token_usage": used,
                        "sglang_running_5s": [min(counter.values("sglang:num_running_reqs", now)),
                                              max(counter.values("sglang:num_running_reqs", now))],
                        "bandwidth_from": hw.get("bandwidth_from")}
    if not seen["expected"]["sglang_running_5s"][0] <= running <= seen["expected"]["sglang_running_5s"][1]:
        problems.append(f"{name}: the window's running {running} outside SGLang's {seen['expected']}")
    if bound.get("tok_per_s") is None or abs(bound["tok_per_s"] - expected) > AGREE * expected:
        problems.append(f"{name}: bound {bound.get('tok_per_s')} where SGLang's figures give {expected:.1f}")
    if share is None or bound.get("share") is None or abs(bound["share"] - share) > 0.01 * share:
        problems.append(f"{name}: share {bound.get('share')} where its tok/s over its bound is {share}")
    if bound_gauge is None or bound.get("tok_per_s") is None or abs(bound_gauge - bound["tok_per_s"]) > \
            AGREE * bound["tok_per_s"]:
        problems.append(f"{name}: /metrics bound {bound_gauge} where genq workers says {bound.get('tok_per_s')}")
    return seen


def check(stack: Stack, work: Path, problems: list[str], *, gpu: bool = False, n: int = 400, max_tokens: int = 16,
          seconds: float = 45.0) -> dict[str, Any]:
    """Both phases on `stack`'s SGLang (on a GPU, `gpu`: the bandwidth from NVML, GPU 0); what each saw
    (problems appended to `problems`)."""
    given = ("--gpu", "0") if gpu else ("--gpu-bandwidth", f"{BANDWIDTH:.0f}")
    out = {}
    for name, args in (("unknown", ()), ("given", given)):
        before = len(problems)
        out[name] = phase(stack, work, f"bound-{name}", args, n, max_tokens, seconds, problems)
        print(f"bound {name}: {len(out[name].get('samples', []))} tok/s samples, {out[name].get('off')} off; "
              f"expected {out[name].get('views', {}).get('expected')}; {len(problems) - before} problems "
              f"{problems[before:][:2]}", flush=True)
    if (out["given"].get("views", {}).get("hardware") or {}).get("bandwidth") is None:
        problems.append(f"bound-given: no bandwidth read ({' '.join(given)}): {out['given'].get('views')}")
    summary = out["given"].get("bound_summary") or ""
    weights = (out["given"].get("views", {}).get("memory_usage") or {}).get("weight") or 0
    if weights > 0 and not summary.startswith("fleet at "):
        problems.append(f"bound-given: the job's summary is {summary!r}, not the fleet's share")
    return out


def main() -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", action="store_true", help="a GPU machine: SGLang on GPU 0, NVML's bandwidth")
    ap.add_argument("--python", help="SGLang's Python [default: scripts/sglang/install.sh's, CPU]")
    ap.add_argument("--model", help="a local model directory [default: the tiny Qwen2 of install.sh]")
    ap.add_argument("--seqs", type=int, default=16, help="SGLang's --max-running-requests")
    ap.add_argument("--prompts", type=int, default=400, help="prompts per phase (a GPU wants thousands)")
    ap.add_argument("--max-tokens", type=int, default=16, help="short answers: SGLang's counter moves as they end")
    ap.add_argument("--seconds", type=float, default=45.0, help="of generation per phase")
    args = ap.parse_args()
    if args.python is None or args.model is None:
        subprocess.run([str(HERE / "install.sh")], check=True)
    work = Path(tempfile.mkdtemp(prefix="genq-bound-"))
    print(f"bound check: work in {work}, load {load():.1f}", flush=True)
    stack = Stack(work, "sglang", args.seqs, python=args.python, model=args.model, gpu=args.gpu)
    problems: list[str] = []
    try:
        print(f"sglang up in {stack.start_s:.0f} s, load {load():.1f}", flush=True)
        out = check(stack, work, problems, gpu=args.gpu, n=args.prompts, max_tokens=args.max_tokens,
                    seconds=args.seconds)
    finally:
        stack.stop()
    (work / "bound.json").write_text(json.dumps({**out, "problems": problems}, indent=2))
    for p in problems:
        print("FAIL:", p)
    print(f"figures in {work / 'bound.json'}; " + ("all checks met" if not problems else f"{len(problems)} failed"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
