"""genq demo: the whole path on one machine, with simulated GPUs.

Starts one `genq sim` per simulated GPU and one `genq worker` per sim, enqueues
synthetic instruction prompts, shows the monitor's live view until the queue
is empty, then prints a summary and where the results are.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import click
import redis

from genq.cli import settings
from genq.core.redisconn import DEFAULT_URL, connect, mask_url

TOPICS = ["sorting algorithms", "the French revolution", "photosynthesis", "TCP congestion control",
          "Bayesian inference", "sourdough baking", "the Krebs cycle", "compiler optimisations",
          "plate tectonics", "options pricing", "garbage collection", "the Silk Road"]
TASKS = ["Explain {t} to a new student.", "Write three exam questions about {t}.",
         "Summarise the main debates about {t}.", "Give a step-by-step example involving {t}.",
         "What are common misconceptions about {t}?"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _answers(url: str) -> bool:
    try:
        conn = redis.Redis.from_url(url, socket_connect_timeout=1)
        return bool(conn.ping())
    except redis.RedisError:
        return False


def _wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise click.ClickException(f"simulator at {url} did not start")


def _write_prompts(path: Path, n: int, seed: int) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            topic = rng.choice(TOPICS)
            row = {"id": f"demo-{i:06d}",
                   "messages": [{"role": "user", "content": rng.choice(TASKS).format(t=topic)}],
                   "topic": topic}
            f.write(json.dumps(row) + "\n")


class Children:
    """Processes the demo started; all stopped on exit, whatever happens."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, name: str, args: list[str]) -> subprocess.Popen:
        log = open(self.log_dir / f"{name}.log", "wb")
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


@click.command()
@click.option("--gpus", type=click.IntRange(1, 16), default=4, show_default=True, help="Simulated GPUs: one sim server and one worker each.")
@click.option("--prompts", "n_prompts", type=click.IntRange(1), default=3000, show_default=True, help="Synthetic prompts to generate.")
@click.option("--output", type=click.Path(file_okay=False), default="demo-out", show_default=True, help="Where prompts, shards and logs go.")
@click.option("--max-running-requests", type=click.IntRange(1), default=37, show_default=True, help="Each simulated server's capacity.")
@click.option("--mean-output-tokens", type=click.FloatRange(1), default=600, show_default=True, help="Mean of the heavy-tailed (lognormal) output lengths.")
@click.option("--speed", type=click.FloatRange(0.1), default=1.0, show_default=True, help="Time compression: higher finishes sooner.")
@click.pass_context
def demo(ctx: click.Context, gpus: int, n_prompts: int, output: str, max_running_requests: int,
         mean_output_tokens: float, speed: float) -> None:
    """Run genq end to end on this machine with simulated GPUs.

    Enqueues synthetic prompts, starts one SGLang-compatible simulator and one
    worker per simulated GPU, shows live progress, and leaves one result per
    prompt under --output. Uses the Redis from --redis / GENQ_REDIS_URL; if that
    is the default and nothing answers, starts a private redis-server.
    """
    url = settings(ctx).redis_url
    out = Path(output).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    children = Children(logs)
    private_redis = None
    try:
        if not _answers(url):
            if url != DEFAULT_URL or shutil.which("redis-server") is None:
                raise click.ClickException(
                    f"no Redis answers at {mask_url(url)}: start one (apt-get install redis-server) or pass --redis URL")
            port = _free_port()
            private_redis = tempfile.mkdtemp(prefix="genq-demo-redis-")
            children.start("redis", ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--dir", private_redis])
            url = f"redis://127.0.0.1:{port}/0"
            deadline = time.monotonic() + 10
            while not _answers(url):
                if time.monotonic() > deadline:
                    raise click.ClickException("could not start a private redis-server")
                time.sleep(0.1)
            click.echo(f"no Redis at {mask_url(DEFAULT_URL)}: started a private one at {url}")
        _run(url, out, logs, children, gpus, n_prompts, max_running_requests, mean_output_tokens, speed)
    finally:
        children.stop()
        if private_redis:
            shutil.rmtree(private_redis, ignore_errors=True)


def _run(url: str, out: Path, logs: Path, children: Children, gpus: int, n_prompts: int,
         capacity: int, mean_tokens: float, speed: float) -> None:
    from rich.console import Console
    from rich.live import Live

    from genq.monitor.progress import Monitor
    from genq.monitor.view import render

    console = Console()
    genq = [sys.executable, "-m", "genq", "--redis", url]
    job = time.strftime("demo-%Y%m%d-%H%M%S")
    prompts_path = out / "prompts.jsonl"
    _write_prompts(prompts_path, n_prompts, seed=7)

    console.print(f"[bold]genq demo[/]: {n_prompts:,} prompts, {gpus} simulated GPUs "
                  f"(max_running_requests {capacity} each), Redis {mask_url(url)}")
    sims = []
    for gpu in range(gpus):
        port = _free_port()
        children.start(f"sim-gpu{gpu}", [
            sys.executable, "-m", "genq", "sim", "--port", str(port), "--max-running-requests", str(capacity),
            "--mean-output-tokens", str(mean_tokens), "--output-sigma", "1.0",
            "--step-ms-base", f"{20 / speed:.3f}", "--step-ms-per-req", f"{0.05 / speed:.4f}",
            "--tokens-per-step", "16"])
        sims.append(f"http://127.0.0.1:{port}")
    for sim_url in sims:
        _wait_http(sim_url + "/health")

    enqueue = subprocess.run([*genq, "enqueue", str(prompts_path), "--job", job, "--batch-size", "128",
                              "--max-tokens", str(int(mean_tokens * 8)), "--output", str(out),
                              "--extra-body", '{"chat_template_kwargs": {"enable_thinking": true}}'],
                             capture_output=True, text=True)
    console.print(enqueue.stdout.rstrip())
    if enqueue.returncode != 0:
        raise click.ClickException(f"enqueue failed:\n{enqueue.stderr}")

    started = time.monotonic()
    workers = [children.start(f"worker-gpu{gpu}", [*genq, "worker", "--server", sim_url, "--burst",
                                                   "--name", f"demo.gpu{gpu}"])
               for gpu, sim_url in enumerate(sims)]
    conn = connect(url)
    mon = Monitor(conn, job)
    with Live(console=console, refresh_per_second=2, transient=False) as live:
        while any(w.poll() is None for w in workers):
            live.update(render(mon.refresh(), mask_url(url), 0.5))
            time.sleep(0.5)
        live.update(render(mon.refresh(), mask_url(url), 0.5))
    makespan = time.monotonic() - started
    failed_workers = [i for i, w in enumerate(workers) if w.returncode != 0]
    if failed_workers:
        raise click.ClickException(f"worker(s) {failed_workers} failed; see {logs}")
    _summary(console, conn, out, job, sims, makespan, n_prompts)


def _summary(console, conn: redis.Redis, out: Path, job: str, sims: list[str], makespan: float,
             n_prompts: int) -> None:
    rows: list[dict] = []
    for shard in sorted((out / job / "shards").glob("*.jsonl")):
        with open(shard) as f:
            rows.extend(json.loads(line) for line in f if line.strip())
    ids = [r["id"] for r in rows]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    utilization = []
    for sim_url in sims:
        with urllib.request.urlopen(sim_url + "/sim/stats") as resp:
            stats = json.loads(resp.read())
        with urllib.request.urlopen(sim_url + "/get_server_info") as resp:
            capacity = json.loads(resp.read())["max_running_requests"]
        utilization.append(stats["busy_mean_running"] / capacity)
    dead = conn.hlen(f"genq:job:{job}:dlq")
    console.print()
    console.print(f"[bold green]done[/] in {makespan:.1f}s: {len(rows):,} results for {n_prompts:,} prompts "
                  f"({len(set(ids)):,} unique ids), {dead} dead letters")
    console.print(f"  output tokens {out_tokens:,} ({out_tokens / max(makespan, 1e-9):,.0f} tok/s); "
                  f"slot utilization per simulated GPU: {', '.join(f'{u:.1%}' for u in utilization)}")
    console.print(f"  shards:   {out / job / 'shards'}  ({len(list((out / job / 'shards').glob('*.jsonl')))} files)")
    console.print(f"  manifest: {out / job / 'manifest'}")
    console.print(f"  logs:     {out / 'logs'}")
    if rows:
        sample = {k: rows[0][k] for k in ("id", "finish_reason", "usage", "worker", "attempts")}
        console.print(f"  first result: {json.dumps(sample)}")
    genq = shutil.which("genq") or os.path.relpath(Path(sys.executable).with_name("genq"))
    console.print(f"  next:     {genq} monitor --job {job} --once --json")
    console.print(f"            {genq} export --job {job} --to {job}.jsonl")
