"""How people drive an SGLang server today: the script genq replaces.

One asyncio script, one aiohttp session, a semaphore of 32, tasks created with a
small stagger (a deliberate slow ramp-up), and the prompts processed in batches
one after another: `gather` waits for a batch's slowest request before the next
batch starts. This is the user's script from the issue, with its knobs as options
so the benchmark can run it as they did; it is not how genq works.

    python bench/baseline.py --server http://127.0.0.1:30000 --input prompts.jsonl \
        --output results.jsonl --concurrency 32 --batch-size 256 --stagger 0.01
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import aiohttp


async def generate(session: aiohttp.ClientSession, sem: asyncio.Semaphore, url: str, model: str,
                   row: dict, max_tokens: int) -> dict:
    async with sem:
        body = {"model": model, "messages": row["messages"], "max_tokens": max_tokens}
        for attempt in range(3):
            try:
                async with session.post(url, json=body) as resp:
                    data = await resp.json()
                    if resp.status == 200:
                        return {"id": row["id"], "completion": data["choices"][0]["message"]["content"],
                                "usage": data.get("usage")}
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(1 + attempt)
        return {"id": row["id"], "error": "failed after 3 attempts"}


async def main(args: argparse.Namespace) -> None:
    with open(args.input) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    url = args.server.rstrip("/") + "/v1/chat/completions"
    sem = asyncio.Semaphore(args.concurrency)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        out = open(args.output, "w")
        for start in range(0, len(rows), args.batch_size):
            tasks = []
            for row in rows[start:start + args.batch_size]:
                tasks.append(asyncio.create_task(generate(session, sem, url, args.model, row, args.max_tokens)))
                await asyncio.sleep(args.stagger)  # don't hammer the server
            for result in await asyncio.gather(*tasks):
                out.write(json.dumps(result) + "\n")
        out.close()
    print(f"{len(rows)} prompts in {time.monotonic() - started:.1f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True)
    parser.add_argument("--input", required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--model", default="default")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--stagger", type=float, default=0.01, help="Seconds between task creations.")
    parser.add_argument("--max-tokens", type=int, default=4096)
    asyncio.run(main(parser.parse_args()))
