"""Counts in messages: "1 batch", "2 batches" (never "1 batches")."""

from __future__ import annotations


def plural(n: int, noun: str, nouns: str | None = None) -> str:
    """n with the noun in the number n asks for: plural(1, "batch", "batches") is "1 batch"."""
    many = nouns or noun + "s"
    return f"{n:,} {noun if n == 1 else many}"
