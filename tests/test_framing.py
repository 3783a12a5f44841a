"""The record framing matches its written grammar (docs/storage-format.md)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from storage.errors import CorruptionError
from storage.framing import (
    END_OF_SEGMENT_RECORD,
    HEADER_SIZE,
    crc32c,
    encode_record,
    record_crc,
    type_seed,
)
from storage.segmented_log import SegmentedLog
from tests.intake_support import NO_SYNC_FS


def test_worked_example_of_the_docs():
    assert encode_record(b"hello", 2).hex(" ") == "05 00 00 00 30 11 a5 53 02 68 65 6c 6c 6f"
    assert END_OF_SEGMENT_RECORD.hex(" ") == "00 00 00 00 52 d0 16 a0 01"
    assert HEADER_SIZE == 9


@given(rtype=st.integers(0, 255), payload=st.binary(max_size=300))
def test_seeded_crc_equals_crc_of_type_and_payload(rtype, payload):
    expected = crc32c(bytes([rtype]) + payload)
    assert record_crc(rtype, payload) == expected
    assert crc32c(payload, type_seed(rtype)) == expected


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(garbage=st.binary(max_size=600), valid_prefix=st.integers(0, 5))
def test_random_segment_bytes_only_parse_or_are_cut_or_reported(tmp_path, garbage, valid_prefix):
    """Fuzz the segment reader: any bytes on disk either parse, are cut as a torn tail,
    or raise CorruptionError — never another exception, never a record that is not
    exactly the frame on disk at its offset. Every example reuses one directory, emptied
    first, and skips fsync: parsing is what is fuzzed, and 300 directories made and
    synced cost seconds."""
    directory = str(tmp_path)
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    written = [b"valid-%d" % i for i in range(valid_prefix)]
    path = os.path.join(directory, "0" * 20)
    with open(path, "wb") as f:
        f.write(b"".join(encode_record(p) for p in written) + garbage)
    with open(path, "rb") as f:
        on_disk = f.read()
    try:
        with SegmentedLog.open(directory, fs=NO_SYNC_FS, max_unsynced_bytes=1 << 20) as log:
            records = list(log.iter_from(0))
    except CorruptionError:
        return
    assert [r.payload for r in records[: len(written)]] == written
    for record in records:
        assert on_disk[record.offset : record.next_offset] == encode_record(
            record.payload, record.type
        )
