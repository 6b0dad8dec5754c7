"""Prompt keys and lognormal output lengths, a prompt's the same on every run and server (a retry costs the same)."""

from __future__ import annotations

import hashlib
import json
import math
import random
from typing import Any


def prompt_key(messages_or_prompt: Any) -> str:
    """First 16 hex chars of sha256 over the canonical JSON of the messages (chat) or the prompt."""
    canonical = json.dumps(messages_or_prompt, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def choice_key(key: str, index: int) -> str:
    """Choice `index`'s key: the prompt's own for the first (n=1 matches n>1's first sample), else its own."""
    return key if index == 0 else prompt_key([key, index])


def output_length(key: str, seed: int, mean_tokens: float, sigma: float, max_tokens: int) -> int:
    """Lognormal with this mean, in [1, max_tokens]; seeded by key and seed alone, never by timing."""
    mu = math.log(max(mean_tokens, 1e-9)) - sigma * sigma / 2  # so that E[exp(N(mu, sigma^2))] is the mean
    length = int(round(random.Random(int(key, 16) ^ seed).lognormvariate(mu, sigma)))
    return max(1, min(length, max_tokens))
