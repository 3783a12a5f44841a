"""The id index's batch put: the same index as one put per id, and the same checks."""

from __future__ import annotations

import os

import pytest

from delayd.logs import message_log, schedule_log
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.id_index import MAX_OFFSET, IdIndex, pack_location, unpack_location
from delayd.logs.message_log import MessageRecord
from delayd.logs.schedule_reader import ScheduleReader

BUCKET = 1_790_000_000_000 - 1_790_000_000_000 % 60_000


def index_bytes(directory: str) -> dict[str, bytes]:
    names = os.listdir(directory)
    return {name: open(os.path.join(directory, name), "rb").read() for name in names}


def test_put_batch_writes_the_index_one_put_each_writes(tmp_path):
    ids = [f"order-{i}".encode() for i in range(500)]
    offsets = [i * 173 for i in range(500)]
    stamps = [BUCKET - 5_000 + i for i in range(500)]
    one_by_one = IdIndex(str(tmp_path / "a"), None)  # type: ignore[arg-type]  # no lookups
    for message_id, offset, stamp in zip(ids, offsets, stamps, strict=True):
        one_by_one.put(message_id, BUCKET, offset, stamp)
    batched = IdIndex(str(tmp_path / "b"), None)  # type: ignore[arg-type]
    batched.put_batch(ids[:200], BUCKET, offsets[:200], stamps[:200])
    batched.put_batch(ids[200:], BUCKET, offsets[200:], stamps[200:])
    for index in (one_by_one, batched):
        index.close()
    assert index_bytes(str(tmp_path / "a")) == index_bytes(str(tmp_path / "b"))
    assert batched.puts == 500


@pytest.mark.parametrize(
    ("bucket_ms", "offsets"),
    [(BUCKET, [0, -1]), (BUCKET, [MAX_OFFSET + 1]), (BUCKET + 1, [0]), (-60_000, [0])],
)
def test_put_batch_refuses_what_put_refuses(tmp_path, bucket_ms, offsets):
    index = IdIndex(str(tmp_path), None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not fit the index"):
        index.put_batch([b"x"] * len(offsets), bucket_ms, offsets, [BUCKET] * len(offsets))
    with pytest.raises(ValueError, match="does not fit the index"):
        index.put(b"x", bucket_ms, offsets[-1], BUCKET)
    index.close()


def test_locations_round_trip_at_the_edges():
    for bucket_ms, offset in [(0, 0), (BUCKET, MAX_OFFSET), (BUCKET, 12345)]:
        assert unpack_location(pack_location(bucket_ms, offset)) == (bucket_ms, offset)


def test_lookup_finds_records_appended_after_an_earlier_lookup(tmp_path):
    """The reader remembers a bucket's length between lookups; a record appended since
    is still found (the canceller looks up ids whose records were just replayed), and
    an offset that is no record boundary is not."""
    buckets = BucketFiles(str(tmp_path / "schedule_log"))
    reader = ScheduleReader(str(tmp_path / "schedule_log"))
    index = IdIndex(str(tmp_path / "index"), reader)

    def schedule(message_id: str) -> int:
        payload = scheduled_payload(message_id)
        (offset,) = buckets.append_batch(BUCKET, [payload], schedule_log.TYPE_SCHEDULED)
        buckets.flush()
        index.put(message_id.encode(), BUCKET, offset, BUCKET)
        return offset

    first = schedule("a")
    assert [loc.offset for loc in index.lookup("a")] == [first]
    later = [schedule(f"b{i}") for i in range(3)]  # the file grew past the length seen
    assert [loc.offset for loc in index.lookup("b2")] == [later[2]]
    assert reader.read_untrusted(BUCKET, later[1] + 3) is None
    assert reader.read_untrusted(BUCKET, 10**9) is None
    index.close()
    reader.close()
    buckets.close()


def scheduled_payload(message_id: str) -> bytes:
    record = MessageRecord(BUCKET + 5, 1, BUCKET, message_id, "orders", None, {}, b"body")
    return schedule_log.encode_scheduled(0, message_log.encode_record(record))
