"""Request parameters a job or a row may set, checked at enqueue.

A bad value would otherwise reach the server with every prompt and send each one
to the dead-letter queue (400 bad_request) hours into a run; checked here, it is
one clear error naming the option or the line before anything is queued.

Known fields: the OpenAI chat/completions request fields, the extras SGLang
accepts (/work/shared/notes/sglang-api.md) and the common vLLM extras. The
fields genq sets itself (model, messages, prompt, stream, stream_options) may not
be overridden. Fields whose answer genq could not record are refused (REFUSED);
docs/fidelity.md says where every accepted field's answer lands in the record.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from typing import Any

# Fields genq writes into every request itself; an override would break it.
SET_BY_GENQ = {
    "model": "the job's --model",
    "messages": "the row",
    "prompt": "the row",
    "stream": "the worker (genq worker --stream/--no-stream)",
    "stream_options": "the worker (genq worker --stream/--no-stream)",
}


def _number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"must be a number, got {_kind(value)}"
        if low is not None and (value <= low if low_open else value < low):
            return f"must be {'>' if low_open else '>='} {low:g}" + (f" and <= {high:g}" if high is not None else "") + f", got {value!r}"
        if high is not None and value > high:
            return f"must be <= {high:g}, got {value!r}"
        return None

    return check


def _integer(low: int | None = None, high: int | None = None) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int):
            return f"must be an integer, got {_kind(value)}"
        if low is not None and value < low:
            return f"must be >= {low}, got {value!r}"
        if high is not None and value > high:
            return f"must be <= {high}, got {value!r}"
        return None

    return check


def _of(*types: type, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) and bool not in types:
            return f"must be {what}, got {_kind(value)}"
        return None if isinstance(value, types) else f"must be {what}, got {_kind(value)}"

    return check


def _list_of(item: type, what: str) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, item) for v in value):
            return f"must be {what}, got {_kind(value)}"
        return None

    return check


def _stop(value: Any) -> str | None:
    if isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        return None
    return f"must be a string or a list of strings, got {_kind(value)}"


def _anything(value: Any) -> str | None:
    return None


_BOOL = _of(bool, what="true or false")
_STR = _of(str, what="a string")
_OBJ = _of(dict, what="an object")
_LIST = _of(list, what="a list")
_STR_OR_OBJ = _of(str, dict, what="a string or an object")

# field -> check(value) returning None or what is wrong with it
KNOWN: dict[str, Callable[[Any], str | None]] = {
    # OpenAI chat completions and completions
    "max_tokens": _integer(1),
    "max_completion_tokens": _integer(1),
    "temperature": _number(0),
    "top_p": _number(0, 1, low_open=True),
    "n": _integer(1),
    "stop": _stop,
    "seed": _integer(),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "logit_bias": _OBJ,
    "logprobs": _of(bool, int, what="true/false (chat) or an integer (completions)"),
    "top_logprobs": _integer(0, 20),
    "echo": _BOOL,
    "suffix": _STR,
    "user": _STR,
    "response_format": _OBJ,
    "tools": _list_of(dict, "a list of tool objects"),
    "tool_choice": _STR_OR_OBJ,
    "parallel_tool_calls": _BOOL,
    "reasoning_effort": _STR,
    "metadata": _OBJ,
    "store": _BOOL,
    "service_tier": _STR,
    "prediction": _OBJ,
    "verbosity": _STR,
    "prompt_cache_key": _STR,
    "safety_identifier": _STR,
    # SGLang extras (and vLLM's, where they share a name)
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, low_open=True),
    "min_tokens": _integer(0),
    "stop_token_ids": _list_of(int, "a list of integers"),
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "regex": _STR,
    "ebnf": _STR,
    "json_schema": _STR,
    "separate_reasoning": _BOOL,
    "stream_reasoning": _BOOL,
    "chat_template_kwargs": _OBJ,
    "continue_final_message": _BOOL,
    "rid": _STR,
    "priority": _integer(),
    "lora_path": _STR,
    # vLLM extras
    "add_generation_prompt": _BOOL,
    "chat_template": _STR,
    "include_stop_str_in_output": _BOOL,
    "length_penalty": _number(),
    "truncate_prompt_tokens": _integer(1),
    "guided_json": _anything,
    "guided_regex": _STR,
    "guided_choice": _list_of(str, "a list of strings"),
    "guided_grammar": _STR,
    "structured_outputs": _OBJ,
}


# Fields the server would answer with something genq does not record (or would not honor):
# refused, because a record that silently lacks what its request asked for is worse than none.
_FUNCTIONS = "OpenAI's deprecated function calling (answered in message.function_call); use tools"
REFUSED = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "modalities": "genq records text only; audio output would be dropped",
    "audio": "genq records text only; audio output would be dropped",
    "web_search_options": "genq does not record web search annotations; no self-hosted engine serves it",
    "best_of": "SGLang ignores it and vLLM's V1 engine refuses it; ask for n samples instead",
}

# Fields of one endpoint only: the other's engines ignore them, so the record would not show them.
CHAT_ONLY = {"top_logprobs": "use 'logprobs': K with --endpoint completions",
             "tools": "completions have no tool calls", "tool_choice": "completions have no tool calls",
             "parallel_tool_calls": "completions have no tool calls"}
COMPLETIONS_ONLY = {"echo": "chat has no echo", "suffix": "chat has no suffix"}


class ParamError(ValueError):
    pass


def check_for_endpoint(params: dict[str, Any], endpoint: str, where: str) -> None:
    """The rules that depend on the endpoint: logprobs is true/false for chat and a count for
    completions; top_logprobs needs logprobs true (chat); one endpoint's fields on the other."""
    logprobs = params.get("logprobs")
    if endpoint == "chat":
        for name, hint in COMPLETIONS_ONLY.items():
            if name in params:
                raise ParamError(f"{where}: {name!r} is a /v1/completions field; {hint} (the job uses --endpoint chat)")
        if logprobs is not None and not isinstance(logprobs, bool):
            raise ParamError(f"{where}: logprobs must be true or false for chat (use top_logprobs: K for "
                             f"alternatives), got {_kind(logprobs)}")
        if params.get("top_logprobs") is not None and logprobs is not True:
            raise ParamError(f"{where}: top_logprobs needs logprobs: true")
    else:
        for name, hint in CHAT_ONLY.items():
            if name in params:
                raise ParamError(f"{where}: {name!r} is a chat field; {hint}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= 20):
            raise ParamError(f"{where}: logprobs must be an integer 0..20 for completions (the alternatives "
                             f"per token), got {_kind(logprobs)}")


# Switches of chat templates (Qwen3's enable_thinking, DeepSeek-V3.1's thinking), which users
# put at the top of the request: the servers take them inside chat_template_kwargs.
CHAT_TEMPLATE_ARGS = ("enable_thinking", "thinking")


def check_params(params: Any, where: str, endpoint: str | None = None) -> None:
    """Raise ParamError naming `where` (an option or a row field) and the first bad field;
    with the endpoint known, its rules too (check_for_endpoint)."""
    if not isinstance(params, dict):
        raise ParamError(f"{where} must be an object of request parameters, got {_kind(params)}")
    for name, value in params.items():
        if name in SET_BY_GENQ:
            raise ParamError(f"{where}: {name!r} cannot be set here; it is set by {SET_BY_GENQ[name]}")
        if name in REFUSED:
            raise ParamError(f"{where}: {name!r} is refused: {REFUSED[name]}")
        check = KNOWN.get(name)
        if check is None and name in CHAT_TEMPLATE_ARGS:
            raise ParamError(f"{where}: {name!r} is not a request field but an argument of the model's chat template "
                             f"(SGLang and vLLM pass it on from chat_template_kwargs): give "
                             f"{{\"chat_template_kwargs\": {{{json.dumps(name)}: {json.dumps(value)}}}}}")
        if check is None:
            close = difflib.get_close_matches(name, KNOWN, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ParamError(f"{where}: unknown request field {name!r}{hint}; known fields: {', '.join(sorted(KNOWN))}")
        problem = check(value)
        if problem:
            raise ParamError(f"{where}: {name} {problem}")
    if endpoint is not None:
        check_for_endpoint(params, endpoint, where)


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, (int, float)):
        return f"{value!r} (a number)"
    if isinstance(value, str):
        return f"{value[:40]!r} (a string)"
    kinds: dict[type, str] = {dict: "an object", list: "a list"}
    return kinds.get(type(value), type(value).__name__)
