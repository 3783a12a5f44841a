"""IdIndex: message id -> the schedule_log records that hold it, on disk.

Cancel and reschedule name a message by its id; the replayer must find its bucket and
offset without a dict of every pending message in memory (10 million pending messages
would cost gigabytes). storage's IndexStore (RocketMQ's IndexFile: a hash slot table and
chained entries in a file) maps a key to 64-bit values; here the value is a schedule_log
location, packed::

    location := bucket_minute:28 offset:36         bucket_minute = bucket start ms / 60,000
    value    = bucket_minute << 36 | offset         (years up to 2480, 64 GiB per bucket)

The replayer puts one entry per record it appends (messages, and the copies a reschedule
writes). Hash collisions and stale entries (an entry that survived a crash for a record
recovery cut) are harmless: ``lookup`` reads the record at every candidate and keeps
only those whose id matches, as the broker does with its own index. Only the active
file's slot table (4 MB) and the entries put since the last flush are in memory.

The index is derived data: the replayer flushes it before each replay checkpoint, so
every record below the checkpoint is indexed durably, and after a crash the records
past it are replayed — and indexed — again (lookups drop the repeated values).
"""

from __future__ import annotations

from dataclasses import dataclass

from delayd.logs import message_log, schedule_log
from delayd.logs.schedule_reader import ScheduleReader
from storage.fs import REAL_FS, FileSystem
from storage.index_store import IndexStore
from storage.indexfile import DEFAULT_SLOT_COUNT

MINUTE_MS = 60_000
OFFSET_BITS = 36
MINUTE_BITS = 64 - OFFSET_BITS  # 28
MAX_OFFSET = (1 << OFFSET_BITS) - 1
MAX_MINUTE = (1 << MINUTE_BITS) - 1
MAX_RESULTS = 64


def pack_location(bucket_ms: int, offset: int) -> int:
    """The index value of (bucket, offset). Raises ValueError outside the ranges above."""
    minute, rest = divmod(bucket_ms, MINUTE_MS)
    if rest or not 0 <= minute <= MAX_MINUTE or not 0 <= offset <= MAX_OFFSET:
        raise ValueError(f"schedule_log location ({bucket_ms}, {offset}) does not fit the index")
    return minute << OFFSET_BITS | offset


def unpack_location(value: int) -> tuple[int, int]:
    """(bucket start ms, offset) of an index value."""
    return (value >> OFFSET_BITS) * MINUTE_MS, value & MAX_OFFSET


def scheduled_id(payload: bytes | memoryview) -> bytes:
    """The message id bytes of a SCHEDULED payload, without decoding the rest."""
    return message_log.message_id_of(payload, schedule_log.PREFIX_SIZE)


@dataclass(frozen=True, slots=True)
class Location:
    """A schedule_log record holding the id looked up, and its payload."""

    bucket_ms: int
    offset: int
    payload: bytes

    @property
    def message_log_offset(self) -> int:
        return schedule_log.message_log_offset_of(self.payload)

    @property
    def due_ms(self) -> int:
        return schedule_log.due_ms_of(self.payload)


class IdIndex:
    """The id index of one data directory; one thread at a time, except ``flush``,
    which may run in a worker thread while puts go on (IndexStore's rule)."""

    def __init__(
        self,
        directory: str,
        reader: ScheduleReader,
        *,
        fs: FileSystem = REAL_FS,
        slot_count: int = DEFAULT_SLOT_COUNT,
    ) -> None:
        self.store = IndexStore.open(directory, fs=fs, slot_count=slot_count)
        self.reader = reader  # its own descriptors: lookups read records back
        self.puts = 0
        self.lookups = 0

    def put(self, message_id: bytes, bucket_ms: int, offset: int, timestamp_ms: int) -> None:
        """Index ``message_id`` -> (bucket, offset); ``timestamp_ms`` (the message's
        receive time) only dates the index file."""
        self.store.put(message_id, pack_location(bucket_ms, offset), timestamp_ms)
        self.puts += 1

    def put_batch(
        self,
        message_ids: list[bytes],
        bucket_ms: int,
        offsets: list[int],
        timestamps_ms: list[int],
    ) -> None:
        """``put`` of ``message_ids[i]`` -> (bucket, ``offsets[i]``) at ``timestamps_ms[i]``
        for every ``i``: the same entries, with one IndexStore call for the batch."""
        if not offsets:
            return
        # pack_location's checks once for the batch, not once per offset.
        base = pack_location(bucket_ms, 0)
        if min(offsets) < 0 or max(offsets) > MAX_OFFSET:
            pack_location(bucket_ms, min(offsets) if min(offsets) < 0 else max(offsets))
        values = [base | offset for offset in offsets]
        self.store.put_batch(message_ids, values, timestamps_ms)
        self.puts += len(message_ids)

    def lookup(self, message_id: str | bytes) -> list[Location]:
        """The schedule_log records holding ``message_id`` (bytes: UTF-8), newest put
        first (at most MAX_RESULTS). Raises CorruptionError for a damaged index chain."""
        self.lookups += 1
        wanted = message_id if isinstance(message_id, bytes) else message_id.encode()
        found: dict[int, bytes] = {}

        def matches(value: int, _key: object) -> bool:
            bucket_ms, offset = unpack_location(value)
            payload = self.reader.read_untrusted(bucket_ms, offset)
            # None or another id: a stale entry (its record was cut) or a collision.
            if (
                payload is None
                or len(payload) < schedule_log.HEAD_SIZE
                or scheduled_id(payload) != wanted
            ):
                return False
            found[value] = payload
            return True

        values = self.store.lookup(wanted, matches, MAX_RESULTS)
        return [Location(*unpack_location(v), found[v]) for v in values]

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()
