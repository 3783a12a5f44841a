"""Message ids made where a message has none (the clients, the HTTP API): 32 hex
digits, ordered by creation time.

Layout, as UUIDv7 and ULID: 48 bits of Unix time in milliseconds, then 80 bits that are
random at the first id of each millisecond and counted up by one for every further id
in the same millisecond ("monotonic" ULIDs). So ids sort by creation time within a
process, two processes collide only if their random 80 bits meet in the same
millisecond, and making an id costs no system call after the first in a millisecond.

The message id is the broker's deduplication key: a producer that retries a send whose
acknowledgement was lost sends the same id again and the broker stores it once.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

_RANDOM_BITS = 80
_RANDOM_MASK = (1 << _RANDOM_BITS) - 1


def _urandom_bits() -> int:
    return int.from_bytes(os.urandom(_RANDOM_BITS // 8), "big")


def _now_ms() -> int:
    return time.time_ns() // 1_000_000


class MessageIds:
    """A source of unique, time-ordered message ids (thread-safe).

    ``clock_ms`` returns Unix time in ms, ``random_bits`` an int of 80 random bits; both
    are injectable for tests.
    """

    def __init__(
        self,
        *,
        clock_ms: Callable[[], int] = _now_ms,
        random_bits: Callable[[], int] = _urandom_bits,
    ) -> None:
        self._clock_ms = clock_ms
        self._random_bits = random_bits
        self._lock = threading.Lock()
        self._last_ms = -1
        self._last_random = 0

    def reset(self) -> None:
        """Forget the last id, so the next one draws fresh random bits.

        Called in a forked child: parent and child would otherwise count up from the
        same value in the same millisecond and make the same ids.
        """
        with self._lock:
            self._last_ms = -1

    def new(self) -> str:
        """A new id: 12 hex digits of ms timestamp, then 20 of random-or-counter."""
        with self._lock:
            now_ms = self._clock_ms()
            if now_ms > self._last_ms:
                self._last_ms = now_ms
                self._last_random = self._random_bits() & _RANDOM_MASK
            else:
                # Same millisecond (or the clock stepped back): count up from the last id,
                # which keeps ids ordered and unique within this process. On overflow of
                # the 80 bits, borrow the next millisecond.
                self._last_random += 1
                if self._last_random > _RANDOM_MASK:
                    self._last_ms += 1
                    self._last_random = 0
            return f"{self._last_ms & 0xFFFF_FFFF_FFFF:012x}{self._last_random:020x}"


_DEFAULT = MessageIds()
os.register_at_fork(after_in_child=_DEFAULT.reset)


def new_message_id() -> str:
    """A new unique, time-ordered message id (32 lowercase hex digits)."""
    return _DEFAULT.new()
