"""Record what a real SGLang server answers to the requests whose answers genq reads, one JSON
file a case, for the sim's shape tests (tests/test_sim_sglang_recorded.py).

    VENV/bin/python scripts/sglang/record.py URL OUT_DIR      (any Python with aiohttp)

Each file: {"request": {"method", "path", "body"}, "status", "content_type", "seconds",
"body" (a JSON answer) or "events" (a stream's data: events decoded, "[DONE]" kept as text)}.
The server is the one scripts/vllm/stack.py starts for `make test-sglang` (16 running
requests, --context-length 2048, no tool-call parser) with the tiny random Qwen2 of
scripts/vllm/make_model.py.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

USAGE = {"include_usage": True, "continuous_usage_stats": True}
TOOL = {"type": "function", "function": {"name": "count_tokens", "parameters": {"type": "object"}}}


def chat(content: str, **extra: Any) -> dict[str, Any]:
    return {"model": "genq-tiny", "messages": [{"role": "user", "content": content}], **extra}


async def call(http: aiohttp.ClientSession, method: str, path: str, body: Any = None) -> dict[str, Any]:
    started = time.monotonic()
    async with http.request(method, path, json=body) as resp:
        raw = await resp.read()
        record: dict[str, Any] = {"request": {"method": method, "path": path, "body": body}, "status": resp.status,
                                  "content_type": resp.headers.get("Content-Type", "")}
    record["seconds"] = round(time.monotonic() - started, 3)
    text = raw.decode()
    if record["content_type"].startswith("text/event-stream"):
        record["events"] = [e[5:].strip() if e[5:].strip() == "[DONE]" else json.loads(e[5:])
                            for e in text.split("\n\n") if e.startswith("data:")]
    elif record["content_type"].startswith("application/json"):
        record["body"] = json.loads(text)
    else:
        record["text"] = text
    return record


async def main(url: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cases: dict[str, dict[str, Any]] = {}
    async with aiohttp.ClientSession(url) as http:
        for path in ("/server_info", "/get_server_info", "/v1/models", "/health", "/version", "/get_load"):
            cases[path.strip("/").replace("/", "_")] = await call(http, "GET", path)
        metrics = await call(http, "GET", "/metrics")
        # The page's sglang: sample lines only (names, labels, values), not its HELP text.
        metrics["text"] = "\n".join(line for line in metrics["text"].splitlines() if line.startswith("sglang:"))
        cases["metrics"] = metrics
        # The random model's answers are random: a logit bias on <|im_end|> (151645) with min_tokens
        # makes them end on end-of-sequence after exactly min_tokens tokens (0: EOS first).
        cases_eos = {"eos_first": {"logit_bias": {"151645": 100}},
                     "eos_after_3": {"logit_bias": {"151645": 100}, "min_tokens": 3}}
        for name, eos in cases_eos.items():
            for stream in (True, False):
                mode = "stream" if stream else "whole"
                cases[f"chat_{mode}_logprobs_{name}"] = await call(http, "POST", "/v1/chat/completions", chat(
                    "say something", max_tokens=8, logprobs=True, top_logprobs=2, stream=stream,
                    stream_options=USAGE if stream else None, **eos))
                cases[f"completions_{mode}_logprobs_{name}"] = await call(http, "POST", "/v1/completions", {
                    "model": "genq-tiny", "prompt": "continue", "max_tokens": 8, "logprobs": 0, "stream": stream,
                    "stream_options": USAGE if stream else None, **eos})
                cases[f"chat_{mode}_n2_{name}"] = await call(http, "POST", "/v1/chat/completions", chat(
                    "two answers", n=2, max_tokens=8, logprobs=True, stream=stream,
                    stream_options=USAGE if stream else None, **eos))
                cases[f"chat_{mode}_stop_{name}"] = await call(http, "POST", "/v1/chat/completions", chat(
                    "stop here", max_tokens=8, stop=["never appears"], stream=stream,
                    stream_options=USAGE if stream else None, **eos))
        cases["chat_stream_n2_length"] = await call(http, "POST", "/v1/chat/completions", chat(
            "two answers", n=2, max_tokens=4, stream=True, stream_options=USAGE))
        cases["chat_whole_too_large"] = await call(http, "POST", "/v1/chat/completions", chat("hi", max_tokens=5000))
        long = "lorem ipsum " * 1200  # ~2,400 tokens: over the 2,048-token context
        cases["chat_whole_over_context"] = await call(http, "POST", "/v1/chat/completions", chat(long, max_tokens=8))
        cases["chat_stream_over_context"] = await call(http, "POST", "/v1/chat/completions",
                                                       chat(long, max_tokens=8, stream=True, stream_options=USAGE))
        cases["chat_whole_unknown_model"] = await call(
            http, "POST", "/v1/chat/completions", {**chat("hi", max_tokens=4), "model": "no-such-model"})
        cases["chat_whole_tools"] = await call(http, "POST", "/v1/chat/completions",
                                               chat("count", max_tokens=6, tools=[TOOL]))
        cases["chat_stream_tools"] = await call(http, "POST", "/v1/chat/completions",
                                                chat("count", max_tokens=6, tools=[TOOL], stream=True,
                                                     stream_options=USAGE))
        cases["chat_whole_regex"] = await call(http, "POST", "/v1/chat/completions",
                                               chat("digits", max_tokens=8, regex="[0-9]{3}"))
        cases["chat_whole_stop_token_ids"] = await call(http, "POST", "/v1/chat/completions",
                                                        chat("stop ids", max_tokens=8, stop_token_ids=[151645]))
    for name, record in cases.items():
        (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"{name}: {record['status']} {record['seconds']} s")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
