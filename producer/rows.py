"""One input row becomes the Prompt its job's endpoint takes, or a reject naming its line and why;
and the request fields a job (--extra-body) or a row may set, checked at enqueue with the endpoint
known (docs/fidelity.md: where each accepted one lands). Every reader goes through here."""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec

from genq.core.records import Endpoint, Prompt, Rejected, pack

MAX_LINE_BYTES = 4 * 1024 * 1024
REJECT_TEXT_LIMIT = 2000
OPENAI_BATCH_URLS = {"/v1/chat/completions": "messages", "/v1/completions": "prompt"}
_REQUEST_FIELDS = {"id", "messages", "prompt", "sampling"}
_BATCH_LINE_FIELDS = {"custom_id", "method", "url", "body"}

json_decoder = msgspec.json.Decoder()
_canonical = msgspec.json.Encoder(order="sorted")
lenient_encoder = msgspec.json.Encoder(enc_hook=str)  # Parquet values JSON has no type for (dates, bytes)

Check = Callable[[Any], "str | None"]  # what is wrong with a value, or None

_STREAM = "the worker (genq worker --stream/--no-stream)"
SET_BY_GENQ = {"model": "the job's --model", "messages": "the row", "prompt": "the row", "stream": _STREAM,
               "stream_options": _STREAM}
# A record that silently lacks what its request asked for is worse than none.
_FUNCTIONS = "OpenAI's deprecated function calling (answered in message.function_call); use tools"
_AUDIO = "genq records text only; audio output would be dropped"
REFUSED = {
    "functions": _FUNCTIONS, "function_call": _FUNCTIONS, "modalities": _AUDIO, "audio": _AUDIO,
    "web_search_options": "genq does not record web search annotations; no self-hosted engine serves it",
    "best_of": "SGLang ignores it and vLLM's V1 engine refuses it; ask for n samples instead",
}
# One endpoint's fields: the other's engines ignore them, so the record would not show them.
_NO_TOOLS, _NO_TEMPLATE = "completions have no tool calls", "completions have no chat template"
CHAT_ONLY = {"top_logprobs": "use 'logprobs': K with --endpoint completions", "tools": _NO_TOOLS,
             "tool_choice": _NO_TOOLS, "parallel_tool_calls": _NO_TOOLS,
             "max_completion_tokens": "use max_tokens with --endpoint completions (the server's default is 16)",
             **dict.fromkeys(["chat_template_kwargs", "chat_template", "add_generation_prompt",
                              "continue_final_message", "reasoning_effort"], _NO_TEMPLATE),
             **dict.fromkeys(["separate_reasoning", "stream_reasoning"], "completions have no reasoning_content")}
COMPLETIONS_ONLY = {"echo": "chat has no echo", "suffix": "chat has no suffix"}
# Chat templates' switches (Qwen3's enable_thinking, DeepSeek-V3.1's thinking): the servers take them
# inside chat_template_kwargs.
CHAT_TEMPLATE_ARGS = ("enable_thinking", "thinking")


class RowError(ValueError):
    """A row, or a set of request fields, that cannot be queued."""


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return f"{value[:40]!r} (a string)"
    kinds: dict[type, str] = {type(None): "null", dict: "an object", list: "a list"}
    return kinds.get(type(value), type(value).__name__)


def _number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
            integer: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            return f"must be {'an integer' if integer else 'a number'}, got {_kind(value)}"
        if not math.isfinite(value):  # JSON has no nan or inf: they would be sent as null
            return f"must be a finite number, got {value!r}"
        if low is not None and (value <= low if low_open else value < low):
            upper = f" and <= {high:g}" if high is not None and not integer else ""
            return f"must be {'>' if low_open else '>='} {low:g}{upper}, got {value!r}"
        return f"must be <= {high:g}, got {value!r}" if high is not None and value > high else None

    return check


def _of(*types: type, what: str, items: bool = False) -> Check:
    """A value of one of `types` (booleans only where bool is named); items: a list of them."""
    def fits(v: Any) -> bool:
        return isinstance(v, types) and (bool in types or not isinstance(v, bool))

    def check(value: Any) -> str | None:
        ok = isinstance(value, list) and all(map(fits, value)) if items else fits(value)
        return None if ok else f"must be {what}, got {_kind(value)}"

    return check


_INT_FROM_1, _INT = _number(1, integer=True), _number(integer=True)
KNOWN: dict[str, Check] = {
    **dict.fromkeys(["echo", "parallel_tool_calls", "store", "ignore_eos", "skip_special_tokens",
                     "spaces_between_special_tokens", "no_stop_trim", "separate_reasoning", "stream_reasoning",
                     "continue_final_message", "add_generation_prompt", "include_stop_str_in_output"],
                    _of(bool, what="true or false")),
    **dict.fromkeys(["suffix", "user", "reasoning_effort", "service_tier", "verbosity", "prompt_cache_key",
                     "safety_identifier", "regex", "ebnf", "json_schema", "rid", "lora_path", "chat_template",
                     "guided_regex", "guided_grammar"], _of(str, what="a string")),
    **dict.fromkeys(["logit_bias", "response_format", "metadata", "prediction", "chat_template_kwargs",
                     "structured_outputs"], _of(dict, what="an object")),
    "max_tokens": _INT_FROM_1, "max_completion_tokens": _INT_FROM_1, "n": _INT_FROM_1,
    "truncate_prompt_tokens": _INT_FROM_1, "seed": _INT, "priority": _INT,
    "temperature": _number(0), "top_p": _number(0, 1, low_open=True), "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2), "min_p": _number(0, 1), "repetition_penalty": _number(0, low_open=True),
    "length_penalty": _number(), "top_logprobs": _number(0, 20, integer=True), "top_k": _number(-1, integer=True),
    "min_tokens": _number(0, integer=True),
    "stop": lambda v: None if isinstance(v, str) else _of(str, what="a string or a list of strings", items=True)(v),
    "logprobs": _of(bool, int, what="true/false (chat) or an integer (completions)"),
    "tools": _of(dict, what="a list of tool objects", items=True),
    "tool_choice": _of(str, dict, what="a string or an object"),
    "stop_token_ids": _of(int, what="a list of integers", items=True),
    "guided_json": lambda v: None,
    "guided_choice": _of(str, what="a list of strings", items=True),
}


# Request fields a row may carry at its top level by mistake: kept as metadata there, never sent (a note says so).
UNSENT_AT_TOP = KNOWN.keys() - {"metadata", "user", "priority", "rid", "store"}


def check_params(params: Any, where: str, endpoint: str | None = None, job: dict[str, Any] | None = None) -> None:
    """Raise RowError naming `where` (an option or a row's field) and the first bad field; with the
    endpoint known, its rules too, for the request as sent: the `job`'s extra_body under these params."""
    if not isinstance(params, dict):
        raise RowError(f"{where} must be an object of request parameters, got {_kind(params)}")
    for name, value in params.items():
        if name in SET_BY_GENQ:
            raise RowError(f"{where}: {name!r} cannot be set here; it is set by {SET_BY_GENQ[name]}")
        if name in REFUSED:
            raise RowError(f"{where}: {name!r} is refused: {REFUSED[name]}")
        if name in CHAT_TEMPLATE_ARGS:
            raise RowError(f"{where}: {name!r} is not a request field but an argument of the model's chat template "
                             f"(SGLang and vLLM pass it on from chat_template_kwargs): give "
                             f"{{\"chat_template_kwargs\": {{{json.dumps(name)}: {json.dumps(value)}}}}}")
        if name not in KNOWN:
            close = difflib.get_close_matches(name, KNOWN, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise RowError(f"{where}: unknown request field {name!r}{hint}; known fields: {', '.join(sorted(KNOWN))}")
        if problem := KNOWN[name](value):
            raise RowError(f"{where}: {name} {problem}")
    sent = {**(job or {}), **params}
    logprobs, other = sent.get("logprobs"), COMPLETIONS_ONLY if endpoint == "chat" else CHAT_ONLY
    for name in other if endpoint else ():
        if name in params:
            raise RowError(f"{where}: {name!r} is a /v1/completions field; {other[name]} (the job uses --endpoint "
                             "chat)" if endpoint == "chat" else f"{where}: {name!r} is a chat field; {other[name]}")
    if endpoint == "chat" and logprobs is not None and not isinstance(logprobs, bool):
        raise RowError(f"{where}: logprobs must be true or false for chat (use top_logprobs: K for "
                         f"alternatives), got {_kind(logprobs)}")
    if endpoint == "chat" and sent.get("top_logprobs") is not None and logprobs is not True:
        raise RowError(f"{where}: top_logprobs needs logprobs: true")
    if endpoint == "completions" and logprobs is not None and (
            isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20):
        raise RowError(f"{where}: logprobs must be an integer 0..20 for completions (the alternatives "
                         f"per token), got {_kind(logprobs)}")


class Row(NamedTuple):
    """A valid row and its source (the JSONL line or Parquet row), kept for a later reject (a duplicate id)."""

    prompt: Prompt
    source: bytes | dict[str, Any]
    digest: bytes  # claim_digest of the prompt as it is sent
    converted: bool = False  # a 'prompt' row sent as one user message
    start: int = -1  # a JSONL line's byte range in the uncompressed input (by-reference batches); -1: none
    end: int = -1
    model: str | None = None  # an OpenAI Batch body's: the job's (--model), checked by the Enqueuer

    def text(self) -> str:
        source = self.source if isinstance(self.source, bytes) else lenient_encoder.encode(self.source)
        return source.decode("utf-8", errors="replace")


def claim_digest(prompt: Prompt) -> bytes:
    """8 bytes of what is sent to the server (not the metadata): the content enqueue stores per id."""
    return hashlib.sha256(_canonical.encode([prompt.messages, prompt.prompt, prompt.sampling])).digest()[:8]


def parse_line(line_no: int, raw: bytes, endpoint: Endpoint, start: int = -1,
               job: dict[str, Any] | None = None) -> Row | Rejected | None:
    """None for a blank line. line_no is 1-based, as editors show it; start: the line's byte offset."""
    if len(raw) > MAX_LINE_BYTES:
        return rejected(line_no, f"line is {len(raw):,} bytes, over the {MAX_LINE_BYTES:,}-byte limit", raw)
    # A byte order mark (Windows editors; files joined with cat) starts no JSON: it is not the row's.
    if not (stripped := raw.strip().removeprefix(b"\xef\xbb\xbf")):
        return None
    try:
        prompt, converted, model = to_prompt(line_no, json_decoder.decode(stripped), endpoint, job)
        pack(prompt)  # Redis holds it as msgpack, whose integers are 64-bit
    except msgspec.DecodeError as exc:
        return rejected(line_no, f"invalid JSON: {exc}", raw)
    except RowError as exc:
        return rejected(line_no, str(exc), raw)
    except OverflowError:
        return rejected(line_no, "has an integer outside -2**63..2**64-1, which genq cannot queue; give it as a "
                        "string", raw)
    return Row(prompt, stripped, claim_digest(prompt), converted, start, start + len(raw) if start >= 0 else -1,
               model)


def to_prompt(line_no: int, obj: Any, endpoint: Endpoint,
              job: dict[str, Any] | None = None) -> tuple[Prompt, bool, str | None]:
    """A decoded row as the endpoint's Prompt, whether it was converted (a prompt sent as one user message),
    and the model an OpenAI Batch body names; `job`: the job's extra_body, sent with the row's sampling."""
    if not isinstance(obj, dict):
        raise RowError(f"expected a JSON object, got {type(obj).__name__}")
    batch_line = "custom_id" in obj and "body" in obj
    prompt = _plain_row(line_no, _openai_batch_row(obj) if batch_line else obj)
    if batch_line:  # its other fields are metadata, as a plain row's are; its request is its body alone
        if beside := sorted((_REQUEST_FIELDS - {"id"}) & obj.keys()):
            raise RowError(f"{beside[0]!r} beside an OpenAI Batch 'body' would not be sent: put it in the body")
        if not isinstance(model := obj["body"].get("model", ""), str):
            raise RowError(f"OpenAI Batch body's 'model' must be a string, got {_kind(model)}")
        prompt.custom_id = prompt.id
        prompt.metadata = {k: v for k, v in obj.items() if k not in _BATCH_LINE_FIELDS}
    if prompt.sampling is not None:
        check_params(prompt.sampling, "OpenAI Batch 'body'" if batch_line else "'sampling'", endpoint, job)
    if endpoint == "completions" and prompt.messages is not None:
        what = "OpenAI Batch url /v1/chat/completions" if batch_line else "'messages'"
        raise RowError(f"has {what} but the job uses --endpoint completions, which takes a 'prompt' string; "
                       "queue chat rows in a job with --endpoint chat")
    if converted := endpoint == "chat" and prompt.messages is None:
        prompt.messages, prompt.prompt = [{"role": "user", "content": prompt.prompt}], None
    return prompt, converted, (model or None) if batch_line else None


def _plain_row(line_no: int, obj: dict[str, Any]) -> Prompt:
    messages, text, raw_id = obj.get("messages"), obj.get("prompt"), obj.get("id")
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
    # The row's id, or 16 hex characters of its content (as given: the same line keeps its id).
    if isinstance(raw_id, bool) or not isinstance(raw_id, (str, int, type(None))):
        raise RowError(f"'id' must be a string or an integer, got {type(raw_id).__name__}")
    if raw_id == "":
        raise RowError("'id' is empty")
    prompt.id = claim_digest(prompt).hex() if raw_id is None else str(raw_id)
    return prompt


def _openai_batch_row(obj: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI Batch line as the plain row it stands for, checked as one from there on."""
    custom_id, method, body = obj["custom_id"], obj.get("method", "POST"), obj["body"]
    url = obj.get("url", "/v1/chat/completions")
    if not isinstance(custom_id, str) or not custom_id:
        raise RowError("'custom_id' must be a non-empty string")
    if method != "POST":
        raise RowError(f"OpenAI Batch 'method' must be POST, got {method!r}")
    if (field := OPENAI_BATCH_URLS.get(url)) is None:
        raise RowError(f"OpenAI Batch 'url' {url!r} is not supported (use {' or '.join(OPENAI_BATCH_URLS)})")
    if not isinstance(body, dict):
        raise RowError("OpenAI Batch 'body' must be an object")
    if body.get(field) is None:
        raise RowError(f"OpenAI Batch body for {url} has no {field!r}")
    return {"id": custom_id, "messages": body.get("messages"), "prompt": body.get("prompt"),  # both: refused
            "sampling": {k: v for k, v in body.items() if k not in SET_BY_GENQ}}


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


def rejected(line_no: int, reason: str, raw: bytes) -> Rejected:
    text = raw[:REJECT_TEXT_LIMIT].decode("utf-8", errors="replace").rstrip("\n")
    if len(raw) > REJECT_TEXT_LIMIT:
        text += f"... [{len(raw) - REJECT_TEXT_LIMIT:,} more bytes]"
    return Rejected(line=line_no, reason=reason, text=text)
