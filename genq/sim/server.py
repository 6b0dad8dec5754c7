"""HTTP face of the simulator: the endpoints, status codes and connection habits of
SGLang, vLLM or llama.cpp's llama-server (SimConfig.flavor; what differs is in
genq/sim/flavors.py, the sources it copies are named in docs/engines.md).

make_app() builds the aiohttp application; genq/sim/serve.py serves it (start()
for tests, run() for the CLI). Serve through those, or pass
handler_cancellation=True to your own AppRunner: that is how a client that hangs
up on a non-stream request is noticed and its slot freed, as SGLang does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.faults import FaultInjector, FaultUpdate
from genq.sim.flavors import error_response, json_response
from genq.sim.generate import Generation
from genq.sim.stepped import SteppedEngine

_fault_decoder = msgspec.json.Decoder(FaultUpdate)



class SimServer:
    """State behind the handlers: one engine, the fault switches, the clock."""

    def __init__(self, config: SimConfig) -> None:
        if config.flavor not in flavors.FLAVORS:
            raise ValueError(f"flavor must be one of {', '.join(flavors.FLAVORS)}, got {config.flavor!r}")
        self.config = config
        self.flavor = config.flavor
        self.engine = SteppedEngine(config)  # the plain engine, and its counts as vLLM reports them
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

    # ---- info endpoints --------------------------------------------------

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

    async def server_info(self, request: web.Request) -> web.Response:
        return json_response(flavors.sglang_server_info(self.config, self.engine))

    async def model_info(self, request: web.Request) -> web.Response:
        path = self.config.model_path
        return json_response({"model_path": path, "tokenizer_path": path, "is_generation": True})

    async def props(self, request: web.Request) -> web.Response:
        return json_response(flavors.llamacpp_props(self.config))

    async def slots(self, request: web.Request) -> web.Response:
        return json_response(flavors.llamacpp_slots(self.config, self.engine))

    async def models(self, request: web.Request) -> web.Response:
        return json_response({"object": "list", "data": [flavors.model_card(self.config)]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=flavors.metrics_page(self.config, self.engine), content_type="text/plain",
                            charset="utf-8")

    # ---- simulator control -----------------------------------------------

    async def sim_stats(self, request: web.Request) -> web.Response:
        return json_response(self.engine.stats_snapshot())

    async def sim_reset(self, request: web.Request) -> web.Response:
        self.engine.reset_stats()
        return json_response({"reset": True})

    async def sim_faults_get(self, request: web.Request) -> web.Response:
        return json_response({**self.faults.snapshot(), "listening": self.listening})

    async def sim_faults_post(self, request: web.Request) -> web.Response:
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

    # ---- generation ------------------------------------------------------

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        self.open_requests += 1
        try:
            return await self.generation.answer(request, chat)
        finally:
            self.open_requests -= 1


SIM_KEY = web.AppKey("sim", SimServer)


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
        for path in ("/get_server_info", "/server_info"):
            r.add_get(path, sim.server_info)
        for path in ("/get_model_info", "/model_info"):
            r.add_get(path, sim.model_info)
    elif config.flavor == "llamacpp":
        r.add_get("/props", sim.props)
        r.add_get("/slots", sim.slots)
    r.add_get("/v1/models", sim.models)
    r.add_get("/metrics", sim.metrics)
    r.add_post("/v1/chat/completions", sim.chat_completions)
    r.add_post("/v1/completions", sim.completions)
    r.add_get("/sim/stats", sim.sim_stats)
    r.add_post("/sim/reset", sim.sim_reset)
    r.add_get("/sim/faults", sim.sim_faults_get)
    r.add_post("/sim/faults", sim.sim_faults_post)
    return app
