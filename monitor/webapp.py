"""`genq monitor --web HOST:PORT`: one live page (monitor/web/, uPlot inside) polling api/state, the same
Monitor's figures as `--json`; controls only with the X-Genq-Token; only a Host naming this server is
answered (else 403: a DNS-rebinding page's), every answer with a same-origin CSP and nosniff (docs/monitoring.md)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import logging
import socket
import threading
import time
from collections import Counter, deque
from itertools import islice
from pathlib import Path
from typing import Any

import msgspec
import redis
from aiohttp import web

from genq.core.ledger import letters
from genq.core.ledger.jobs import check_job_name
from genq.core.records import DeadLetter, unpack
from genq.core.redisconn import in_words
from genq.monitor.eta import LN2, bucket_log_bounds, length_bucket, norm_cdf
from genq.monitor.exporter import parse_listen
from genq.monitor.progress import DOWN, JobReport, Monitor, encode
from genq.ops import control as ops

log = logging.getLogger("genq.monitor")
STATIC = Path(__file__).parent / "web"
CONTROL_ACTIONS = ("pause", "resume", "drain")
JOB_FIELDS = ("completed", "failed", "percent", "percent_completed", "eta_s", "eta_low_s", "eta_high_s",
              "rate_per_sec", "output_tokens_per_sec", "in_flight")
WORKER_FIELDS = ("tok_per_s", "req_per_s", "slot_utilization")
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")
# The page's own scripts and styles only (uPlot ships beside it); its icon is an empty data: URL.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}
DLQ_READ_LIMIT = 20_000  # letters read for the breakdown; beyond, by_kind covers the first ones scanned
# Without ?job= the page follows the job a user is watching: one that runs (the most requests in
# flight), else one waiting for workers, else the newest; not the alphabetically first.
FOLLOW_ORDER = ("running", "writing", "blocked", "paused", "queued", "empty")


class History:
    """Each job's figures at every refresh, a ring buffer per job, served as columns aligned on `t` (uPlot's form)."""

    def __init__(self, maxlen: int = 3600) -> None:
        self.maxlen = maxlen
        self.points: dict[str, tuple[str | None, deque[dict[str, Any]]]] = {}  # job -> (its incarnation, ring)
        self.lock = threading.Lock()

    def record(self, reports: list[JobReport]) -> None:
        with self.lock:
            jobs = {r.progress.job for r in reports}  # a deleted job's points go with it
            self.points = {j: kept for j, kept in self.points.items() if j in jobs}
            for r in reports:
                p, config = r.progress, r.snapshot.config
                life, ring = self.points.get(p.job, (None, deque(maxlen=self.maxlen)))
                if config is not None and life not in (None, config.incarnation):
                    ring = deque(maxlen=self.maxlen)  # deleted and enqueued again: the points are of another job
                self.points[p.job] = (life if config is None else config.incarnation, ring)
                if ring and ring[-1]["t"] >= p.updated_at:
                    continue  # a second reader of the same refresh
                ring.append({"t": p.updated_at, **{name: getattr(p, name) for name in JOB_FIELDS},
                             "workers": {w.name: {f: getattr(w, f) for f in WORKER_FIELDS}
                                         for w in p.worker_details if w.state not in DOWN}})

    def columns(self, job: str) -> dict[str, Any]:
        """{"t": [...], field: [...], "workers": {name: {field: [...]}}}, None where absent."""
        with self.lock:
            pts = list(self.points[job][1]) if job in self.points else []
        names = sorted({n for p in pts for n in p["workers"]})
        return {**{name: [p[name] for p in pts] for name in ("t", *JOB_FIELDS)},
                "workers": {n: {f: [p["workers"].get(n, {}).get(f) for p in pts] for f in WORKER_FIELDS}
                            for n in names}}


def host_name(header: str) -> str:
    """'Name:8008' -> 'name'; '[::1]:8008' -> '::1'."""
    name = header.strip().lower()
    if name.startswith("["):
        return name[1:].partition("]")[0]
    return (name.partition(":")[0] if name.count(":") == 1 else name).rstrip(".")


def is_own_host(header: str, names: frozenset[str]) -> bool:
    name = host_name(header)
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return True  # an address names no domain a page could rebind
    return name in names


def length_histogram(report: JobReport) -> dict[str, Any]:
    """Per log bucket: finished lengths, running ones (tokens so far), and the fit's expected finished count."""
    finished = {int(b): n for b, n in report.snapshot.hist.items()}
    running = Counter(length_bucket(t) for t in report.snapshot.running_tokens if t > 0)
    model = report.estimate.model
    keys = set(finished) | set(running)
    if model is not None:  # the fit's central 99.8 %, so its tails show where nothing was seen yet
        keys |= {max(0, int(round(4 * (model.mu + k * model.sigma) / LN2))) for k in (-3, 3)}
    buckets = list(range(min(keys), max(keys) + 1)) if keys else []
    n = sum(finished.values())

    def fitted(b: int) -> float | None:
        if model is None or n == 0:
            return None
        lo, hi = bucket_log_bounds(b)
        return round(n * (norm_cdf((hi - model.mu) / model.sigma) - norm_cdf((lo - model.mu) / model.sigma)), 3)

    return {"buckets": buckets, "tokens": [round(2 ** (b / 4) - 1) for b in buckets],
            "finished": [finished.get(b, 0) for b in buckets], "running": [running.get(b, 0) for b in buckets],
            "fitted": [fitted(b) for b in buckets], "mu": model and model.mu, "sigma": model and model.sigma}


def followed(reports: list[JobReport]) -> JobReport | None:
    order = {status: i for i, status in enumerate(FOLLOW_ORDER)}
    return min(reports, default=None, key=lambda r: (order.get(r.progress.status, len(order)), -r.progress.in_flight,
                                                     -(r.snapshot.created_at or 0.0)))


def dead_letter_summary(conn: redis.Redis, job: str, latest: int = 5) -> dict[str, Any]:
    """The job's dead letters: how many, how many of each kind, and the newest few."""
    found: list[DeadLetter] = []
    for raw in islice(letters.scan_raw(conn, job, 1000), DLQ_READ_LIMIT):
        with contextlib.suppress(msgspec.DecodeError):
            found.append(unpack(raw, DeadLetter))
    by_kind = Counter(d.kind for d in found)
    found.sort(key=lambda d: d.at, reverse=True)
    rows = [dict(id=d.id, kind=d.kind, message=d.message[:300], worker=d.worker, batch=d.batch, at=d.at,
                 attempts=d.attempts, status=d.status) for d in found[:latest]]
    return {"total": letters.count(conn, job), "by_kind": dict(sorted(by_kind.items())), "latest": rows}


def make_app(monitor: Monitor, history: History, interval: float, token: str | None,
             names: frozenset[str]) -> web.Application:
    @web.middleware
    async def own_host_only(request: web.Request, handler: Any) -> web.StreamResponse:
        # No Host at all is no browser's request (aiohttp's request.host would look the machine's name up).
        if (host := request.headers.get("Host")) is not None and not is_own_host(host, names):
            # Whoever sent it reads this (a rebinding page is same-origin): it names nothing of this machine.
            return web.Response(status=403, text="genq monitor: this Host is not one of the page's names; "
                                                 "start it with --web-allow-host NAME to allow another\n")
        return await handler(request)

    async def security_headers(request: web.Request, response: web.StreamResponse) -> None:
        response.headers.update(HEADERS)

    app = web.Application(middlewares=[own_host_only])
    app.on_response_prepare.append(security_headers)
    scanned: dict[str, tuple[float, dict[str, Any]]] = {}  # job -> (monotonic, summary): one DLQ scan an interval

    def dead_letters(job: str) -> dict[str, Any]:
        cached = scanned.get(job)
        if cached is None or time.monotonic() - cached[0] >= interval:
            cached = scanned[job] = (time.monotonic(), dead_letter_summary(monitor.conn, job))
        return cached[1]

    async def index(request: web.Request) -> web.StreamResponse:
        return web.FileResponse(STATIC / "index.html")

    async def state(request: web.Request) -> web.Response:
        reports = await asyncio.to_thread(monitor.current, interval)
        jobs = [r.progress.job for r in reports]
        wanted = request.query.get("job")
        if wanted is not None and wanted not in jobs:
            return web.json_response({"error": f"no job named {wanted!r}", "jobs": jobs}, status=404)
        chosen = next((r for r in reports if r.progress.job == wanted), None) if wanted else followed(reports)
        body: dict[str, Any] = {"jobs": jobs, "job": None, "interval": interval, "controls": token is not None,
                                "redis_note": monitor.redis_note.text if monitor.redis_note else None}
        if chosen is not None:
            job = chosen.progress.job
            body.update(job=job, progress=chosen.progress, history=history.columns(job),
                        lengths=length_histogram(chosen), dead_letters=await asyncio.to_thread(dead_letters, job))
        return web.json_response(body, dumps=lambda obj: encode(obj).decode())

    def act(action: str, job: str | None) -> str:
        ops.jobs_named(monitor.conn, job)  # Refused: a job deleted since the page showed it stays unknown
        if action == "drain":  # every live worker finishes what it holds and exits
            for row in ops.select(ops.fleet(monitor.conn), everyone=True):
                ops.update_control(monitor.conn, row.name, drain=True)
        else:  # pause or resume
            getattr(ops, action)(monitor.conn, job)
        return f"{action} {job or 'all'}"

    async def control(request: web.Request) -> web.Response:
        if token is None or not hmac.compare_digest(request.headers.get("X-Genq-Token", "").encode(), token.encode()):
            return web.json_response({"error": "wrong or missing token"}, status=403)
        try:
            body = msgspec.json.decode(await request.read(), type=dict[str, Any])
            action, job = body.get("action"), body.get("job") or None
            if action not in CONTROL_ACTIONS:
                raise ValueError(f"action must be one of {', '.join(CONTROL_ACTIONS)}")
            if job is not None and not isinstance(job, str):
                raise ValueError("job must be a job's name")
            if job is not None:
                check_job_name(job)
            if action == "drain" and job is not None:  # it would drain every worker and answer "drain JOB"
                raise ValueError("drain is for every worker: give no job")
        except (msgspec.DecodeError, ValueError) as exc:  # msgspec's ValidationError is a DecodeError
            return web.json_response({"error": f"a control is a JSON object {{action, job}}: {exc}"}, status=400)
        try:
            done = await asyncio.to_thread(act, action, job)
        except ops.Refused as exc:  # unknown to Redis: nothing stored for it (the next job of that name unpaused)
            return web.json_response({"error": str(exc)}, status=404)
        except (redis.RedisError, OSError) as exc:  # away, or refusing writes: said, not a 500 and a traceback
            log.warning("web control %s %s not taken: %s", action, job or "all", in_words(exc))
            return web.json_response({"error": f"Redis did not take it: {in_words(exc)}"}, status=503)
        log.warning("web control: %s (from %s)", done, request.remote)
        return web.json_response({"ok": done})

    app.router.add_get("/", index)
    app.router.add_get("/api/state", state)
    app.router.add_static("/static/", STATIC / "static", show_index=False)
    if token is not None:
        app.router.add_post("/api/control", control)
    return app


def serve_web(monitor: Monitor, history: History, listen: str, interval: float, token: str | None = None,
              allow_hosts: tuple[str, ...] = ()) -> None:
    """Start the page's server in a background thread (binding here: errors reach the caller)."""
    host, port = parse_listen(listen, "--web")
    names = frozenset(host_name(n) for n in (*LOOPBACK_NAMES, host, socket.gethostname(), *allow_hosts) if n)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(monitor, history, interval, token, names), access_log=None)
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, host, port).start())
    threading.Thread(target=loop.run_forever, name="genq-web", daemon=True).start()
