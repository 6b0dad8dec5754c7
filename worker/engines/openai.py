"""Any other OpenAI-compatible server: none of the engines genq recognises.

Nothing to probe and no metric names of its own: its capacity starts at the controller's guess
and is learned from /metrics only if the page carries another engine's names; its context is
/v1/models `max_model_len` when it lists one. Its errors are read like the others' (nested
`{"error": {...}}` or flat), by the one tolerant reader in worker/wire.py.
"""

from __future__ import annotations

from genq.worker.engines.base import Engine


class OpenAICompatible(Engine):
    name = "openai-compatible"


OPENAI = OpenAICompatible()
