"""What a worker measured of its server's decode speed (worker/decoding.py), as stored and sent."""

from __future__ import annotations

import msgspec


class DecodeBin(msgspec.Struct, array_like=True):
    """One request's decode speed while about `decoding` sequences decoded at once on a worker:
    tokens streamed over request-seconds spent decoding, decayed alike."""

    decoding: float  # the mean count over the bin's request-seconds
    busy_s: float
    tokens: float
    # Booked while none of the worker's requests waited for its first token: no prefill of its own
    # in the server's steps, as in the drain at the end of a job (False: while it admitted requests).
    clean: bool = False


class ServerDecode(msgspec.Struct, omit_defaults=True):
    """A server's figures kept in Redis (keys.server_decode) beyond one worker's life: the next
    worker on that server starts from them, so a job's ETA knows how its last requests drain
    before the job has drained once."""

    at: float  # when they were written (time.time()): a reader decays them by their age
    worker: str
    bins: list[DecodeBin] = []
