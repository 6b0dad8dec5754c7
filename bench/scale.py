"""Scale benchmark (#15): `genq enqueue` of millions of prompts, inline and by reference.

Starts its own redis-server (a free loopback port, nothing on disk; never 6379) and
moto's S3 server, writes N synthetic chat prompts whose text is real natural
language (Python's own help topics, pydoc_data, plus the package descriptions in this
venv's METADATA files and the system's licence texts: cut into consecutive,
non-overlapping pieces, so nothing repeats within a batch), then times one
`genq enqueue` process per run and reports:

- wall time and prompts/s, and the time extrapolated to 10 M prompts;
- Redis used_memory added per queued prompt (and extrapolated to 10 M);
- the producer's peak RSS (the process's own, from wait4), at N and at N/10: flat
  in the input's size when the producer's memory is bounded.

Runs: inline from a local file, by reference from a local file, by reference from
moto's S3 (the input uploaded first, not timed). moto's server answered HTTP 500 to the
CompleteMultipartUpload of a 2.2 GB object (objects over 2 GiB, presumably), so on S3 the same lines are
cut into objects of at most S3_OBJECT_BYTES, enqueued one after the other into the same
job: the time is their sum, the RSS the highest. Targets (exit 1 on a miss):
by reference <= 150 bytes of Redis per queued prompt; inline <= 0.5 x the input's
bytes; producer peak RSS < 500 MB; 10 M prompts (extrapolated) in < 10 minutes.

    .venv/bin/python bench/scale.py                  # 2 M prompts: several minutes
    .venv/bin/python bench/scale.py --prompts 200000  # a quick look
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import redis
from common import PY, ROOT, conditions, free_port, table
from footprint import measure_footprint, measure_refresh

from genq.core.redisconn import LocalRedis

TARGET_REF_BYTES = 150
TARGET_INLINE_RATIO = 0.5
TARGET_RSS_MB = 500
TARGET_10M_S = 600
TEN_M = 10_000_000
PROMPT_CHARS = (800, 2800)  # each prompt's text: 1,800 characters on average, a ~1.9 KB JSONL line
S3_OBJECT_BYTES = 1 << 30
S3_ENV = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def corpus() -> str:
    """Natural-language text shipped with Python and the installed packages."""
    import pydoc_data.topics

    parts = list(pydoc_data.topics.topics.values())
    site = Path(msgspec.__file__).resolve().parent.parent
    for path in sorted(glob.glob(str(site / "*.dist-info" / "METADATA"))):
        parts.append(Path(path).read_text(errors="replace").split("\n\n", 1)[-1])
    for path in sorted(glob.glob("/usr/share/common-licenses/*")):
        if os.path.isfile(path):
            parts.append(Path(path).read_text(errors="replace"))
    return "\n".join(parts)


def write_input(path: Path, n: int, seed: int = 0) -> int:
    """n chat prompts, each the next PROMPT_CHARS characters of the corpus (wrapping around)."""
    text = corpus()
    rng = random.Random(seed)
    pos = 0
    enc = msgspec.json.Encoder()
    with open(path, "wb") as f:
        for i in range(n):
            size = rng.randint(*PROMPT_CHARS)
            if pos + size > len(text):
                pos = 0
            piece = text[pos:pos + size]
            pos += size
            f.write(enc.encode({"id": f"s{i:09d}", "messages": [{"role": "user", "content": piece}],
                                "source": "corpus"}) + b"\n")
    return len(text)


def split(path: Path, most: int) -> list[Path]:
    """The lines of path cut into files of at most `most` bytes each."""
    parts: list[Path] = []
    out = None
    with open(path, "rb") as f:
        for line in f:
            if out is None or out.tell() + len(line) > most:
                if out is not None:
                    out.close()
                parts.append(path.with_suffix(f".part{len(parts):02d}.jsonl"))
                out = open(parts[-1], "wb")
            out.write(line)
    if out is not None:
        out.close()
    return parts


class Servers:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.redis = LocalRedis()
        self.moto_port = free_port()
        self.moto = subprocess.Popen([PY, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.moto_port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **S3_ENV})
        self.url = self.redis.url
        self.s3_url = f"http://127.0.0.1:{self.moto_port}"
        self.conn = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + 30
        while True:
            try:
                self.conn.ping()
                self.s3().list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def s3(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_url, aws_access_key_id="bench",
                            aws_secret_access_key="bench", region_name="us-east-1")

    def stop(self) -> None:
        self.redis.stop()
        self.moto.terminate()
        self.moto.wait(timeout=30)


def run_measured(servers: Servers, sources: list[str], job: str, mode: str) -> dict:
    """enqueue() of each source in turn into one job, with the producer's own peak RSS: the
    child runs under wait4 in a helper."""
    code = ("import os,sys,subprocess,json;p=subprocess.Popen(sys.argv[1:]);_,s,r=os.wait4(p.pid,0);"
            "print(json.dumps({'rc':os.waitstatus_to_exitcode(s),'rss_kb':r.ru_maxrss}))")
    servers.conn.flushall()
    before = int(servers.conn.info("memory")["used_memory"])
    load = os.getloadavg()[0]
    elapsed, rss_kb, outs = 0.0, 0, []
    for source in sources:
        args = [PY, "-c", code, PY, "-m", "genq", "--redis", servers.url, "enqueue", source, "--job", job,
                "--output", str(servers.tmp / "out"), mode, "--s3-endpoint-url", servers.s3_url]
        started = time.monotonic()
        proc = subprocess.run(args, capture_output=True, text=True, env={**os.environ, **S3_ENV}, cwd=ROOT)
        elapsed += time.monotonic() - started
        lines = proc.stdout.strip().splitlines()
        status = msgspec.json.decode(lines[-1])
        if status["rc"] != 0:
            sys.exit(f"genq enqueue {source} exited {status['rc']}:\n{proc.stdout}\n{proc.stderr}")
        rss_kb = max(rss_kb, status["rss_kb"])
        outs.extend(lines[:-1])
    used = int(servers.conn.info("memory")["used_memory"]) - before
    queued = int(servers.conn.hget(f"genq:job:{job}:stats", "total") or 0)
    return {"elapsed": elapsed, "used": used, "queued": queued, "rss_mb": rss_kb / 1024,
            "out": "\n".join(outs), "load": f"{load:.1f} -> {os.getloadavg()[0]:.1f}"}


def footprint_part(n: int) -> list[str]:
    """bench/footprint.py at this size: what a prompt costs in flight and once finished, and
    whether the monitor's refresh stays flat from 20 K to n prompts (target <= 1.5x)."""
    fp = measure_footprint()
    print(f"Redis per prompt (bench/footprint.py, {fp.prompts:,} prompts of 400 + 1,500 characters): "
          f"queued inline {fp.per_queued:,.0f} B, in flight {fp.per_in_flight:,.0f} B, finished "
          f"{fp.per_finished:,.0f} B (10 M finished: {fp.per_finished * TEN_M / 2**30:.2f} GiB) ({conditions()})",
          flush=True)
    ref = measure_refresh(large=n)
    print(f"monitor refresh: {ref.small_ms:.2f} ms at {ref.small:,} prompts, {ref.large_ms:.2f} ms at "
          f"{ref.large:,} ({ref.ratio:.2f}x; target <= 1.5) ({conditions()})", flush=True)
    return [] if ref.met else [f"monitor refresh at {ref.large:,} prompts {ref.ratio:.2f}x the one at {ref.small:,}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=2_000_000)
    parser.add_argument("--no-footprint", action="store_true",
                        help="Skip bench/footprint.py's part: Redis per in-flight and finished prompt, and the "
                             "monitor's refresh at 20 K vs --prompts prompts.")
    args = parser.parse_args()
    if not shutil.which("redis-server"):
        sys.exit("redis-server is not installed (apt-get install redis-server)")
    n, small = args.prompts, max(args.prompts // 10, 1)
    tmp = Path(tempfile.mkdtemp(prefix="genq-scale-"))
    print(f"conditions: {conditions()}")
    try:
        big, little = tmp / "prompts.jsonl", tmp / "small.jsonl"
        chars = write_input(big, n)
        write_input(little, small)
        size = big.stat().st_size
        print(f"input: {n:,} prompts, {size / 1e6:,.1f} MB ({size / n:,.0f} bytes a line) from a "
              f"{chars / 1e6:.1f} M-character natural-language corpus; small run: {small:,} prompts")
        servers = Servers(tmp)
        try:
            from boto3.s3.transfer import TransferConfig

            s3 = servers.s3()
            s3.create_bucket(Bucket="scale")
            transfer = TransferConfig(multipart_chunksize=64 << 20, max_concurrency=2)
            objects = []
            for part in split(big, S3_OBJECT_BYTES):
                s3.upload_file(str(part), "scale", part.name, Config=transfer)
                objects.append(f"s3://scale/{part.name}")
                part.unlink()
            s3.upload_file(str(little), "scale", "small.jsonl", Config=transfer)
            print(f"uploaded to moto S3 as {len(objects)} object(s) of at most {S3_OBJECT_BYTES / 2**30:.0f} GiB "
                  f"({conditions()})", flush=True)
            runs = [
                ("inline, local file", [str(big)], [str(little)], "--input-inline"),
                ("by reference, local file", [str(big)], [str(little)], "--input-by-reference"),
                ("by reference, moto S3", objects, ["s3://scale/small.jsonl"], "--input-by-reference"),
            ]
            rows, misses = [], []
            for name, source, small_source, mode in runs:
                low = run_measured(servers, small_source, "scale", mode)
                high = run_measured(servers, source, "scale", mode)
                if high["queued"] != n or low["queued"] != small:
                    misses.append(f"{name}: queued {high['queued']:,} of {n:,}")
                rate = n / high["elapsed"]
                per = high["used"] / n
                ten_m_s = TEN_M / rate
                rows.append([name, f"{high['elapsed']:.1f} s", f"{rate:,.0f}", f"{per:,.0f} B",
                             f"{high['used'] / size:.3f}", f"{per * TEN_M / 2**30:.2f} GiB",
                             f"{low['rss_mb']:.0f} / {high['rss_mb']:.0f} MB", f"{ten_m_s / 60:.1f} min",
                             high["load"]])
                if "inline" in name and high["used"] > TARGET_INLINE_RATIO * size:
                    misses.append(f"{name}: Redis {high['used'] / size:.3f} x the input "
                                  f"(target <= {TARGET_INLINE_RATIO})")
                if "reference" in name and per > TARGET_REF_BYTES:
                    misses.append(f"{name}: {per:.0f} bytes of Redis per queued prompt (target <= {TARGET_REF_BYTES})")
                if high["rss_mb"] > TARGET_RSS_MB:
                    misses.append(f"{name}: producer peak RSS {high['rss_mb']:.0f} MB (target < {TARGET_RSS_MB})")
                if ten_m_s > TARGET_10M_S:
                    misses.append(f"{name}: 10 M prompts would take {ten_m_s / 60:.1f} min (target < 10)")
                print(f"  {name} (load {high['load']}): " + " | ".join(rows[-1][1:7]), flush=True)
        finally:
            servers.stop()
        print(table(["run", f"enqueue {n:,}", "prompts/s", "Redis/prompt", "Redis/input bytes",
                     "Redis at 10 M", f"peak RSS {small:,} / {n:,}", "10 M (extrapolated)",
                     "load (1-min, before -> after)"], rows))
        print(f"conditions after: {conditions()}")
        if not args.no_footprint:
            misses += footprint_part(n)
        for miss in misses:
            print(f"MISSED: {miss}")
        return 1 if misses else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
