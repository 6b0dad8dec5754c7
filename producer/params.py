"""The request fields a job (--extra-body) or a row (sampling, an OpenAI Batch body) may set, checked
once at enqueue with the endpoint known: a bad value is one error naming the option or line, not a
dead letter for every prompt hours into a run. Fields genq sets cannot be overridden; fields whose
answer genq would not record are refused (docs/fidelity.md: where each accepted one lands)."""

from __future__ import annotations

import difflib
import json
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], "str | None"]  # what is wrong with a value, or None

SET_BY_GENQ = {
    "model": "the job's --model",
    "messages": "the row",
    "prompt": "the row",
    "stream": "the worker (genq worker --stream/--no-stream)",
    "stream_options": "the worker (genq worker --stream/--no-stream)",
}

# A record that silently lacks what its request asked for is worse than none.
_FUNCTIONS = "OpenAI's deprecated function calling (answered in message.function_call); use tools"
_AUDIO = "genq records text only; audio output would be dropped"
REFUSED = {
    "functions": _FUNCTIONS,
    "function_call": _FUNCTIONS,
    "modalities": _AUDIO,
    "audio": _AUDIO,
    "web_search_options": "genq does not record web search annotations; no self-hosted engine serves it",
    "best_of": "SGLang ignores it and vLLM's V1 engine refuses it; ask for n samples instead",
}

# One endpoint's fields: the other's engines ignore them, so the record would not show them.
CHAT_ONLY = {"top_logprobs": "use 'logprobs': K with --endpoint completions",
             "tools": "completions have no tool calls", "tool_choice": "completions have no tool calls",
             "parallel_tool_calls": "completions have no tool calls"}
COMPLETIONS_ONLY = {"echo": "chat has no echo", "suffix": "chat has no suffix"}

# Chat templates' switches (Qwen3's enable_thinking, DeepSeek-V3.1's thinking): users put them at the
# top of the request, the servers take them inside chat_template_kwargs.
CHAT_TEMPLATE_ARGS = ("enable_thinking", "thinking")


class ParamError(ValueError):
    pass


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


def _number(low: float | None = None, high: float | None = None, *, low_open: bool = False,
            integer: bool = False) -> Check:
    def check(value: Any) -> str | None:
        if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
            return f"must be {'an integer' if integer else 'a number'}, got {_kind(value)}"
        if low is not None and (value <= low if low_open else value < low):
            upper = f" and <= {high:g}" if high is not None and not integer else ""
            return f"must be {'>' if low_open else '>='} {low:g}{upper}, got {value!r}"
        if high is not None and value > high:
            return f"must be <= {high:g}, got {value!r}"
        return None

    return check


def _integer(low: int | None = None, high: int | None = None) -> Check:
    return _number(low, high, integer=True)


def _of(*types: type, what: str, items: bool = False) -> Check:
    """A value of one of `types` (booleans only where bool is named); items: a list of them."""
    def fits(v: Any) -> bool:
        return isinstance(v, types) and (bool in types or not isinstance(v, bool))

    def check(value: Any) -> str | None:
        ok = isinstance(value, list) and all(map(fits, value)) if items else fits(value)
        return None if ok else f"must be {what}, got {_kind(value)}"

    return check


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
    "max_tokens": _integer(1),
    "max_completion_tokens": _integer(1),
    "temperature": _number(0),
    "top_p": _number(0, 1, low_open=True),
    "n": _integer(1),
    "stop": lambda v: None if isinstance(v, str) else _of(str, what="a string or a list of strings", items=True)(v),
    "seed": _integer(),
    "frequency_penalty": _number(-2, 2),
    "presence_penalty": _number(-2, 2),
    "logprobs": _of(bool, int, what="true/false (chat) or an integer (completions)"),
    "top_logprobs": _integer(0, 20),
    "tools": _of(dict, what="a list of tool objects", items=True),
    "tool_choice": _of(str, dict, what="a string or an object"),
    "top_k": _integer(-1),
    "min_p": _number(0, 1),
    "repetition_penalty": _number(0, low_open=True),
    "min_tokens": _integer(0),
    "stop_token_ids": _of(int, what="a list of integers", items=True),
    "priority": _integer(),
    "length_penalty": _number(),
    "truncate_prompt_tokens": _integer(1),
    "guided_json": lambda v: None,
    "guided_choice": _of(str, what="a list of strings", items=True),
}


def check_params(params: Any, where: str, endpoint: str | None = None) -> None:
    """Raise ParamError naming `where` (an option or a row's field) and the first bad field; with the
    endpoint known, its rules too."""
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
        _check_for_endpoint(params, endpoint, where)


def _check_for_endpoint(params: dict[str, Any], endpoint: str, where: str) -> None:
    """logprobs: true/false for chat, a count for completions; one endpoint's fields refused on the other."""
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
        return
    for name, hint in CHAT_ONLY.items():
        if name in params:
            raise ParamError(f"{where}: {name!r} is a chat field; {hint}")
    if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or not 0 <= logprobs <= 20):
        raise ParamError(f"{where}: logprobs must be an integer 0..20 for completions (the alternatives "
                         f"per token), got {_kind(logprobs)}")
