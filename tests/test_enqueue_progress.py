"""enqueue's progress line has a percent and an ETA for every input whose size is known (#28):
plain JSONL (bytes of its size), a .gz file (compressed bytes of its size), a Parquet file (rows
of its metadata's count), local and on S3 (the object's size; moto's S3 server). The percent is
of what is queued, never of what the reading thread has read ahead: every line drawn must agree
with the prompts it says are queued, and 100% only once all of them are."""

from __future__ import annotations

import gzip
import json
import re
import secrets
from pathlib import Path

import pytest

from tests.conftest import run_genq_on_a_tty
from tests.s3server import moto, s3_env  # noqa: F401  (fixtures)

pytestmark = pytest.mark.e2e  # runs the CLI (and moto's server)

ROWS = 30_000
PERCENT = re.compile(r"queued ([\d,]+) · (\d+\.\d)% of ([\d,.]+ (?:MiB compressed|MiB|rows)), ETA ")


def _rows(n: int) -> list[dict]:
    # Random metadata: the .gz stays a few MiB, more than one 1 MiB read of an S3 stream.
    return [{"id": f"p{i:06d}", "prompt": f"prompt number {i}", "noise": secrets.token_hex(100)} for i in range(n)]


def _write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=4096)
    else:
        text = "".join(json.dumps(r) + "\n" for r in rows).encode()
        path.write_bytes(gzip.compress(text, 6) if path.suffix == ".gz" else text)
    return path


def _progress(*args: str) -> list[tuple[int, float, str]]:
    """Run `genq enqueue ARGS` with stderr on a terminal (progress is drawn for one only):
    (prompts queued, percent, of what) of every progress line drawn."""
    # 700 a batch: the last batch is short, queued only once the input is all read.
    returncode, out, text = run_genq_on_a_tty("enqueue", *args, "--batch-size", "700")
    assert returncode == 0, text + out
    found = [(int(q.replace(",", "")), float(p), what) for q, p, what in PERCENT.findall(text)]
    assert found, text[-2000:]
    return found


def _check(found: list[tuple[int, float, str]], what: str, slack: float = 2.0) -> None:
    """What the user reads: the percent of the same line's queued prompts (within `slack` points:
    rows differ a little in bytes, and a .gz's compressed position runs a read buffer ahead),
    rising, short of 100 on some line, 100 on the last and on no line before all are queued."""
    assert {w for _, _, w in found} == {what}, found
    off = [(q, p) for q, p, _ in found if abs(p - 100 * q / ROWS) > slack]
    assert not off, f"percent is not of the prompts queued (queued, percent): {off} of {found}"
    assert not [(q, p) for q, p, _ in found if p == 100.0 and q < ROWS], f"100% while still queueing: {found}"
    assert any(0 < p < 100 for _, p, _ in found), f"no line with a percent short of 100: {found}"
    assert [p for _, p, _ in found] == sorted(p for _, p, _ in found), found
    assert found[-1][:2] == (ROWS, 100.0), found


def _mib(path: Path, compressed: bool = False) -> str:
    return f"{path.stat().st_size / 2**20:,.1f} MiB" + (" compressed" if compressed else "")


def _s3_gz_slack(size: int) -> float:
    # A .gz's compressed position is of what has been read: an S3 stream reads 1 MiB at a time.
    return 2.0 + 100 * 2**20 / size


def test_percent_and_eta_for_local_jsonl_gz_and_parquet(redis_url, tmp_path):
    rows = _rows(ROWS)
    plain = _write(tmp_path / "big.jsonl", rows)
    _check(_progress(str(plain), "--job", "plain", "--output", str(tmp_path / "out")), _mib(plain))
    gz = _write(tmp_path / "big.jsonl.gz", rows)  # read from the file 8 KiB at a time: no more slack
    _check(_progress(str(gz), "--job", "gz", "--output", str(tmp_path / "out")), _mib(gz, compressed=True))
    parquet = _write(tmp_path / "big.parquet", rows)
    _check(_progress(str(parquet), "--job", "pq", "--output", str(tmp_path / "out")), f"{ROWS:,} rows")


def test_percent_and_eta_for_inputs_on_s3(moto, redis_url, tmp_path):  # noqa: F811
    rows = _rows(ROWS)
    s3 = moto.client()
    s3.create_bucket(Bucket="inputs")
    for name, what in (("big.jsonl", None), ("big.jsonl.gz", None), ("big.parquet", f"{ROWS:,} rows")):
        local = _write(tmp_path / name, rows)
        s3.put_object(Bucket="inputs", Key=name, Body=local.read_bytes())
        job = name.replace(".", "-")
        found = _progress(f"s3://inputs/{name}", "--job", job, "--output", str(tmp_path / "out"),
                          "--s3-endpoint-url", moto.url)
        gz = name.endswith(".gz")
        _check(found, what or _mib(local, compressed=gz), slack=_s3_gz_slack(local.stat().st_size) if gz else 2.0)
