"""Idempotent intake in process: storage's HashFilter and read_key_hashes, KnownIds over
a real id index, and the Receiver + IntakePath deciding DUPLICATE — before and after
replay, across a reopen (index lookups while the filter warms, none once warm), after a
failed append (the ids are not held), and after a power loss on the crash simulator."""

from __future__ import annotations

import errno
import os
import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from delayd.logs import layout
from delayd.logs.known_ids import (
    ENTRIES_PER_WORD,
    HEADROOM,
    MIN_WORD_BITS,
    KnownIds,
    word_bits_for,
)
from delayd.logs.message_log import TYPE_MESSAGE
from delayd.protocol import Message, ResultCode
from delayd.replay import open_replayer
from delayd.server.intake import IntakePath
from delayd.server.receiver import IntakeLimits, Receiver
from storage.crashfs import CrashSimFileSystem
from storage.flusher import LogWriter
from storage.fs import REAL_FS, FileSystem, OsFileSystem
from storage.hashfilter import MAX_WORD_BITS, HashFilter
from storage.index_hashes import read_key_hashes
from storage.index_store import IndexStore
from storage.indexfile import default_hash
from storage.segmented_log import SegmentedLog
from tests.trio_support import running

NOW = 1_795_341_600_000

# ------------------------------------------------------------------ HashFilter


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), max_size=300), st.sampled_from([8, 16, 20, 21, 22, 26]))
def test_a_filter_never_forgets_a_hash_and_only_its_low_32_bits_count(hashes, word_bits):
    f = HashFilter(word_bits)  # 8: many collisions, still no false "absent"
    f.add_many(hashes)
    assert all(f.may_contain(h) for h in hashes)
    assert all(f.may_contain(h & 0xFFFFFFFF) for h in hashes)  # as rebuilt from an index
    rebuilt = HashFilter(word_bits)
    rebuilt.add_all([h & 0xFFFFFFFF for h in hashes])
    assert all(rebuilt.may_contain(h) for h in hashes)
    f.close()
    rebuilt.close()


def test_add_many_answers_which_may_have_been_in_and_the_false_rate_is_low():
    rnd = random.Random(7)
    f = HashFilter(word_bits=14)  # 16,384 words, 65,536 hashes: 4 a word, a full filter
    added = [rnd.getrandbits(64) for _ in range(65_536)]
    maybes = f.add_many(added)
    assert maybes is not None and len(maybes) < 0.02 * len(added)
    assert f.add_many(added) == added  # each in now
    assert f.add_many(iter([added[0], 12345, added[0]])) == [added[0], added[0]]
    others = [rnd.getrandbits(64) for _ in range(50_000)]
    false_rate = sum(map(f.may_contain, others)) / len(others)
    assert 0.005 < false_rate < 0.025  # 1.7 % measured at this load
    assert HashFilter(word_bits=14).add_many(others[:100]) is None  # none in an empty one
    f.close()


@pytest.mark.parametrize(("word_bits", "measured"), [(20, 0.014), (22, 0.015), (24, 0.026)])
def test_a_big_filters_words_and_masks_are_independent(word_bits, measured):
    # Four hashes in each of 4,096 of the filter's words, and probes of those words: a
    # filter past 2**20 words has fewer than 12 hash bits left for its masks, and masks
    # read from bits that also pick the word crowd each word's bits (3.2 % at 2**22
    # words, 7.2 % at 2**24). At 2**24 equal 32-bit hashes alone make 1.6 %.
    rnd = random.Random(5)
    f = HashFilter(word_bits)
    low_bits = 32 - word_bits
    words = rnd.sample(range(1 << word_bits), 4096)
    f.add_all([w << low_bits | rnd.getrandbits(low_bits) for w in words for _ in range(4)])
    probes = [rnd.choice(words) << low_bits | rnd.getrandbits(low_bits) for _ in range(100_000)]
    false_rate = sum(map(f.may_contain, probes)) / len(probes)
    assert false_rate == pytest.approx(measured, abs=0.004)
    f.close()


def test_the_size_is_checked():
    with pytest.raises(ValueError, match="word_bits"):
        HashFilter(word_bits=40)
    assert HashFilter(word_bits=12).size_bytes == 32 * 1024


def test_read_key_hashes_lists_every_entry_flushed_pending_and_rolled(tmp_path):
    keys = [f"id-{i}".encode() for i in range(250)]
    with IndexStore.open(str(tmp_path), slot_count=31, max_entries=100) as store:
        for n, key in enumerate(keys[:180]):
            store.put(key, n, NOW)
        store.flush()  # the first file sealed, the second partly on disk
        for n, key in enumerate(keys[180:], 180):
            store.put(key, n, NOW)  # pending, in memory
        sources = store.hash_sources()
        assert len(sources) == 3
        listed = [h for source in sources for chunk in read_key_hashes(source) for h in chunk]
    assert listed == [default_hash(k) & 0xFFFFFFFF for k in keys]


# ------------------------------------------------------------------ KnownIds and intake


def make_intake(data: str, fs: FileSystem, word_bits: int = 16) -> tuple[IntakePath, KnownIds]:
    log = SegmentedLog.open(layout.message_log_dir(data), fs=fs)
    replayer = open_replayer(data, log, segment_scale=1, fs=fs)
    assert replayer.index is not None
    known = KnownIds(replayer.index, word_bits=word_bits)
    replayer.known = known
    receiver = Receiver(IntakeLimits(), replayer.recovery.next_sequence, known)
    intake = IntakePath(receiver, LogWriter(log), replayer, clock=lambda: NOW)
    assert not intake.ids_ready.is_set()  # the server sets it once replay caught up
    intake.ids_ready.set()  # the tests replay what the log held themselves, first
    return intake, known


def close(intake: IntakePath, known: KnownIds) -> None:
    try:
        intake.replayer.close()
        intake.log.close()
    finally:
        known.close()


def message(message_id: str, delay_ms: int = 1000, body: bytes = b"x") -> Message:
    return Message(message_id, "orders", body=body, delay_ms=delay_ms)


def codes(results) -> list[ResultCode]:
    return [r.code for r in results]


async def test_duplicates_in_a_batch_before_replay_after_replay_and_after_a_reopen(tmp_path):
    data = str(tmp_path)
    intake, known = make_intake(data, REAL_FS)
    try:
        async with running(intake.writer.run):
            first = await intake.send_batch([message("a", 5000), message("a", 9), message("b")])
            assert codes(first) == [ResultCode.OK, ResultCode.DUPLICATE, ResultCode.OK]
            assert first[1].due_ms == NOW + 5000  # the held message's due time
            assert known.unindexed_count == 2  # accepted, not replayed yet
            again = await intake.send_batch([message("a", 1), message("c")])
            assert codes(again) == [ResultCode.DUPLICATE, ResultCode.OK]
            intake.replayer.replay_available()
            assert known.unindexed_count == 0  # the index answers for them now
            after = await intake.send_batch([message("b", 70), message("a", 70)])
            assert codes(after) == [ResultCode.DUPLICATE] * 2
            assert [r.due_ms for r in after] == [NOW + 1000, NOW + 5000]
        intake.replayer.checkpoint()
        assert intake.receiver.duplicate_total == 4
        assert intake.receiver.accepted_total == 3
    finally:
        close(intake, known)

    intake, known = make_intake(data, REAL_FS)  # a restart: the filter starts cold
    try:
        async with running(intake.writer.run):
            lookups = known.lookups
            results = await intake.send_batch([message("a"), message("c"), message("d")])
            assert codes(results) == [ResultCode.DUPLICATE, ResultCode.DUPLICATE, ResultCode.OK]
            assert known.lookups == lookups + 3  # cold: every id looked up in the index
            built = known.build_filter(known.begin_rebuild())
            assert built is not None
            assert known.finish_rebuild(built) and known.warm
            assert built.added == 4  # a, b, c indexed before this run; d claimed
            lookups = known.lookups
            fresh = await intake.send_batch([message(f"new-{i}") for i in range(200)])
            assert codes(fresh) == [ResultCode.OK] * 200
            assert known.lookups - lookups < 10  # warm: new ids are not looked up
            resent = await intake.send_batch([message("b"), message("new-7")])
            assert codes(resent) == [ResultCode.DUPLICATE] * 2
    finally:
        close(intake, known)


async def test_held_answers_as_a_send_would_and_adds_nothing(tmp_path):
    """HELD_IDS (KnownIds.held): each id's held due time, before and after replay, cold
    and warm; an id it was asked about is not held by being asked (a warm filter still
    rules it out, and a send of it is OK)."""
    intake, known = make_intake(str(tmp_path), REAL_FS)
    try:
        async with running(intake.writer.run):
            await intake.send_batch([message("a", 5000), message("b", 7)])
            assert await intake.held(["a", "b", "x"]) == [NOW + 5000, NOW + 7, None]
            intake.replayer.replay_available()
            assert known.unindexed_count == 0
            assert await intake.held(["b", "a", "x"]) == [NOW + 7, NOW + 5000, None]
            assert known.finish_rebuild(known.build_filter(known.begin_rebuild()))
            lookups = known.lookups
            asked = [f"never-{i}" for i in range(200)]
            assert await intake.held([*asked, "a"]) == [None] * 200 + [NOW + 5000]
            assert known.lookups - lookups < 10  # warm: the filter rules most ids out
            assert not any(known.filter.may_contain(default_hash(i.encode())) for i in asked[:3])
            sent = await intake.send_batch([message(asked[0]), message("a", 1)])
            assert codes(sent) == [ResultCode.OK, ResultCode.DUPLICATE]
            assert sent[1].due_ms == (await intake.held(["a"]))[0]
    finally:
        close(intake, known)


class FullDiskOnce(OsFileSystem):
    """The real file system, with the next ``pwrite`` failing with ENOSPC when armed."""

    armed = False

    def pwrite(self, fd, data, offset):
        if self.armed:
            self.armed = False
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().pwrite(fd, data, offset)


async def test_ids_of_an_append_refused_for_a_full_disk_are_not_held(tmp_path):
    fs = FullDiskOnce()
    intake, known = make_intake(str(tmp_path), fs)
    try:
        async with running(intake.writer.run):
            end = intake.log.end_offset
            fs.armed = True
            refused = intake.append([message("lost-1"), message("lost-2")])
            assert [r.code for r in refused.results] == [ResultCode.DISK_FULL] * 2
            assert intake.log.end_offset == end
            assert known.unindexed_count == 0
            # The retry is a new send, not a DUPLICATE of what was never stored.
            again = await intake.send_batch([message("lost-1"), message("lost-2")])
            assert codes(again) == [ResultCode.OK] * 2
    finally:
        close(intake, known)


async def test_a_power_loss_forgets_only_what_was_never_acknowledged(tmp_path):
    fs = CrashSimFileSystem()
    fs.mkdir("/data")
    fs.fsync_dir("/")
    intake, known = make_intake("/data", fs)
    async with running(intake.writer.run):
        acked = await intake.send_batch([message(f"acked-{i}") for i in range(20)])
        assert codes(acked) == [ResultCode.OK] * 20
        intake.append([message("unacked")])  # appended, never made durable
        fs.materialize(str(tmp_path / "after"), "drop", random.Random(3))
    close(intake, known)

    intake, known = make_intake(str(tmp_path / "after" / "data"), REAL_FS)
    try:
        async with running(intake.writer.run):
            intake.replayer.replay_available()  # what the server's start-up catch-up does
            results = await intake.send_batch([message("acked-3"), message("unacked")])
            # The acknowledged id is held; the one never acknowledged may be sent again.
            assert codes(results) == [ResultCode.DUPLICATE, ResultCode.OK]
    finally:
        close(intake, known)


async def test_warming_skips_a_deleted_index_file_and_gives_up_on_an_unreadable_one(tmp_path):
    data = str(tmp_path)
    intake, known = make_intake(data, REAL_FS)
    try:
        async with running(intake.writer.run):
            await intake.send_batch([message("a"), message("b")])
        intake.replayer.replay_available()
        intake.replayer.checkpoint()  # flushed: the entries are read from the file
        plan = known.begin_rebuild()
        (source,) = plan.sources
        closed = source._replace(fd=os.open(os.devnull, os.O_WRONLY))  # reads fail
        os.close(closed.fd)
        assert known.build_filter(replace(plan, sources=[closed])) is None  # it is there
        gone = closed._replace(path=str(tmp_path / "deleted-by-retention"))
        built = known.build_filter(replace(plan, sources=[gone, source]))
        assert built is not None and built.added == 2  # a deleted file holds no ids
        assert known.finish_rebuild(built)
    finally:
        close(intake, known)


async def test_the_filter_is_rebuilt_bigger_when_full_and_keeps_every_id(tmp_path):
    intake, known = make_intake(str(tmp_path), REAL_FS, word_bits=12)  # 16,384 ids
    full = []
    known.on_full = lambda: full.append(known.held_estimate)
    try:
        known.warm = True  # the index is empty: the empty filter holds every id held
        capacity = known.capacity
        sent = [message(f"m-{i}") for i in range(capacity + 1000)]
        async with running(intake.writer.run):
            for start in range(0, len(sent), 4000):
                await intake.send_batch(sent[start : start + 4000])
                intake.replayer.replay_available()
            assert full and full[0] > capacity  # told once the filter held too many
            plan = known.begin_rebuild()
            during = await intake.send_batch([message("during-1"), message("during-2")])
            assert codes(during) == [ResultCode.OK] * 2
            built = known.build_filter(plan)
            assert built is not None
            assert not known.finish_rebuild(built, max_hashes=1)  # one recorded id left
            assert known.finish_rebuild(built, max_hashes=1)
            assert known.filter is built and built.word_bits == MIN_WORD_BITS > 12
            lookups = known.lookups
            again = await intake.send_batch([*sent[::500], message("during-2"), message("fresh")])
            held = len(sent[::500]) + 1
            assert codes(again) == [ResultCode.DUPLICATE] * held + [ResultCode.OK]
            assert known.lookups - lookups <= held + 1  # the held ones (and a false maybe)
    finally:
        close(intake, known)


@pytest.mark.parametrize("word_bits", [MIN_WORD_BITS, MIN_WORD_BITS + 2, MAX_WORD_BITS - 2])
def test_a_filter_that_filled_is_rebuilt_four_times_as_big_not_eight(word_bits):
    # on_full fires once the filter holds just over its capacity, a power of two.
    held = (1 << word_bits) * ENTRIES_PER_WORD + 1
    assert word_bits_for(held) == word_bits + 2


@given(st.integers(0, (1 << MAX_WORD_BITS) * ENTRIES_PER_WORD // HEADROOM))
def test_a_filter_is_built_for_half_of_headroom_to_headroom_times_the_ids(ids):
    capacity = (1 << word_bits_for(ids)) * ENTRIES_PER_WORD
    assert capacity >= ids * HEADROOM // 2
    if word_bits_for(ids) > MIN_WORD_BITS:
        assert capacity <= ids * HEADROOM


async def test_replay_steps_past_a_segment_marker_at_the_durable_end(tmp_path):
    """A crash between a segment's END_OF_SEGMENT marker and the next segment's file
    leaves the durable end 9 bytes past the last record. Replay must step past it:
    intake waits for the start-up catch-up, and only a send could bring a record."""
    data = str(tmp_path)
    directory = layout.message_log_dir(data)
    payloads = (
        Receiver(IntakeLimits(), 1)
        .accept([message(f"m-{i}", body=b"x" * 1100) for i in range(4)], NOW)
        .payloads
    )
    crashed = SegmentedLog.open(directory, segment_size=4096)
    crashed.append_batch(payloads[:3], TYPE_MESSAGE)  # fills most of the first segment
    crashed.flush()
    crashed.append_batch(payloads[3:], TYPE_MESSAGE)  # rolls: a marker, a second segment
    segments = sorted(os.listdir(directory))  # never flushed, never closed: a crash
    assert len(segments) == 2
    os.unlink(os.path.join(directory, segments[-1]))  # the crash: no second segment
    log = SegmentedLog.open(directory, segment_size=4096)
    replayer = open_replayer(data, log, segment_scale=1, index=False)
    try:
        assert replayer.replay_available() == 3  # the three before the marker
        assert replayer.position < log.durable_offset
        assert replayer.replay_available() == 0
        assert replayer.position == log.durable_offset
    finally:
        replayer.close()
        log.close()
