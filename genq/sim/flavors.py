"""What differs between the engines the simulator plays (SGLang, vLLM, llama.cpp): info endpoints,
metric names, error bodies and context checks, each copied from the engine's sources (docs/engines.md).
The answers' shapes they share are in protocol.py, their streaming in serve.py."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from genq.sim.config import SimConfig

if TYPE_CHECKING:
    from genq.sim.engine import Engine

FLAVORS = ("sglang", "vllm", "llamacpp")
VERSION = "0.0.0-genq-sim"
_JSON = "application/json"
_encode = msgspec.json.encode


def json_response(data: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=_encode(data), content_type=_JSON)


# ---- errors ------------------------------------------------------------------


def error_body(flavor: str, status: int, message: str, err_type: str | None = None, **extra: Any) -> dict[str, Any]:
    """The engine's error body: SGLang's is flat, vLLM and llama.cpp nest it under "error"."""
    if flavor == "sglang":
        return {"object": "error", "message": message, "type": err_type or "BadRequestError", "param": None,
                "code": status}
    if flavor == "vllm":
        return {"error": {"message": message, "type": err_type or "BadRequestError", "param": extra.get("param"),
                          "code": status}}
    # llama.cpp: format_error_response() in tools/server/server-common.cpp
    return {"error": {"code": status, "message": message, "type": err_type or _LLAMACPP_TYPES.get(status, "server_error"),
                      **extra}}


def error_response(flavor: str, status: int, message: str, err_type: str | None = None,
                   **extra: Any) -> web.Response:
    return json_response(error_body(flavor, status, message, err_type, **extra), status)


def sse(data: Any) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


def stream_error(flavor: str, message: str) -> bytes:
    """The SSE event an engine sends on its HTTP 200 stream when a request fails after output began
    (SGLang's create_streaming_error_response() makes any failure a 400; vLLM's GenerationError a 500)."""
    if flavor == "sglang":
        return sse({"error": error_body(flavor, 400, message)}) + b"data: [DONE]\n\n"
    if flavor == "vllm":
        return sse(error_body(flavor, 500, message, "InternalServerError")) + b"data: [DONE]\n\n"
    return sse(error_body(flavor, 500, message))


_LLAMACPP_TYPES = {400: "invalid_request_error", 404: "not_found_error", 500: "server_error", 503: "unavailable_error"}


def bad_request(flavor: str, message: str) -> web.Response:
    return error_response(flavor, 400, message)


def context_check(flavor: str, n_prompt: int, max_new: int | None, ctx: int,
                  ctx_given: bool = False) -> web.Response | int:
    """The engine's answer to a prompt against its context: a 400, or the most tokens
    the request may generate. ctx_given: SGLang was started with --context-length."""
    if flavor == "llamacpp":
        # Checked against the slot's context; max_tokens past its end is no error, the slot
        # stops there (finish_reason "length").
        if n_prompt >= ctx:
            return error_response(
                flavor, 400,
                f"request ({n_prompt} tokens) exceeds the available context size ({ctx} tokens), try increasing it",
                "exceed_context_size_error", n_prompt_tokens=n_prompt, n_ctx=ctx)
        return ctx - n_prompt if max_new is None else min(max_new, ctx - n_prompt)
    if flavor == "vllm":
        # vLLM 0.32's checks in its order. "at least ctx + 1": its chat tokenizer cuts there; the
        # "(parameter=..., value=...)" tail is VLLMValidationError's str().
        if max_new is not None and max_new > ctx:
            return error_response(flavor, 400, f"max_tokens={max_new} cannot be greater than max_model_len={ctx}. "
                                               f"Please request fewer output tokens. (parameter=max_tokens, "
                                               f"value={max_new})", param="max_tokens")
        if n_prompt > ctx:
            return error_response(
                flavor, 400, f"This model's maximum context length is {ctx} tokens. However, your prompt contains "
                             f"at least {ctx + 1} input tokens, which exceeds this limit even without any output "
                             f"tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
                             f"value={ctx + 1})", param="input_tokens")
        if n_prompt == ctx:
            return error_response(flavor, 400, "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
                                  param="max_tokens")
        return ctx - n_prompt if max_new is None else min(max_new, ctx - n_prompt)
    # SGLang 0.5.23: with --context-length, max_tokens over it is refused before the prompt is
    # tokenized (its message's missing space included).
    if ctx_given and max_new is not None and max_new > ctx:
        return bad_request(flavor, f"max_completion_tokens is too large: {max_new}."
                                   f"This model supports at most {ctx} completion tokens.")
    if n_prompt >= ctx:
        return bad_request(flavor, f"The input ({n_prompt} tokens) is longer than the model's context length "
                                   f"({ctx} tokens).")
    if max_new is not None and max_new + n_prompt >= ctx:
        return bad_request(
            flavor,
            f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
            f"You requested a total of {max_new + n_prompt} tokens: {n_prompt} tokens from the "
            f"input messages and {max_new} tokens for the completion. Please reduce the number "
            f"of tokens in the input messages or the completion to fit within the limit.")
    # SGLang runs a chat request without a limit up to the context length.
    return ctx - n_prompt if max_new is None else max_new


# ---- info endpoints ----------------------------------------------------------


def model_card(cfg: SimConfig) -> dict[str, Any]:
    flavor = cfg.flavor
    return {
        # llama.cpp names the model by its file (or --alias).
        "id": cfg.model_path if flavor == "llamacpp" else cfg.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": flavor,
        "root": cfg.model_path,
        "max_model_len": cfg.context_length,
    }


def sglang_server_info(cfg: SimConfig, engine: Engine) -> dict[str, Any]:
    # memory_usage as SGLang's scheduler reports it (GB: bytes / 2^30), from the sim's knobs.
    memory = {"weight": cfg.weight_gb, "kvcache": round(cfg.max_total_num_tokens * cfg.kv_bytes_per_token / 2**30, 3),
              "token_capacity": cfg.max_total_num_tokens, "graph": 1.2}
    return {
        "model_path": cfg.model_path,
        "served_model_name": cfg.model_name,
        "host": cfg.host,
        "port": cfg.port,
        # As given on its command line: null unless --context-length / --max-running-requests were.
        "context_length": cfg.context_length if cfg.args_given else None,
        "max_running_requests": cfg.max_running_requests if cfg.args_given else None,
        "max_queued_requests": cfg.max_queued_requests,
        "max_total_num_tokens": cfg.max_total_num_tokens,
        "max_req_input_len": min(cfg.context_length, cfg.max_total_num_tokens) - 1,
        "version": VERSION,
        "internal_states": [
            {
                "last_gen_throughput": engine.last_gen_throughput,
                "effective_max_running_requests_per_dp": cfg.max_running_requests,
                "memory_usage": memory,
            }
        ],
        # Not in SGLang: the simulator's own knobs, for benchmark reports.
        "sim": msgspec.to_builtins(cfg),
    }


def llamacpp_props(cfg: SimConfig) -> dict[str, Any]:
    """get_res_props() in tools/server/server-context.cpp (the fields a client reads)."""
    return {
        "default_generation_settings": {"n_ctx": cfg.context_length, "params": {"n_predict": -1}},
        "total_slots": cfg.max_running_requests,
        "model_alias": cfg.model_name,
        "model_path": cfg.model_path,
        "modalities": {"vision": False, "audio": False},
        "build_info": VERSION,
    }


def llamacpp_slots(cfg: SimConfig, engine: Engine) -> list[dict[str, Any]]:
    """GET /slots (with --slots): one entry per slot; the first `running` are busy."""
    busy = engine.num_running
    return [{"id": i, "n_ctx": cfg.context_length, "speculative": False, "is_processing": i < busy}
            for i in range(cfg.max_running_requests)]


# ---- metrics -----------------------------------------------------------------


def metrics_page(cfg: SimConfig, eng: Engine) -> str:
    """/metrics in the engine's names: (kind, name, help, value) rows, rendered alike."""
    usage = eng.used_tokens / cfg.max_total_num_tokens
    if cfg.flavor == "llamacpp":
        # server_task_result_metrics in tools/server/server-task.cpp: no labels, integer values.
        rows: list[tuple[str, str, str, Any]] = [
            ("counter", "llamacpp:prompt_tokens_total", "Number of prompt tokens processed", eng.prompt_tokens_total),
            ("counter", "llamacpp:tokens_predicted_total", "Number of generation tokens processed",
             eng.generation_tokens_total),
            ("gauge", "llamacpp:requests_processing", "Number of requests processing", eng.num_running),
            ("gauge", "llamacpp:requests_deferred", "Number of requests deferred", eng.num_waiting),
        ]
        return "".join(f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name} {value}\n" for kind, name, text, value in rows)
    label = cfg.model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    if cfg.flavor == "vllm":
        # vllm/v1/metrics/loggers.py PrometheusStatLogger (0.32); counters get _total on the wire. The
        # scheduler's counts as its last step left them (Engine.stepped_running); none deferred.
        labels = f'engine="0",model_name="{label}"'
        rows = [
            ("gauge", "vllm:num_requests_running", "Number of requests in model execution batches.",
             eng.stepped_running),
            ("gauge", "vllm:num_requests_waiting", "Number of requests waiting to be processed.", eng.stepped_waiting),
            ("gauge", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage),
            ("counter", "vllm:num_preemptions_total", "Cumulative number of preemption from the engine.", 0),
            ("counter", "vllm:prompt_tokens_total", "Number of prefill tokens processed.", eng.prompt_tokens_total),
            ("counter", "vllm:generation_tokens_total", "Number of generation tokens processed.",
             eng.generation_tokens_total),
        ]
    else:
        # python/sglang/srt/metrics/collector.py
        labels = f'model_name="{label}"'
        rows = [
            ("gauge", "sglang:num_running_reqs", "The number of running requests.", eng.num_running),
            ("gauge", "sglang:num_queue_reqs", "The number of requests in the waiting queue.", eng.num_waiting),
            ("gauge", "sglang:num_used_tokens", "The number of used tokens.", eng.used_tokens),
            ("gauge", "sglang:token_usage", "The token usage.", usage),
            ("gauge", "sglang:gen_throughput", "The generation throughput (token/s).", eng.last_gen_throughput),
            # 0.5.23 has this gauge (no retraction counter); the sim never retracts.
            ("gauge", "sglang:num_retracted_reqs", "The number of retracted requests.", 0),
            ("counter", "sglang:prompt_tokens_total", "Number of prefill tokens processed.", eng.prompt_tokens_total),
            ("counter", "sglang:generation_tokens_total", "Number of generation tokens processed.",
             eng.generation_tokens_total),
            ("counter", "sglang:num_requests_total", "Number of requests processed.", eng.num_requests_total),
            ("counter", "sglang:num_aborted_requests_total", "Number of requests aborted.", eng.num_aborted_total),
        ]
    page = "".join(f"# HELP {name} {text}\n# TYPE {name} {kind}\n{name}{{{labels}}} {float(value)}\n"
                   for kind, name, text, value in rows)
    if cfg.flavor == "vllm":
        name = "vllm:num_requests_waiting_by_reason"
        page += (f"# HELP {name} Number of waiting requests by reason. Reason labels: 'capacity' = waiting "
                 "for scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, KV "
                 "transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.\n"
                 f"# TYPE {name} gauge\n"
                 f'{name}{{{labels},reason="capacity"}} {float(eng.stepped_waiting)}\n'
                 f'{name}{{{labels},reason="deferred"}} 0.0\n')
    return page
