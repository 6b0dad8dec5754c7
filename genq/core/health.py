"""Per-worker efficiency: slot use and what holds a GPU back, from its WorkerStatus."""

from __future__ import annotations

from genq.core.records import WorkerStatus

KV_FULL = 0.98


def slot_utilization(s: WorkerStatus) -> float | None:
    """Share of the server's decode slots in use (server_running / server_capacity)."""
    if s.server_running is None or not s.server_capacity:
        return None
    return s.server_running / s.server_capacity


def bottlenecks(s: WorkerStatus | None) -> list[str]:
    """What limits this worker now, most important first; [] when nothing does."""
    if s is None:
        return ["lost: no heartbeat for 15 s (worker crashed, or its host or Redis link is down)"]
    if s.state == "stopped":
        return []
    out: list[str] = []
    if s.state == "server_down":
        out.append(f"server down ({s.note})" if s.note else "server down")
    elif s.note:
        out.append(s.note)
    cap, limit = s.server_capacity, s.concurrency_limit
    if limit and cap and limit < cap:
        out.append(f"concurrency cap {limit} below server capacity {cap} (genq concurrency to raise it)")
    if s.server_token_usage is not None and s.server_token_usage >= KV_FULL:
        out.append(f"KV cache full ({s.server_token_usage:.0%} of tokens in use)")
    if (s.server_waiting is not None and s.server_waiting == 0 and s.queued > 0
            and s.in_flight >= s.concurrency_target and s.state == "busy" and not (limit and cap and limit < cap)):
        out.append(f"server queue empty while the worker holds {s.queued} prompts: "
                   f"in-flight target {s.concurrency_target} is what limits it")
    seen: set[str] = set()
    unique = []
    for line in out:  # the worker's own note may repeat a derived one
        key = line.split(" (")[0].lower()
        if key not in seen:
            seen.add(key)
            unique.append(line)
    return unique


def fleet_gpu_note(statuses: list[WorkerStatus]) -> str | None:
    """One line for the whole fleet when no worker (with a status) reports GPU figures."""
    if not statuses or any(s.gpu_sample is not None for s in statuses):
        return None
    notes = sorted({s.gpu_note for s in statuses if s.gpu_note})
    if notes:
        return "no GPU figures from any worker: " + "; ".join(notes)
    return "no GPU figures from any worker"
