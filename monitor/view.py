"""The live terminal view (rich): job totals and ETA, then one row per worker."""

from __future__ import annotations

from msgspec.structs import replace
from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from genq.core.decodebound import NO_HEARTBEAT
from genq.core.words import plural
from genq.monitor.progress import DOWN, JobReport, WorkerReport

STATUS_STYLE = {"empty": "dim", "queued": "yellow", "running": "green", "paused": "magenta", "blocked": "bold red",
                "partial": "yellow", "writing": "green", "done": "bold green"}
STATE_STYLE = {"busy": "green", "idle": "dim", "paused": "magenta", "draining": "yellow", "server_down": "bold red",
               "lost": "bold red", "silent": "bold red", "gone": "dim", "starting": "yellow", "stopped": "dim"}
# (column, right-justified, wraps, min width its title's)
COLUMNS = (("worker", False, False, True), ("state", False, False, True), ("in flight/target", True, True, False),
           ("server run/wait", True, True, False), ("slots", True, False, True), ("tok/s", True, False, True),
           ("of bound", True, False, False), ("done", True, False, True), ("errors", True, False, False),
           ("GPU", False, True, False))


def duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    s = int(round(seconds))
    m, h = s // 60, s // 3600
    if s < 90:
        return f"{s}s"
    if m < 90:
        return f"{m}m {s % 60:02d}s"
    return f"{h}h {m % 60:02d}m" if h < 48 else f"{h // 24}d {h % 24:02d}h"


def count(n: float | None) -> str:
    if n is None:
        return "?"
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f}{unit}"
    return f"{n:.0f}" if n == int(n) else f"{n:.1f}"


def nbytes(n: int) -> str:
    for unit, size in (("GB", 1 << 30), ("MB", 1 << 20), ("kB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def render(reports: list[JobReport], redis_display: str, interval: float | None,
           redis_note: str | None = None) -> RenderableType:
    """The whole view; interval None for one report (--once): nothing refreshes, nothing to leave."""
    if not reports:
        again = "" if interval is None else f"; refreshing every {interval:g}s"
        return Text(f"no jobs in {redis_display} yet (genq enqueue creates one){again}")
    seen: dict[str, WorkerReport] = {}
    for w in (w for r in reports for w in r.progress.worker_details):  # a worker of several jobs: once, its sums
        s = seen.setdefault(w.name, w)
        if s is not w:  # "gone" only for a job that is done: lost for one that is not
            seen[w.name] = replace(s, job_completed=s.job_completed + w.job_completed, errors=s.errors + w.errors,
                                   state=w.state if s.state == "gone" else s.state)
    workers = list(seen.values())
    parts: list[RenderableType] = [*(job_panel(r) for r in reports), worker_table(workers),
                                   *bottleneck_lines(workers)]
    gpu_note = next((r.progress.gpu_note for r in reports if r.progress.gpu_note), None)
    if gpu_note:
        parts.append(Text(f"GPU: {gpu_note}", style="dim"))
    if redis_note:  # Redis refusing writes, or evicting genq's keys (genq.core.redisconn)
        parts.append(Text(f"warning: {redis_note}", style="bold yellow"))
    footer = f"redis {redis_display} · RQ queue genq: {plural(reports[0].progress.rq_queued, 'batch', 'batches')}" \
             " (all jobs)" + ("" if interval is None else f" · every {interval:g}s · Ctrl-C to leave")
    return Group(*parts, Text(footer, style="dim"))


def job_panel(r: JobReport) -> Panel:
    p = r.progress
    finished = p.completed + p.failed
    # Done and failed apart: a job whose prompts were dead-lettered is finished, not done.
    head = Text.assemble((p.job, "bold"), "  ", (p.status, STATUS_STYLE.get(p.status, "")), "  ",
                         f"{p.completed:,} / {p.total:,} done ({p.percent_completed:.1f}%)")
    if p.failed:
        head.append(f"  {p.failed:,} failed ({p.percent_failed:.1f}%)", style="bold red")
    if finished and p.failed and finished < p.total:
        head.append(f"  {finished:,} finished ({p.percent:.1f}%)")
    counts = Text(
        f"done {p.completed:,}  failed {p.failed:,}  in flight {p.in_flight:,}  not started {p.queued:,}"
        f" · batches: {p.batches_done:,} written, {p.held_batches:,} held by workers"
        f" ({plural(p.held, 'prompt')} unsent),"
        f" {p.queued_batches:,} in RQ's queue")
    if p.other_batches and (p.blocked or p.status == "paused"):
        counts.append(f", {p.other_batches:,} parked while the job is {'blocked' if p.blocked else 'paused'}",
                      style="yellow")
    elif p.other_batches:
        counts.append(f", {p.other_batches:,} elsewhere (retrying, failed in RQ or orphaned)", style="yellow")
    rate = "?" if p.rate_per_sec is None else f"{p.rate_per_sec:.2f}"
    tok_s = "?" if p.output_tokens_per_sec is None else count(p.output_tokens_per_sec)
    speed = Text(f"{rate} prompts/s · {tok_s} out tok/s · tokens in {count(p.total_input_tokens)}"
                 f" out {count(p.total_output_tokens)} · avg out {count(p.avg_output_tokens)} (finished)"
                 f" · expected {count(p.expected_output_tokens)} (fit incl. running)")
    if p.eta_state == "done":
        eta = Text.assemble(("finished", "bold green"))
    elif p.eta_s is not None:
        eta = Text.assemble(("ETA ", "bold"), (duration(p.eta_s), "bold cyan"),
                            f"  (90% range {duration(p.eta_low_s)} – {duration(p.eta_high_s)})", f"  · {p.eta_state}")
    else:
        eta = Text.assemble(("ETA ", "bold"), (p.eta_state, "yellow"), f"  {p.eta_note}")
    short = p.elapsed_s < 9.95  # a short run in tenths: 0.4 s of generation is not "elapsed 0s"
    if p.elapsed_s > 0:
        eta.append(f"  · elapsed {f'{p.elapsed_s:.1f}s' if short else duration(p.elapsed_s)}")
    elif not finished:  # a job genq recover rebuilt has finished prompts and no times
        eta.append("  · not started")
    share = Text(f"priority {p.priority}" + (f" (weight {p.weight:g})" if p.weight != 1 else "")
                 + (f" · {100 * p.share:.0f}% of the fleet's requests in flight" if p.share else ""), style="dim")
    bar = Table.grid(padding=(0, 1))  # alone, a bar ends no line
    bar.add_row(ProgressBar(total=max(p.total, 1), completed=finished, width=60))
    lines: list[RenderableType] = [head, bar, counts, speed, eta, share]
    for text, style, prefix in ((p.blocked, "bold red", ""), (p.tail, "cyan", ""), (p.rate_source, "dim", "rate: "),
                                (p.bound_summary, "", "GPUs: ")):
        if text:
            lines.append(Text(prefix + text, style=style))
    lines.append(Text(f"shards {p.shards:,} ({nbytes(p.s3_bytes)}, {plural(p.shard_records, 'record')})", style="dim"))
    return Panel(Group(*lines), expand=True)


def worker_table(workers: list[WorkerReport]) -> Table:
    t = Table(expand=True, show_edge=False, pad_edge=False)
    for col, right, wraps, min_width in COLUMNS:
        t.add_column(col, justify="right" if right else "left", no_wrap=not wraps,
                     min_width=len(col) if min_width else None)
    gpu_any = any(w.gpu is not None for w in workers)
    for w in sorted(workers, key=lambda w: (w.state == "lost", w.name)):
        if w.state in (*DOWN, "server_down"):  # no figures of a server it does not have
            t.add_row(w.name, Text(w.state.replace("_", " "), STATE_STYLE[w.state]), "", "", "", "", "",
                      f"{w.job_completed:,}", "", "")
            continue
        server = "-" if w.server_running is None else f"{w.server_running:.0f}/{w.server_waiting or 0:.0f}"
        slots = "-" if w.slot_utilization is None else f"{w.slot_utilization:.0%}"
        target = f"{w.in_flight}/{w.concurrency_target}" + (f" (cap {w.concurrency_limit})" if w.concurrency_limit
                                                            else "")
        t.add_row(w.name, Text(w.state, STATE_STYLE.get(w.state, "")), target, server, slots,
                  count(w.tok_per_s), bound_cell(w), f"{w.job_completed:,}", str(w.errors), gpu_cell(w, gpu_any))
    return t


def bound_cell(w: WorkerReport) -> Text:
    """The share of its decode bound the GPU reaches, red when much slower than its peers; "?" where a
    figure is missing (the line below the table names it)."""
    v = w.bound
    if v is None:
        return Text("")
    if v.bound.tok_per_s is None or v.bound.share is None:
        return Text("?", style="dim")
    return Text(f"{v.bound.share:.0%} of {count(v.bound.tok_per_s)}", style="bold red" if v.slow else "")


def gpu_cell(w: WorkerReport, gpu_any: bool) -> str:
    g = w.gpu
    if g is None:  # without any GPU in the fleet the note is shown once below the table
        return (w.gpu_note or "no telemetry") if gpu_any else ""
    return " ".join([f"{g.utilization_pct:.0f}%", f"{g.memory_used_mib / 1024:.1f}/{g.memory_total_mib / 1024:.0f} GiB",
                     *(f"{v:.0f}{unit}" for v, unit in ((g.power_w, " W"), (g.temperature_c, "°C"),
                                                        (g.sm_clock_mhz, " MHz")) if v is not None)])


def bottleneck_lines(workers: list[WorkerReport]) -> list[RenderableType]:
    lines: list[RenderableType] = []
    for w in workers:
        if w.state in DOWN:
            continue
        lines += [Text.assemble(("bottleneck ", "bold yellow"), (w.name, "bold"), f": {b}") for b in w.bottlenecks]
        v = w.bound
        if v is not None and v.slow:
            lines.append(Text.assemble(("slow GPU ", "bold red"), (w.name, "bold"), f": {v.slow}"))
        # genq's own target and nothing to send are the bottleneck lines.
        if v is not None and v.cap is not None and v.cap.code not in ("genq_target", "nothing_to_send"):
            lines.append(Text.assemble(("batch ", "bold yellow"), (w.name, "bold"), f": capped by {v.cap.text}",
                                       f"; fix: {v.cap.advice}" if v.cap.advice else ""))
        if v is not None and v.bound.tok_per_s is None and v.bound.unknown:
            lines.append(Text.assemble(("bound ", "dim"), (w.name, "bold"), f": {v.bound.unknown}"))
    lost = [w.name for w in workers if w.state == "lost"]
    if lost:
        shown = ", ".join(lost[:8]) + (f" and {len(lost) - 8} more" if len(lost) > 8 else "")
        lines.append(Text.assemble(("lost ", "bold red"), f"{shown}: {NO_HEARTBEAT}"))
    return lines
