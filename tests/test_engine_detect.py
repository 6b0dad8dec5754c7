"""Which engine a server is (worker/engines.py `detect`), from its answers alone, without a server.

The order is what tells the engines apart: an endpoint of the engine's own (SGLang's
/server_info, llama.cpp's /props) before the metric prefixes on /metrics (vLLM's), and
anything else is a plain OpenAI-compatible server. The sim plays each engine end to end
(tests/test_engines.py); these are the cases it does not: a server that names no engine.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from genq.worker.engines import ServerInfo, detect, metrics_from_text

SGLANG_INFO = {"max_running_requests": 48, "context_length": 4096}
PROPS = {"total_slots": 4, "default_generation_settings": {"n_ctx": 1024}}


def detected(answers: dict[str, Any], page: bytes | None = None) -> tuple[ServerInfo, list[str]]:
    """What detect makes of a server answering `answers` (path -> JSON) and `page` on /metrics."""
    asked: list[str] = []

    async def get_json(path: str) -> Any:
        asked.append(path)
        return answers.get(path)

    async def get(path: str) -> tuple[int, bytes]:
        asked.append(path)
        return (404, b"") if page is None else (200, page)

    return asyncio.run(detect(get_json, get)), asked


def test_sglang_is_told_by_its_server_info_and_llamacpp_is_not_asked() -> None:
    # /server_info first: 0.5.23 logs a deprecation warning at every /get_server_info.
    found, asked = detected({"/server_info": SGLANG_INFO}, b"sglang:num_running_reqs 0\n")
    assert (found.engine.name, found.capacity, found.context_length, found.has_metrics) == ("sglang", 48, 4096, True)
    assert asked == ["/server_info", "/metrics"]
    found, asked = detected({"/get_server_info": SGLANG_INFO})  # an older SGLang
    assert (found.engine.name, found.capacity, asked) == ("sglang", 48,
                                                          ["/server_info", "/get_server_info", "/metrics"])


def test_sglang_0_5_23_as_recorded() -> None:
    """Real SGLang 0.5.23 (--max-running-requests 16 --context-length 2048) and its metrics page."""
    recorded = Path(__file__).parent / "recordings" / "sglang-0.5.23"
    info = json.loads((recorded / "server_info.json").read_text())["body"]
    page = json.loads((recorded / "metrics.json").read_text())["text"]
    found, _ = detected({"/server_info": info}, page.encode())
    assert (found.engine.name, found.capacity, found.context_length, found.has_metrics) == ("sglang", 16, 2048, True)
    # Its retraction gauge (with a pid label) is read; it has no retraction counter.
    figures = metrics_from_text(page)
    assert (figures.running, figures.waiting, figures.retracted, figures.retractions_total) == (0, 0, 0, None)


def test_llamacpp_is_told_by_its_props_and_counts_slots_when_props_does_not() -> None:
    found, _ = detected({"/props": PROPS})
    assert (found.engine.name, found.capacity, found.context_length, found.has_metrics) == ("llamacpp", 4, 1024, False)
    found, asked = detected({"/props": {"default_generation_settings": {}}, "/slots": [{}, {}]})
    assert (found.engine.name, found.capacity, found.context_length) == ("llamacpp", 2, None)
    assert asked[-2:] == ["/slots", "/metrics"]
    assert detected({"/props": {"total_slots": 4}})[0].engine.name == "openai-compatible", "no llama.cpp answer"


def test_vllm_is_named_by_its_metrics_and_another_page_names_no_engine() -> None:
    found, _ = detected({}, b'vllm:num_requests_running{engine="0"} 3\n')
    assert (found.engine.name, found.capacity, found.has_metrics) == ("vllm", None, True)
    # SGLang's names without its endpoint: metrics genq reads, from a server it does not know.
    found, _ = detected({}, b"sglang:num_running_reqs 3\n")
    assert (found.engine.name, found.has_metrics) == ("openai-compatible", True)
    found, _ = detected({}, b"process_cpu_seconds_total 1\n")
    assert (found.engine.name, found.capacity, found.context_length, found.has_metrics) == \
        ("openai-compatible", None, None, False)
