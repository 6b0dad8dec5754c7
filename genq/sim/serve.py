"""HTTP face of the simulator: the endpoints, status codes and connection habits of
SGLang, vLLM or llama.cpp's llama-server (SimConfig.flavor; what differs is in
genq/sim/flavors.py, the sources it copies are named in docs/engines.md).

start() serves it on a port for tests, run() until a signal for the CLI. Both run
aiohttp with handler_cancellation=True: that is how a client that hangs up on a
non-stream request is noticed and its slot freed, as SGLang does.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.engine import Engine
from genq.sim.faults import FaultInjector, FaultUpdate
from genq.sim.flavors import error_response, json_response
from genq.sim.generate import Generation

_fault_decoder = msgspec.json.Decoder(FaultUpdate)


class SimServer:
    """State behind the handlers: one engine, the fault switches, the clock."""

    def __init__(self, config: SimConfig) -> None:
        if config.flavor not in flavors.FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(flavors.FLAVORS)}, got {config.flavor!r}")
        self.config = config
        self.flavor = config.flavor
        self.engine = Engine(config)
        self.faults = FaultInjector(config)
        self.started_at = time.monotonic()
        self._outage_task: asyncio.Task[None] | None = None
        self.sites: list[web.BaseSite] = []  # set by start(): what stop_listening closes
        self.listening = True
        self.open_requests = 0  # generation requests being handled
        self.generation = Generation(config, self.engine, self.faults, self.ready, self.start_outage)

    # ---- lifecycle -------------------------------------------------------

    async def on_startup(self, app: web.Application) -> None:
        self.started_at = time.monotonic()
        self.engine.start()
        if self.config.outage_at is not None:
            self._outage_task = asyncio.get_running_loop().create_task(self._scheduled_outage(self.config.outage_at))

    async def on_cleanup(self, app: web.Application) -> None:
        if self._outage_task is not None:
            self._outage_task.cancel()
        await self.engine.stop()

    async def _scheduled_outage(self, at: float) -> None:
        await asyncio.sleep(at)
        self.start_outage(self.config.outage_for)

    def start_outage(self, duration: float) -> None:
        self.faults.start_outage(duration)
        if duration > 0:
            self.engine.drop_all()

    async def stop_listening(self) -> None:
        """What llama-server does on SIGTERM: the listening socket closes, requests in
        progress hang (no more output, no answer, no close), and a request arriving
        on a kept-alive connection loses it. The engine stops: nothing moves again."""
        self.listening = False
        for site in self.sites:
            await site.stop()
        await self.engine.stop()

    def ready(self) -> bool:
        return time.monotonic() - self.started_at >= self.config.startup_delay

    @web.middleware
    async def gate(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        if not self.listening:
            # Stopped: no request is served any more; the connection just closes.
            if request.transport is not None:
                request.transport.close()
            return web.Response(status=503)  # never sent
        return await handler(request)

    # ---- endpoints -------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        if self.config.health_delay:
            await asyncio.sleep(self.config.health_delay)
        if self.flavor == "sglang":
            # SGLang's /health runs a one-token generation and answers when it is done (about
            # 1 s on 0.5.23 on CPU): a step of the sim's engine stands for it.
            await asyncio.sleep(self.config.step_ms_base / 1000)
        ok = self.ready() and not self.faults.in_outage()
        if self.flavor == "llamacpp":
            if ok:
                return json_response({"status": "ok"})
            return error_response(self.flavor, 503, "Loading model", "unavailable_error")
        return web.Response(status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=flavors.metrics_page(self.config, self.engine), content_type="text/plain",
                            charset="utf-8")

    async def sim_reset(self, request: web.Request) -> web.Response:
        self.engine.reset_stats()
        return json_response({"reset": True})

    async def sim_faults(self, request: web.Request) -> web.Response:
        """GET: the switches; POST: change them (FaultUpdate)."""
        if request.method == "POST":
            try:
                update = _fault_decoder.decode(await request.read())
                self.faults.apply(update)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                return flavors.bad_request(self.flavor, str(exc))
            if update.outage_for is not None:
                self.start_outage(update.outage_for)
            if update.stop_listening:
                await self.stop_listening()
        return json_response({**self.faults.snapshot(), "listening": self.listening})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.open_requests += 1
        try:
            return await self.generation.answer(request, chat=request.path.endswith("/chat/completions"))
        finally:
            self.open_requests -= 1


SIM_KEY = web.AppKey("sim", SimServer)


def _answers(make: Callable[[], Any]) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler answering make()'s JSON."""

    async def handler(request: web.Request) -> web.Response:
        return json_response(make())

    return handler


def make_app(config: SimConfig) -> web.Application:
    sim = SimServer(config)
    # SGLang takes large prompts; aiohttp's 1 MiB default body limit would not.
    app = web.Application(client_max_size=256 * 1024 * 1024, middlewares=[sim.gate])
    app[SIM_KEY] = sim
    app.on_startup.append(sim.on_startup)
    app.on_cleanup.append(sim.on_cleanup)
    r = app.router
    r.add_get("/health", sim.health)
    if config.flavor == "sglang":
        r.add_get("/health_generate", sim.health)
        info = _answers(lambda: flavors.sglang_server_info(config, sim.engine))
        model = _answers(lambda: {"model_path": config.model_path, "tokenizer_path": config.model_path,
                                  "is_generation": True})
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, model)
    elif config.flavor == "llamacpp":
        r.add_get("/props", _answers(lambda: flavors.llamacpp_props(config)))
        r.add_get("/slots", _answers(lambda: flavors.llamacpp_slots(config, sim.engine)))
    r.add_get("/v1/models", _answers(lambda: {"object": "list", "data": [flavors.model_card(config)]}))
    r.add_get("/metrics", sim.metrics)
    r.add_post("/v1/chat/completions", sim.generate)
    r.add_post("/v1/completions", sim.generate)
    r.add_get("/sim/stats", _answers(sim.engine.stats_snapshot))
    r.add_post("/sim/reset", sim.sim_reset)
    r.add_get("/sim/faults", sim.sim_faults)
    r.add_post("/sim/faults", sim.sim_faults)
    return app


@dataclass
class RunningSim:
    """A sim serving on a port; close() stops it."""

    runner: web.AppRunner
    url: str

    @property
    def sim(self) -> SimServer:
        return self.runner.app[SIM_KEY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(config: SimConfig) -> RunningSim:
    """Serve make_app(config) on config.host:config.port (0: any free port)."""
    # No access log: it would cost more than the instant mode itself.
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    runner.app[SIM_KEY].sites.append(site)
    host, port = runner.addresses[0][:2]
    return RunningSim(runner, f"http://{host}:{port}")


def run(config: SimConfig, on_ready: Callable[[str], None] = print) -> None:
    """Serve until SIGINT or SIGTERM; on_ready gets the base URL once listening.

    The llamacpp flavor answers its first SIGTERM as llama-server does: it stops
    listening and leaves open requests hanging; it exits once none is open (their
    clients gave up) or on a second signal."""

    async def serve() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        running = await start(config)
        signals = 0

        def on_signal() -> None:
            nonlocal signals
            signals += 1
            if config.flavor == "llamacpp" and signals == 1:
                loop.create_task(running.sim.stop_listening())
            else:
                stop.set()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        try:
            on_ready(running.url)
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), timeout=0.2)
                except TimeoutError:
                    if not running.sim.listening and running.sim.open_requests == 0:
                        break
        finally:
            await running.close()

    asyncio.run(serve())
