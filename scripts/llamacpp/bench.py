"""genq end to end against a real llama.cpp llama-server (CPU, tiny random model).

    make test-llamacpp          (or: python scripts/llamacpp/bench.py)

Builds (or reuses) llama-server and a tiny random-weight GGUF under
~/.cache/genq-llamacpp, starts llama-server with 8 slots (-np 8 -c 16384: 2,048
tokens a slot, --metrics --slots) and a private redis-server, each on a free
loopback port, and runs N prompts of which LONG exceed a slot's context:

1. genq defaults (auto concurrency, streaming): every prompt that fits completes
   exactly once at the first attempt, the too-long ones are dead-lettered as
   bad_request with the server's message, nothing else; genq finds 8 slots.
2. genq --concurrency 8: throughput of the defaults must be within 5% of it.
3. what streaming costs: genq stream vs --no-stream at 8 in flight, against a bare
   aiohttp client (8 in flight, stream vs not) on the same server and prompts;
   genq's cost must be no more than the bare client's (plus 5 points of noise).

Throughput is completion tokens over the span from the first request's start to
the last finish (process start-up is not counted for either side). Prints a
markdown table and writes llamacpp-bench.json. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CACHE = Path(os.environ.get("GENQ_LLAMACPP_CACHE", Path.home() / ".cache" / "genq-llamacpp"))
TREE = CACHE / f"llama_cpp_python-{os.environ.get('GENQ_LLAMACPP_PY_VERSION', '0.3.36')}" / "vendor" / "llama.cpp"
SLOTS, CTX = 8, 16384


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ok(url: str, timeout: float, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout}s")


def prompts(n: int, long: int) -> list[dict]:
    rows = [{"id": f"p{i:04d}", "messages": [{"role": "user", "content": f"Tell me about item {i}, please."}]}
            for i in range(n - long)]
    # ~3,000 tokens each: more than a slot's 2,048.
    rows += [{"id": f"long{i}", "messages": [{"role": "user", "content": "word " * 3000 + str(i)}]}
             for i in range(long)]
    return rows


class Stack:
    """A private redis-server and llama-server, stopped at the end."""

    def __init__(self, work: Path, model: Path) -> None:
        self.procs: list[subprocess.Popen] = []
        rport, lport = free_port(), free_port()
        self.redis = f"redis://127.0.0.1:{rport}/0"
        self.server = f"http://127.0.0.1:{lport}"
        self._start(["redis-server", "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(work)], work / "redis.log")
        self._start([str(CACHE / "build" / "bin" / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                     "--port", str(lport), "-np", str(SLOTS), "-c", str(CTX), "--metrics", "--slots"],
                    work / "llama-server.log")
        wait_ok(self.server + "/health", 120, self.procs[-1])

    def cpu_s(self) -> float:
        """CPU seconds llama-server has used: the work, whatever else the machine runs."""
        fields = Path(f"/proc/{self.procs[-1].pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def _start(self, args: list[str], log: Path) -> None:
        self.procs.append(subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()


class Sampler:
    """Busy slots and deferred requests from llama-server's /metrics, twice a second,
    and its CPU time: figures a shared, noisy machine does not distort as much as tok/s."""

    def __init__(self, stack: Stack) -> None:
        self.stack, self.busy, self.deferred = stack, [], []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self.cpu0 = self.stack.cpu_s()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.cpu = self.stack.cpu_s() - self.cpu0

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            try:
                with urllib.request.urlopen(self.stack.server + "/metrics", timeout=2) as resp:
                    text = resp.read().decode()
            except OSError:
                continue
            values = dict(line.split(" ", 1) for line in text.splitlines() if line.startswith("llamacpp:"))
            self.busy.append(float(values.get("llamacpp:requests_processing", "nan")))
            self.deferred.append(float(values.get("llamacpp:requests_deferred", "nan")))

    def figures(self, tokens: int) -> dict:
        # Samples while work was in flight; the first and last seconds ramp.
        busy = [b for b in self.busy if b > 0] or [0.0]
        return {"busy_slots": sum(busy) / len(busy), "max_deferred": max(self.deferred or [0.0]),
                "server_cpu_s": self.cpu, "server_cpu_ms_per_tok": 1000 * self.cpu / max(tokens, 1)}


def genq(stack: Stack, *args: str, timeout: float = 1800) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "genq", "--redis", stack.redis, *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def genq_run(stack: Stack, work: Path, src: Path, name: str, max_tokens: int, *worker_args: str) -> dict:
    subprocess.run(["redis-cli", "-u", stack.redis, "flushall"], check=True, capture_output=True)
    out = work / f"out-{name}"
    shutil.rmtree(out, ignore_errors=True)
    p = genq(stack, "enqueue", str(src), "--job", name, "--batch-size", "50", "--max-tokens", str(max_tokens),
             "--output", str(out))
    assert p.returncode == 0, p.stderr
    p = genq(stack, "worker", "--server", stack.server, "--burst", *worker_args)
    (work / f"worker-{name}.log").write_text(p.stdout + p.stderr)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for shard in sorted((out / name / "shards").glob("*.jsonl"))
            for line in open(shard) if line.strip()]
    letters = json.loads(genq(stack, "dlq", "list", "--json").stdout or "[]")
    start = min(r["finished_at"] - r["latency_s"] for r in rows)
    span = max(r["finished_at"] for r in rows) - start
    tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    capacity_line = next((line for line in (p.stdout + p.stderr).splitlines() if "in flight" in line), "")
    return {"name": name, "args": " ".join(worker_args) or "(defaults)", "rows": rows, "letters": letters,
            "span_s": span, "tokens": tokens, "tok_s": tokens / span, "capacity_line": capacity_line}


async def bare(server: str, rows: list[dict], max_tokens: int, stream: bool, concurrency: int) -> dict:
    """A plain aiohttp client, 8 in flight, no retries: the floor genq is held to."""
    queue = list(rows)
    starts, ends, tokens, errors = [], [], 0, 0
    async with aiohttp.ClientSession() as http:
        async def one(row: dict) -> None:
            nonlocal tokens, errors
            body = {"messages": row["messages"], "max_tokens": max_tokens, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            starts.append(time.time())
            try:
                # A new connection per request: llama-server closes it after a stream anyway.
                async with http.post(server + "/v1/chat/completions", json=body,
                                     headers={"Connection": "close"}) as resp:
                    raw = await resp.read()
            except aiohttp.ClientError:
                errors += 1
                return
            ends.append(time.time())
            if resp.status != 200:
                errors += 1
                return
            if stream:
                for line in raw.split(b"\n"):
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if event.get("usage"):
                            tokens += event["usage"]["completion_tokens"]
            else:
                tokens += json.loads(raw)["usage"]["completion_tokens"]

        async def lane() -> None:
            while queue:
                await one(queue.pop(0))

        await asyncio.gather(*(lane() for _ in range(concurrency)))
    span = max(ends) - min(starts)
    return {"name": f"bare-{'stream' if stream else 'nostream'}", "tokens": tokens, "span_s": span,
            "tok_s": tokens / span, "errors": errors}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--long", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "llamacpp-bench.json")
    args = ap.parse_args()
    subprocess.run([str(HERE / "build.sh")], check=True)
    model = CACHE / "tiny.gguf"
    if not model.exists():
        subprocess.run(["python3", str(HERE / "make_model.py"), str(TREE), str(model), "--eog-scale", "1.8"],
                       check=True)
    work = Path(tempfile.mkdtemp(prefix="genq-llamacpp-"))
    rows = prompts(args.n, args.long)
    src = work / "prompts.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    fit = sorted(r["id"] for r in rows if not r["id"].startswith("long"))
    long_ids = sorted(r["id"] for r in rows if r["id"].startswith("long"))
    stack = Stack(work, model)
    problems: list[str] = []
    fitting = [r for r in rows if not r["id"].startswith("long")]
    configs: list[tuple[str, tuple[str, ...]]] = [
        ("defaults", ()), ("c8", ("--concurrency", "8")), ("c8-nostream", ("--concurrency", "8", "--no-stream")),
        ("bare-nostream", ()), ("bare-stream", ())]
    runs: list[dict] = []
    try:
        # The machine is shared: each round runs the configurations in the reverse
        # order of the one before (ABBA), so a drift in load hits all of them alike.
        for rnd in range(args.rounds):
            for name, worker_args in (configs if rnd % 2 == 0 else configs[::-1]):
                with Sampler(stack) as sampler:
                    if name.startswith("bare"):
                        run = asyncio.run(bare(stack.server, fitting, args.max_tokens, name == "bare-stream", SLOTS))
                    else:
                        run = genq_run(stack, work, src, name, args.max_tokens, *worker_args)
                run.update(sampler.figures(run["tokens"]))
                run["round"] = rnd
                runs.append(run)
                print(f"round {rnd} {name}: {run['tok_s']:.0f} tok/s over {run['span_s']:.1f} s, "
                      f"busy slots {run['busy_slots']:.2f}, server {run['server_cpu_ms_per_tok']:.2f} ms CPU/token",
                      flush=True)
    finally:
        stack.stop()
    for run in runs:
        if run["name"].startswith("bare"):
            continue
        ids = sorted(r["id"] for r in run["rows"])
        if ids != fit:
            problems.append(f"{run['name']}: {len(ids)} results, {len(set(ids))} distinct, want {len(fit)}")
        retried = [r["id"] for r in run["rows"] if r["attempts"] != 1]
        if retried:
            problems.append(f"{run['name']}: {len(retried)} results needed more than one attempt")
        dead = {letter["id"]: letter for letter in run["letters"]}
        if sorted(dead) != long_ids:
            problems.append(f"{run['name']}: dead letters {sorted(dead)[:10]}, want only the {len(long_ids)} long")
        if any(d["kind"] != "bad_request" or "exceeds the available context size" not in d["message"]
               for d in dead.values()):
            problems.append(f"{run['name']}: a dead letter is not llama.cpp's context 400")
        run["finish"] = {k: sum(1 for r in run["rows"] if r["finish_reason"] == k) for k in ("stop", "length")}
    first = next(r for r in runs if r["name"] == "defaults")
    if "capacity 8)" not in first["capacity_line"]:
        problems.append(f"genq did not find 8 slots: {first['capacity_line']}")

    def tok_s(name: str) -> float:  # over all rounds: total tokens over total span
        mine = [r for r in runs if r["name"] == name]
        return sum(r["tokens"] for r in mine) / sum(r["span_s"] for r in mine)

    ratio = tok_s("defaults") / tok_s("c8")
    if ratio < 0.95:
        problems.append(f"defaults reach {ratio:.1%} of --concurrency 8")
    genq_cost = 1 - tok_s("c8") / tok_s("c8-nostream")
    bare_cost = 1 - tok_s("bare-stream") / tok_s("bare-nostream")
    if genq_cost > bare_cost + 0.05:
        problems.append(f"streaming costs genq {genq_cost:.1%}, a bare client {bare_cost:.1%}")
    print("\n| run | in flight | round | tokens | span s | tok/s | busy slots | server CPU ms/token "
          "| stop/length | dead letters |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        common = (f"| {run['round']} | {run['tokens']} | {run['span_s']:.1f} | {run['tok_s']:.0f} "
                  f"| {run['busy_slots']:.2f} | {run['server_cpu_ms_per_tok']:.2f} ")
        if run["name"].startswith("bare"):
            print(f"| {run['name']} | 8 {common}| | {run['errors']} errors |")
        else:
            print(f"| genq {run['name']} | {run['args']} {common}| {run['finish']['stop']}/{run['finish']['length']} "
                  f"| {len(run['letters'])} |")

    def mean(name: str, key: str) -> float:
        mine = [r[key] for r in runs if r["name"] == name]
        return sum(mine) / len(mine)

    print("\nmean busy slots: " + ", ".join(f"{c} {mean(c, 'busy_slots'):.2f}" for c, _ in configs))
    print("server CPU ms per token: " + ", ".join(f"{c} {mean(c, 'server_cpu_ms_per_tok'):.2f}" for c, _ in configs))
    print(f"\ndefaults / --concurrency 8: {ratio:.3f}; streaming cost: genq {genq_cost:+.1%}, bare {bare_cost:+.1%}")
    print(f"genq: {first['capacity_line'].split('INFO ', 1)[-1]}")
    summary = {"runs": [{k: v for k, v in r.items() if k not in ("rows", "letters")} for r in runs],
               "ratio_defaults_c8": ratio, "stream_cost_genq": genq_cost,
               "stream_cost_bare": bare_cost, "problems": problems, "work": str(work)}
    args.out.write_text(json.dumps(summary, indent=2))
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
