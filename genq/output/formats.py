"""The formats `genq export` writes, one table: JSONL as stored, Parquet, and OpenAI Batch.

OpenAI Batch output follows OpenAI's batch output and error file lines, as vLLM's run_batch writes
them: {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}. A success gets
a chat.completion (or text_completion) body rebuilt from its Result; a dead letter goes to the errors
file with the server's HTTP status and message when it answered, else response null and error
{"code", "message"} (a timeout, a reset).
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


# One fixed schema, a column's name and kind: an Arrow type, "usage" (an int64 of Result.usage),
# "json" (a JSON string: metadata, logprobs, matched_stop and tool_calls have keys that differ from row
# to row), "messages" (a list of {role, content}, non-string content as its JSON) or "choices" (every
# sample when n > 1; the columns before it are choice 0's). The JSONL export keeps every field as it is.
_CHOICE_COLUMNS = {"index": "int64", "completion": "string", "reasoning_content": "string",
                   "finish_reason": "string", "completion_tokens": "int64", "logprobs": "json",
                   "matched_stop": "json", "tool_calls": "json"}
PARQUET_COLUMNS = {
    "id": "string", "custom_id": "string", "index": "int64", "job": "string", "batch": "string",
    "messages": "messages", "prompt": "string", "completion": "string", "reasoning_content": "string",
    "finish_reason": "string", "prompt_tokens": "usage", "completion_tokens": "usage", "reasoning_tokens": "usage",
    "model": "string", "worker": "string", "attempts": "int32", "latency_s": "float64", "response_id": "string",
    "finished_at": "float64", "metadata": "json", "choices": "choices", "logprobs": "json",
    "matched_stop": "json", "tool_calls": "json",
}


def _cells(obj: Result | Choice, columns: dict[str, str]) -> dict[str, Any]:
    return {name: _cell(obj, name, kind) for name, kind in columns.items()}


def _cell(obj: Any, name: str, kind: str) -> Any:
    if kind == "usage":
        return getattr(obj.usage, name)
    value = getattr(obj, name)
    if kind == "json":  # matched_stop: "null" when stop was set and the server named nothing, null when not set
        absent = msgspec.UNSET if name == "matched_stop" else None
        return None if value is absent or (name == "metadata" and not value) else _json.encode(value).decode()
    if kind == "messages" and value is not None:
        return [{"role": m.get("role"), "content": _text(m.get("content"))} for m in value]
    if kind == "choices" and value is not None:
        return [_cells(c, _CHOICE_COLUMNS) for c in value]
    return value


def _text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else _json.encode(value).decode()  # multimodal parts


def parquet_schema() -> Any:
    import pyarrow as pa

    def arrow(kind: str) -> Any:
        if kind == "messages":
            return pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
        if kind == "choices":
            return pa.list_(pa.struct([(name, arrow(k)) for name, k in _CHOICE_COLUMNS.items()]))
        return getattr(pa, {"json": "string", "usage": "int64"}.get(kind, kind))()

    return pa.schema([(name, arrow(kind)) for name, kind in PARQUET_COLUMNS.items()])


def write_jsonl(lines: Iterable[bytes], out: BinaryIO) -> int:
    count = 0
    for line in lines:
        out.write(line)
        count += 1
    return count


def write_parquet(lines: Iterable[bytes], out: BinaryIO) -> int:
    """Row groups of PARQUET_ROWS_PER_GROUP rows, zstd-compressed, one schema (PARQUET_COLUMNS)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema, count, rows = parquet_schema(), 0, []
    with pq.ParquetWriter(out, schema, compression="zstd") as writer:
        for line in lines:
            r = _result_decoder.decode(line)
            rows.append(_cells(r, PARQUET_COLUMNS))
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
    usage: dict[str, Any] = {"prompt_tokens": r.usage.prompt_tokens, "completion_tokens": r.usage.completion_tokens,
                             "total_tokens": r.usage.prompt_tokens + r.usage.completion_tokens}
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
            continue
        message: dict[str, Any] = {"role": "assistant", "content": c.completion, "reasoning_content": c.reasoning_content}
        if c.tool_calls:
            message["tool_calls"] = c.tool_calls
        choices.append({"index": c.index, "message": message, "logprobs": c.logprobs, "finish_reason": c.finish_reason})
    body = {
        "id": r.response_id or (f"cmpl-{h}" if completions else f"chatcmpl-{h}"),
        "object": "text_completion" if completions else "chat.completion",
        "created": int(r.finished_at),
        "model": r.model,
        "choices": choices,
        "usage": usage,
    }
    return {"id": f"batch_req_{h}", "custom_id": r.custom_id or r.id,
            "response": {"status_code": 200, "request_id": r.response_id or f"req_{h}", "body": body}, "error": None}


def openai_error_line(letter: DeadLetter) -> dict[str, Any]:
    """One line of an OpenAI Batch error file for a dead letter."""
    h = _hash(letter.job, letter.id)
    custom_id = (letter.prompt.custom_id if letter.prompt else None) or letter.id
    status = letter.status
    if status is None and letter.kind == "server_error":
        status = 500  # an error event inside a 200 stream: the server failed the request
    if status is None:  # no HTTP answer to report: OpenAI's "non-HTTP error" shape
        return {"id": f"batch_req_{h}", "custom_id": custom_id, "response": None,
                "error": {"code": letter.kind, "message": letter.message}}
    error = {"message": letter.message, "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
             "param": None, "code": letter.kind}
    return {"id": f"batch_req_{h}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"req_{h}", "body": {"error": error}}, "error": None}


def write_openai_batch(lines: Iterable[bytes], out: BinaryIO) -> int:
    return write_jsonl((_json.encode(openai_output_line(_result_decoder.decode(line))) + b"\n" for line in lines), out)


class Format(NamedTuple):
    """An export format: its writer, the file name `genq export --to DIR/` gives it, the suffixes that
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


def format_for(dest: str, asked: str | None) -> str:
    """--format if given, else the one the destination's suffix chooses, else jsonl."""
    return asked or next((name for name, f in FORMATS.items() if dest.endswith(f.chosen_by)), "jsonl")
