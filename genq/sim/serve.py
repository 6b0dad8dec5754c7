"""Serving the simulator: start() on a port for tests, run() until a signal for the CLI."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from genq.sim.config import SimConfig
from genq.sim.server import SIM_KEY, SimServer, make_app


@dataclass
class RunningSim:
    """A sim serving on a port; close() stops it."""

    runner: web.AppRunner
    url: str
    sites: list[web.BaseSite] = field(default_factory=list)

    @property
    def sim(self) -> SimServer:
        return self.runner.app[SIM_KEY]

    async def close(self) -> None:
        await self.runner.cleanup()


async def start(config: SimConfig) -> RunningSim:
    """Serve make_app(config) on config.host:config.port (0: any free port)."""
    # handler_cancellation: a client hang-up cancels its handler, which aborts
    # the request. No access log: it would cost more than the instant mode itself.
    runner = web.AppRunner(make_app(config), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    runner.app[SIM_KEY].sites.append(site)
    host, port = runner.addresses[0][:2]
    return RunningSim(runner, f"http://{host}:{port}", [site])


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
