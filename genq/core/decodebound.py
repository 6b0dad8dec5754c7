"""Is a GPU doing what its hardware allows? Pure functions of the workers' heartbeat records. Decode is
memory-bound: a step reads the weights and the KV cache in use and makes a token per running sequence,
so tokens/s <= running x bandwidth / (weight bytes + token_usage x KV pool bytes)."""

from __future__ import annotations

import statistics

import msgspec

from genq.core.records import GpuSample, Hardware, Tally, WorkerStatus
from genq.core.timings import STATUS_TTL_S

KV_FULL = 0.9  # of the KV pool in use: the server admits no more at the mean context
AT_LIMIT = 0.95  # of the running limit in use: the limit is what caps the batch
ROOM = 1.15  # the KV cache holds this many times the running limit: the limit, not the KV, caps
SLOWER = 0.7  # a GPU below this share of its peers' median (share of the bound, or speed) is flagged
SAME_BATCH = 0.25  # without bounds, peers are compared only at a running count within this of each other


class GpuFigures(msgspec.Struct, omit_defaults=True):
    hw: Hardware = Hardware()
    running: float | None = None  # requests the server runs now
    waiting: float | None = None  # in the server's queue
    running_limit: int | None = None  # the server's own (SGLang max_running_requests, llama.cpp slots)
    token_usage: float | None = None  # share of the KV cache in use, 0..1
    tok_per_s: float | None = None  # the server's generation speed
    target: int = 0  # genq's in-flight target
    cap: int | None = None  # genq's own cap on it (--concurrency, genq concurrency)
    in_flight: int = 0
    queued: int = 0  # prompts the worker holds, not sent yet


class Bound(msgspec.Struct, omit_defaults=True):
    tok_per_s: float | None = None  # the bound; None when a figure is missing
    share: float | None = None  # measured / bound
    step_bytes: float | None = None  # read per decode step
    kv_bytes: float | None = None  # of them, KV (None: not counted, unknown)
    unknown: str | None = None  # "unknown: <what is missing> (give it with --...)"


class Cap(msgspec.Struct):
    code: str  # one of CAPS: fit for a Prometheus label
    text: str  # what caps it, with the figures
    advice: str = ""  # the fix, in the server's own flags (or genq's)


CAPS = ("kv_cache", "running_limit", "prefill", "genq_target", "nothing_to_send")


class Verdict(msgspec.Struct, omit_defaults=True):
    bound: Bound
    cap: Cap | None = None
    slow: str | None = None


def figures_of(s: WorkerStatus) -> GpuFigures:
    server = s.tok_per_s_from == "server"  # its speed over a window: set against the window's batch
    return GpuFigures(hw=s.hardware or Hardware(), running=s.window_running if server else s.server_running,
                      waiting=s.server_waiting, running_limit=s.server_capacity,
                      token_usage=s.window_token_usage if server else s.server_token_usage,
                      tok_per_s=s.tok_per_s if s.state == "busy" or s.tok_per_s else None,
                      target=s.concurrency_target, cap=s.concurrency_limit, in_flight=s.in_flight, queued=s.queued)


def bound(f: GpuFigures) -> Bound:
    hw = f.hw
    if hw.bandwidth is None or hw.weight_bytes is None or not f.running:
        missing = [what for what, absent in (
            ("memory bandwidth (give it with genq worker --gpu-bandwidth, e.g. 1.79TB/s)", hw.bandwidth is None),
            ("model weight bytes (give them with genq worker --model-bytes, e.g. 54GB)", hw.weight_bytes is None),
            ("running requests (the server's metrics)", not f.running)) if absent]
        return Bound(unknown="unknown: " + "; ".join(missing))
    kv = None if hw.kv_pool_bytes is None or f.token_usage is None else f.token_usage * hw.kv_pool_bytes
    step = hw.weight_bytes + (kv or 0.0)
    top = f.running * hw.bandwidth / step
    share = None if f.tok_per_s is None else f.tok_per_s / top
    return Bound(tok_per_s=top, share=share, step_bytes=step, kv_bytes=kv,
                 unknown=None if kv is not None else "unknown: KV bytes read per step (not counted: the bound "
                                                     "is a ceiling; the server does not publish its KV cache size)")


# The server flags that lift each cap, by engine ("" for any other).
KV_ADVICE = {
    "sglang": "more KV cache: --mem-fraction-static (e.g. 0.9), --kv-cache-dtype fp8_e4m3; a hybrid "
              "(Mamba) model: --mamba-scheduler-strategy no_buffer",
    "vllm": "more KV cache: --gpu-memory-utilization (e.g. 0.95), --kv-cache-dtype fp8",
    "": "more KV cache (a larger context per slot, or a smaller KV dtype)",
}
LIMIT_FLAG = {"sglang": "--max-running-requests", "vllm": "--max-num-seqs", "llamacpp": "-np (with -c grown alike)",
              "": "the running limit"}
PREFILL_ADVICE = {"sglang": "a larger --chunked-prefill-size admits more prompts a step",
                  "vllm": "a larger --max-num-batched-tokens admits more prompts a step", "": ""}


def batch_cap(f: GpuFigures) -> Cap | None:
    """What caps the running batch now, and the flag that lifts it; None when nothing runs."""
    running = f.running or 0.0
    if f.in_flight == 0 and not running:
        return None
    engine = f.hw.engine if f.hw.engine in LIMIT_FLAG else ""
    # What the KV cache holds at the running requests' mean context now (prompt + output so far).
    holds = running / f.token_usage if running and f.token_usage else None
    ctx = f.token_usage * f.hw.token_capacity / running if running and f.token_usage and f.hw.token_capacity else None
    at = f" at {ctx:,.0f} tokens a request" if ctx else ""
    limit = f.running_limit
    if f.token_usage is not None and f.token_usage >= KV_FULL:
        return Cap("kv_cache", f"KV cache {f.token_usage:.0%} full with {running:.0f} running: it holds "
                               f"~{holds or running:.0f}{at}", KV_ADVICE.get(engine, KV_ADVICE[""]))
    if limit and running >= AT_LIMIT * limit:
        if holds is not None and holds >= ROOM * limit:
            return Cap("running_limit", f"{running:.0f} running at the server's limit {limit}, where its KV "
                                        f"cache would hold ~{holds:.0f}{at}",
                       f"raise {LIMIT_FLAG[engine]} to ~{holds:.0f}")
        return Cap("running_limit", f"{running:.0f} running at the server's limit {limit}", "")
    if f.waiting:
        return Cap("prefill", f"{f.waiting:.0f} waiting in the server's queue with {running:.0f} running "
                              f"(limit {limit or '?'}): admission (prefill) is slower than the answers end",
                   PREFILL_ADVICE.get(engine, ""))
    if f.queued > 0 and f.in_flight >= f.target:
        if f.cap and f.cap <= f.target:
            own, advice = f"genq's cap {f.cap}", "raise it with `genq concurrency`"
        else:
            own = f"genq's in-flight target {f.target}"
            advice = "genq's controller grows it while the server's queue stays empty"
        return Cap("genq_target", f"{own}: the server's queue is empty while the worker holds {f.queued} prompts",
                   advice)
    if f.queued == 0:
        return Cap("nothing_to_send", f"{running:.0f} running and nothing more to send (the job's tail, or "
                                      "its queue is empty)", "more batches per worker: genq worker --prefetch")
    return None


def slow(fleet: dict[str, GpuFigures]) -> dict[str, str]:
    """GPUs much slower than their peers, with why: share of the bound against the peers' median, or
    where a bound is unknown, tokens per running request against peers' at about the same running."""
    shares = {n: share for n, f in fleet.items() if (share := bound(f).share) is not None and share > 0}
    out: dict[str, str] = {}
    for name, share in shares.items():
        others = [s for n, s in shares.items() if n != name]
        if others and share < SLOWER * statistics.median(others):
            out[name] = f"at {share:.0%} of its bound where its peers are at {statistics.median(others):.0%}"
    speeds = {n: f.tok_per_s / f.running for n, f in fleet.items() if n not in shares and f.running and f.tok_per_s}
    for name, mine in speeds.items():
        running = fleet[name].running or 0.0
        peers = [v for n, v in speeds.items()
                 if n != name and abs((fleet[n].running or 0.0) - running) <= SAME_BATCH * running]
        if peers and mine < SLOWER * statistics.median(peers):
            out[name] = (f"{mine:.1f} tok/s a request at {running:.0f} running where its peers make "
                         f"{statistics.median(peers):.1f}")
    return out


def summary(parts: dict[str, tuple[float, float]], gpus: int, over: str = "") -> str | None:
    """One line from each GPU's (tokens made, tokens its bound allowed); None with no bound."""
    known = {n: (made, top) for n, (made, top) in parts.items() if top > 0}
    if not known:
        return None
    made, top = sum(m for m, _ in known.values()), sum(t for _, t in known.values())
    words = [f"fleet at {made / top:.0%} of its bandwidth bound{over}"
             + (f" ({len(known)} of {gpus} GPUs with a bound)" if len(known) < gpus else "")]
    shares = {n: m / t for n, (m, t) in known.items()}
    if len(shares) > 1:
        low = min(shares, key=shares.__getitem__)
        words.append(f"{low} slowest at {shares[low]:.0%}")
        for n, share in sorted(shares.items()):
            others = statistics.median(v for m, v in shares.items() if m != n)
            if share < SLOWER * others:
                words.append(f"{n} much slower than its peers ({share:.0%} against {others:.0%})")
    return "; ".join(words)


def fleet_line(fleet: dict[str, GpuFigures], verdicts: dict[str, Verdict]) -> str | None:
    return summary({n: (fleet[n].tok_per_s or 0.0, v.bound.tok_per_s or 0.0)
                    for n, v in verdicts.items() if v.bound.share is not None}, len(fleet))


def verdicts(fleet: dict[str, GpuFigures], model_of: dict[str, str | None] | None = None) -> dict[str, Verdict]:
    """Each GPU's verdict; its peers are those serving the same model."""
    model_of = model_of or {}
    flagged: dict[str, str] = {}
    for model in {model_of.get(n) for n in fleet}:
        flagged.update(slow({n: f for n, f in fleet.items() if model_of.get(n) == model}))
    return {n: Verdict(bound=bound(f), cap=batch_cap(f), slow=flagged.get(n)) for n, f in fleet.items()}


def working(statuses: dict[str, WorkerStatus]) -> dict[str, GpuFigures]:
    """The figures of each worker whose server runs requests now, one worker (the first) per server."""
    seen: set[str] = set()
    out = {}
    for n, s in sorted(statuses.items()):
        if s.state in ("busy", "draining") and s.server_running and s.server not in seen:
            seen.add(s.server)
            out[n] = figures_of(s)
    return out


def judge(statuses: dict[str, WorkerStatus]) -> dict[str, Verdict]:
    """Each working GPU's verdict, a slow one's with NVML's figures."""
    fleet = working(statuses)
    out = verdicts(fleet, {n: statuses[n].model for n in fleet})
    for n, v in out.items():
        if v.slow is not None and (told := nvml_words(statuses[n].gpu_sample)):
            v.slow = f"{v.slow} ({told})"
    return out


def nvml_words(g: GpuSample | None) -> str | None:
    if g is None:
        return None
    words = [g.name]
    if g.sm_clock_mhz is not None:
        words.append(f"SM {g.sm_clock_mhz:,.0f}" + (f" of {g.max_sm_clock_mhz:,.0f}" if g.max_sm_clock_mhz else "")
                     + " MHz")
    if g.power_w is not None:
        words.append(f"{g.power_w:.0f}" + (f" of {g.power_limit_w:.0f}" if g.power_limit_w else "") + " W")
    if g.temperature_c is not None:
        words.append(f"{g.temperature_c:.0f} °C")
    if g.throttled:
        words.append("throttled: " + ", ".join(g.throttled))
    return ", ".join(words)


TALLIED_JOBS = 20  # a worker keeps the tallies of its last jobs


def add_tally(tallies: dict[str, Tally], in_flight: dict[str, int], s: WorkerStatus, dt: float) -> None:
    """Books dt seconds of one worker's GPU to its jobs by their requests in flight; of a shared server,
    its part (its sequences over those the server holds), so the server is booked once."""
    total = sum(in_flight.values())
    if total <= 0 or dt <= 0:
        return
    f = figures_of(s)
    b = bound(f)
    held = (s.server_running or 0.0) + (s.server_waiting or 0.0)  # up to a look old: may be fewer than its own
    part = 1.0 if held <= s.sequences else s.sequences / held
    # The server's counter is the whole server's speed; a worker's own answers are its part already.
    made = None if f.tok_per_s is None else f.tok_per_s * (part if s.tok_per_s_from == "server" else 1.0)
    for job, n in in_flight.items():
        seconds = dt * n / total
        t = tallies.pop(job, None) or Tally()
        t.busy_s += seconds
        if b.tok_per_s is not None and made is not None:
            t.made += made * seconds
            t.bound += b.tok_per_s * part * seconds
        tallies[job] = t  # the most recent last
    while len(tallies) > TALLIED_JOBS:
        tallies.pop(next(iter(tallies)))


def job_line(statuses: list[WorkerStatus], job: str) -> str | None:
    """The summary of a job from its workers' tallies, summed per server."""
    parts: dict[str, tuple[float, float]] = {}
    names: dict[str, str] = {}
    for s in sorted(statuses, key=lambda s: s.name):
        if (t := s.bound_tally.get(job)) is not None:
            name = names.setdefault(s.server, s.name)
            made, top = parts.get(name, (0.0, 0.0))
            parts[name] = (made + t.made, top + t.bound)
    return summary(parts, len(parts), " over the job")


# A bottleneck is (code, text): a code of CODES (most important first; a Prometheus label), the numbers for people.
KV_FULL_NOW = 0.98  # of the KV cache in use now: bottlenecks() says it is full
CODES = ("lost", "server_down", "waiting", "cap_below_capacity", "kv_cache_full", "target_limits", "no_prompts")
# Why a worker is shown lost: its status record, renewed every beat, has expired.
NO_HEARTBEAT = f"no heartbeat for {STATUS_TTL_S:.0f} s"


def slot_utilization(s: WorkerStatus) -> float | None:
    return None if s.server_running is None or not s.server_capacity else s.server_running / s.server_capacity


def bottlenecks(s: WorkerStatus | None) -> list[tuple[str, str]]:
    """What limits this worker now as (code, text), most important first; [] when nothing does."""
    if s is None:
        return [("lost", f"lost: {NO_HEARTBEAT} (worker crashed, or its host or Redis link is down)")]
    if s.state == "stopped":
        return []
    out: list[tuple[str, str]] = []
    if s.state == "server_down":
        out.append(("server_down", f"server down ({s.note})" if s.note else "server down"))
    elif s.note:
        out.append(("waiting", s.note))
    cap, limit = s.server_capacity, s.concurrency_limit
    capped = bool(limit and cap and limit < cap)
    if capped:
        out.append(("cap_below_capacity",
                    f"concurrency cap {limit} below server capacity {cap} (genq concurrency to raise it)"))
    if s.server_token_usage is not None and s.server_token_usage >= KV_FULL_NOW:
        out.append(("kv_cache_full", f"KV cache full ({s.server_token_usage:.0%} of tokens in use)"))
    if (s.server_waiting is not None and s.server_waiting == 0 and s.queued > 0
            and s.in_flight >= s.concurrency_target and s.state == "busy" and not capped):
        out.append(("target_limits", f"server queue empty while the worker holds {s.queued} prompts: "
                                     f"in-flight target {s.concurrency_target} is what limits it"))
    if s.state == "idle" and not s.batches:
        out.append(("no_prompts", "idle: nothing to take from the queue"))
    keys = [text.split(" (")[0].lower() for _, text in out]  # the worker's own note may repeat a derived one
    return [b for i, b in enumerate(out) if keys[i] not in keys[:i]]


def fleet_gpu_note(statuses: list[WorkerStatus]) -> str | None:
    """One line for the whole fleet when no worker (with a status) reports GPU figures."""
    if not statuses or any(s.gpu_sample is not None for s in statuses):
        return None
    notes = sorted({s.gpu_note for s in statuses if s.gpu_note})
    return "no GPU figures from any worker" + (": " + "; ".join(notes) if notes else "")
