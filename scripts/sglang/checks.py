"""The checks `make test-sglang` runs on real SGLang beside scripts/vllm/bench.py's (capacity,
over-context, the brake, throughput): what a record keeps of what a request asked for, pause and
drain, and a worker killed mid-batch. Each adds what it saw wrong to `problems`.

Real SGLang 0.5.23 answers (tests/recordings/sglang-0.5.23/): the random model's text is random,
so a logit bias on <|im_end|> (151645) with min_tokens makes an answer end on end-of-sequence after
exactly min_tokens tokens (none: EOS first); its chat stream sends nothing for that token.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from runs import ROOT, flush, genq  # scripts/llamacpp/, on sys.path once stack.py is imported

EOS = 151645
EOS_BIAS = {"logit_bias": {str(EOS): 100}}
TOOL = {"type": "function", "function": {"name": "count_tokens", "parameters": {"type": "object"}}}
STOPS = [" ", "e", "a", "o"]
# id prefix -> the sampling of its rows; each row's record is checked by its prefix (_problems_of).
CASES = {
    "eos1": {"logprobs": True, "top_logprobs": 2, **EOS_BIAS},  # EOS first: a valid, empty answer
    "eos1n2": {"logprobs": True, "n": 2, **EOS_BIAS},
    "eos4": {"logprobs": True, "top_logprobs": 2, "min_tokens": 3, **EOS_BIAS},
    "eos4n2": {"logprobs": True, "n": 2, "min_tokens": 3, **EOS_BIAS},
    "lp": {"logprobs": True},  # to max_tokens or an unforced EOS
    "stop": {"stop": STOPS},
    "stopeos": {"stop": ["never appears"], "min_tokens": 2, **EOS_BIAS},
    "stopid": {"stop_token_ids": [EOS], "min_tokens": 2, **EOS_BIAS},
    "tools": {"tools": [TOOL]},
    "regex": {"regex": "[0-9]{3}"},
}


def _rows(per_case: int) -> list[dict]:
    return [{"id": f"{case}-{i}", "messages": [{"role": "user", "content": f"Say something about {case} {i}."}],
             "sampling": sampling} for case, sampling in CASES.items() for i in range(per_case)]


def _records(out: Path, job: str) -> list[dict]:
    return [json.loads(line) for shard in sorted((out / job / "shards").glob("*.jsonl"))
            for line in open(shard) if line.strip()]


def _letters(stack: Any) -> list[dict]:
    return json.loads(genq(stack, "dlq", "list", "--json").stdout or "[]")


def _worker(stack: Any, log: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "genq", "--redis", stack.redis, "worker", "--server", stack.server,
                             *args], cwd=ROOT, stdout=open(log, "a"), stderr=subprocess.STDOUT)


def _enqueue(stack: Any, work: Path, job: str, rows: list[dict], max_tokens: int, batch: int) -> Path:
    src, out = work / f"{job}.jsonl", work / f"out-{job}"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    p = genq(stack, "enqueue", str(src), "--job", job, "--batch-size", str(batch), "--max-tokens", str(max_tokens),
             "--output", str(out))
    if p.returncode != 0:
        raise RuntimeError(f"enqueue {job}: {(p.stderr or p.stdout).strip()[-500:]}")
    return out


def _exactly_once(job: str, records: list[dict], rows: list[dict], letters: list[dict]) -> list[str]:
    ids = sorted(r["id"] for r in records)
    want = sorted(r["id"] for r in rows)
    problems = []
    if ids != want:
        problems.append(f"{job}: {len(ids)} records ({len(set(ids))} distinct) for {len(want)} prompts; "
                        f"missing {sorted(set(want) - set(ids))[:5]}")
    if letters:
        problems.append(f"{job}: dead letters {[(d['id'], d['kind'], d['message'][:120]) for d in letters[:3]]}")
    return problems


def _entries(logprobs: dict | None) -> list[dict]:
    return (logprobs or {}).get("content") or []


def _problems_of(r: dict, streamed: bool) -> list[str]:
    """What is wrong with one record, by the case its id names."""
    case, out = r["id"].split("-")[0], []
    choices = r.get("choices") or [{**r, "completion_tokens": r["usage"]["completion_tokens"]}]
    if CASES[case].get("logprobs"):
        counts = [c.get("completion_tokens") for c in choices]
        if None in counts:  # a whole n > 1 answer counts only the request's tokens
            counts = [len(_entries(c["logprobs"])) for c in choices]
            if sum(counts) != r["usage"]["completion_tokens"]:
                out.append(f"{r['id']}: {counts} logprob entries, usage {r['usage']['completion_tokens']}")
        for c, tokens in zip(choices, counts, strict=True):
            entries = _entries(c.get("logprobs"))
            if len(entries) != tokens:
                out.append(f"{r['id']}: choice {c['index']}: {len(entries)} logprob entries for {tokens} tokens")
            elif c["finish_reason"] == "stop" and entries:
                last = entries[-1]
                # Streamed, SGLang sends nothing for EOS: genq records its entry as nulls; whole, SGLang lists it.
                want = None if streamed else "<|im_end|>"
                if last["token"] != want:
                    out.append(f"{r['id']}: choice {c['index']}: last entry {last['token']!r}, want {want!r}")
        if case.startswith("eos1") and any((c["completion"], c["finish_reason"], t) != ("", "stop", 1)
                                           for c, t in zip(choices, counts, strict=True)):
            out.append(f"{r['id']}: not an EOS-first answer: "
                       f"{[(c['completion'], c['finish_reason']) for c in choices]}")
        if case.startswith("eos4") and counts != [4] * len(choices):
            out.append(f"{r['id']}: {counts} tokens, want 4 a choice")
    elif "logprobs" in r:
        out.append(f"{r['id']}: logprobs recorded, not asked")
    if case == "stop" and not (r["finish_reason"] == "stop" and r["matched_stop"] in STOPS
                               or r["finish_reason"] == "length" and r["matched_stop"] is None):
        out.append(f"{r['id']}: {r['finish_reason']} with matched_stop {r.get('matched_stop', '(absent)')!r}")
    if case in ("stopeos", "stopid") and (r["finish_reason"], r.get("matched_stop")) != ("stop", EOS):
        out.append(f"{r['id']}: {r['finish_reason']} with matched_stop {r.get('matched_stop', '(absent)')!r}")
    if case not in ("stop", "stopeos", "stopid") and "matched_stop" in r:
        out.append(f"{r['id']}: matched_stop recorded, stop not set")
    if case == "tools" and (r.get("tool_calls") or not isinstance(r["completion"], str)):
        out.append(f"{r['id']}: tool calls {r.get('tool_calls')} from a server without a tool-call parser")
    if case == "regex" and not re.fullmatch("[0-9]{3}", r["completion"]):
        out.append(f"{r['id']}: {r['completion']!r} does not match [0-9]{{3}}")
    return out


def fidelity(stack: Any, work: Path, problems: list[str], per_case: int = 3) -> dict:
    """Every case of CASES, streamed (genq's default) and not: each record as checked by _problems_of."""
    seen = {}
    for streamed in (True, False):
        job = "sgl-stream" if streamed else "sgl-whole"
        flush(stack)
        rows = _rows(per_case)
        out = _enqueue(stack, work, job, rows, 16, 10)
        proc = _worker(stack, work / f"worker-{job}.log", "--burst", *([] if streamed else ["--no-stream"]))
        proc.wait(timeout=1800)
        records, letters = _records(out, job), _letters(stack)
        found = _exactly_once(job, records, rows, letters)
        found += [p for r in records for p in _problems_of(r, streamed)]
        problems += found
        seen[job] = {"records": len(records), "letters": len(letters), "problems": found}
        print(f"{job}: {len(records)} records of {len(rows)} ({len(CASES)} cases), {len(letters)} dead letters, "
              f"{len(found)} problems {found[:3]}", flush=True)
    return seen


def _done(out: Path, job: str) -> int:
    return len(_records(out, job))


def pause_drain(stack: Any, work: Path, problems: list[str], n: int, max_tokens: int) -> dict:
    """`genq pause`: the requests in flight end and no new one reaches the server (its count of
    requests arrived stands still for 10 s once it has none running or queued); `genq resume` goes
    on; `genq drain --all --wait`: the worker exits 0 holding nothing; a --burst worker finishes
    the job exactly once."""
    flush(stack)
    job = "sgl-pause"
    rows = [{"id": f"pd-{i}", "messages": [{"role": "user", "content": f"Pause {i}."}]} for i in range(n)]
    out = _enqueue(stack, work, job, rows, max_tokens, 8)
    log = work / f"worker-{job}.log"
    base = _requests(stack)  # the server's counter since it started: this job's requests are those past it
    proc = _worker(stack, log)
    found: list[str] = []
    if not _wait(lambda: _done(out, job) >= 1 or _requests(stack) >= base + 8, 600):
        found.append("pause: the job sent no requests within 600 s")
    genq(stack, "pause")
    at_pause = _done(out, job)
    # The requests in flight end: 18 of 32 tokens take 5-60 s on 2 shared cores, by their load.
    if not _wait(lambda: _busy(stack) == 0, 600):
        found.append(f"pause: {_busy(stack):.0f} requests running or queued 600 s after the pause")
    before = _arrived(stack)
    time.sleep(10)
    after = _arrived(stack)
    if after != before:
        found.append(f"pause: {after - before:.0f} requests reached the server in 10 s paused")
    genq(stack, "resume")
    resumed = _wait(lambda: _arrived(stack) > after, 120)
    if not resumed:
        found.append("resume: no request reached the server within 120 s")
    p = genq(stack, "drain", "--all", "--wait", "--timeout", "600")
    code = proc.wait(timeout=660)
    if p.returncode != 0 or code != 0:
        found.append(f"drain: genq drain exit {p.returncode}, worker exit {code}: {p.stdout[-300:]}{p.stderr[-300:]}")
    _worker(stack, log, "--burst").wait(timeout=1800)
    found += _exactly_once(job, _records(out, job), rows, _letters(stack))
    problems += found
    print(f"pause and drain: paused at {at_pause}/{n} records, {after - before:.0f} requests arrived in 10 s "
          f"paused, {len(found)} problems {found[:3]}", flush=True)
    return {"paused_requests": [before, after], "problems": found}


def killed(stack: Any, work: Path, problems: list[str], n: int, max_tokens: int) -> dict:
    """A worker SIGKILLed mid-batch: the next workers finish the job, every prompt exactly once."""
    flush(stack)
    job = "sgl-kill"
    rows = [{"id": f"k-{i}", "messages": [{"role": "user", "content": f"Kill {i}."}]} for i in range(n)]
    out = _enqueue(stack, work, job, rows, max_tokens, 12)
    log = work / f"worker-{job}.log"
    proc = _worker(stack, log)
    _wait(lambda: _done(out, job) >= 12, 900)  # a batch written, the next ones in flight
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    at_kill = _done(out, job)
    began = time.monotonic()
    # genq's reconciler queues the dead worker's batches again within about 40 s of the kill.
    while _done(out, job) < n and time.monotonic() - began < 900:
        _worker(stack, log, "--burst").wait(timeout=1800)
        time.sleep(5)
    found = _exactly_once(job, _records(out, job), rows, _letters(stack))
    problems += found
    print(f"worker killed mid-batch at {at_kill}/{n} records: {_done(out, job)} records after "
          f"{time.monotonic() - began:.0f} s, {len(found)} problems {found[:3]}", flush=True)
    return {"at_kill": at_kill, "problems": found}


def _requests(stack: Any) -> float:
    """Requests the server has finished (sglang:num_requests_total)."""
    return stack.metrics().get("sglang:num_requests_total", 0.0)


def _busy(stack: Any) -> float:
    """Requests the server is running or holds queued."""
    m = stack.metrics()
    return m.get("sglang:num_running_reqs", 0.0) + m.get("sglang:num_queue_reqs", 0.0)


def _arrived(stack: Any) -> float:
    """Generation requests that have reached the server, counted on arrival (its HTTP middleware's
    sglang:http_requests_total, less /health, /metrics and the rest)."""
    with urllib.request.urlopen(stack.server + "/metrics", timeout=5) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if line.startswith("sglang:http_requests_total{") and "completions\"" in line)


def _wait(ready: Any, timeout: float) -> bool:
    began = time.monotonic()
    while time.monotonic() - began < timeout:
        if ready():
            return True
        time.sleep(1)
    return False


def run_all(stack: Any, work: Path, problems: list[str], n: int, max_tokens: int) -> dict:
    """Every check; pause and drain and the killed worker on jobs of n prompts of max_tokens, sized
    so that the job outlasts the pause and the kill on the server at hand (a GPU ends 48 short
    prompts within a second)."""
    import bound_check  # scripts/sglang/, on sys.path as this module is: the decode bound's figures

    out: dict[str, Any] = {}
    sized = (n, max_tokens)
    for name, check, extra in (("fidelity", fidelity, ()), ("pause and drain", pause_drain, sized),
                               ("killed", killed, sized), ("bound", bound_check.check, ())):
        try:
            out[name] = check(stack, work, problems, *extra)
        except Exception as exc:  # noqa: BLE001 - a check that breaks is a failed check; the next still run
            problems.append(f"{name}: {type(exc).__name__}: {exc}")
    return out
