"""The preflight: a job's settings against what its server says about itself, before any request.

The context a request may fill is what each engine reports (worker/engines.py, worker/server.py discover):
SGLang's /get_server_info `context_length`, vLLM's /v1/models `max_model_len`, llama.cpp's
/props `default_generation_settings.n_ctx` (per slot: llama-server splits `-c` over `-np`).
A prompt has at least one token, so max_tokens alone >= the context never fits: SGLang answers
every request with a 400, vLLM 0.32 too once max_tokens is over the context (at the context
itself it cuts max_tokens to what each prompt leaves), llama.cpp cuts every completion at the
slot's end. That is the job's error, not each prompt's: the job is blocked before its first
request. (Below the context, vLLM 0.32 and llama.cpp cut max_tokens to what the prompt leaves,
SGLang answers 400: the brake's case, worker/brake.py.)
"""

from __future__ import annotations

from genq.core.records import JobConfig
from genq.worker.server import ServerInfo


def preflight(config: JobConfig, server: ServerInfo | None) -> str | None:
    """Why `config` can never work against `server`, or None."""
    if server is None or not server.context_length:
        return None  # the server says nothing about its context: the brake is the safeguard
    context = server.context_length
    if config.max_tokens < context:
        return None
    where = server.engine.context_where
    return (f"max_tokens {config.max_tokens} (settings version {config.settings_version}) is not below {where} "
            f"of {context} tokens on this {server.flavor} server: no prompt can fit (prompt + max_tokens must "
            f"fit in the context). Lower it with `genq jobs set {config.name} --max-tokens N` (N < {context}), "
            f"then `genq resume --job {config.name}`.")
