"""Streamed answers of the simulated server: the chunks of every choice of a request,
interleaved by index as SGLang and vLLM send them, with the flavor's ways of ending."""

from __future__ import annotations

import asyncio
import socket
import struct

from aiohttp import web

from genq.sim import flavors
from genq.sim.config import SimConfig
from genq.sim.engine import Engine, SimRequest
from genq.sim.protocol import StreamOptions
from genq.sim.reply import Reply, sse

# The message of the stream_error fault (and of the 500 a whole answer gets instead).
STREAM_ERROR = "Internal server error (simulated, mid-stream)"
# cpp-httplib's keep-alive header, which llama-server sends even on the streamed
# responses after which it closes the connection.
_LLAMACPP_KEEP_ALIVE = {"Connection": "Keep-Alive", "Keep-Alive": "timeout=5, max=100"}


def drop_connection(request: web.Request) -> None:
    """Reset the TCP connection as a crashed server would: no response, no FIN."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        # Linger 0 turns close() into an RST, so the client sees a reset at once.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


async def stream(
    engine: Engine, config: SimConfig, request: web.Request, reqs: list[SimRequest], replies: list[Reply],
    options: StreamOptions, failing: bool,
) -> web.StreamResponse:
    continuous = options.continuous_usage_stats
    llamacpp = config.flavor == "llamacpp"
    req = reqs[0]
    headers = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    resp = web.StreamResponse(headers={**headers, **_LLAMACPP_KEEP_ALIVE} if llamacpp else headers)
    if config.flavor in ("llamacpp", "sglang"):
        # llama-server answers (headers included) only with the first result, and
        # SGLang's _handle_streaming_request awaits the stream's first chunk before
        # it returns the response: a queued request gets no byte at all until it runs.
        await _any_progress(engine, [(each, 0) for each in reqs])
        if req.dropped and not failing:
            drop_connection(request)
            return resp
    # vLLM returns Starlette's StreamingResponse at once: headers at once, the
    # first event (the role) only with the first output, nothing while queued.
    await resp.prepare(request)
    # Choices stream interleaved, each chunk one choice with its index. vLLM ends each
    # choice with its finish_reason as it finishes; SGLang sends every finish chunk
    # after the last output (serving_chat.py, _generate_chat_stream).
    finish_at_end = per_token = config.flavor == "sglang"
    sent = [0] * len(reqs)
    finished = [False] * len(reqs)
    last_id = replies[0].chunk_id
    finished_early = [False] * len(reqs)  # its finish went with its last token (SGLang's completions)
    while True:
        await _any_progress(engine, [(each, sent[i]) for i, each in enumerate(reqs) if not finished[i]])
        for i, (each, reply) in enumerate(zip(reqs, replies, strict=True)):
            done = each.generated
            if finished[i] or (done <= sent[i] and each.finish_reason is None):
                continue
            if sent[i] == 0 and reply.chat:
                # Chat streams open with the role; completion streams start with text.
                await resp.write(sse(reply.chunk({"role": "assistant", "content": ""}, None,
                                                  0 if continuous and not per_token else None)))
                last_id = reply.chunk_id
            # SGLang sends a chunk per token; the others one per step.
            for a, b in ([(t, t + 1) for t in range(sent[i], done)] if per_token else [(sent[i], done)] * (done > sent[i])):
                sent[i] = b
                # SGLang's chat stream sends nothing for the end-of-sequence token (no text, no
                # logprob), though its usage counts it and its whole answer lists its logprob.
                if per_token and reply.chat and each.natural_finish == "stop" and b == each.target:
                    continue
                deltas = reply.deltas(a, b)
                # SGLang's completions stream ends a choice on its last token's chunk, with the
                # finish and (at end-of-sequence) that token's logprob; there is no finish chunk.
                last = per_token and not reply.chat and b == each.target and each.finish_reason is not None
                for d, delta in enumerate(deltas):
                    # The step's logprobs ride on its last delta.
                    logprobs = reply.logprobs(a, b) if d == len(deltas) - 1 else None
                    finish = each.finish_reason if last and d == len(deltas) - 1 else None
                    await resp.write(sse(reply.chunk(delta, finish, b if continuous else None, logprobs)))
                    last_id = reply.chunk_id
                finished_early[i] = finished_early[i] or last
            if each.finish_reason is not None:
                finished[i] = True
                if not (finish_at_end or each.dropped):
                    await _finish(resp, reply, each, done, continuous)
        if all(finished) or req.dropped:
            break
    if req.dropped and failing:
        await resp.write(flavors.stream_error(config.flavor, STREAM_ERROR))
    elif any(each.dropped for each in reqs):
        drop_connection(request)
        return resp
    else:
        if finish_at_end:
            # SGLang's finish chunks, and its usage chunk, all carry the id of the last chunk sent.
            for each, reply, tokens, early in zip(reqs, replies, sent, finished_early, strict=True):
                if not early:
                    await _finish(resp, reply, each, tokens, continuous, last_id)
        if options.include_usage:
            await resp.write(sse(replies[0].usage_chunk(sum(sent), last_id if finish_at_end else None)))
        await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    if llamacpp and request.transport is not None:
        # llama-server closes the connection after a stream, whatever its
        # Keep-Alive header said: stop reading it now, close it a moment later.
        transport = request.transport
        transport.pause_reading()
        asyncio.get_running_loop().call_later(config.stream_close_delay, transport.close)
    return resp


async def _finish(resp: web.StreamResponse, reply: Reply, req: SimRequest, tokens: int, continuous: bool,
                  chunk_id: str | None = None) -> None:
    """A choice's last chunks: its tool call, if it makes one, then its finish_reason (SGLang's
    chat finish chunk has no usage)."""
    usage = tokens if continuous else None
    for delta in reply.tool_deltas(tokens):
        await resp.write(sse(reply.chunk(delta, None, usage, chunk_id=chunk_id)))
    usage = None if reply.sglang and reply.chat else usage
    await resp.write(sse(reply.chunk(None, reply.finish(req.finish_reason), usage, chunk_id=chunk_id)))


async def _any_progress(engine: Engine, waiting: list[tuple[SimRequest, int]]) -> None:
    """Return once any of these choices has more tokens than it sent, or has finished."""
    if len(waiting) == 1:
        await engine.wait(*waiting[0])
        return
    if any(r.finish_reason is not None or r.generated > seen for r, seen in waiting):
        return
    waits = [asyncio.ensure_future(engine.wait(r, seen)) for r, seen in waiting]
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()

