"""`delayd inspect` against a data directory written with the project's own writers
(SegmentedLog, BucketFiles, RecordFile + dispatch_log.encode_entry, the checkpoint
files): every subcommand's output matches what was written, damage is reported as
corrupt or torn tail where it was planted, and nothing in the directory changes."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from delayd.cli.main import main
from delayd.inspect import files as inspect_files
from delayd.inspect import report
from delayd.inspect.report import WHEEL_CHECKPOINT
from delayd.logs import layout, message_log, retirement, schedule_log
from delayd.logs.bucket_files import BucketFiles
from delayd.logs.buckets import bucket_name, bucket_of
from delayd.logs.dispatch_log import EntryKind, check_group_name, encode_entry
from delayd.logs.log_files import total_bytes
from delayd.logs.message_log import MessageRecord
from delayd.replay.state import ReplayCheckpoint, ensure_segment_scale, write_replay_checkpoint
from delayd.wheel.cursor import LoadCursors
from storage.checkpoint import write_checkpoint
from storage.framing import HEADER_SIZE
from storage.fs import REAL_FS
from storage.record_file import RecordFile
from storage.segmented_log import RECOVERY_CHECKPOINT, SegmentedLog
from tests.damage_support import cut, flip_byte

T = 1_704_067_200_000  # 2024-01-01T00:00:00Z: in the past, so due times have passed
MINUTE = 60_000
COUNT = 12  # messages written
REPLAYED = 10  # of them copied into schedule_log; the last two are not yet
BINARY = 5  # the message whose body is not UTF-8


@dataclass
class Bucket:
    name: str
    records: list[tuple[int, int, MessageRecord]] = field(default_factory=list)  # offset, ml
    entries: list[tuple[int, EntryKind, int, int, str]] = field(default_factory=list)

    def offset_of(self, message_id: str) -> int:
        (offset,) = [o for o, _, m in self.records if m.message_id == message_id]
        return offset


@dataclass
class Written:
    """What the test wrote, to compare inspect's output with."""

    data: str
    messages: list[tuple[int, MessageRecord]]  # (message_log offset, record)
    buckets: dict[str, Bucket]
    replay: ReplayCheckpoint
    wheel: LoadCursors

    def bucket(self, i: int) -> Bucket:
        return self.buckets[sorted(self.buckets)[i]]

    def path(self, *parts: str) -> str:
        return os.path.join(self.data, "delay", *parts)


def message(i: int) -> MessageRecord:
    return MessageRecord(
        due_ms=T + (i % 3) * MINUTE + i,  # three buckets: 00:00, 00:01, 00:02
        sequence=i + 1,
        receive_ms=T - 5000,
        message_id=f"m-{i}",
        subject="orders",
        key="k" if i % 2 else None,
        properties={"n": str(i)} if i % 3 == 0 else {},
        body=b"\xff\x00binary" if i == BINARY else f"body {i}".encode(),
    )


def write_data_dir(data: str) -> Written:
    ensure_segment_scale(REAL_FS, data, 1)
    log = SegmentedLog.open(layout.message_log_dir(data), segment_size=300)  # ~4 a segment
    records = [message(i) for i in range(COUNT)]
    payloads = [message_log.encode_record(r) for r in records]
    offsets = log.append_batch(payloads, message_log.TYPE_MESSAGE)
    log.flush()
    log.close()

    buckets: dict[str, Bucket] = {}
    with BucketFiles(layout.schedule_log_dir(data)) as files:
        for offset, payload, record in list(zip(offsets, payloads, records, strict=True))[
            :REPLAYED
        ]:
            start = bucket_of(record.due_ms, 1)
            (at,) = files.append_batch(start, [schedule_log.encode_scheduled(offset, payload)])
            buckets.setdefault(bucket_name(start), Bucket(bucket_name(start))).records.append(
                (at, offset, record)
            )
        sizes = files.open_sizes()

    first, second, _ = sorted(buckets)
    plan = {
        # 00:00 holds m-0, m-3, m-6, m-9: every one has an entry, then COMPLETE
        first: [
            (EntryKind.DISPATCHED, "m-0", 3, "billing"),
            (EntryKind.DISPATCHED, "m-3", 7, "orders"),
            (EntryKind.DEAD_LETTERED, "m-6", 900, "orders"),
            (EntryKind.CANCELLED, "m-9", -4000, ""),
        ],
        # 00:01 holds m-1, m-4, m-7: only m-1 went out
        second: [(EntryKind.DISPATCHED, "m-1", 12, "billing")],
        # 00:02 (m-2, m-5, m-8) has no dispatch_log file at all
    }
    for name, entries in plan.items():
        bucket = buckets[name]
        path = os.path.join(layout.dispatch_log_dir(data), name)
        with RecordFile.open(path) as dispatch:
            for kind, message_id, late_ms, group in entries:
                offset = bucket.offset_of(message_id)
                due_ms = next(m.due_ms for o, _, m in bucket.records if o == offset)
                raw = check_group_name(group) if group else b""
                position = dispatch.append(encode_entry(offset, due_ms + late_ms, raw), kind)
                bucket.entries.append((position, kind, offset, due_ms + late_ms, group))
            if name == first:
                size = sizes[bucket_of(T, 1)]
                position = dispatch.append(encode_entry(size, T + MINUTE), EntryKind.COMPLETE)
                bucket.entries.append((position, EntryKind.COMPLETE, size, T + MINUTE, ""))
    second_ms = bucket_of(T + MINUTE, 1)
    replay = ReplayCheckpoint(offsets[REPLAYED], REPLAYED + 1, {second_ms: sizes[second_ms]})
    write_replay_checkpoint(REAL_FS, data, replay)
    wheel = LoadCursors(second_ms, sizes[second_ms], 100)
    write_checkpoint(
        REAL_FS, os.path.join(layout.checkpoint_dir(data), WHEEL_CHECKPOINT), wheel.to_bytes()
    )
    return Written(data, list(zip(offsets, records, strict=True)), buckets, replay, wheel)


@pytest.fixture
def written(tmp_path: Path) -> Written:
    return write_data_dir(str(tmp_path / "data"))


def inspect(capsys, data: str, *args: str) -> tuple[int, str]:
    """Run `delayd inspect --data DATA ARGS` in-process: exit status and stdout."""
    status = main(["inspect", "--data", data, *args])
    out = capsys.readouterr().out
    return status, out


def inspect_json(capsys, data: str, *args: str) -> dict:
    status, out = inspect(capsys, data, "--json", *args)
    assert status == 0, out
    return json.loads(out)


def text_lines(capsys, data: str, *args: str, status: int = 0) -> list[str]:
    got, out = inspect(capsys, data, *args)
    assert got == status, out
    lines = out.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    return lines


def segments_of(data: str) -> list[str]:
    return sorted(n for n in os.listdir(layout.message_log_dir(data)) if n.isdigit())


def message_json(m: MessageRecord) -> dict:
    out = {
        "message_id": m.message_id,
        "sequence": m.sequence,
        "due_ms": m.due_ms,
        "receive_ms": m.receive_ms,
        "subject": m.subject,
        "key": m.key,
        "properties": m.properties,
        "body_bytes": len(m.body),
    }
    if m.message_id == f"m-{BINARY}":
        out["body_base64"] = "/wBiaW5hcnk="
    else:
        out["body"] = m.body.decode()
    return out


def strip_times(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k not in ("due", "received")}


# ---------------------------------------------------------------- what was written


def test_summary_counts_what_was_written(written, capsys):
    doc = inspect_json(capsys, written.data, "summary")
    names = segments_of(written.data)
    assert len(names) >= 3  # the small segment size made the log roll
    assert [s["name"] for s in doc["message_log"]] == names
    per_segment = [
        sum(1 for offset, _ in written.messages if int(name) <= offset < int(following))
        for name, following in zip(names, [*names[1:], str(2**63)], strict=True)
    ]
    assert [s["records"] for s in doc["message_log"]] == per_segment
    assert sum(per_segment) == COUNT
    assert [s["sealed"] for s in doc["message_log"]] == [True] * (len(names) - 1) + [False]
    sizes = [os.path.getsize(os.path.join(layout.message_log_dir(written.data), n)) for n in names]
    assert [s["bytes"] for s in doc["message_log"]] == sizes

    first, second, third = (written.bucket(i) for i in range(3))
    buckets = {b["name"]: b for b in doc["buckets"]}
    assert list(buckets) == [first.name, second.name, third.name]
    for bucket in (first, second, third):
        got = buckets[bucket.name]["schedule_log"]
        assert got["records"] == len(bucket.records) and got["damage"] is None
        assert got["bytes"] == os.path.getsize(written.path("schedule_log", bucket.name))
    assert buckets[first.name]["dispatch_log"]["entries"] == {
        "dispatched": 2,
        "dead_lettered": 1,
        "cancelled": 1,
        "complete": 1,
        "rescheduled": 0,
        "not_moved": 0,
        "route": 0,
        "routed": 0,
    }
    assert buckets[first.name]["dispatch_log"]["bytes"] == 5 * (HEADER_SIZE + 32)
    assert [buckets[b.name]["undispatched"] for b in (first, second, third)] == [0, 2, 3]
    assert [buckets[b.name]["complete"] for b in (first, second, third)] == [True, False, False]
    assert buckets[second.name]["dispatch_log"]["complete_up_to"] is None
    assert buckets[third.name]["dispatch_log"] is None

    checkpoints = doc["checkpoints"]
    assert checkpoints["meta"] == {"format": 1, "segment_scale_minutes": 1}
    assert checkpoints["replay"] == {
        "position": written.replay.position,
        "next_sequence": REPLAYED + 1,
        "bucket_sizes": {second.name: os.path.getsize(written.path("schedule_log", second.name))},
    }
    wheel = checkpoints["wheel"]
    assert wheel["loading"]["bucket"] == second.name == wheel["loaded"]["bucket"]
    assert wheel["loading"]["offset"] == written.wheel.loading.offset
    assert wheel["loaded"]["offset"] == 100 and wheel["complete"] is False
    assert checkpoints["errors"] == {} and doc["damages"] == []


def test_summary_as_text(written, capsys):
    lines = text_lines(capsys, written.data, "summary")
    first, second, third = (written.bucket(i) for i in range(3))
    assert f"message_log  {len(segments_of(written.data))} segment(s)" in lines[2]
    assert lines[2].endswith(f"{COUNT} records")
    row = next(line for line in lines if line.startswith(f"  {first.name} "))
    assert row.split()[2:] == ["4", "2", "1", "1", "0", "yes"]
    row = next(line for line in lines if line.startswith(f"  {second.name} "))
    assert row.split()[2:] == ["3", "1", "0", "0", "2", "no"]
    row = next(line for line in lines if line.startswith(f"  {third.name} "))
    assert row.split()[2:] == ["3", "-", "-", "-", "3", "no"]
    assert any(line.startswith("  meta    format 1, segment_scale_minutes 1") for line in lines)
    assert any(f"position {written.replay.position:,}" in line for line in lines)
    assert any(
        line.startswith(f"  wheel   bucket {second.name} loaded 100 of") and "(loading)" in line
        for line in lines
    )
    assert lines[-1] == "damage  none"


def test_message_log_pages_through_every_record_across_segments(written, capsys):
    seen = []
    start: list[str] = []
    while True:
        doc = inspect_json(capsys, written.data, "message-log", "--limit", "5", *start)
        seen += doc["records"]
        if doc["next_offset"] is None:
            break
        start = ["--from", str(doc["next_offset"])]
    assert [r["offset"] for r in seen] == [offset for offset, _ in written.messages]
    assert [strip_times(r["message"]) for r in seen] == [
        message_json(m) for _, m in written.messages
    ]
    assert {r["segment"] for r in seen} == set(segments_of(written.data))
    assert seen[0]["message"]["due"] == "2024-01-01T00:00:00.000Z"
    lines = text_lines(capsys, written.data, "message-log", "--limit", "2")
    assert lines[1] == "@0  seq 1  due 2024-01-01T00:00:00.000Z  (+5.0 s)"
    assert lines[2] == "    id m-0  subject orders  props n=0  body 6 B 'body 0'"
    assert lines[3].startswith(f"@{written.messages[1][0]}  seq 2")
    assert lines[-1] == f"more: --from {written.messages[2][0]}"


def test_bucket_lists_its_records_with_their_dispatch_entries(written, capsys):
    first = written.bucket(0)
    doc = inspect_json(capsys, written.data, "bucket", first.name)
    assert [(r["offset"], r["message_log_offset"]) for r in doc["records"]] == [
        (offset, ml) for offset, ml, _ in first.records
    ]
    assert [strip_times(r["message"]) for r in doc["records"]] == [
        message_json(m) for _, _, m in first.records
    ]
    entries = {r["offset"]: r["dispatch"] for r in doc["records"]}
    for _, kind, offset, at_ms, group in first.entries[:-1]:  # the COMPLETE mark is no record's
        (entry,) = entries[offset]
        assert (entry["kind"], entry["at_ms"], entry["group"]) == (kind.name.lower(), at_ms, group)
    assert doc["next_offset"] is None and doc["damages"] == []

    second = written.bucket(1)
    lines = text_lines(capsys, written.data, "bucket", second.name, "--limit", "2")
    m1 = second.records[0][2]
    assert lines[1] == (
        f"@0  message_log @{second.records[0][1]}  seq 2  due 2024-01-01T00:01:00.001Z  (+1m 5s)"
    )
    assert lines[3] == "    dispatched 2024-01-01T00:01:00.013Z to group billing (12 ms after due)"
    assert m1.message_id == "m-1" and lines[2].startswith("    id m-1  subject orders  key k")
    assert lines[6] == "    no dispatch_log entry"
    assert lines[-1] == f"more: --from {second.records[2][0]}"


def test_dispatch_state_of_a_bucket(written, capsys):
    first, second = written.bucket(0), written.bucket(1)
    doc = inspect_json(capsys, written.data, "dispatch", first.name)
    assert [
        (e["position"], e["kind"], e["offset"], e["at_ms"], e["group"]) for e in doc["entries"]
    ] == [(p, k.name.lower(), o, a, g) for p, k, o, a, g in first.entries]
    assert doc["complete_up_to"] == os.path.getsize(written.path("schedule_log", first.name))
    assert doc["undispatched"] == [] and doc["schedule_records"] == 4
    doc = inspect_json(capsys, written.data, "dispatch", second.name)
    assert doc["undispatched"] == [second.offset_of("m-4"), second.offset_of("m-7")]
    assert doc["complete_up_to"] is None
    lines = text_lines(capsys, written.data, "dispatch", first.name)
    assert lines[1] == "  2 dispatched, 1 dead-lettered, 1 cancelled, 1 complete"
    assert lines[5].split() == ["0", "dispatched", "0", "2024-01-01T00:00:00.003Z", "billing"]
    lines = text_lines(capsys, written.data, "dispatch", written.bucket(2).name)
    assert lines[0].endswith("no file (nothing dispatched yet)")
    assert lines[1].startswith("schedule_log records 3, undispatched 3: @0, @")


@pytest.mark.parametrize(
    ("message_id", "status", "entry"),
    [
        ("m-0", "dispatched", ("dispatched", 3, "billing")),
        ("m-6", "dead_lettered", ("dead_lettered", 900, "orders")),
        ("m-9", "cancelled", ("cancelled", -4000, "")),
        ("m-4", "overdue", None),
        ("m-11", "not_replayed", None),
    ],
)
def test_find_says_where_a_message_is_and_what_became_of_it(
    written, capsys, message_id, status, entry
):
    doc = inspect_json(capsys, written.data, "find", message_id)
    (found,) = doc["found"]
    offset, record = next((o, m) for o, m in written.messages if m.message_id == message_id)
    assert found["status"] == status
    assert found["message_log_offset"] == offset
    assert strip_times(found["message"]) == message_json(record)
    if status == "not_replayed":
        assert found["bucket"] is None and found["dispatch"] == []
        return
    bucket = written.buckets[bucket_name(bucket_of(record.due_ms, 1))]
    assert (found["bucket"], found["bucket_offset"]) == (bucket.name, bucket.offset_of(message_id))
    if entry is None:
        assert found["dispatch"] == []
    else:
        kind, late_ms, group = entry
        (got,) = found["dispatch"]
        assert (got["kind"], got["at_ms"] - record.due_ms, got["group"]) == (kind, late_ms, group)


def test_find_as_text_and_a_message_that_is_not_there(written, capsys):
    lines = text_lines(capsys, written.data, "find", "m-0")
    assert lines[0] == "message m-0: 1 record(s)"
    assert (
        lines[1]
        == f"message_log @0 (segment {segments_of(written.data)[0]})  seq 1  subject orders"
    )
    assert lines[2] == "  received 2023-12-31T23:59:55.000Z  due 2024-01-01T00:00:00.000Z"
    assert lines[3] == f"  schedule_log {written.bucket(0).name} @0"
    assert lines[4] == "  dispatched 2024-01-01T00:00:00.003Z to group billing (3 ms after due)"
    lines = text_lines(capsys, written.data, "find", "m-11")
    assert lines[-1] == "  not in schedule_log: replay has not copied it yet"
    lines = text_lines(capsys, written.data, "find", "nope", status=1)
    assert lines == ["message nope: not found in message_log or schedule_log"]


def test_find_tells_waiting_from_overdue_by_the_time_now(written):
    record = message(4)
    for now_ms, status in ((record.due_ms - 1, "waiting"), (record.due_ms, "overdue")):
        result = report.find_message(REAL_FS, written.data, "m-4", now_ms)
        assert [f.status for f in result.found] == [status]


# ---------------------------------------------------------------- damage


@dataclass
class Planted:
    # The recovery checkpoint says the log was durable up to the last segment (as a
    # flush past checkpoint_every_bytes writes it): below it a bad record is corruption,
    # above it (within the unsynced window) a torn tail.
    corrupt_segment: str  # first (sealed) message_log segment, record 1 flipped
    corrupt_at: int  # byte position in that file
    torn_segment: str  # last message_log segment, last record cut short
    torn_at: int
    # schedule_log buckets are judged as the replayer's recovery opens them: the replay
    # checkpoint lists this one's length as durable, so a shorter file is corruption.
    torn_bucket: str  # schedule_log: last record cut short
    torn_bucket_at: int
    # No record after the replay checkpoint maps to this bucket (m-11, which would,
    # is the torn tail of message_log): recovery reopens it at its full length and never
    # cuts it, so a flipped record is corruption wherever it lies.
    flipped_bucket: str
    flipped_bucket_at: int


def plant_damage(w: Written) -> Planted:
    names = segments_of(w.data)
    first_segment = [o for o, _ in w.messages if o < int(names[1])]
    corrupt_at = first_segment[1]
    flip_byte(os.path.join(layout.message_log_dir(w.data), names[0]), corrupt_at + HEADER_SIZE + 3)
    last = os.path.join(layout.message_log_dir(w.data), names[-1])
    checkpoint = os.path.join(layout.message_log_dir(w.data), RECOVERY_CHECKPOINT)
    write_checkpoint(REAL_FS, checkpoint, int(names[-1]).to_bytes(8, "little"))
    torn_at = w.messages[-1][0] - int(names[-1])
    cut(last, os.path.getsize(last) - 4)
    second, third = w.bucket(1), w.bucket(2)
    torn_bucket_at = second.records[-1][0]
    cut(w.path("schedule_log", second.name), torn_bucket_at + 20)
    flipped_bucket_at = third.records[1][0]
    flip_byte(w.path("schedule_log", third.name), flipped_bucket_at + HEADER_SIZE + 30)
    return Planted(
        names[0],
        corrupt_at,
        names[-1],
        torn_at,
        second.name,
        torn_bucket_at,
        third.name,
        flipped_bucket_at,
    )


def test_damage_is_reported_where_it_was_planted(written, capsys):
    planted = plant_damage(written)
    doc = inspect_json(capsys, written.data, "summary")
    damages = [(d["kind"], os.path.basename(d["file"]), d["position"]) for d in doc["damages"]]
    assert damages == [
        ("corrupt", planted.corrupt_segment, planted.corrupt_at),
        ("torn tail", planted.torn_segment, planted.torn_at),
        ("corrupt", planted.torn_bucket, planted.torn_bucket_at),
        ("corrupt", planted.flipped_bucket, planted.flipped_bucket_at),
    ]
    reasons = [d["reason"] for d in doc["damages"]]
    assert reasons[0] == "crc mismatch" and "runs past the end" in reasons[1]
    segments = doc["message_log"]
    assert segments[0]["records"] == 1  # the scan of that file stops at the bad record
    assert (
        segments[-1]["records"]
        == sum(1 for o, _ in written.messages if o >= int(planted.torn_segment)) - 1
    )
    buckets = {b["name"]: b["schedule_log"] for b in doc["buckets"]}
    assert buckets[planted.torn_bucket]["records"] == 2
    assert buckets[planted.flipped_bucket]["records"] == 1

    lines = text_lines(capsys, written.data, "summary")
    marked = [line.split()[1] for line in lines if line.startswith("! ")]
    assert marked == [
        planted.corrupt_segment,
        planted.torn_segment,
        *sorted([planted.torn_bucket, planted.flipped_bucket]),
    ]
    at = lines.index("damage  4")
    assert lines[at + 1].split()[:4] == [
        "corrupt",
        f"delay/message_log/{planted.corrupt_segment}",
        "@",
        str(planted.corrupt_at),
    ]
    assert lines[at + 2].strip() == "crc mismatch"
    assert lines[at + 5].startswith(f"  corrupt    delay/schedule_log/{planted.torn_bucket} @ ")


def test_a_segment_before_the_last_cut_short_is_corrupt_not_torn(written, capsys):
    # Only the last segment is written to: an earlier one ending mid-record lost
    # bytes that were once durable (its marker and part of its last record).
    names = segments_of(written.data)
    middle = os.path.join(layout.message_log_dir(written.data), names[1])
    cut(middle, os.path.getsize(middle) - 12)
    last_in_middle = max(o for o, _ in written.messages if o < int(names[2])) - int(names[1])
    doc = inspect_json(capsys, written.data, "summary")
    ((kind, file, position, reason),) = [
        (d["kind"], d["file"], d["position"], d["reason"]) for d in doc["damages"]
    ]
    assert (kind, file, position) == ("corrupt", middle, last_in_middle)
    assert "runs past the end" in reason


def test_listings_stop_at_damage_in_a_file_and_go_on_in_the_next(written, capsys):
    planted = plant_damage(written)
    doc = inspect_json(capsys, written.data, "message-log", "--limit", "100")
    offsets = [r["offset"] for r in doc["records"]]
    second_base = int(segments_of(written.data)[1])
    expected = [
        o
        for o, _ in written.messages[:-1]  # the torn last record is not one
        if o < planted.corrupt_at or o >= second_base  # nothing after the bad one in its file
    ]
    assert offsets == expected
    assert [d["kind"] for d in doc["damages"]] == ["corrupt", "torn tail"]
    doc = inspect_json(capsys, written.data, "bucket", planted.flipped_bucket)
    assert [r["offset"] for r in doc["records"]] == [0]
    ((kind, position),) = [(d["kind"], d["position"]) for d in doc["damages"]]
    assert (kind, position) == ("corrupt", planted.flipped_bucket_at)
    lines = text_lines(capsys, written.data, "bucket", planted.flipped_bucket)
    assert lines[-3] == "damage"
    assert lines[-2].startswith(f"  corrupt    delay/schedule_log/{planted.flipped_bucket} @ ")


def test_zero_filled_tail_is_torn_and_an_unreadable_entry_is_corrupt(written, capsys):
    third = written.bucket(2)
    path = written.path("schedule_log", third.name)
    size = os.path.getsize(path)
    with open(path, "ab") as f:
        f.write(bytes(4096))  # what a crash that extended the file can leave
    second = written.bucket(1)
    dispatch_path = written.path("dispatch_log", second.name)
    with RecordFile.open(dispatch_path) as dispatch:  # a crc that holds, a type unknown
        position = dispatch.append(encode_entry(0, T), 99)
    doc = inspect_json(capsys, written.data, "summary")
    assert [(d["kind"], d["file"], d["position"]) for d in doc["damages"]] == [
        ("corrupt", dispatch_path, position),
        ("torn tail", path, size),
    ]
    assert "dispatch_log entry of type 9" in doc["damages"][0]["reason"]
    doc = inspect_json(capsys, written.data, "dispatch", second.name)
    assert [e["kind"] for e in doc["entries"]] == ["dispatched"]  # what came before it


def test_an_unreadable_checkpoint_is_named_and_the_rest_still_shown(written, capsys):
    flip_byte(layout.replay_checkpoint_path(written.data), 20)
    doc = inspect_json(capsys, written.data, "checkpoints")
    assert doc["replay"] is None and doc["meta"]["segment_scale_minutes"] == 1
    assert "crc mismatch" in doc["errors"]["replay"]
    lines = text_lines(capsys, written.data, "checkpoints")
    assert any(
        line.startswith("  replay  UNREADABLE: checkpoint magic, length or crc") for line in lines
    )
    assert any(line.startswith("  wheel   bucket") for line in lines)


def test_nothing_in_the_data_directory_changes(written, capsys):
    plant_damage(written)

    def snapshot() -> dict[str, tuple[bytes, int]]:
        found = {}
        for directory, _, names in os.walk(written.data):
            for name in names:
                path = os.path.join(directory, name)
                with open(path, "rb") as f:
                    found[path] = (f.read(), os.stat(path).st_mtime_ns)
        return found

    before = snapshot()
    bucket = written.bucket(1).name
    for args in (
        ["summary"],
        ["message-log"],
        ["bucket", bucket],
        ["dispatch", bucket],
        ["checkpoints"],
        ["find", "m-4"],
    ):
        for fmt in ([], ["--json"]):
            inspect(capsys, written.data, *fmt, *args)
    assert snapshot() == before


# ---------------------------------------------------------------- progress, errors


def test_progress_accounts_for_every_byte_scanned(written, monkeypatch):
    plant_damage(written)
    monkeypatch.setattr(inspect_files, "PROGRESS_EVERY_RECORDS", 1)
    steps: list[int] = []
    report.summary(REAL_FS, written.data, steps.append)
    assert sum(steps) == total_bytes(written.data)
    assert all(step >= 0 for step in steps) and len(steps) > COUNT
    steps.clear()
    report.find_message(REAL_FS, written.data, "m-1", T, steps.append)
    scanned = total_bytes(written.data) - sum(
        os.path.getsize(os.path.join(layout.dispatch_log_dir(written.data), n))
        for n in os.listdir(layout.dispatch_log_dir(written.data))
    )
    assert sum(steps) == scanned  # find reads dispatch_log without counting it


def test_requests_that_cannot_be_answered(written, tmp_path, capsys):
    status = main(["inspect", "--data", str(tmp_path / "nothing"), "summary"])
    assert status == 2 and "not a delayd data directory" in capsys.readouterr().err
    status = main(["inspect", "--data", written.data, "bucket", "202613011200"])
    assert status == 2 and "not a valid UTC time" in capsys.readouterr().err
    status = main(["inspect", "--data", written.data, "bucket", "202401010059"])
    assert status == 2 and "no bucket 202401010059" in capsys.readouterr().err
    status = main(["inspect", "summary"])
    assert status == 2 and "--data DIR is required" in capsys.readouterr().err
    # --data and --json also after the subcommand
    status = main(["inspect", "checkpoints", "--data", written.data, "--json"])
    assert status == 0 and json.loads(capsys.readouterr().out)["meta"]["format"] == 1


def test_message_log_shows_a_bucket_retirement_with_its_bucket(tmp_path, capsys):
    data = str(tmp_path)
    ensure_segment_scale(REAL_FS, data, 1)
    start_ms = 1_795_341_600_000
    payload = retirement.encode(retirement.Retirement(start_ms, 1370, start_ms + 60_000))
    with SegmentedLog.open(layout.message_log_dir(data)) as log:
        log.append_batch([payload], message_log.TYPE_RETIRE_BUCKET)
    (row,) = inspect_json(capsys, data, "message-log")["records"]
    assert (row["type"], row["retired_bucket"], row["message"]) == (
        "retire_bucket",
        bucket_name(start_ms),
        None,
    )
    lines = text_lines(capsys, data, "message-log")
    assert lines[1] == f"@0  retire_bucket  bucket {bucket_name(start_ms)}"
