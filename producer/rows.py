"""Turn one input row into a Prompt, or say exactly why it cannot be one.

Accepted rows (one JSON object a line):
  {"id": ..., "messages": [...], "sampling": {...}, ...metadata}
  {"id": ..., "prompt": "...", ...}
  OpenAI Batch: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}

`sampling` and an OpenAI Batch body are checked field by field (genq.producer.params).
fit_endpoint then makes a row what the job's endpoint takes (a prompt becomes one user
message for chat; messages are refused for completions) before it is stored.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import msgspec

from genq.core.records import Endpoint, Prompt, Rejected
from genq.producer.params import ParamError, check_for_endpoint, check_params

MAX_LINE_BYTES = 4 * 1024 * 1024
REJECT_TEXT_LIMIT = 2000
OPENAI_BATCH_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
# Body fields genq sets itself: the job decides the model and streaming.
_BODY_FIELDS_IGNORED = {"model", "stream", "stream_options", "messages", "prompt"}
_REQUEST_FIELDS = {"id", "messages", "prompt", "sampling"}

_decoder = msgspec.json.Decoder()
_canonical = msgspec.json.Encoder(order="sorted")
_fallback = msgspec.json.Encoder(enc_hook=str)  # Parquet values JSON has no type for (dates, bytes)


class RowError(ValueError):
    pass


class Row(NamedTuple):
    """A valid row and where it came from, kept in case the row is rejected later (a duplicate id).

    source is the raw JSONL line or the Parquet row; it becomes text only for a reject.
    """

    prompt: Prompt
    source: bytes | dict[str, Any]
    start: int = -1  # a JSONL line's byte range in the (uncompressed) input, for by-reference batches
    end: int = -1

    def text(self) -> str:
        """The whole line, for the rejects file."""
        if isinstance(self.source, bytes):
            return self.source.decode("utf-8", errors="replace")
        return _fallback.encode(self.source).decode()


def content_digest(prompt: Prompt) -> str:
    """Stable digest of what is sent to the server (not of the metadata): 16 hex characters."""
    return claim_digest(prompt).hex()


def claim_digest(prompt: Prompt) -> bytes:
    """content_digest as the 8 raw bytes enqueue stores in keys.job_ids."""
    return hashlib.sha256(_canonical.encode([prompt.messages, prompt.prompt, prompt.sampling])).digest()[:8]


def parse_line(line_no: int, raw: bytes, start: int = -1) -> Row | Rejected | None:
    """None for a blank line. line_no is 1-based, as editors show it; start is the line's
    byte offset in the input (kept in the Row, with its end, for by-reference batches)."""
    if len(raw) > MAX_LINE_BYTES:
        return _reject(line_no, f"line is {len(raw):,} bytes, over the {MAX_LINE_BYTES:,}-byte limit", raw)
    stripped = raw.strip()
    if not stripped:
        return None
    try:
        obj = _decoder.decode(stripped)
    except msgspec.DecodeError as exc:
        return _reject(line_no, f"invalid JSON: {exc}", raw)
    try:
        return Row(row_to_prompt(line_no, obj), stripped, start, start + len(raw) if start >= 0 else -1)
    except RowError as exc:
        return _reject(line_no, str(exc), raw)


def row_to_prompt(line_no: int, obj: Any) -> Prompt:
    """Validate a decoded row (a JSONL line or a Parquet row). Raises RowError."""
    if not isinstance(obj, dict):
        raise RowError(f"expected a JSON object, got {type(obj).__name__}")
    if "custom_id" in obj and "body" in obj:
        return _openai_batch_row(line_no, obj)
    messages = obj.get("messages")
    prompt = obj.get("prompt")
    if messages is not None and prompt is not None:
        raise RowError("has both 'messages' and 'prompt'; give one")
    if messages is None and prompt is None:
        raise RowError("missing 'messages' (a list of {role, content}) or 'prompt' (a string)")
    if messages is not None:
        _check_messages(messages)
    elif not isinstance(prompt, str) or not prompt:
        raise RowError("'prompt' must be a non-empty string")
    sampling = obj.get("sampling")
    if sampling is not None:
        _check_sampling(sampling, "'sampling'")
    metadata = {k: v for k, v in obj.items() if k not in _REQUEST_FIELDS}
    result = Prompt(
        id="",
        index=line_no - 1,
        messages=messages,
        prompt=prompt,
        sampling=sampling or None,
        metadata=metadata,
    )
    result.id = _row_id(obj.get("id"), result)
    return result


def _openai_batch_row(line_no: int, obj: dict[str, Any]) -> Prompt:
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
    value = body.get(field)
    if field == "messages":
        if value is None:
            raise RowError("OpenAI Batch body has no 'messages'")
        _check_messages(value)
    elif not isinstance(value, str) or not value:
        raise RowError("OpenAI Batch body for /v1/completions needs a non-empty string 'prompt'")
    sampling = {k: v for k, v in body.items() if k not in _BODY_FIELDS_IGNORED} or None
    if sampling:
        _check_sampling(sampling, "OpenAI Batch 'body'")
    return Prompt(
        id=custom_id,
        index=line_no - 1,
        messages=value if field == "messages" and isinstance(value, list) else None,
        prompt=value if field == "prompt" else None,
        sampling=sampling,
        custom_id=custom_id,
    )


def _check_sampling(sampling: Any, where: str) -> None:
    try:
        check_params(sampling, where)
    except ParamError as exc:
        raise RowError(str(exc)) from None


def fit_endpoint(prompt: Prompt, endpoint: Endpoint) -> bool:
    """Make the row what the job's endpoint takes; True when it was converted. Raises RowError.

    /v1/chat/completions takes only messages: a plain prompt becomes one user
    message (the stored Prompt is what is sent, so this happens at enqueue).
    /v1/completions takes only a prompt string: messages cannot be flattened
    without the model's chat template, so such a row is refused. The row's request
    fields must suit the endpoint (params.check_for_endpoint).
    """
    if prompt.sampling:
        where = "OpenAI Batch 'body'" if prompt.custom_id is not None else "'sampling'"
        try:
            check_for_endpoint(prompt.sampling, endpoint, where)
        except ParamError as exc:
            raise RowError(str(exc)) from None
    if endpoint == "chat" and prompt.messages is None:
        prompt.messages = [{"role": "user", "content": prompt.prompt}]
        prompt.prompt = None
        return True
    if endpoint == "completions" and prompt.messages is not None:
        what = "OpenAI Batch url /v1/chat/completions" if prompt.custom_id is not None else "'messages'"
        raise RowError(f"has {what} but the job uses --endpoint completions, which takes a 'prompt' string; "
                       "queue chat rows in a job with --endpoint chat")
    return False


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise RowError("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RowError(f"messages[{i}] must be an object with 'role' and 'content'")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise RowError(f"messages[{i}] has no 'role'")
        content = message.get("content")
        if content is None and not message.get("tool_calls"):
            raise RowError(f"messages[{i}] has no 'content'")
        if content is not None and not isinstance(content, (str, list)):
            raise RowError(f"messages[{i}].content must be a string or a list of parts")


def _row_id(raw_id: Any, prompt: Prompt) -> str:
    if raw_id is None:
        return content_digest(prompt)
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int)):
        raise RowError(f"'id' must be a string or an integer, got {type(raw_id).__name__}")
    text = str(raw_id)
    if not text:
        raise RowError("'id' is empty")
    return text


def _cut(raw: bytes) -> str:
    text = raw[:REJECT_TEXT_LIMIT].decode("utf-8", errors="replace").rstrip("\n")
    if len(raw) > REJECT_TEXT_LIMIT:
        text += f"... [{len(raw) - REJECT_TEXT_LIMIT:,} more bytes]"
    return text


def _reject(line_no: int, reason: str, raw: bytes) -> Rejected:
    return Rejected(line=line_no, reason=reason, text=_cut(raw))


def rejected(line_no: int, reason: str, raw: bytes) -> Rejected:
    return _reject(line_no, reason, raw)
