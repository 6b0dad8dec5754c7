"""Many values in one script argument: a msgpack array of strings, for Redis's Lua cmsgpack.

A script given one argument per value pays redis-py's encoding of each (and Redis's parsing
of each); one argument holding them all costs one. Redis's cmsgpack reads no msgpack `bin`
type, which is what msgspec writes for bytes, so everything goes as `str` (Lua strings
are bytes): ints become their decimal text, read back with tonumber().
"""

from __future__ import annotations

from collections.abc import Iterable


def lua_list(items: Iterable[bytes | str | int]) -> bytes:
    """A msgpack array of str for cmsgpack.unpack in a script."""
    body = bytearray()
    count = 0
    for item in items:
        raw = item if isinstance(item, bytes) else str(item).encode()
        size = len(raw)
        if size < 32:
            body.append(0xA0 | size)
        elif size < 0x100:
            body += b"\xd9" + size.to_bytes(1, "big")
        elif size < 0x10000:
            body += b"\xda" + size.to_bytes(2, "big")
        else:
            body += b"\xdb" + size.to_bytes(4, "big")
        body += raw
        count += 1
    if count < 16:
        head = bytes([0x90 | count])
    elif count < 0x10000:
        head = b"\xdc" + count.to_bytes(2, "big")
    else:
        head = b"\xdd" + count.to_bytes(4, "big")
    return head + bytes(body)
