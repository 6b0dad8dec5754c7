"""Deterministic prompt keys and heavy-tailed output lengths.

The same prompt gets the same output length on every run and every server, so tests
can compare runs and a retry costs what the first try cost. Lengths are lognormal:
most answers are short, a few very long, as with real models.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any


def prompt_key(messages_or_prompt: Any) -> str:
    """First 16 hex chars of sha256 over the canonical JSON of the messages list
    (chat) or the prompt (completions)."""
    canonical = json.dumps(messages_or_prompt, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def choice_key(key: str, index: int) -> str:
    """The key of a request's choice `index`: the prompt's own for the first (an n=1 answer
    matches the first sample of n>1), a key of its own for each other sample."""
    return key if index == 0 else prompt_key([key, index])


def output_length(key: str, seed: int, mean_tokens: float, sigma: float, max_tokens: int) -> int:
    """Natural output length for a prompt: lognormal with the given mean, at least 1,
    at most max_tokens. Seeded only by key and seed, so it never depends on timing."""
    rng = random.Random(int(key, 16) ^ seed)
    # mu chosen so that E[exp(N(mu, sigma^2))] == mean_tokens.
    mu = math.log(max(mean_tokens, 1e-9)) - sigma * sigma / 2
    length = int(round(rng.lognormvariate(mu, sigma)))
    return max(1, min(length, max_tokens))
