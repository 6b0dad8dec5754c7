"""The brake's checks (#25, docs/settings.md) against a real engine: one definition for
scripts/llamacpp/bench.py and scripts/vllm/bench.py. Each takes a stack (its .redis and
.server), a work folder and the problems list it appends to; it prints what it saw.

1. preflight: max_tokens alone over the context (4096 > 2,048): the job is blocked by the
   worker's preflight before any request; the server's own counter (`served`, read before
   and after) has not moved; nothing dead-lettered.
2. brake: a setting the server refuses on every request (response_format type "yaml": vLLM's
   request validation and llama.cpp's oaicompat parser answer 400): blocked by the brake
   within BLOCK_WITHIN_S with the server's message, at most 2 x the worker's in-flight target
   dead-lettered; `genq jobs set JOB --extra-body '{}'` + `genq resume --job JOB` finish it,
   every prompt once, every record at settings version 2.
   (Why not max_tokens: vLLM 0.32 and llama.cpp answer a prompt + max_tokens over the
   context with no error, they cut max_tokens to what the prompt leaves; that is check 4.)
3. too long: 5 prompts over the context among 300: each dead-lettered on its own as
   bad_request with the engine's message, the other 295 done, the job never blocked, `partial`.
4. cut at the context: max_tokens that fits alone but not with the prompts (prompts of
   ~1,800 tokens, max_tokens 1000): never a block; each prompt either cut by the engine
   (vLLM 0.32, llama.cpp: a record within the context) or refused on its own as
   bad_request with the engine's context message (vLLM 0.26 answers 400, seen on an H200),
   every prompt once, one way or the other.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from runs import ROOT, flush, genq

from genq.core import keys
from genq.core.records import JobBlock, WorkerStatus, unpack
from genq.core.redisconn import connect

BLOCK_WITHIN_S = 15.0
CONTEXT = 2048
BAD = '{"response_format": {"type": "yaml"}}'


def _rows(out: Path, job: str) -> list[dict]:
    return [json.loads(line) for shard in sorted((out / job / "shards").glob("*.jsonl")) for line in open(shard)
            if line.strip()]


def _enqueue(stack: Any, work: Path, job: str, rows: list[dict], *args: str) -> Path:
    flush(stack)
    src, out = work / f"{job}.jsonl", work / f"out-{job}"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = genq(stack, "enqueue", str(src), "--job", job, "--batch-size", "30", "--output", str(out), *args)
    assert p.returncode == 0, p.stderr
    return out


def _worker(stack: Any, work: Path, name: str) -> str:
    log = work / f"worker-{name}.log"
    proc = subprocess.run([sys.executable, "-m", "genq", "--redis", stack.redis, "worker", "--server", stack.server,
                           "--burst", "--name", name], cwd=ROOT, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                          timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-3000:]
    return text


def _state(stack: Any, job: str) -> dict:
    rows = json.loads(genq(stack, "jobs", "--json").stdout or "[]")
    return next((r for r in rows if r["name"] == job), {})


def _facts(stack: Any, job: str, worker: str) -> tuple[JobBlock | None, WorkerStatus | None, int]:
    conn = connect(stack.redis)
    try:
        raw, status = conn.get(keys.job_blocked(job)), conn.get(keys.worker_status(worker))
        return (unpack(raw, JobBlock) if raw else None, unpack(status, WorkerStatus) if status else None,
                conn.hlen(keys.job_dlq(job)))
    finally:
        conn.close()


def prompts(n: int, tag: str, words: int = 0) -> list[dict]:
    return [{"id": f"{tag}{i:04d}", "messages": [{"role": "user", "content": ("word " * words) + f"item {i}?"}]}
            for i in range(n)]


def preflight(stack: Any, work: Path, served: Callable[[], float], problems: list[str]) -> None:
    job = "pre"
    out = _enqueue(stack, work, job, prompts(60, "p"), "--max-tokens", "4096")
    before = served()
    _worker(stack, work, "pre-w")
    block, _, letters = _facts(stack, job, "pre-w")
    moved = served() - before
    state = _state(stack, job)
    print(f"brake 1, preflight (max_tokens 4096, context {CONTEXT}): blocked by "
          f"{block.reason if block else 'nothing'}; the server's counter moved by {moved:g}; {letters} dead letters; "
          f"state {state.get('state')}; {len(_rows(out, job))} records", flush=True)
    if block is None or block.reason != "preflight" or "max_tokens 4096" not in block.message:
        problems.append(f"preflight: not blocked before any request: {block}")
    if moved or letters or state.get("state") != "blocked":
        problems.append(f"preflight: {moved:g} reached the server, {letters} dead letters, state {state.get('state')}")


def brake(stack: Any, work: Path, message: str, problems: list[str]) -> None:
    """message: what the engine's 400 for BAD says (a part of it)."""
    job, n = "brk", 300
    out = _enqueue(stack, work, job, prompts(n, "b"), "--max-tokens", "32", "--extra-body", BAD)
    started = time.time()
    _worker(stack, work, "brk-w")
    block, status, letters = _facts(stack, job, "brk-w")
    target = status.concurrency_target if status else 0
    after = (block.at - started) if block else float("nan")
    print(f"brake 2, a setting the server refuses ({BAD}): blocked by {block.reason if block else 'nothing'} "
          f"{after:.1f} s after the worker started, "
          f"{block.failures if block else 0} of {block.outcomes if block else 0} "
          f"outcomes across {block.prompts if block else 0} prompts; {letters} dead letters (in-flight target "
          f"{target}); message: {block.message[:160] if block else '-'}", flush=True)
    if block is None or block.reason != "brake" or message not in block.message or block.status != 400:
        problems.append(f"brake: not blocked by the brake with the server's message: {block}")
    elif after > BLOCK_WITHIN_S:
        problems.append(f"brake: blocked {after:.1f} s after the worker started (target {BLOCK_WITHIN_S:.0f} s)")
    if letters > 2 * target:
        problems.append(f"brake: {letters} dead letters, more than 2 x the in-flight target {target}")
    said = genq(stack, "jobs", "set", job, "--extra-body", "{}", "--note", "real-engine brake check").stdout
    resumed = genq(stack, "resume", "--job", job).stdout
    _worker(stack, work, "brk-after")
    rows = _rows(out, job)
    ids = [r["id"] for r in rows]
    versions = sorted({r["settings_version"] for r in rows})
    state = _state(stack, job)
    print(f"  jobs set + resume: {len(rows)} records of {n}, {len(set(ids))} distinct, settings versions {versions}, "
          f"state {state.get('state')}, {state.get('failed', '?')} failed", flush=True)
    if "settings version 2" not in said or "queued again" not in resumed:
        problems.append(f"brake: jobs set / resume said {said.strip()[-200:]!r} / {resumed.strip()[-200:]!r}")
    if sorted(ids) != sorted(r["id"] for r in prompts(n, "b")) or versions != [2] or state.get("state") != "done":
        problems.append(f"brake: after the fix {len(rows)} records ({len(set(ids))} distinct) of {n}, versions "
                        f"{versions}, state {state.get('state')}")


def too_long(stack: Any, work: Path, message: str, problems: list[str]) -> None:
    """message: a part of the engine's 400 for a prompt over the context."""
    job = "mix"
    rows = prompts(295, "m") + [{"id": f"long{i}", "messages": [{"role": "user", "content": "word " * 3000}]}
                                for i in range(5)]
    out = _enqueue(stack, work, job, rows, "--max-tokens", "32")
    _worker(stack, work, "mix-w")
    block, _, _ = _facts(stack, job, "mix-w")
    letters = json.loads(genq(stack, "dlq", "list", "--json").stdout or "[]")
    done = _rows(out, job)
    state = _state(stack, job)
    kinds = sorted({(d["kind"], message in d["message"]) for d in letters})
    print(f"brake 3, 5 too-long prompts among 300: {len(done)} records, {len(letters)} dead letters "
          f"{sorted(d['id'] for d in letters)} ({kinds}), blocked: {block is not None}, state {state.get('state')}",
          flush=True)
    if block is not None or sorted(d["id"] for d in letters) != [f"long{i}" for i in range(5)] \
            or kinds != [("bad_request", True)] or sorted(r["id"] for r in done) != [f"m{i:04d}" for i in range(295)] \
            or state.get("state") != "partial":
        problems.append(f"too long: {len(done)} records, letters {sorted(d['id'] for d in letters)} {kinds}, "
                        f"block {block}, state {state.get('state')}")


def cut_at_context(stack: Any, work: Path, over_context: str, problems: list[str]) -> None:
    job, n = "cut", 16
    out = _enqueue(stack, work, job, prompts(n, "c", words=1800), "--max-tokens", "1000")
    _worker(stack, work, "cut-w")
    block, _, _ = _facts(stack, job, "cut-w")
    dead = json.loads(genq(stack, "dlq", "list", "--job", job, "--json").stdout or "[]")
    refused = [d for d in dead if d["kind"] == "bad_request" and over_context in d["message"]]
    letters = len(dead)
    rows = _rows(out, job)
    totals = sorted(r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"] for r in rows)
    cut = [r for r in rows if r["finish_reason"] == "length"]
    print(f"brake 4, max_tokens 1000 with prompts of ~1,800 tokens: {len(rows)} records of {n}, {letters} dead "
          f"letters, blocked: {block is not None}; prompt + completion {totals[:1]}..{totals[-1:]}, "
          f"{len(cut)} cut ('length') at "
          f"{sorted({r['usage']['prompt_tokens'] + r['usage']['completion_tokens'] for r in cut})}",
          flush=True)
    ids = sorted([r["id"] for r in rows] + [d["id"] for d in dead])
    if block is not None or len(refused) != letters or ids != [f"c{i:04d}" for i in range(n)] \
            or (totals and totals[-1] > CONTEXT):
        problems.append(f"cut at the context: {len(rows)} records, {letters} letters, block {block}, totals {totals}")


def run_all(stack: Any, work: Path, served: Callable[[], float], refused: str, over_context: str,
            problems: list[str]) -> None:
    start = served()
    checks: list[tuple[str, Callable[[], None]]] = [
        ("preflight", lambda: preflight(stack, work, served, problems)),
        ("brake", lambda: brake(stack, work, refused, problems)),
        ("too long", lambda: too_long(stack, work, over_context, problems)),
        ("cut at the context", lambda: cut_at_context(stack, work, over_context, problems))]
    for name, check in checks:
        try:
            check()
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check; the next still run
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    if served() <= start:  # the counter must see the requests of checks 2-4, or check 1 proves nothing
        problems.append("preflight: the server's counter did not move over the brake checks: it counts nothing")
