"""One input row becomes the Prompt its job's endpoint takes, or a reject saying why: the one check
every reader (JSONL, Parquet, a by-reference batch read back) goes through. Rows are
{"id", "messages" | "prompt", "sampling", ...metadata} or OpenAI Batch lines. Chat sends a prompt as
one user message (the stored Prompt is what is sent); completions refuses messages, which only the
model's chat template could flatten."""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import msgspec

from genq.core.records import Endpoint, Prompt, Rejected
from genq.producer.params import ParamError, check_params

MAX_LINE_BYTES = 4 * 1024 * 1024
REJECT_TEXT_LIMIT = 2000
OPENAI_BATCH_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
_BODY_FIELDS_IGNORED = {"model", "stream", "stream_options", "messages", "prompt"}  # the job decides them
_REQUEST_FIELDS = {"id", "messages", "prompt", "sampling"}

json_decoder = msgspec.json.Decoder()
_canonical = msgspec.json.Encoder(order="sorted")
lenient_encoder = msgspec.json.Encoder(enc_hook=str)  # Parquet values JSON has no type for (dates, bytes)


class RowError(ValueError):
    pass


class Row(NamedTuple):
    """A valid row and its source (the JSONL line or Parquet row), kept for a later reject (a duplicate id)."""

    prompt: Prompt
    source: bytes | dict[str, Any]
    digest: bytes  # claim_digest of the prompt as it is sent
    converted: bool = False  # a 'prompt' row sent as one user message
    start: int = -1  # a JSONL line's byte range in the uncompressed input (by-reference batches); -1: none
    end: int = -1

    def text(self) -> str:
        """The whole line, for the rejects file."""
        if isinstance(self.source, bytes):
            return self.source.decode("utf-8", errors="replace")
        return lenient_encoder.encode(self.source).decode()


def claim_digest(prompt: Prompt) -> bytes:
    """8 bytes of what is sent to the server (not the metadata): the content enqueue stores per id."""
    return hashlib.sha256(_canonical.encode([prompt.messages, prompt.prompt, prompt.sampling])).digest()[:8]


def parse_line(line_no: int, raw: bytes, endpoint: Endpoint, start: int = -1) -> Row | Rejected | None:
    """None for a blank line. line_no is 1-based, as editors show it; start: the line's byte offset."""
    if len(raw) > MAX_LINE_BYTES:
        return rejected(line_no, f"line is {len(raw):,} bytes, over the {MAX_LINE_BYTES:,}-byte limit", raw)
    stripped = raw.strip()
    if not stripped:
        return None
    try:
        prompt, converted = to_prompt(line_no, json_decoder.decode(stripped), endpoint)
    except msgspec.DecodeError as exc:
        return rejected(line_no, f"invalid JSON: {exc}", raw)
    except RowError as exc:
        return rejected(line_no, str(exc), raw)
    return Row(prompt, stripped, claim_digest(prompt), converted, start, start + len(raw) if start >= 0 else -1)


def to_prompt(line_no: int, obj: Any, endpoint: Endpoint) -> tuple[Prompt, bool]:
    """A decoded row (a JSONL line or a Parquet row) as the endpoint's Prompt, and whether it was
    converted (a prompt sent as one user message). Raises RowError."""
    if not isinstance(obj, dict):
        raise RowError(f"expected a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj and "body" in obj:
        prompt, where = _plain_row(line_no, _openai_batch_row(obj)), "OpenAI Batch 'body'"
        prompt.custom_id = prompt.id
    else:
        prompt, where = _plain_row(line_no, obj), "'sampling'"
    if prompt.sampling is not None:
        try:
            check_params(prompt.sampling, where, endpoint)
        except ParamError as exc:
            raise RowError(str(exc)) from None
    if endpoint == "completions" and prompt.messages is not None:
        what = "OpenAI Batch url /v1/chat/completions" if prompt.custom_id is not None else "'messages'"
        raise RowError(f"has {what} but the job uses --endpoint completions, which takes a 'prompt' string; "
                       "queue chat rows in a job with --endpoint chat")
    if endpoint == "chat" and prompt.messages is None:
        prompt.messages, prompt.prompt = [{"role": "user", "content": prompt.prompt}], None
        return prompt, True
    return prompt, False


def _plain_row(line_no: int, obj: dict[str, Any]) -> Prompt:
    messages, text = obj.get("messages"), obj.get("prompt")
    if messages is not None and text is not None:
        raise RowError("has both 'messages' and 'prompt'; give one")
    if messages is None and text is None:
        raise RowError("missing 'messages' (a list of {role, content}) or 'prompt' (a string)")
    if messages is not None:
        _check_messages(messages)
    elif not isinstance(text, str) or not text:
        raise RowError("'prompt' must be a non-empty string")
    sampling = obj.get("sampling")
    prompt = Prompt(id="", index=line_no - 1, messages=messages, prompt=text,
                    sampling=sampling if sampling != {} else None,
                    metadata={k: v for k, v in obj.items() if k not in _REQUEST_FIELDS})
    prompt.id = _row_id(obj.get("id"), prompt)  # of the row as given: the same line keeps its id
    return prompt


def _openai_batch_row(obj: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Batch line as the plain row it stands for, checked as one from there on."""
    custom_id = obj["custom_id"]
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError("'custom_id' must be a non-empty string")
    method = obj.get("method", "POST")
    if method != "POST":
        raise RowError(f"OpenAI Batch 'method' must be POST, got {method!r}")
    url = obj.get("url", "/v1/chat/completions")
    field = OPENAI_BATCH_URLS.get(url)
    if field is None:
        raise RowError(f"OpenAI Batch 'url' {url!r} is not supported (use {' or '.join(OPENAI_BATCH_URLS)})")
    body = obj["body"]
    if not isinstance(body, dict):
        raise RowError("OpenAI Batch 'body' must be an object")
    if body.get(field) is None:
        raise RowError(f"OpenAI Batch body for {url} has no {field!r}")
    return {"id": custom_id, field: body[field],
            "sampling": {k: v for k, v in body.items() if k not in _BODY_FIELDS_IGNORED}}


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role:
            raise RowError(f"messages[{i}] has no 'role'")
        if content is None and not message.get("tool_calls"):
            raise RowError(f"messages[{i}] has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise RowError(f"messages[{i}].content must be a string or a list of parts")


def _row_id(raw_id: Any, prompt: Prompt) -> str:
    """The row's id, or 16 hex characters of its content when it has none."""
    if raw_id is None:
        return claim_digest(prompt).hex()
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise RowError(f"'id' must be a string or an integer, got {type(raw_id).__name__}")
    if raw_id == "":
        raise RowError("'id' is empty")
    return str(raw_id)


def rejected(line_no: int, reason: str, raw: bytes) -> Rejected:
    """A reject, its text cut to REJECT_TEXT_LIMIT bytes."""
    text = raw[:REJECT_TEXT_LIMIT].decode("utf-8", errors="replace").rstrip("\n")
    if len(raw) > REJECT_TEXT_LIMIT:
        text += f"... [{len(raw) - REJECT_TEXT_LIMIT:,} more bytes]"
    return Rejected(line=line_no, reason=reason, text=text)
