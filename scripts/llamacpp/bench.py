"""genq end to end against a real llama.cpp llama-server (CPU, tiny random model).

    make test-llamacpp          (or: python scripts/llamacpp/bench.py)

Builds (or reuses) llama-server and a tiny random-weight GGUF under
~/.cache/genq-llamacpp, starts llama-server with 8 slots (-np 8 -c 16384: 2,048
tokens a slot, --metrics --slots) and a private redis-server, each on a free
loopback port (parts in runs.py). Exits 1 if any check below fails.

0. The brake (#25, brakes.py, shared with scripts/vllm/bench.py): the preflight refuses
   max_tokens over a slot's context before any request reaches llama-server (its prompt and
   predicted token counters do not move); a setting llama.cpp refuses on every request
   blocks the job within seconds with its message, at most 2 x the in-flight target
   dead-lettered, and `genq jobs set` + `genq resume --job` finish it exactly once at
   settings version 2; 5 too-long prompts among 300 are dead-lettered alone; max_tokens
   that fits alone but not with the prompts is cut at the slot's end, no error.

1. Correctness and the ETA: one long genq run with defaults (auto concurrency,
   streaming) over --eta-n prompts, --long of them longer than a slot's context.
   Every prompt that fits completes exactly once at the first attempt, the too-long
   ones are dead-lettered as bad_request with llama.cpp's message, nothing else;
   genq finds 8 slots. Meanwhile this script runs the monitor's own estimator
   (genq.monitor.progress.Monitor, what `genq monitor --json` runs, refreshed every
   second) and records its ETA when 25, 50 and 75 % of the prompts are done; at the
   end each is compared with the true time left (to the last result's commit): it
   must be within +-15 %.

2. Throughput, in --rounds short rounds of --round-n prompts. Each round runs five
   configurations back to back: genq defaults, genq --concurrency 8, genq
   --concurrency 8 --no-stream, a bare aiohttp client (8 in flight) without and with
   streaming; odd rounds in the reverse order (ABBA), so the two sides of every
   comparison run next to each other and a linear drift in load cancels over two
   rounds. The machine is shared and its load swings several-fold within minutes, so
   rates from different minutes cannot be compared; instead:
   - every comparison is a ratio of two runs of the same round (paired), and the
     verdict is the median over rounds of those ratios, not a ratio of totals;
   - defaults vs --concurrency 8 is judged on throughput normalised by llama-server's
     own generation speed: the slot-seconds it spent generating
     (llamacpp:tokens_predicted_seconds_total, before and after the run) over the
     slot-seconds the run lasted (8 x span). When the CPU is contended every token
     takes longer, the tokens per second fall and the generation seconds rise
     alike, so this "occupancy" reflects how well the client keeps slots generating
     (genq's driving), not how fast the CPU was. Target: median ratio >= 0.95. The
     raw paired tok/s ratio is printed beside it.
   - what streaming costs: 1 - tok/s(stream) / tok/s(no stream), for genq (at 8 in
     flight) and for the bare client, per round; target: median over rounds of
     (genq's cost - the bare client's cost) <= 0.05. Also printed: the same costs in
     occupancy (server-normalised) terms, and the client's CPU
     ms per request (the genq worker; the bare client's process),
     which hardly depends on the load: the extra CPU a streamed request costs the
     client (stream minus no-stream run of the same round, per request; genq's
     start-up cancels out), genq against the bare client.
   Every genq run is checked for correctness as in 1.

Throughput is completion tokens over the span from the first request's start to the
last finish (process start-up is not counted for either side). The load average is
recorded with every figure. Prints markdown tables and writes llamacpp-bench.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# scripts/llamacpp/ is on sys.path when this runs as a script.
import brakes
from runs import CACHE, HERE, ROOT, SLOTS, TREE, Sampler, Stack, bare_run, genq_run, load, prompts

CONFIGS: list[tuple[str, tuple[str, ...]]] = [
    ("defaults", ()), ("c8", ("--concurrency", "8")), ("c8-nostream", ("--concurrency", "8", "--no-stream")),
    ("bare-nostream", ()), ("bare-stream", ())]


def check(run: dict, fit: list[str], long_ids: list[str]) -> list[str]:
    """What must hold for every genq run."""
    problems = []
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
    if "capacity 8)" not in run["capacity_line"]:
        problems.append(f"{run['name']}: genq did not find 8 slots: {run['capacity_line']}")
    run["finish"] = {k: sum(1 for r in run["rows"] if r["finish_reason"] == k) for k in ("stop", "length")}
    return problems


def write_prompts(path: Path, rows: list[dict]) -> tuple[list[str], list[str]]:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return (sorted(r["id"] for r in rows if not r["id"].startswith("long")),
            sorted(r["id"] for r in rows if r["id"].startswith("long")))


def eta_phase(stack: Stack, work: Path, args: argparse.Namespace, problems: list[str]) -> dict:
    src = work / "eta-prompts.jsonl"
    fit, long_ids = write_prompts(src, prompts(args.eta_n, args.long, "e"))
    with Sampler(stack) as sampler:
        run = genq_run(stack, work, src, "eta-defaults", args.max_tokens, eta=True)
    run.update(sampler.figures(run))
    problems += check(run, fit, long_ids)
    print(f"\nETA ({run['capacity_line'].split('INFO ', 1)[-1]}): {args.eta_n} prompts, {run['tokens']} tokens "
          f"in {run['span_s']:.1f} s ({run['tok_s']:.0f} tok/s), load {run['load']:.1f}")
    print("| done | monitor ETA | 90% range | true time left | error | state | load "
          "| tok/s | per-request tok/s | fitted mean length | overhead (a/b) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|")
    for pt in run["eta"]:
        eta = "–" if pt["eta_s"] is None else f"{pt['eta_s']:.1f} s"
        rng = "–" if pt["eta_low_s"] is None else f"[{pt['eta_low_s']:.0f}, {pt['eta_high_s']:.0f}]"
        err = "–" if pt["error"] is None else f"{pt['error']:+.0%}"
        print(f"| {pt['at']:.0%} | {eta} | {rng} | {pt['true_s']:.1f} s | {err} | {pt['state']} | {pt['load']:.1f} "
              f"| {pt['tok_s'] or 0:.0f} | {pt['per_request_tok_s'] or 0:.1f} | {pt['fit_mean'] or 0:.1f} "
              f"| {'none (flat)' if pt.get('overhead') is None else format(pt['overhead'], '.1f')} |")
        if pt["error"] is None or abs(pt["error"]) > 0.15:
            problems.append(f"ETA at {pt['at']:.0%} done: {eta} for {pt['true_s']:.1f} s left (target +-15%)")
    if len(run["eta"]) < 3:
        problems.append(f"ETA recorded at {len(run['eta'])} of 3 checkpoints")
    return run


def rounds_phase(stack: Stack, work: Path, args: argparse.Namespace, problems: list[str]) -> list[dict]:
    src = work / "prompts.jsonl"
    rows = prompts(args.round_n, args.long)
    fit, long_ids = write_prompts(src, rows)
    fitting = [r for r in rows if not r["id"].startswith("long")]
    runs: list[dict] = []
    for rnd in range(args.rounds):
        for name, worker_args in (CONFIGS if rnd % 2 == 0 else CONFIGS[::-1]):
            with Sampler(stack) as sampler:
                if name.startswith("bare"):
                    run = bare_run(stack.server, fitting, args.max_tokens, name == "bare-stream")
                else:
                    run = genq_run(stack, work, src, name, args.max_tokens, *worker_args)
            run.update(sampler.figures(run))
            run["round"] = rnd
            runs.append(run)
            if not name.startswith("bare"):
                problems += check(run, fit, long_ids)
            elif run["errors"]:
                problems.append(f"round {rnd} {name}: {run['errors']} requests failed")
            print(f"round {rnd} {name}: {run['tok_s']:.0f} tok/s over {run['span_s']:.1f} s, occupancy "
                  f"{run['occupancy']:.3f}, busy slots {run['busy_slots']:.2f}, client "
                  f"{run['client_cpu_ms_per_req']:.2f} ms CPU/request, load {run['load']:.1f}"
                  + (f", {run['errors']} errors" if "errors" in run else ""), flush=True)
    return runs


def verdicts(runs: list[dict], rounds: int, problems: list[str]) -> dict:
    by = {(r["name"], r["round"]): r for r in runs}
    per_round = []
    for rnd in range(rounds):
        def get(name: str, key: str, rnd: int = rnd) -> float:
            return by[(name, rnd)][key]
        per_round.append({
            "round": rnd,
            "load": statistics.mean(by[(c, rnd)]["load"] for c, _ in CONFIGS),
            "defaults_c8_tok_s": get("defaults", "tok_s") / get("c8", "tok_s"),
            "defaults_c8_occupancy": get("defaults", "occupancy") / (get("c8", "occupancy") or float("nan")),
            "stream_cost_genq": 1 - get("c8", "tok_s") / get("c8-nostream", "tok_s"),
            "stream_cost_bare": 1 - get("bare-stream", "tok_s") / get("bare-nostream", "tok_s"),
            # The same in server-normalised throughput (occupancy): what streaming costs in
            # slot-time kept generating, whatever the CPU's speed at that moment.
            "stream_cost_genq_occ": 1 - get("c8", "occupancy") / get("c8-nostream", "occupancy"),
            "stream_cost_bare_occ": 1 - get("bare-stream", "occupancy") / get("bare-nostream", "occupancy"),
            # Client CPU a streamed request costs beyond a whole answer (start-up cancels out).
            "stream_cpu_ms_genq": 1000 * (get("c8", "client_cpu_s") - get("c8-nostream", "client_cpu_s"))
            / get("c8", "requests"),
            "stream_cpu_ms_bare": 1000 * (get("bare-stream", "client_cpu_s") - get("bare-nostream", "client_cpu_s"))
            / get("bare-stream", "requests"),
        })
    med = {k: statistics.median(r[k] for r in per_round) for k in per_round[0] if k not in ("round", "load")}
    med["stream_cost_gap"] = statistics.median(r["stream_cost_genq"] - r["stream_cost_bare"] for r in per_round)
    if med["defaults_c8_occupancy"] < 0.95:
        problems.append(f"defaults reach {med['defaults_c8_occupancy']:.1%} of --concurrency 8's occupancy")
    if med["stream_cost_gap"] > 0.05:
        problems.append(f"streaming costs genq {med['stream_cost_gap']:+.1%} more than a bare client")
    return {"per_round": per_round, "median": med}


def report(runs: list[dict], v: dict) -> None:
    print("\n| run | round | tokens | span s | tok/s | occupancy | busy slots | server CPU ms/token "
          "| client CPU ms/request | load |\n|---|---|---|---|---|---|---|---|---|---|")
    for run in runs:
        print(f"| {run['name']} | {run['round']} | {run['tokens']} | {run['span_s']:.1f} | {run['tok_s']:.0f} "
              f"| {run['occupancy']:.3f} | {run['busy_slots']:.2f} | {run['server_cpu_ms_per_tok']:.2f} "
              f"| {run['client_cpu_ms_per_req']:.2f} | {run['load']:.1f} |")
    print("\n| round | load | defaults/c8 tok/s | defaults/c8 occupancy | stream cost genq | stream cost bare "
          "| stream CPU ms/req genq | bare |\n|---|---|---|---|---|---|---|---|")
    for r in v["per_round"]:
        print(f"| {r['round']} | {r['load']:.1f} | {r['defaults_c8_tok_s']:.3f} | {r['defaults_c8_occupancy']:.3f} "
              f"| {r['stream_cost_genq']:+.1%} | {r['stream_cost_bare']:+.1%} | {r['stream_cpu_ms_genq']:+.2f} "
              f"| {r['stream_cpu_ms_bare']:+.2f} |")
    m = v["median"]
    print(f"\nmedians over rounds: defaults/c8 occupancy {m['defaults_c8_occupancy']:.3f} (target >= 0.95), "
          f"tok/s {m['defaults_c8_tok_s']:.3f}; streaming cost genq {m['stream_cost_genq']:+.1%}, bare "
          f"{m['stream_cost_bare']:+.1%}, gap {m['stream_cost_gap']:+.1%} (target <= +5%); client CPU per "
          f"streamed request beyond a whole answer: genq {m['stream_cpu_ms_genq']:+.2f} ms, "
          f"bare {m['stream_cpu_ms_bare']:+.2f} ms; in occupancy: genq {m['stream_cost_genq_occ']:+.1%}, "
          f"bare {m['stream_cost_bare_occ']:+.1%}")

    def mean(name: str, key: str) -> float:
        return statistics.mean(r[key] for r in runs if r["name"] == name)
    print("client CPU ms/request (genq: with its start-up): "
          + ", ".join(f"{c} {mean(c, 'client_cpu_ms_per_req'):.2f}" for c, _ in CONFIGS))
    print("mean occupancy: " + ", ".join(f"{c} {mean(c, 'occupancy'):.3f}" for c, _ in CONFIGS))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--eta-n", type=int, default=800, help="prompts of the defaults run that checks the ETA")
    ap.add_argument("--round-n", type=int, default=80, help="prompts of each throughput run")
    ap.add_argument("--long", type=int, default=5, help="prompts longer than a slot's context, in every genq run")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--skip-eta", action="store_true")
    ap.add_argument("--skip-brakes", action="store_true")
    ap.add_argument("--out", type=Path, default=ROOT / "llamacpp-bench.json")
    args = ap.parse_args()
    subprocess.run([str(HERE / "build.sh")], check=True)
    model = CACHE / "tiny.gguf"
    if not model.exists():
        subprocess.run(["python3", str(HERE / "make_model.py"), str(TREE), str(model), "--eog-scale", "1.8"],
                       check=True)
    work = Path(tempfile.mkdtemp(prefix="genq-llamacpp-"))
    print(f"llamacpp bench: {SLOTS} slots, work in {work}, load {load():.1f}", flush=True)
    stack = Stack(work, model)
    problems: list[str] = []
    try:
        if not args.skip_brakes:
            brakes.run_all(stack, work, stack.work_done, "response_format type must be one of",
                           "exceeds the available context size", problems)
        eta = None if args.skip_eta else eta_phase(stack, work, args, problems)
        runs = rounds_phase(stack, work, args, problems) if args.rounds else []
    finally:
        stack.stop()
    v = verdicts(runs, args.rounds, problems) if runs else {}
    if runs:
        report(runs, v)
    strip = ("rows", "letters")
    summary = {"eta_run": eta and {k: x for k, x in eta.items() if k not in strip},
               "runs": [{k: x for k, x in r.items() if k not in strip} for r in runs],
               "verdicts": v, "problems": problems, "work": str(work)}
    args.out.write_text(json.dumps(summary, indent=2))
    for p in problems:
        print("FAIL:", p)
    print("all checks met" if not problems else f"{len(problems)} check(s) failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
