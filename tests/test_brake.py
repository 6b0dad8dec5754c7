"""A bad setting stops the job, not its prompts (#25): the preflight, the brake, settings fixed in place.

Real processes throughout: a private redis-server, `genq sim --max-context N` playing SGLang,
vLLM or llama.cpp (their exact 400 messages), real `genq enqueue`, `genq worker --burst`,
`genq jobs set/show`, `genq resume --job`, `genq monitor --json`, and the shared exactly-once
audit (tests/audit.py) at the end.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from genq.core import keys
from genq.core.records import JobBlock, WorkerStatus, unpack
from genq.monitor.exporter import make_registry
from genq.monitor.progress import Monitor
from tests.audit import audit
from tests.conftest import run_genq, sim_stats, write_prompts

FAST = dict(mean_output_tokens=24, output_sigma=0.5, tokens_per_step=16, step_ms_base=2, max_running_requests=8)
CONTEXT = 2048


def enqueue(redis_url: str, tmp_path: Path, job: str, n: int, *args: str) -> tuple[list[str], Path]:
    src = tmp_path / f"{job}.jsonl"
    ids = write_prompts(src, n)
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", job, "--output", str(out), "--batch-size", "30", *args,
             redis_url=redis_url)
    return ids, out


def block_of(rconn, job: str) -> JobBlock | None:
    raw = rconn.get(keys.job_blocked(job))
    return unpack(raw, JobBlock) if raw else None


def jobs_row(redis_url: str, job: str) -> dict:
    rows = json.loads(run_genq("jobs", "--json", redis_url=redis_url).stdout)
    return next(r for r in rows if r["name"] == job)


def monitor(redis_url: str, job: str) -> dict:
    return json.loads(run_genq("monitor", "--job", job, "--once", "--json", redis_url=redis_url).stdout)


def fix_and_finish(redis_url: str, rconn, url: str, worker, job: str, out: Path, ids: list[str],
                   old_max_tokens: int) -> None:
    """`genq jobs set` + `genq resume --job`, a burst worker, then every prompt exactly once at version 2."""
    said = run_genq("jobs", "set", job, "--max-tokens", "1024", "--note", "fits the context",
                    redis_url=redis_url).stdout
    assert "settings version 2" in said and "still blocked" in said, said
    shown = run_genq("jobs", "show", job, redis_url=redis_url).stdout
    assert "settings version 2" in shown and f"max_tokens {old_max_tokens} -> 1024 (fits the context)" in shown, shown
    resumed = run_genq("resume", "--job", job, redis_url=redis_url).stdout
    assert re.search(r"parked batch(es)? queued again", resumed), resumed
    assert block_of(rconn, job) is None and not rconn.exists(keys.job_paused(job))
    proc = worker(url, "--burst", name="after")
    assert proc.wait(timeout=120) == 0, proc.log()
    found = audit(rconn, job, out, ids)  # exactly once, no letter, status done
    assert len(found.results) == len(ids) and not found.letters
    versions = {r["settings_version"] for r in found.results.values()}
    assert versions == {2}, f"records at settings versions {versions}, not all at the new one"
    assert jobs_row(redis_url, job)["state"] == "done"


@pytest.mark.parametrize("flavor", ["sglang", "vllm", "llamacpp"])
def test_preflight_blocks_before_any_request(flavor, redis_url, rconn, sim, worker, tmp_path):
    """The issue's case: --max-tokens 4096 against a 2,048-token context. Blocked by the worker's
    preflight from what the server says about itself; the server sees no generation request."""
    url = sim(flavor=flavor, max_context=CONTEXT, **FAST)
    ids, out = enqueue(redis_url, tmp_path, "pre", 300 if flavor == "sglang" else 60, "--max-tokens", "4096")
    proc = worker(url, "--burst")
    assert proc.wait(timeout=60) == 0, proc.log()  # a burst worker leaves: only a blocked job is left
    block = block_of(rconn, "pre")
    assert block is not None and block.reason == "preflight", proc.log()
    assert "max_tokens 4096" in block.message and f"{CONTEXT} tokens" in block.message, block.message
    stats = sim_stats(url)
    assert stats["generation_requests"] == 0 and stats["finished_requests"] == 0, stats
    assert rconn.hlen(keys.job_dlq("pre")) == 0
    row = jobs_row(redis_url, "pre")
    assert row["state"] == "blocked" and row["remaining"] == len(ids) and row["blocked"]["reason"] == "preflight"
    assert "is blocked (preflight" in run_genq("jobs", redis_url=redis_url).stdout
    if flavor == "sglang":
        fix_and_finish(redis_url, rconn, url, worker, "pre", out, ids, 4096)


def test_brake_blocks_a_job_whose_every_request_fails(redis_url, rconn, sim, worker, tmp_path):
    """max_tokens below the context, but prompt + max_tokens over it: every request gets SGLang's
    400. The brake blocks the job within seconds with the server's message; its prompts stay queued
    (at most 2 x the worker's in-flight target dead-lettered); set + resume finishes it exactly once."""
    url = sim(max_context=CONTEXT, **FAST)
    ids, out = enqueue(redis_url, tmp_path, "brk", 300, "--max-tokens", str(CONTEXT - 1))
    started = time.time()
    proc = worker(url, "--burst", "--name", "brk-w")
    assert proc.wait(timeout=60) == 0, proc.log()
    block = block_of(rconn, "brk")
    assert block is not None and block.reason == "brake", proc.log()
    # Nobody resumed it: the worker must not say so (the brake's own parking is no operator's pause).
    assert "resumed:" not in proc.log(), proc.log()
    assert block.message.startswith("Requested token count exceeds the model's maximum context length of 2048"), block
    assert block.status == 400 and block.failures > block.outcomes / 2 and block.prompts >= 8, block
    assert block.at - started < 15, f"blocked {block.at - started:.1f}s after the worker started"
    status = unpack(rconn.get(keys.worker_status("brk-w")), WorkerStatus)
    letters = rconn.hlen(keys.job_dlq("brk"))
    assert letters <= 2 * status.concurrency_target, (letters, status.concurrency_target)
    assert rconn.scard(keys.job_done("brk")) == 0
    row = jobs_row(redis_url, "brk")
    assert row["state"] == "blocked" and row["done"] == 0 and row["remaining"] + row["failed"] == len(ids)
    doc = monitor(redis_url, "brk")
    assert doc["status"] == "blocked" and doc["blocked_reason"] == "brake"
    assert "Requested token count exceeds" in doc["blocked"] and "genq resume --job brk" in doc["blocked"], doc
    assert doc["rate_per_sec"] in (None, 0.0), "nothing was done: no rate"
    metrics = generate_latest(make_registry(Monitor(rconn, once=True))).decode()
    assert 'genq_job_status{job="brk",status="blocked"} 1.0' in metrics
    assert 'genq_job_blocked{job="brk",reason="brake"} 1.0' in metrics
    assert 'genq_job_blocked{job="brk",reason="preflight"} 0.0' in metrics
    # The prompts that tripped the brake were not dead-lettered: every prompt is still to do.
    assert letters == 0, f"{letters} prompts dead-lettered"
    fix_and_finish(redis_url, rconn, url, worker, "brk", out, ids, CONTEXT - 1)


def test_a_few_too_long_prompts_are_dead_lettered_alone(redis_url, rconn, sim, worker, tmp_path):
    """5 prompts longer than the context among 300: each is dead-lettered on its own with the server's
    message, the other 295 finish, the job is never blocked and never shown as done."""
    url = sim(max_context=CONTEXT, **FAST)
    src = tmp_path / "mixed.jsonl"
    ids = write_prompts(src, 295)
    long_ids = [f"long{i}" for i in range(5)]
    with open(src, "a") as f:
        for pid in long_ids:
            f.write(json.dumps({"id": pid, "messages": [{"role": "user", "content": "word " * 3000}]}) + "\n")
    out = tmp_path / "out"
    run_genq("enqueue", str(src), "--job", "mix", "--output", str(out), "--batch-size", "30", "--max-tokens", "64",
             redis_url=redis_url)
    proc = worker(url, "--burst")
    assert proc.wait(timeout=90) == 0, proc.log()
    assert block_of(rconn, "mix") is None, proc.log()
    found = audit(rconn, "mix", out, ids + long_ids)  # status "partial": never "done" with dead letters
    assert sorted(found.letters) == long_ids and len(found.results) == 295
    for letter in found.letters.values():
        assert letter.kind == "bad_request" and letter.status == 400 and letter.attempts == 1
        assert "is longer than the model's context length (2048 tokens)" in letter.message
    assert jobs_row(redis_url, "mix")["state"] == "partial"
    assert {r["settings_version"] for r in found.results.values()} == {1}
