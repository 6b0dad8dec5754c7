"""`genq demo`: the whole path on one machine: a `genq sim` and a `genq worker` per simulated GPU, synthetic
prompts, the monitor's live view until the queue is empty, then a summary. Children run as `python -P`
(genq.PYTHON): the folder they start in never shadows the installed genq."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import click
import redis
from rich.console import Console

from genq import PYTHON
from genq.cli import Finite
from genq.core.ledger import letters
from genq.core.redisconn import ENV_VAR, LocalRedis, connect, free_port, mask_url
from genq.core.words import plural
from genq.ops import control
from genq.output import truth

TOPICS = ["sorting algorithms", "the French revolution", "photosynthesis", "TCP congestion control",
          "Bayesian inference", "sourdough baking", "the Krebs cycle", "plate tectonics"]
TASKS = ["Explain {t} to a new student.", "Write three exam questions about {t}.",
         "What are common misconceptions about {t}?"]


opt = functools.partial(click.option, show_default=True)


@click.command()
@opt("--num-gpus", "gpus", type=click.IntRange(1, 16), default=4, help="Simulated GPUs, a sim and a worker each.")
@opt("--prompts", "n_prompts", type=click.IntRange(1), default=3000, help="Synthetic prompts to generate.")
@opt("--output", type=click.Path(file_okay=False), default="demo-out", help="Where prompts, shards and logs go.")
@opt("--max-running-requests", "capacity", type=click.IntRange(1), default=37, help="Each simulated server's capacity.")
@opt("--mean-output-tokens", "mean_tokens", type=Finite(1), default=600,
     help="Mean of the heavy-tailed (lognormal) output lengths.")
@opt("--speed", type=Finite(0.1), default=1.0, help="Time compression: higher finishes sooner.")
@click.option("--keep", is_flag=True, help="With --redis: keep the demo's job in that Redis afterwards.")
@click.pass_context
def demo(ctx: click.Context, gpus: int, n_prompts: int, output: str, capacity: int, mean_tokens: float, speed: float,
         keep: bool) -> None:
    """Run genq end to end here, with simulated GPUs. Its Redis: a private one, or --redis URL (README)."""
    from rich.live import Live

    from genq.monitor.progress import Monitor
    from genq.monitor.view import render

    given = ctx.find_root().obj  # --redis or GENQ_REDIS_URL; None: the demo's own Redis
    if keep and given is None:
        raise click.UsageError("--keep needs --redis URL (the demo's own Redis is stopped at the end)")
    out, console = Path(output).resolve(), Console()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:  # the children stop before a private Redis: none sees it vanish
        url = given
        if url is None:
            try:
                with open(out / "logs" / "redis.log", "wb") as log:
                    url = stack.enter_context(LocalRedis(log=log)).url
            except RuntimeError as e:
                raise click.ClickException(f"the demo runs a redis-server of its own: {e} "
                                           "(or give --redis URL)") from None
        conn = connect(url)
        conn.ping()
        children: list[subprocess.Popen] = []
        stack.callback(_stop, children)
        genq = [*PYTHON, "-m", "genq"]
        os.environ[ENV_VAR] = url  # its children's Redis, out of their argv (the process list): docs/security.md
        job = time.strftime("demo-%Y%m%d-%H%M%S")
        rng = random.Random(7)
        with open(out / "prompts.jsonl", "w") as f:
            for i in range(n_prompts):
                topic = rng.choice(TOPICS)
                f.write(json.dumps({"id": f"demo-{i:06d}", "topic": topic, "messages": [
                    {"role": "user", "content": rng.choice(TASKS).format(t=topic)}]}) + "\n")
        where = mask_url(url) if given is not None else f"a private redis-server at {url}, stopped at the end"
        console.print(f"[bold]genq demo[/]: {n_prompts:,} prompts, {gpus} simulated GPUs "
                      f"(max_running_requests {capacity} each), Redis {where}")
        sims = [f"http://127.0.0.1:{free_port()}" for _ in range(gpus)]
        for gpu, sim in enumerate(sims):
            _start(children, out / "logs", f"sim-gpu{gpu}", [
                *PYTHON, "-m", "genq", "sim", "--port", sim.rsplit(":", 1)[1], "--max-running-requests", str(capacity),
                "--mean-output-tokens", str(mean_tokens), "--output-sigma", "1.0",
                "--step-ms-base", f"{20 / speed:.3f}", "--step-ms-per-req", f"{0.05 / speed:.4f}",
                "--tokens-per-step", "16"])
        for sim in sims:
            _wait_http(sim + "/health")
        enqueue = subprocess.run([*genq, "enqueue", str(out / "prompts.jsonl"), "--job", job, "--batch-size", "128",
                                  "--max-tokens", str(int(mean_tokens * 8)), "--output", str(out),
                                  "--extra-body", '{"chat_template_kwargs": {"enable_thinking": true}}'],
                                 capture_output=True, text=True)
        console.print(enqueue.stdout.rstrip())
        if enqueue.returncode != 0:
            raise click.ClickException(f"enqueue failed:\n{enqueue.stderr}")
        started = time.monotonic()
        workers = [_start(children, out / "logs", f"worker-gpu{gpu}",
                          [*genq, "worker", "--server", sim, "--burst", "--name", f"demo.gpu{gpu}"])
                   for gpu, sim in enumerate(sims)]
        mon = Monitor(conn, job)
        with Live(console=console, refresh_per_second=2, transient=False) as live:
            while any(w.poll() is None for w in workers):
                live.update(render(mon.refresh(), mask_url(url), 0.5))
                time.sleep(0.5)
            live.update(render(mon.refresh(), mask_url(url), 0.5))
        makespan = time.monotonic() - started
        if failed := [i for i, w in enumerate(workers) if w.returncode != 0]:
            raise click.ClickException(f"worker(s) {failed} failed; see {out / 'logs'}")
        _summary(console, conn, out, job, sims, makespan, n_prompts, hints=keep)
        if given is not None and not keep:
            control.delete_job(conn, control.find_job(conn, job))
            click.echo(f"removed the demo's job {job} from {mask_url(url)} (--keep keeps it)")


def _start(children: list[subprocess.Popen], log_dir: Path, name: str, args: list[str]) -> subprocess.Popen:
    """A child in a session of its own, logging to LOG_DIR/NAME.log."""
    with open(log_dir / f"{name}.log", "wb") as log:
        children.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    return children[-1]


def _stop(children: list[subprocess.Popen]) -> None:
    """SIGTERM to every child still running, then 15 s for each before it is killed."""
    for proc in children:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in children:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)
        proc.kill()


def _wait_http(url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return urllib.request.urlopen(url, timeout=1).close()
        except OSError:
            time.sleep(0.1)
    raise click.ClickException(f"simulator at {url} did not start")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url) as resp:
        return json.loads(resp.read())


def _summary(console: Console, conn: redis.Redis, out: Path, job: str, sims: list[str], makespan: float,
             n_prompts: int, *, hints: bool) -> None:
    root = Path(truth.job_root(str(out), job))
    shards = sorted((root / truth.SHARDS_DIR).glob("*.jsonl"))
    rows = [json.loads(line) for shard in shards for line in shard.read_text().splitlines() if line.strip()]
    out_tokens = sum(r["usage"]["completion_tokens"] for r in rows)
    # Each sim's mean running requests over its running limit, as SGLang reports that limit.
    utilization = [_get(u + "/sim/stats")["busy_mean_running"]
                   / _get(u + "/server_info")["internal_states"][0]["effective_max_running_requests_per_dp"]
                   for u in sims]
    genq = shutil.which("genq") or os.path.relpath(Path(sys.executable).with_name("genq"))
    lines = [
        "", f"[bold green]done[/] in {makespan:.1f}s: {plural(len(rows), 'result')} for {plural(n_prompts, 'prompt')} "
        f"({len({r['id'] for r in rows}):,} unique ids), {plural(letters.count(conn, job), 'dead letter')}",
        f"  output tokens {out_tokens:,} ({out_tokens / max(makespan, 1e-9):,.0f} tok/s); "
        f"slot utilization per simulated GPU: {', '.join(f'{u:.1%}' for u in utilization)}",
        f"  shards:   {root / truth.SHARDS_DIR}  ({plural(len(shards), 'file')})",
        f"  manifest: {root / truth.MANIFEST_DIR}", f"  logs:     {out / 'logs'}"]
    if rows:
        sample = {k: rows[0][k] for k in ("id", "finish_reason", "usage", "worker", "attempts")}
        lines.append(f"  first result: {json.dumps(sample)}")
    lines += [f"  next:     {genq} monitor --job {job} --once --json", f"            {genq} export --job {job} "
              f"--to {job}.jsonl"] if hints else [
        '  next:     the walk-through in README.md, "Using it" (enqueue, worker, monitor, export)']
    for line in lines:
        console.print(line)
