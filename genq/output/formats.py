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


def _json_or_none(value: Any) -> str | None:
    return None if value is None else _json.encode(value).decode()


def _stop_json(value: Any) -> str | None:
    """matched_stop: "null" when stop was set and the server named nothing, null when not set."""
    return None if value is msgspec.UNSET else _json.encode(value).decode()


def _text(value: Any) -> str | None:
    return value if value is None or isinstance(value, str) else _json.encode(value).decode()  # multimodal parts


def _field(name: str) -> Callable[[Any], Any]:
    return lambda r: getattr(r, name)


def _usage(name: str) -> Callable[[Result], Any]:
    return lambda r: getattr(r.usage, name)


_CHOICE_COLUMNS: list[tuple[str, str, Callable[[Choice], Any]]] = [
    ("index", "int64", _field("index")),
    ("completion", "string", _field("completion")),
    ("reasoning_content", "string", _field("reasoning_content")),
    ("finish_reason", "string", _field("finish_reason")),
    ("completion_tokens", "int64", _field("completion_tokens")),
    ("logprobs", "string", lambda c: _json_or_none(c.logprobs)),
    ("matched_stop", "string", lambda c: _stop_json(c.matched_stop)),
    ("tool_calls", "string", lambda c: _json_or_none(c.tool_calls)),
]

# One fixed schema: a column's type ("messages" and "choices" are lists of structs) and its value.
# messages hold non-string content as its JSON; metadata, logprobs, matched_stop and tool_calls are
# JSON strings (their keys differ from row to row); choices: every sample when n > 1 (the columns
# above it are choice 0's). The JSONL export keeps every field as it is.
PARQUET_COLUMNS: list[tuple[str, str, Callable[[Result], Any]]] = [
    ("id", "string", _field("id")),
    ("custom_id", "string", _field("custom_id")),
    ("index", "int64", _field("index")),
    ("job", "string", _field("job")),
    ("batch", "string", _field("batch")),
    ("messages", "messages", lambda r: None if r.messages is None else [
        {"role": m.get("role"), "content": _text(m.get("content"))} for m in r.messages]),
    ("prompt", "string", _field("prompt")),
    ("completion", "string", _field("completion")),
    ("reasoning_content", "string", _field("reasoning_content")),
    ("finish_reason", "string", _field("finish_reason")),
    ("prompt_tokens", "int64", _usage("prompt_tokens")),
    ("completion_tokens", "int64", _usage("completion_tokens")),
    ("reasoning_tokens", "int64", _usage("reasoning_tokens")),
    ("model", "string", _field("model")),
    ("worker", "string", _field("worker")),
    ("attempts", "int32", _field("attempts")),
    ("latency_s", "float64", _field("latency_s")),
    ("response_id", "string", _field("response_id")),
    ("finished_at", "float64", _field("finished_at")),
    ("metadata", "string", lambda r: _json.encode(r.metadata).decode() if r.metadata else None),
    ("choices", "choices", lambda r: None if r.choices is None else [
        {name: value(c) for name, _, value in _CHOICE_COLUMNS} for c in r.choices]),
    ("logprobs", "string", lambda r: _json_or_none(r.logprobs)),
    ("matched_stop", "string", lambda r: _stop_json(r.matched_stop)),
    ("tool_calls", "string", lambda r: _json_or_none(r.tool_calls)),
]


def parquet_schema() -> Any:
    import pyarrow as pa

    def struct(columns: list[tuple[str, str, Any]]) -> Any:
        return pa.struct([(name, getattr(pa, kind)()) for name, kind, _ in columns])

    lists = {"messages": pa.list_(struct([("role", "string", None), ("content", "string", None)])),
             "choices": pa.list_(struct(_CHOICE_COLUMNS))}
    return pa.schema([(name, lists[kind] if kind in lists else getattr(pa, kind)()) for name, kind, _ in PARQUET_COLUMNS])


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
            rows.append({name: value(r) for name, _, value in PARQUET_COLUMNS})
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
