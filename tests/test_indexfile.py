"""IndexFile / IndexStore on real files: put and lookup, reopen, rolling, forced hash
collisions, verification through key_matches, truncation, retention, torn files, and
power loss at every crash point."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import pytest
import xxhash

from storage import indexfile
from storage.crashfs import MODES, CrashSimFileSystem
from storage.errors import CorruptionError
from storage.framing import crc32c
from storage.index_store import IndexStore, file_name
from storage.indexfile import (
    ENTRY,
    ENTRY_SIZE,
    HEADER_COPY_SIZE,
    HEADER_REGION_SIZE,
    HEADER_V1,
    SLOT_SIZE,
    IndexFile,
)
from storage.indexfile import _decode_header as decode_header
from tests.crash_support import power_loss_at_every_crash_point

SMALL = {"slot_count": 7, "max_entries": 50}


class Truth:
    """Stands in for the commitlog: which keys the record at each offset holds.

    ``key_matches`` is what the broker passes: it "reads the record" and compares, and
    counts its calls so tests can see that verification happened.
    """

    def __init__(self) -> None:
        self.keys: dict[int, set[bytes]] = {}
        self.calls = 0

    def add(self, offset: int, key: bytes | str) -> None:
        self.keys.setdefault(offset, set()).add(key.encode() if isinstance(key, str) else key)

    def key_matches(self, offset: int, key: bytes | str) -> bool:
        self.calls += 1
        data = key.encode() if isinstance(key, str) else key
        return data in self.keys.get(offset, ())

    def expected(self, key: bytes | str, put_order: list[int]) -> list[int]:
        """Offsets holding ``key``, newest put first, each once."""
        data = key.encode() if isinstance(key, str) else key
        seen: list[int] = []
        for offset in reversed(put_order):
            if data in self.keys.get(offset, ()) and offset not in seen:
                seen.append(offset)
        return seen


def always(offset: int, key: bytes | str) -> bool:
    return True


def index_files(directory: Path) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.isdigit())


def fill(store: IndexStore, truth: Truth, count: int, keys: int, start: int = 0) -> list[int]:
    """Put ``count`` records, record i at offset 100 i holding key f"k{i % keys}"."""
    order = []
    for i in range(start, start + count):
        store.put(f"k{i % keys}", 100 * i, 1_000_000 + i)
        truth.add(100 * i, f"k{i % keys}")
        order.append(100 * i)
    return order


def test_put_and_lookup_newest_first(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        order = fill(store, truth, 40, keys=6)
        for k in range(6):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)
        assert store.lookup(b"k1", truth.key_matches) == [3700, 3100, 2500, 1900, 1300, 700, 100]
        assert store.lookup("k1", truth.key_matches, max_results=2) == [3700, 3100]
        assert store.lookup("absent", truth.key_matches) == []


def test_lookups_see_unflushed_puts_and_flush_batches_the_writes(tmp_path):
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        store.put("order-1", 0, 5)
        path = store.files[0]
        empty_size = os.path.getsize(path)
        store.put("order-2", 100, 6)
        assert store.lookup("order-1", always) == [0]
        assert store.lookup("order-2", always) == [100]
        assert os.path.getsize(path) == empty_size  # nothing written yet: buffered
        store.flush()
        assert os.path.getsize(path) == empty_size + 2 * ENTRY_SIZE
        assert store.lookup("order-2", always) == [100]


def test_reopen(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        order = fill(store, truth, 30, keys=4)
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        assert store.reindex_from is None
        for k in range(4):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)
        order += fill(store, truth, 10, keys=4, start=30)
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        for k in range(4):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)


def test_full_file_rolls_to_a_new_file_named_by_its_first_offset(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=8) as store:
        order = fill(store, truth, 30, keys=3)
        assert index_files(tmp_path) == [file_name(100 * i) for i in (0, 8, 16, 24)]
        for k in range(3):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=8) as store:
        for k in range(3):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)


def test_prepare_creates_the_first_file_at_open_and_puts_fill_it(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        assert store.files == []
        store.prepare(500)
        assert index_files(tmp_path) == [file_name(500)]
        order = fill(store, truth, 3, keys=2, start=5)  # offsets 500, 600, 700
        store.prepare(900)  # there is a file: nothing to do
        assert index_files(tmp_path) == [file_name(500)]
        assert store.lookup("k1", truth.key_matches) == truth.expected("k1", order)
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        assert store.lookup("k0", truth.key_matches) == truth.expected("k0", order) == [600]


def test_two_keys_of_one_record_straddling_a_roll_get_distinct_names(tmp_path):
    with IndexStore.open(str(tmp_path), slot_count=3, max_entries=1) as store:
        store.put("message-id", 500, 1)
        store.put("business-key", 500, 1)  # same record: the new file cannot be "500"
        store.put("other", 900, 2)
        assert index_files(tmp_path) == [file_name(500), file_name(501), file_name(900)]
        assert store.lookup("business-key", always) == [500]
        assert store.lookup("message-id", always) == [500]


def test_timestamps_too_far_apart_roll(tmp_path):
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        store.put("a", 0, 1_000)
        store.put("b", 100, 1_000 + 2**32 - 1)  # the largest delta that fits
        store.put("c", 200, 1_000 + 2**32)
        assert index_files(tmp_path) == [file_name(0), file_name(200)]
        assert [store.lookup(k, always) for k in "abc"] == [[0], [100], [200]]


def _store_bytes(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in index_files(directory)}


@pytest.mark.parametrize("per_key", [False, True])
@pytest.mark.parametrize("max_entries", [1, 8, 50])
def test_put_batch_writes_exactly_what_one_put_each_writes(tmp_path, per_key, max_entries):
    """Batches of every size, across full files, negative and overflowing time deltas:
    the files are byte for byte those of one put per key."""
    rng = random.Random(max_entries * 2 + per_key)
    batches = []
    offset, base_ms = 0, 10_000
    for size in [1, 3, 0, 7, 20, 2, 13, 1, 30]:
        keys = [b"k%d" % rng.randrange(12) for _ in range(size)]
        offsets = [offset + 100 * i for i in range(size)]
        offset += 100 * size
        if size == 13:
            base_ms += 2**32  # this batch no longer fits the file's time range
        stamps = [base_ms + rng.randrange(-50, 50) for _ in range(size)]
        batches.append((keys, offsets, stamps if per_key else base_ms))
    one, many = tmp_path / "one", tmp_path / "many"
    with IndexStore.open(str(one), slot_count=5, max_entries=max_entries) as store:
        for keys, offsets, stamps in batches:
            for i, (key, at) in enumerate(zip(keys, offsets, strict=True)):
                store.put(key, at, stamps[i] if per_key else stamps)
    with IndexStore.open(str(many), slot_count=5, max_entries=max_entries) as store:
        for keys, offsets, stamps in batches:
            store.put_batch(keys, offsets, stamps)
        lookups = {k: store.lookup(b"k%d" % k, always) for k in range(12)}
    assert len(_store_bytes(many)) > 1
    assert _store_bytes(many) == _store_bytes(one)
    with IndexStore.open(str(one), slot_count=5, max_entries=max_entries) as store:
        assert {k: store.lookup(b"k%d" % k, always) for k in range(12)} == lookups


def test_put_batch_refuses_mismatched_lengths_and_bad_offsets(tmp_path):
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        with pytest.raises(ValueError):
            store.put_batch([b"a", b"b"], [1], 5)
        with pytest.raises(ValueError):
            store.put_batch([b"a"], [1], [5, 6])
        with pytest.raises(ValueError):
            store.put_batch([b"a", b"b"], [1, -1], 5)
        store.put_batch([b"a"], [1], 5)
        assert store.lookup(b"a", always) == [1]


def test_lookup_dedupes_offsets_put_twice(tmp_path):
    """The broker's reput re-puts from its checkpoint after a crash, so the same key and
    offset can be in the index twice, even in two files."""
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=4) as store:
        for _ in range(3):
            for offset in (10, 20, 30):
                store.put("dup", offset, 1)
        assert len(index_files(tmp_path)) == 3
        assert store.lookup("dup", always) == [30, 20, 10]


@pytest.mark.parametrize(
    "hash_fn",
    [lambda key: 42, lambda key: xxhash.xxh64_intdigest(key) % 3],
    ids=["constant", "three-values"],
)
def test_forced_hash_collisions_still_return_exactly_the_right_offsets(tmp_path, hash_fn):
    truth = Truth()
    options = {"slot_count": 11, "max_entries": 25, "hash_fn": hash_fn}
    with IndexStore.open(str(tmp_path), **options) as store:
        order = fill(store, truth, 60, keys=9)
        for k in range(9):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)
        # with a permissive verifier the collisions show: the hash alone is not enough
        assert len(store.lookup("k0", always, max_results=1000)) > len(truth.expected("k0", order))
    with IndexStore.open(str(tmp_path), **options) as store:
        for k in range(9):
            assert store.lookup(f"k{k}", truth.key_matches) == truth.expected(f"k{k}", order)
        assert store.lookup("k9", truth.key_matches) == []


def test_lookup_never_returns_an_offset_whose_record_does_not_match(tmp_path):
    """The record at an offset may no longer hold the key (a commitlog truncated and
    rewritten): key_matches says so, and the offset is not returned."""
    truth = Truth()
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        order = fill(store, truth, 20, keys=2)
        truth.keys[1800] = {b"someone-else"}
        truth.keys[1400] = set()
        assert store.lookup("k0", truth.key_matches) == [1600, 1200, 1000, 800, 600, 400, 200, 0]
        assert store.lookup("k0", truth.key_matches) == truth.expected("k0", order)


def test_truncate_beyond_drops_files_and_undoes_trailing_entries(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=8) as store:
        fill(store, truth, 30, keys=3)
        store.flush()
        # 2000 lies in the third file [1600, 2300]: the fourth goes whole, the third keeps
        # 1600..1900. Entries pointing at 2000 or beyond must never come back, even with a
        # verifier that accepts anything.
        assert store.truncate_beyond(2000) == 10
        assert index_files(tmp_path) == [file_name(0), file_name(800), file_name(1600)]
        for k in range(3):
            assert all(o < 2000 for o in store.lookup(f"k{k}", always, max_results=100))
        assert store.lookup("k2", always) == [1700, 1400, 1100, 800, 500, 200]
        # puts continue in the truncated file, over the undone entry numbers
        store.put("k2", 2000, 7)
        store.put("new", 2100, 8)
        assert store.lookup("k2", always)[:2] == [2000, 1700]
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=8) as store:
        assert store.lookup("k2", always)[:2] == [2000, 1700]
        assert store.lookup("new", always) == [2100]
        assert store.lookup("k1", always) == [1900, 1600, 1300, 1000, 700, 400, 100]
        assert store.truncate_beyond(0) == 22  # everything
        assert index_files(tmp_path) == []
        store.put("fresh", 0, 1)
        assert store.lookup("fresh", always) == [0]


def test_truncate_beyond_unflushed_entries(tmp_path):
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        fill(store, Truth(), 10, keys=3)
        store.flush()
        fill(store, Truth(), 10, keys=3, start=10)  # in memory only
        assert store.truncate_beyond(1500) == 5
        assert store.lookup("k0", always) == [1200, 900, 600, 300, 0]
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        assert store.lookup("k0", always) == [1200, 900, 600, 300, 0]


def test_delete_before_drops_whole_files_below(tmp_path):
    truth = Truth()
    with IndexStore.open(str(tmp_path), slot_count=5, max_entries=8) as store:
        order = fill(store, truth, 30, keys=3)
        assert store.delete_before(700) == 0  # the first file ends at 700
        assert store.delete_before(701) == 1
        assert store.delete_before(1600) == 1
        assert index_files(tmp_path) == [file_name(1600), file_name(2400)]
        kept = [o for o in order if o >= 1600]
        assert store.lookup("k0", truth.key_matches) == truth.expected("k0", kept)
        assert store.delete_before(10**9) == 1  # never the newest file
        assert index_files(tmp_path) == [file_name(2400)]


# ---------------------------------------------------------------------------- recovery


def build_file(directory: Path, flushed: int, unflushed: int = 0) -> tuple[Truth, list[int]]:
    """One index file with ``flushed`` committed entries, left open as by a kill -9."""
    truth = Truth()
    store = IndexStore.open(str(directory), slot_count=7, max_entries=1000)
    order = fill(store, truth, flushed, keys=5)
    store.flush()
    order += fill(store, truth, unflushed, keys=5, start=flushed)
    return truth, order


def entries_start(slot_count: int = 7) -> int:
    return HEADER_REGION_SIZE + slot_count * SLOT_SIZE


def test_torn_tail_at_every_byte(tmp_path):
    """The file cut anywhere in its last entries (damage: those were committed): the whole
    entries that remain are found, and reindex_from asks for a re-put of the file."""
    source = tmp_path / "source"
    truth, order = build_file(source, 20)
    name = index_files(source)[0]
    size = os.path.getsize(source / name)
    assert size == entries_start() + 20 * ENTRY_SIZE
    for cut in range(size - 3 * ENTRY_SIZE, size + 1):
        victim = tmp_path / f"cut{cut}"
        shutil.copytree(source, victim)
        os.truncate(victim / name, cut)
        whole = (cut - entries_start()) // ENTRY_SIZE
        with IndexStore.open(str(victim), slot_count=7, max_entries=1000) as store:
            for k in range(5):
                assert store.lookup(f"k{k}", always) == truth.expected(f"k{k}", order[:whole])
            assert store.reindex_from == (0 if whole < 20 else None)
            store.put("after", 5000, 1)
        assert os.path.getsize(victim / name) == entries_start() + (whole + 1) * ENTRY_SIZE
        with IndexStore.open(str(victim), slot_count=7, max_entries=1000) as store:
            assert store.reindex_from is None  # the repair was made durable
            assert store.lookup("after", always) == [5000]
            assert store.lookup("k0", always) == truth.expected("k0", order[:whole])
        shutil.rmtree(victim)


def test_entries_past_the_committed_count_are_cut_quietly(tmp_path):
    """A flush that wrote entries but crashed before its header: not committed, not lost
    (the broker's reput refills them), so no reindex is asked for."""
    truth, order = build_file(tmp_path, 12)
    path = tmp_path / index_files(tmp_path)[0]
    with open(path, "ab") as f:
        f.write(ENTRY.pack(123, 99_999, 0, 0) + b"\x01\x02\x03")
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        assert store.reindex_from is None
        assert store.lookup("k3", always) == truth.expected("k3", order)
    assert os.path.getsize(path) == entries_start() + 12 * ENTRY_SIZE


def slot_position(key: str, slot_count: int = 7) -> int:
    return (
        HEADER_REGION_SIZE
        + (xxhash.xxh64_intdigest(key.encode()) & 0xFFFFFFFF) % (slot_count) * SLOT_SIZE
    )


def test_slot_table_from_an_unfinished_flush_is_rebuilt(tmp_path):
    """Slots written by a flush whose header never made it point past the committed
    entries (or anywhere, if torn): the header's crc of the slot table exposes it and the
    table is replayed from the entries."""
    truth, order = build_file(tmp_path, 15)
    path = tmp_path / index_files(tmp_path)[0]
    with open(path, "r+b") as f:
        f.seek(slot_position("k2"))
        f.write((3).to_bytes(4, "little"))  # a plausible but wrong chain head
        f.seek(slot_position("k4"))
        f.write((40).to_bytes(4, "little"))  # an entry that does not exist
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        assert store.reindex_from is None
        for k in range(5):
            assert store.lookup(f"k{k}", always) == truth.expected(f"k{k}", order)


def test_flushes_write_the_slot_table_only_every_slot_write_entries_puts(tmp_path, monkeypatch):
    """A flush makes the entries and a header durable; the slots follow every
    SLOT_WRITE_ENTRIES puts (and at close). A kill -9 or a power loss between two slot
    writes reopens with the later entries replayed into the table."""
    monkeypatch.setattr(indexfile, "SLOT_WRITE_ENTRIES", 10)
    fs = CrashSimFileSystem()
    truth = Truth()
    store = IndexStore.open("/idx", fs=fs, slot_count=7, max_entries=1000)
    store.prepare(0)
    reader = fs.open(store.files[0], os.O_RDONLY)

    def on_disk() -> tuple[bytes, object]:
        header_region = fs.pread(reader, HEADER_REGION_SIZE, 0)
        copies = [decode_header(header_region[i : i + HEADER_COPY_SIZE]) for i in (0, 128)]
        newest = max((h for h in copies if h is not None), key=lambda h: h.seq)
        return fs.pread(reader, 7 * SLOT_SIZE, HEADER_REGION_SIZE), newest

    order = fill(store, truth, 6, keys=3)
    store.flush()
    slots, header = on_disk()
    assert slots == bytes(7 * SLOT_SIZE)  # not written
    assert (header.entry_count, header.slot_entry_count) == (6, 0)
    order += fill(store, truth, 5, keys=3, start=6)
    store.flush()
    slots, header = on_disk()
    assert slots != bytes(7 * SLOT_SIZE)
    assert (header.entry_count, header.slot_entry_count) == (11, 11)
    order += fill(store, truth, 3, keys=4, start=11)
    store.flush()
    assert on_disk()[1].slot_entry_count == 11

    fs.restart()  # kill -9: the page cache stays
    with IndexStore.open("/idx", fs=fs, slot_count=7, max_entries=1000) as reopened:
        assert reopened.reindex_from is None
        for k in range(4):
            assert reopened.lookup(f"k{k}", always) == truth.expected(f"k{k}", order)
    fs.materialize(str(tmp_path), "pages", random.Random(3))  # and then a power loss
    with IndexStore.open(str(tmp_path / "idx"), slot_count=7, max_entries=1000) as reopened:
        for k in range(4):
            assert reopened.lookup(f"k{k}", always) == truth.expected(f"k{k}", order)


def test_a_version_1_file_reads_as_slots_written_by_every_flush(tmp_path):
    """Files written before the header counted the entries in the slot table."""
    truth = Truth()
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        order = fill(store, truth, 12, keys=5)  # closing writes the slots, as v1 did
    path = tmp_path / index_files(tmp_path)[0]
    with open(path, "r+b") as f:
        for copy in (0, 1):
            f.seek(copy * HEADER_COPY_SIZE)
            header = decode_header(f.read(HEADER_COPY_SIZE))
            if header is None:
                continue
            body = HEADER_V1.pack(b"DIDX", 1, *header[:-1])
            f.seek(copy * HEADER_COPY_SIZE)
            f.write(body + crc32c(body).to_bytes(4, "little") + bytes(4))
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        assert store.reindex_from is None
        for k in range(5):
            assert store.lookup(f"k{k}", always) == truth.expected(f"k{k}", order)


def test_inconsistent_entry_ends_the_file_at_replay(tmp_path):
    """Replay checks each entry's prev link against the slot it rebuilt so far; the first
    entry that disagrees (damaged) ends the file, and reindex_from asks for a re-put."""
    truth, order = build_file(tmp_path, 15)
    path = tmp_path / index_files(tmp_path)[0]
    with open(path, "r+b") as f:
        f.seek(entries_start() + 9 * ENTRY_SIZE + 16)  # entry 10's prev field
        f.write((77).to_bytes(4, "little"))
        f.seek(slot_position("k0"))
        f.write(bytes(4))  # and a slot, so the table fails its crc
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        assert store.reindex_from == 0
        for k in range(5):
            assert store.lookup(f"k{k}", always) == truth.expected(f"k{k}", order[:9])


def test_torn_header_copy_falls_back_to_the_other(tmp_path):
    truth, order = build_file(tmp_path, 6)
    path = tmp_path / index_files(tmp_path)[0]
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        order += fill(store, truth, 4, keys=5, start=6)
    newest = IndexFile.open(str(path))._seq % 2
    with open(path, "r+b") as f:
        f.seek(newest * HEADER_COPY_SIZE + 30)
        f.write(b"\xff\xff")
    with IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000) as store:
        # The older copy commits 6 entries: the 4 after are cut and the table replayed.
        assert store.lookup("k1", always) == truth.expected("k1", order[:6])
        assert store.reindex_from is None


def test_no_valid_header_is_corruption(tmp_path):
    build_file(tmp_path, 3)
    path = tmp_path / index_files(tmp_path)[0]
    with open(path, "r+b") as f:
        f.write(bytes(HEADER_REGION_SIZE))
    with pytest.raises(CorruptionError) as info:
        IndexStore.open(str(tmp_path), slot_count=7, max_entries=1000)
    assert info.value.path == str(path)


def test_chain_pointing_forward_in_a_sealed_file_is_corruption(tmp_path):
    with IndexStore.open(str(tmp_path), slot_count=3, max_entries=4) as store:
        for i in range(6):
            store.put("x", i, 1)
    first = tmp_path / file_name(0)
    with open(first, "r+b") as f:
        f.seek(entries_start(3) + 2 * ENTRY_SIZE + 16)  # entry 3 now links to entry 3
        f.write((3).to_bytes(4, "little"))
    with (
        IndexStore.open(str(tmp_path), slot_count=3, max_entries=4) as store,
        pytest.raises(CorruptionError, match="links forward"),
    ):
        store.lookup("x", always)


def test_leftover_of_an_interrupted_creation_is_removed(tmp_path):
    (tmp_path / (file_name(700) + ".tmp")).write_bytes(b"half a file")
    with IndexStore.open(str(tmp_path), **SMALL) as store:
        assert store.files == []
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------------------- power loss

INDEX_DIR = "/data/index"
INDEX_OPTIONS = {"slot_count": 13, "max_entries": 24}


class Journal:
    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.truth = Truth()
        self.order: list[int] = []  # offsets put, in put order
        self.acked = 0  # puts below this position of order were flushed


def key_of(seed: int, i: int) -> str:
    return f"key-{random.Random(f'{seed}:{i}').randrange(12)}"


def index_workload(journal: Journal):
    def run(fs: CrashSimFileSystem) -> None:
        rng = random.Random(journal.seed)
        fs.mkdir("/data")
        fs.fsync_dir("/")
        store = IndexStore.open(INDEX_DIR, fs=fs, **INDEX_OPTIONS)
        for _ in range(80):
            if rng.random() < 0.7:
                for _ in range(rng.choice([1, 1, 3, 9])):
                    i = len(journal.order)
                    journal.truth.add(100 * i, key_of(journal.seed, i))
                    journal.order.append(100 * i)
                    store.put(key_of(journal.seed, i), 100 * i, 1_000 + i)
            else:
                pending = len(journal.order)
                store.flush()
                journal.acked = pending
        store.close()
        journal.acked = len(journal.order)

    return run


def check_index(root: Path, journal: Journal) -> None:
    with IndexStore.open(str(root) + INDEX_DIR, **INDEX_OPTIONS) as store:
        # A crash only loses what no flush committed: nothing to re-put beyond the
        # broker's checkpoint.
        assert store.reindex_from is None
        acked = journal.order[: journal.acked]
        for k in range(12):
            key = f"key-{k}"
            found = store.lookup(key, journal.truth.key_matches, max_results=1000)
            everything = store.lookup(key, always, max_results=1000)
            # every acknowledged put is found; nothing never put is even a candidate
            assert set(journal.truth.expected(key, acked)) <= set(found), key
            assert set(everything) <= set(journal.order), key
        # the recovered store takes puts
        store.put("after", 10**9, 1)
        assert store.lookup("after", always) == [10**9]


def test_index_workload_covers_rolls():
    journal = Journal(5)
    fs = CrashSimFileSystem()
    index_workload(journal)(fs)
    assert 100 <= fs.ops <= 600
    assert len(fs.listdir(INDEX_DIR)) >= 4


@pytest.mark.parametrize("mode", MODES)
def test_index_power_loss_at_every_crash_point(mode, tmp_path):
    power_loss_at_every_crash_point(lambda: Journal(5), index_workload, check_index, tmp_path, mode)
