"""The record formats `genq export` writes: JSONL as stored, Parquet, and OpenAI Batch.

OpenAI Batch output follows OpenAI's batch output/error file lines, as vLLM's
run_batch writes them: {"id", "custom_id", "response": {"status_code",
"request_id", "body"}, "error"}. Successes go to the output file with a
chat.completion (or text_completion) body rebuilt from the Result; prompts in
the dead-letter queue go to the errors file, with the server's HTTP status and
message when it answered ({"error": {...}} body) or, for failures without an
HTTP answer (timeouts, resets), response null and error {"code", "message"}.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import Any, BinaryIO, NamedTuple

import msgspec

from genq.core.records import Choice, DeadLetter, Result

PARQUET_ROWS_PER_GROUP = 5000

_json = msgspec.json.Encoder()
_result_decoder = msgspec.json.Decoder(Result)


def write_jsonl(lines: Iterable[bytes], out: BinaryIO) -> int:
    count = 0
    for line in lines:
        out.write(line)
        count += 1
    return count


def _parquet_schema() -> Any:
    import pyarrow as pa

    return pa.schema([
        ("id", pa.string()), ("custom_id", pa.string()), ("index", pa.int64()),
        ("job", pa.string()), ("batch", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("prompt", pa.string()),
        ("completion", pa.string()), ("reasoning_content", pa.string()), ("finish_reason", pa.string()),
        ("prompt_tokens", pa.int64()), ("completion_tokens", pa.int64()), ("reasoning_tokens", pa.int64()),
        ("model", pa.string()), ("worker", pa.string()), ("attempts", pa.int32()), ("latency_s", pa.float64()),
        ("response_id", pa.string()), ("finished_at", pa.float64()),
        ("metadata", pa.string()),  # JSON: its keys differ from row to row
        # n > 1: every sample (completion, finish_reason, ... above are choice 0's).
        ("choices", pa.list_(pa.struct([
            ("index", pa.int64()), ("completion", pa.string()), ("reasoning_content", pa.string()),
            ("finish_reason", pa.string()), ("completion_tokens", pa.int64()), ("logprobs", pa.string()),
            ("matched_stop", pa.string()), ("tool_calls", pa.string())]))),
        ("logprobs", pa.string()),  # JSON: the OpenAI logprobs object, when asked for
        ("matched_stop", pa.string()),  # JSON: a stop string or a token id, when stop was set
        ("tool_calls", pa.string()),  # JSON: the calls, when the request offered tools
    ])


def _json_or_none(value: Any) -> str | None:
    return None if value is None else _json.encode(value).decode()


def _stop_json(value: Any) -> str | None:
    """matched_stop: "null" when stop was set and the server named nothing, null when not set."""
    return None if value is msgspec.UNSET else _json.encode(value).decode()


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    return _json.encode(value).decode()  # multimodal parts: kept as their JSON


def parquet_row(r: Result) -> dict[str, Any]:
    return {
        "id": r.id, "custom_id": r.custom_id, "index": r.index, "job": r.job, "batch": r.batch,
        "messages": None if r.messages is None else [
            {"role": m.get("role"), "content": _text(m.get("content"))} for m in r.messages],
        "prompt": r.prompt, "completion": r.completion, "reasoning_content": r.reasoning_content,
        "finish_reason": r.finish_reason, "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens, "reasoning_tokens": r.usage.reasoning_tokens,
        "model": r.model, "worker": r.worker, "attempts": r.attempts, "latency_s": r.latency_s,
        "response_id": r.response_id, "finished_at": r.finished_at,
        "metadata": _json.encode(r.metadata).decode() if r.metadata else None,
        "choices": None if r.choices is None else [
            {"index": c.index, "completion": c.completion, "reasoning_content": c.reasoning_content,
             "finish_reason": c.finish_reason, "completion_tokens": c.completion_tokens,
             "logprobs": _json_or_none(c.logprobs), "matched_stop": _stop_json(c.matched_stop),
             "tool_calls": _json_or_none(c.tool_calls)}
            for c in r.choices],
        "logprobs": _json_or_none(r.logprobs), "matched_stop": _stop_json(r.matched_stop),
        "tool_calls": _json_or_none(r.tool_calls),
    }


def write_parquet(lines: Iterable[bytes], out: BinaryIO) -> int:
    """Row groups of PARQUET_ROWS_PER_GROUP with one fixed schema (see _parquet_schema).

    messages are list<struct<role, content>> (non-string content as its JSON);
    metadata is a JSON string. The JSONL export keeps every field as it is."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema()
    count = 0
    rows: list[dict[str, Any]] = []
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        for line in lines:
            rows.append(parquet_row(_result_decoder.decode(line)))
            count += 1
            if len(rows) >= PARQUET_ROWS_PER_GROUP:
                writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                rows = []
        if rows or count == 0:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
    return count


def _hash(job: str, prompt_id: str) -> str:
    return hashlib.sha256(f"{job}\0{prompt_id}".encode()).hexdigest()[:24]


def openai_output_line(r: Result) -> dict[str, Any]:
    """One line of an OpenAI Batch output file for a finished prompt."""
    h = _hash(r.job, r.id)
    usage: dict[str, Any] = {
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "total_tokens": r.usage.prompt_tokens + r.usage.completion_tokens,
    }
    if r.usage.reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": r.usage.reasoning_tokens}
    completions = r.messages is None and r.prompt is not None
    samples = r.choices or [Choice(index=0, completion=r.completion, finish_reason=r.finish_reason,
                                   reasoning_content=r.reasoning_content, logprobs=r.logprobs,
                                   tool_calls=r.tool_calls)]
    choices: list[dict[str, Any]] = []
    for c in samples:
        if completions:
            choices.append({"index": c.index, "text": c.completion, "logprobs": c.logprobs,
                            "finish_reason": c.finish_reason})
        else:
            message: dict[str, Any] = {"role": "assistant", "content": c.completion,
                                       "reasoning_content": c.reasoning_content}
            if c.tool_calls:
                message["tool_calls"] = c.tool_calls
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
            })
    body = {
        "id": r.response_id or (f"cmpl-{h}" if completions else f"chatcmpl-{h}"),
        "object": "text_completion" if completions else "chat.completion",
        "created": int(r.finished_at),
        "model": r.model,
        "choices": choices,
        "usage": usage,
    }
    return {
        "id": f"batch_req_{h}",
        "custom_id": r.custom_id or r.id,
        "response": {"status_code": 200, "request_id": r.response_id or f"req_{h}", "body": body},
        "error": None,
    }


def openai_error_line(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI Batch error file for a dead letter."""
    h = _hash(letter.job, letter.id)
    custom_id = (letter.prompt.custom_id if letter.prompt else None) or letter.id
    status = letter.status
    if status is None and letter.kind == "server_error":
        status = 500  # an error event inside a 200 stream: the server failed the request
    if status is None:
        # No HTTP answer to report (timeout, reset, unparsable reply): OpenAI's
        # "non-HTTP error" shape.
        return {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None,
                "error": {"code": letter.kind, "message": letter.message}}
    error = {
        "message": letter.message,
        "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
        "param": None,
        "code": letter.kind,
    }
    return {
        "id": f"batch_req_{h}",
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": f"req_{h}", "body": {"error": error}},
        "error": None,
    }


def write_openai_batch(lines: Iterable[bytes], out: BinaryIO) -> int:
    count = 0
    for line in lines:
        out.write(_json.encode(openai_output_line(_result_decoder.decode(line))) + b"\n")
        count += 1
    return count


class Format(NamedTuple):
    """One export format: its writer, the file name `genq export --to DIR/` gives it, the suffixes that
    choose it when --format is not given, and whether dead letters go to an errors file beside it."""

    write: Callable[[Iterable[bytes], BinaryIO], int]
    file_suffix: str
    chosen_by: tuple[str, ...] = ()
    errors_file: bool = False


FORMATS: dict[str, Format] = {
    "jsonl": Format(write_jsonl, ".jsonl"),
    "parquet": Format(write_parquet, ".parquet", chosen_by=(".parquet", ".pq")),
    "openai-batch": Format(write_openai_batch, ".batch_output.jsonl", errors_file=True),
}
DEFAULT_FORMAT = "jsonl"


def format_for(dest: str, asked: str | None) -> str:
    """--format if given, else the one the destination's suffix chooses, else jsonl."""
    if asked:
        return asked
    return next((name for name, f in FORMATS.items() if dest.endswith(f.chosen_by)), DEFAULT_FORMAT)
