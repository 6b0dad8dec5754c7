"""Where input rows come from: local JSONL files (plain or .gz)."""

from __future__ import annotations

import gzip
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


class SourceError(Exception):
    pass


def open_lines(uri: str) -> Iterator[bytes]:
    """Yield the raw lines of a JSONL input, newline included."""
    path = Path(uri)
    if not path.exists():
        raise SourceError(f"input file not found: {uri}")
    if path.is_dir():
        raise SourceError(f"input is a directory, expected a JSONL file: {uri}")
    opener: BinaryIO
    with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as opener:
        # Read the file as it streams rather than all at once: inputs can be many GB.
        yield from opener


def default_rejects_path(uri: str) -> str:
    """prompts.jsonl -> prompts.rejects.jsonl beside it (in the current directory for remote inputs)."""
    remote = "://" in uri
    name = uri.rsplit("/", 1)[-1]
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    folder = Path(".") if remote else Path(uri).parent
    return str(folder / f"{name}.rejects.jsonl")
