"""Every record that crosses Redis, HTTP or disk, defined once as a msgspec Struct; encoded and
decoded only at the edges (Redis calls, HTTP bodies, files) with pack and unpack."""

from __future__ import annotations

import functools
import math
import secrets
import threading
from collections.abc import Sequence
from typing import Any, Literal

import msgspec
import zstandard

Endpoint = Literal["chat", "completions"]


class SettingsChange(msgspec.Struct, omit_defaults=True):
    """One `genq jobs set`: the version it made, when, and each setting's new and previous value."""

    version: int
    at: float
    changed: dict[str, Any]
    previous: dict[str, Any] = {}
    note: str | None = None


class JobConfig(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False):
    """A generation job: stored once in Redis, read by every worker."""

    name: str
    output: str  # local directory or s3://bucket/prefix
    endpoint: Endpoint = "chat"
    model: str = "auto"  # "auto": the first id the server lists in /v1/models
    max_tokens: int = 4096
    temperature: float | None = None
    top_p: float | None = None
    extra_body: dict[str, Any] = {}
    batch_size: int = 256
    max_attempts: int = 5
    compression: Literal["none", "gzip"] = "none"
    s3_endpoint_url: str | None = None
    created_at: float = 0.0
    incarnation: str = ""  # the life of this name: every claim, record and write is checked against it
    settings_version: int = 1  # +1 per `genq jobs set` (docs/settings.md); results record theirs
    settings_history: list[SettingsChange] = []
    brake: bool = True  # False (--no-brake): failing prompts are dead-lettered one by one, never a block

    def served_by(self, server_model: str | None) -> bool:
        """Whether a server of server_model may run this job's prompts; one that lists none is trusted."""
        return self.model in ("auto", server_model) or server_model is None


class JobSchedule(msgspec.Struct, omit_defaults=True):
    """How a job shares the fleet (docs/scheduling.md): higher priority first, then by weight."""

    priority: int = 0
    weight: float = 1.0
    changed_at: float = 0.0
    version: int = 0  # +1 per change: job.json's and Redis's copies compared by it (docs/recovery.md)


class JobBlock(msgspec.Struct, omit_defaults=True):
    """Why a job's settings cannot work against its server: its prompts wait (docs/settings.md)."""

    reason: Literal["preflight", "brake"]
    message: str  # the server's own message (brake) or what the preflight found
    worker: str
    at: float
    settings_version: int = 1
    status: int | None = None  # the brake's: HTTP status, failures, outcomes and prompts in its window
    failures: int = 0
    outcomes: int = 0
    prompts: int = 0


def new_incarnation() -> str:
    return secrets.token_hex(6)


class Prompt(msgspec.Struct, omit_defaults=True):
    """One input row. Exactly one of messages / prompt / body carries the request."""

    id: str
    index: int  # position in the input (0-based line number), for ordered export
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    sampling: dict[str, Any] | None = None  # the row's overrides of the job's request parameters
    metadata: dict[str, Any] = {}
    custom_id: str | None = None  # OpenAI Batch input: echoed back on export


class InputRange(msgspec.Struct, array_like=True, frozen=True):
    """A by-reference batch's lines first_line..last_line (1-based), bytes [start, end) of uri;
    digest covers each (line number, line), so a changed line is noticed before sending."""

    uri: str  # s3://bucket/key or an absolute path every worker can read
    start: int
    end: int
    first_line: int
    last_line: int
    digest: str


class BatchSource(msgspec.Struct, array_like=True):
    """A pending batch (keys.batch): its ids and prompts zstd-compressed, or its input range."""

    job: str
    id: str
    count: int
    ids: bytes
    created_at: float = 0.0
    prompts: bytes = b""  # inline
    ref: InputRange | None = None  # by reference

    @classmethod
    def inline(cls, job: str, batch: str, prompts: Sequence[Prompt], created_at: float = 0.0) -> BatchSource:
        return cls(job=job, id=batch, count=len(prompts), ids=_zstd().c.compress(pack([p.id for p in prompts])),
                   created_at=created_at, prompts=_zstd().c.compress(pack(list(prompts))))

    @classmethod
    def by_reference(cls, job: str, batch: str, ids: Sequence[str], ref: InputRange,
                     created_at: float = 0.0) -> BatchSource:
        return cls(job=job, id=batch, count=len(ids), ids=_zstd().c.compress(pack(list(ids))), created_at=created_at,
                   ref=ref)

    def prompt_ids(self) -> list[str]:
        return unpack(_zstd().d.decompress(self.ids), list[str])

    def inline_prompts(self) -> list[Prompt]:
        """The prompts of an inline batch (raises ValueError for a by-reference one)."""
        if self.ref is not None:
            raise ValueError(f"batch {self.job}/{self.id} is by reference: read it with genq.producer.sources")
        return unpack(_zstd().d.decompress(self.prompts), list[Prompt])


# The fastest level: prompts come out at 0.28 of their JSON (level 3: 0.26, at 1.6 times the time).
ZSTD_LEVEL = 1
_zstd_local = threading.local()  # zstd contexts are not thread-safe: one pair per thread


def _zstd() -> threading.local:
    if not hasattr(_zstd_local, "c"):
        _zstd_local.c, _zstd_local.d = zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor()
    return _zstd_local


def batch_id(seq: int) -> str:
    return f"b{seq:07d}"


def batch_number(batch: str) -> int:
    """batch_id's inverse: b0000017 -> 17; 0 for an id genq did not number."""
    digits = batch[1:].split(".", 1)[0]
    return int(digits) if digits.isdigit() else 0


class Usage(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None


class Choice(msgspec.Struct, omit_defaults=True):
    """One of the n samples of a request for n > 1 (Result.choices); fields as Result's."""

    index: int
    completion: str
    finish_reason: str | None
    completion_tokens: int | None = None  # this sample's own length, where the server said it (streamed)
    reasoning_content: str | None = None
    logprobs: dict[str, Any] | None = None
    matched_stop: int | str | None | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[dict[str, Any]] | None = None


class Result(msgspec.Struct, omit_defaults=True):
    """One completed prompt: a line of a shard (docs/fidelity.md lists every field). With n > 1
    samples, `choices` holds them all and the top-level fields are choice 0's; usage is the request's."""

    id: str
    job: str
    batch: str
    index: int
    completion: str
    finish_reason: str | None
    usage: Usage
    model: str
    worker: str
    attempts: int
    latency_s: float
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    reasoning_content: str | None = None
    metadata: dict[str, Any] = {}
    sampling: dict[str, Any] | None = None  # the row's own request fields (Prompt.sampling), as sent
    custom_id: str | None = None
    response_id: str | None = None
    finished_at: float = 0.0
    settings_version: int = 0  # JobConfig.settings_version the request was sent with (0: before versions)
    choices: list[Choice] | None = None  # n > 1 only
    logprobs: dict[str, Any] | None = None  # only when asked for
    # Only when the request set stop or stop_token_ids (SGLang's matched_stop, vLLM's stop_reason).
    matched_stop: int | str | None | msgspec.UnsetType = msgspec.UNSET
    tool_calls: list[dict[str, Any]] | None = None  # when the request offered tools


def without_prompt(result: Result) -> Result:
    """A Result as kept in Redis until its shard is written: without the prompt its batch holds."""
    if (result.messages is None and result.prompt is None and not result.metadata and result.sampling is None
            and result.custom_id is None):
        return result  # the worker's records come without it: no copy
    return msgspec.structs.replace(result, messages=None, prompt=None, metadata={}, sampling=None, custom_id=None)


def with_prompt(result: Result, prompt: Prompt) -> Result:
    return msgspec.structs.replace(result, messages=prompt.messages, prompt=prompt.prompt,
                                   metadata=prompt.metadata, sampling=prompt.sampling, custom_id=prompt.custom_id)


ErrorKind = Literal[
    "bad_request",  # the server rejected the prompt (4xx): not retryable
    "server_error",  # 5xx / SSE error events, retried until attempts run out
    "timeout",  # request or stall timeout, retried until attempts run out
    "connection",  # reset or refused while the server looked healthy
    "protocol",  # an answer genq could not parse
    "server_crash",  # the server went down --server-crash-limit times with this prompt in flight
    "batch_failed",  # a whole batch failed in RQ (shown from its failed registry)
    "input_changed",  # a by-reference batch's input lines are missing or differ from what was queued
]


class DeadLetter(msgspec.Struct, omit_defaults=True):
    """A prompt genq gave up on, and why."""

    id: str
    job: str
    batch: str
    attempts: int
    kind: ErrorKind
    message: str
    worker: str
    at: float
    status: int | None = None  # HTTP status, when there was one
    prompt: Prompt | None = None  # kept so the letter can be requeued


class Rejected(msgspec.Struct, omit_defaults=True):
    """A malformed input line (the producer's rejects file)."""

    line: int
    reason: str
    text: str  # the raw line (truncated when huge)


class InFlight(msgspec.Struct):
    """A worker's running requests for one job, published about once a second."""

    worker: str
    job: str
    at: float
    tokens: list[int]  # each one's completion tokens so far (for the ETA)
    queued: int  # prompts held by the worker but not yet sent


class GpuSample(msgspec.Struct, omit_defaults=True):
    index: int
    name: str
    utilization_pct: float
    memory_used_mib: float
    memory_total_mib: float
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    temperature_c: float | None = None
    max_sm_clock_mhz: float | None = None
    mem_clock_mhz: float | None = None
    power_limit_w: float | None = None
    throttled: list[str] | None = None  # NVML's clock-event reasons now: "power cap", "hw thermal", ...


class Hardware(msgspec.Struct, omit_defaults=True, frozen=True):
    """What a worker read of its GPU and server that only the decode bound needs (None: not read)."""

    engine: str | None = None  # "sglang" | "vllm" | "llamacpp" | ...: whose flags the advice names
    bandwidth: float | None = None  # bytes/s
    bandwidth_from: str | None = None  # "NVML ...", "--gpu-bandwidth", ...
    weight_bytes: float | None = None
    weight_from: str | None = None
    kv_pool_bytes: float | None = None  # the whole KV cache (SGLang's memory_usage.kvcache)
    token_capacity: int | None = None  # tokens the KV cache holds


class Tally(msgspec.Struct, array_like=True):
    """A job's part of one GPU's decode so far: seconds run, tokens made and tokens the bound allowed."""

    busy_s: float = 0.0
    made: float = 0.0
    bound: float = 0.0


class BatchRef(msgspec.Struct, frozen=True, order=True, array_like=True):
    """A batch's identity (batch ids are numbered per job)."""

    job: str
    batch: str

    def __str__(self) -> str:
        return f"{self.job}/{self.batch}"


class DecodeBin(msgspec.Struct, array_like=True):
    """Tokens streamed over request-seconds decoding while about `decoding` sequences decoded at once."""

    decoding: float
    busy_s: float
    tokens: float
    clean: bool = False  # booked while no request of the worker waited for its first token (no prefill)


class ServerDecode(msgspec.Struct, omit_defaults=True):
    """A server's decode figures kept beyond one worker's life: the next worker starts from them."""

    at: float  # time.time() when written: a reader decays them by their age
    worker: str
    bins: list[DecodeBin] = []


WorkerState = Literal["starting", "busy", "idle", "paused", "draining", "server_down", "stopped"]


class WorkerStatus(msgspec.Struct, omit_defaults=True):
    """A worker's heartbeat record for the fleet view (genq workers, monitor)."""

    name: str
    host: str
    pid: int
    server: str
    state: WorkerState
    started_at: float
    heartbeat_at: float
    gpu: str | None = None
    concurrency_target: int = 0
    concurrency_limit: int | None = None  # --concurrency N (a cap), None for auto
    server_capacity: int | None = None
    in_flight: int = 0
    sequences: int = 0  # those requests' sequences on the server: more than in_flight for n > 1 samples
    queued: int = 0
    batches: list[BatchRef] = []
    prefetch: int = 2  # genq worker --prefetch: batches held at least while the queue lasts
    tok_per_s: float = 0.0
    req_per_s: float = 0.0
    done: int = 0
    errors: int = 0
    server_running: float | None = None
    server_waiting: float | None = None
    server_token_usage: float | None = None
    gpu_sample: GpuSample | None = None
    gpu_note: str | None = None  # e.g. "no GPU: NVML driver not found"
    note: str | None = None  # why the server is down, or what the worker waits for
    job_errors: dict[str, int] = {}  # failed request attempts per job (errors: the worker's total)
    model: str | None = None  # what its server serves: it takes only jobs for that model or auto
    decode: list[DecodeBin] = []  # its requests' speed against how many decoded at once (worker/controller.py)
    token_s: float | None = None  # moving averages: seconds per output token, output tokens per request
    mean_tokens: float | None = None
    tok_per_s_from: str | None = None  # "server" (its generation-token counter) or "answers" (over 30 s)
    window_running: float | None = None  # the server's mean running count and KV usage over that window
    window_token_usage: float | None = None
    hardware: Hardware | None = None  # what the decode bound needs beyond the above (genq.core.decodebound)
    bound_tally: dict[str, Tally] = {}  # per job, its part of this GPU's decode against the bound so far


class Control(msgspec.Struct, omit_defaults=True):
    """Operator instructions to one worker (genq drain, genq concurrency)."""

    drain: bool = False
    concurrency: int | None = None  # live cap; 0 or None: back to auto


_encoder = msgspec.msgpack.Encoder()


def pack(obj: Any) -> bytes:
    return _encoder.encode(obj)


@functools.cache
def _decoder(typ: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(typ)  # one per type: msgpack.decode(type=) builds one a call


def unpack(data: bytes, typ: type) -> Any:
    return _decoder(typ).decode(data)


def length_bucket(tokens: int) -> int:
    """A completion's bucket in the output-length histograms: 4 per doubling of its length."""
    return int(round(4 * math.log2(tokens + 1)))


class ShardInfo(msgspec.Struct, omit_defaults=True):
    """A written shard: one line of the manifest."""

    batch: str
    uri: str
    records: int
    bytes: int
    at: float
    prompts: int = 0  # records + letters == prompts (0: an older genq)
    letters: int = 0
    incarnation: str = ""  # JobConfig.incarnation of the job that wrote it


# --------------------------------------------------------------------------- the output's own records
# Beside the shards, so that a ledger lost with Redis is rebuilt from the output alone (docs/recovery.md).


class ShardMarker(ShardInfo):
    """OUTPUT/JOB/manifest/BATCH.json: its ShardInfo plus what rebuilding the ledger needs."""

    sha256: str = ""  # of the shard's bytes: a second writer with other bytes is told apart
    digests: dict[str, str] = {}  # every prompt of the batch with an outcome -> content digest (hex)
    dead_letters: list[DeadLetter] = []  # the batch's dead letters (with their prompt: requeue needs it)
    tally: dict[str, list[int]] = {}  # worker -> [results, input tokens, output tokens] in the shard
    hist: dict[int, int] = {}  # output-length bucket (length_bucket) -> results in the shard


class JobRecord(msgspec.Struct, omit_defaults=True):
    """OUTPUT/JOB/job.json: the job at its current settings, for genq recover."""

    config: JobConfig
    inputs: list[str] = []  # what was enqueued (absolute paths or s3:// URIs)
    reserved: int = 0  # batch numbers up to this may be in use: a lost counter restarts above it
    deleted_at: float | None = None  # `genq jobs delete`: the next enqueue starts a new job
    schedule: JobSchedule | None = None  # its priority and weight (None: never set)
    paused: bool = False  # `genq pause --job`


class EnqueueRecord(msgspec.Struct, omit_defaults=True):
    """OUTPUT/JOB/enqueues/RUN.json: what one enqueue or requeue brought in, written before its batches
    are queued, so that a Redis that lost them queues them again (genq.producer.enqueue.queue_lost)."""

    incarnation: str
    input: str  # the input read (absolute path or s3:// URI)
    batches: list[list[int]] = []  # the batches it queued: [first, last] number ranges
    prompts: int = 0  # the prompts in them
    letters: list[str] = []  # a requeue's: the dead letters it moved into those batches
    override: dict[str, Any] = {}  # a requeue's: what it set in each prompt's sampling (requeued again with it)


# msgspec (0.20) builds a Struct type's decoding information at its first decode, and a second thread decoding the
# type meanwhile can read it half built: a segfault (genq recover's marker reads). Built here, before any thread.
for _struct in [t for t in list(globals().values()) if isinstance(t, type) and issubclass(t, msgspec.Struct)]:
    msgspec.json.Decoder(_struct)
