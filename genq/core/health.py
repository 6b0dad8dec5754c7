"""Per-worker efficiency: slot use and what holds a GPU back, from its WorkerStatus. A bottleneck
is (code, text): a code of a fixed set (CODES, fit for a Prometheus label), and the numbers for people.
"""

from __future__ import annotations

from genq.core.records import WorkerStatus
from genq.core.timings import STATUS_TTL_S

KV_FULL = 0.98

# Every code bottlenecks() can return, most important first.
CODES = ("lost", "server_down", "waiting", "cap_below_capacity", "kv_cache_full", "target_limits", "no_prompts")

Bottleneck = tuple[str, str]
# Why a worker is shown lost: its status record, renewed every beat, has expired.
NO_HEARTBEAT = f"no heartbeat for {STATUS_TTL_S:.0f} s"


def slot_utilization(s: WorkerStatus) -> float | None:
    """Share of the server's decode slots in use (server_running / server_capacity)."""
    if s.server_running is None or not s.server_capacity:
        return None
    return s.server_running / s.server_capacity


def bottlenecks(s: WorkerStatus | None) -> list[Bottleneck]:
    """What limits this worker now as (code, text), most important first; [] when nothing does."""
    if s is None:
        return [("lost", f"lost: {NO_HEARTBEAT} (worker crashed, or its host or Redis link is down)")]
    if s.state == "stopped":
        return []
    out: list[Bottleneck] = []
    if s.state == "server_down":
        out.append(("server_down", f"server down ({s.note})" if s.note else "server down"))
    elif s.note:
        out.append(("waiting", s.note))
    cap, limit = s.server_capacity, s.concurrency_limit
    capped = bool(limit and cap and limit < cap)
    if capped:
        out.append(("cap_below_capacity",
                    f"concurrency cap {limit} below server capacity {cap} (genq concurrency to raise it)"))
    if s.server_token_usage is not None and s.server_token_usage >= KV_FULL:
        out.append(("kv_cache_full", f"KV cache full ({s.server_token_usage:.0%} of tokens in use)"))
    if (s.server_waiting is not None and s.server_waiting == 0 and s.queued > 0
            and s.in_flight >= s.concurrency_target and s.state == "busy" and not capped):
        out.append(("target_limits", f"server queue empty while the worker holds {s.queued} prompts: "
                                     f"in-flight target {s.concurrency_target} is what limits it"))
    if s.state == "idle" and not s.batches:
        out.append(("no_prompts", "idle: nothing to take from the queue"))
    seen: set[str] = set()
    unique = []
    for code, text in out:  # the worker's own note may repeat a derived one
        key = text.split(" (")[0].lower()
        if code not in seen and key not in seen:
            seen.update((code, key))
            unique.append((code, text))
    return unique


def fleet_gpu_note(statuses: list[WorkerStatus]) -> str | None:
    """One line for the whole fleet when no worker (with a status) reports GPU figures."""
    if not statuses or any(s.gpu_sample is not None for s in statuses):
        return None
    notes = sorted({s.gpu_note for s in statuses if s.gpu_note})
    if notes:
        return "no GPU figures from any worker: " + "; ".join(notes)
    return "no GPU figures from any worker"
