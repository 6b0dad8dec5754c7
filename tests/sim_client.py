"""Helpers for the simulator's tests: a fresh in-process `genq sim` per test, and its HTTP API."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from genq.sim.config import SimConfig
from genq.sim.serve import SimServer, start

REPO = Path(__file__).resolve().parents[1]
Body = Callable[[SimServer, aiohttp.ClientSession], Awaitable[None]]


def with_sim(**overrides: Any) -> Callable[[Body], Callable[[], None]]:
    """Run an async test body against a fresh in-process sim on a free port.
    Fast steps by default so that every test finishes in about a second."""
    settings: dict[str, Any] = {"port": 0, "step_ms_base": 2.0, "step_ms_per_req": 0.0, "mean_output_tokens": 64.0}
    settings.update(overrides)

    def decorate(body: Body) -> Callable[[], None]:
        async def main() -> None:
            sim = await start(SimConfig(**settings))
            try:
                async with aiohttp.ClientSession(sim.url) as http:
                    await asyncio.wait_for(body(sim, http), timeout=8)
            finally:
                await sim.close()

        def test() -> None:
            asyncio.run(main())

        return test

    return decorate


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


async def post(http: aiohttp.ClientSession, body: dict[str, Any],
               path: str = "/v1/chat/completions") -> tuple[int, Any]:
    async with http.post(path, json=body) as resp:
        return resp.status, await resp.json()


async def sse_events(http: aiohttp.ClientSession, body: dict[str, Any],
                     path: str = "/v1/chat/completions") -> list[Any]:
    """Every `data:` event of a stream, decoded; "[DONE]" stays a string."""
    async with http.post(path, json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    assert raw.endswith("\n\n")
    events = []
    for block in raw.split("\n\n")[:-1]:
        assert block.startswith("data: "), block
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


async def metrics(http: aiohttp.ClientSession) -> dict[str, float]:
    async with http.get("/metrics") as resp:
        text = await resp.text()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)  # its series summed, as genq reads them
    return values


async def wait_for_metric(http: aiohttp.ClientSession, name: str, value: float) -> dict[str, float]:
    """Poll /metrics until name == value (the with_sim timeout bounds the wait)."""
    while (m := await metrics(http))[name] != value:
        await asyncio.sleep(0.005)
    return m


async def health_becomes(http: aiohttp.ClientSession, status: int) -> None:
    """Poll /health until it answers status (the with_sim timeout bounds the wait)."""
    while True:
        async with http.get("/health") as resp:
            if resp.status == status:
                return
        await asyncio.sleep(0.01)


async def sim_stats(http: aiohttp.ClientSession) -> dict[str, Any]:
    async with http.get("/sim/stats") as resp:
        return await resp.json()


# ---- lengths --------------------------------------------------------------
