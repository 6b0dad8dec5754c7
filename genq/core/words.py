"""Counts in messages: "1 batch", "2 batches" (never "1 batches")."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    return f"{n:,} {noun if n == 1 else nouns or noun + 's'}"
