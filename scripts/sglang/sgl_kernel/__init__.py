"""A pure-torch stand-in for `sgl_kernel`, SGLang's compiled kernel module, on CPU.

With SGLANG_USE_CPU_ENGINE=1, SGLang 0.5.23 imports sgl_kernel unconditionally, but its CPU
build (AMX/AVX-512 C++ ops) is not on PyPI. Each layer's CPU path uses those ops only when
torch.ops.sgl_kernel.convert_weight_packed exists, else its pure-torch forward_native; this
module registers no torch ops, so every layer takes forward_native. The one function plain
decoding calls by name is assign_req_to_token_pool_cpu, written here in torch; any other name
SGLang imports (speculative decoding, KV-cache copies) resolves to a function that raises if
it is ever called, so a path this stand-in does not cover fails loudly, not silently.

Put the folder holding this package first on PYTHONPATH when starting the server
(scripts/sglang/install.sh, scripts/vllm/stack.py).
"""

from __future__ import annotations

from typing import Any, NoReturn

import torch


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Row req_pool_indices[i], columns [start_offset[i], end_offset[i]) take the next
    end - start entries of out_cache_loc, in batch order (as SGLang's Triton
    assign_req_to_token_pool does)."""
    taken = 0
    for row, start, end in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        length = end - start
        req_to_token[row, start:end] = out_cache_loc[taken:taken + length].to(req_to_token.dtype)
        taken += length


def _missing(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: not in genq's pure-torch stand-in (scripts/sglang/sgl_kernel)")

    call.__name__ = name
    return call


def __getattr__(name: str) -> Any:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
