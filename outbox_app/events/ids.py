"""Event ids: UUIDv7, time-ordered and monotonic within a process.

Python 3.14's ``uuid.uuid7`` is used where present. Older Pythons get the same
algorithm here (RFC 9562, section 6.2, method 1: a 42-bit counter after the
millisecond timestamp, seeded randomly each millisecond and incremented within
one). Unlike generators that advance the timestamp by a millisecond for every id
made faster than the clock, a burst of ids never runs ahead of real time, so ids
of different processes keep sorting by when they were made (to the millisecond).

A relay process is named by :func:`worker_name`.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0
_COUNTER_BITS = 42


def _uuid7() -> uuid.UUID:
    global _last_ms, _counter
    with _lock:
        now_ms = time.time_ns() // 1_000_000
        if now_ms > _last_ms:
            _last_ms = now_ms
            # Top bit clear: room to count up within the millisecond.
            _counter = int.from_bytes(os.urandom(6)) >> (48 - _COUNTER_BITS + 1)
        else:
            _counter += 1
            if _counter >> _COUNTER_BITS:  # 2**41 ids in one millisecond
                _last_ms += 1
                _counter = 0
        timestamp, counter = _last_ms, _counter
    tail = int.from_bytes(os.urandom(4))
    value = (timestamp & 0xFFFF_FFFF_FFFF) << 80
    value |= 0x7 << 76  # version 7
    value |= (counter >> 30) << 64  # rand_a: the counter's top 12 bits
    value |= 0b10 << 62  # variant
    value |= (counter & 0x3FFF_FFFF) << 32  # the counter's low 30 bits
    value |= tail
    return uuid.UUID(int=value)


new_event_id = getattr(uuid, "uuid7", _uuid7)


def worker_name() -> str:
    """``host:pid``: a relay process, as ``locked_by`` on the rows it leased and
    ``last_seen_by`` on the subscriptions it has."""
    return f"{socket.gethostname()}:{os.getpid()}"
