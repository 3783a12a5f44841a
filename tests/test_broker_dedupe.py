"""IdWindow: exact with forced fingerprint collisions, FIFO and age eviction, and the
backward-shift deletion checked against a model. Time is passed in (now_ms)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from delayd.broker.dedupe import MARK_MS, IdWindow, table_size_for


class FakeLog:
    """Records by commitlog offset: what read_id consults to verify a fingerprint hit."""

    def __init__(self) -> None:
        self.records: dict[int, bytes] = {}
        self.reads = 0

    def store(self, message_id: bytes) -> int:
        offset = len(self.records) * 100
        self.records[offset] = message_id
        return offset

    def read_id(self, offset: int) -> bytes | None:
        self.reads += 1
        return self.records.get(offset)


def window(max_ids=1000, window_ms=10_000, fingerprint=None) -> tuple[IdWindow, FakeLog]:
    log = FakeLog()
    kwargs = {} if fingerprint is None else {"fingerprint": fingerprint}
    return IdWindow(max_ids, window_ms, log.read_id, **kwargs), log


def test_finds_stored_ids_and_never_a_new_one():
    w, log = window()
    for i in range(500):
        w.add(b"id-%d" % i, log.store(b"id-%d" % i), store_ms=0)
    assert all(w.find(b"id-%d" % i) == i * 100 for i in range(500))
    assert all(w.find(b"new-%d" % i) is None for i in range(500))
    assert len(w) == 500


def test_forced_collisions_are_resolved_by_reading_the_record():
    # Every id has the same fingerprint: the table degenerates to one cluster and every
    # answer rests on comparing the stored id.
    w, log = window(max_ids=64, fingerprint=lambda _: 42)
    for i in range(30):
        w.add(b"c-%d" % i, log.store(b"c-%d" % i), store_ms=0)
    assert w.find(b"c-17") == 1700
    assert w.find(b"c-99") is None  # 30 candidates read, none matched: not a duplicate
    assert w.collisions >= 30
    # the 64-bit fingerprint collides but the ids differ in a single byte
    w2, log2 = window(fingerprint=lambda m: 7 if m.startswith(b"x") else 8)
    w2.add(b"x-1", log2.store(b"x-1"), 0)
    assert w2.find(b"x-2") is None and w2.find(b"x-1") == 0


def test_evicts_oldest_beyond_max_ids_even_with_collisions():
    w, log = window(max_ids=10, fingerprint=lambda m: int(m[2:]) % 3)
    for i in range(25):
        w.add(b"e-%d" % i, log.store(b"e-%d" % i), store_ms=0)
    assert len(w) == 10
    assert [i for i in range(25) if w.find(b"e-%d" % i) is not None] == list(range(15, 25))
    assert w.oldest_offset == 1500


def test_expires_by_age_never_before_the_window():
    w, log = window(window_ms=10_000)
    for ms in range(0, 5000, 10):  # 500 ids over 5 s
        w.add(b"t-%d" % ms, log.store(b"t-%d" % ms), store_ms=ms)
    assert w.expire(now_ms=10_000) == 0  # nothing is older than 10 s yet
    w.expire(now_ms=12_500)
    kept = [ms for ms in range(0, 5000, 10) if w.find(b"t-%d" % ms) is not None]
    # everything stored within the window is kept; at most one mark block more
    assert all(ms in kept for ms in range(2500, 5000, 10))
    assert min(kept) >= 2500 - MARK_MS
    w.expire(now_ms=100_000)
    assert len(w) == 0 and w.oldest_offset is None
    w.add(b"again", log.store(b"again"), store_ms=100_000)
    assert w.find(b"again") is not None and w.find(b"t-4990") is None


def test_memory_stays_compact():
    w, _ = window(max_ids=100_000)
    assert table_size_for(100_000) == 262_144  # load 0.38..0.6
    for i in range(100_000):
        w.add(b"m-%d" % i, i, store_ms=0)
    assert w.memory_bytes / 100_000 < 27  # 16 B ring + 4 B slots / load


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["add", "find", "expire"]), st.integers(0, 60)),
        max_size=300,
    )
)
def test_matches_a_model_under_churn(operations):
    # Tiny fingerprints force clusters that wrap around the table, exercising every
    # case of the backward-shift deletion.
    w, log = window(max_ids=12, window_ms=2 * MARK_MS, fingerprint=lambda m: int(m) % 5)
    model: list[tuple[bytes, int]] = []  # (id, store_ms), oldest first
    now = 0
    for op, n in operations:
        now += 37
        message_id = b"%d" % n
        if op == "add":
            if w.find(message_id) is None:
                w.add(message_id, log.store(message_id), now)
                model.append((message_id, now))
                model = model[-12:]
        elif op == "expire":
            w.expire(now)
        found = w.find(message_id)
        alive = [m for m, ms in model if m == message_id]
        if found is not None:
            assert log.records[found] == message_id  # never a wrong answer
            assert alive
        recent = [m for m, ms in model if m == message_id and ms > now - 2 * MARK_MS]
        if recent:
            assert found is not None  # never forgotten within the window and max_ids


@settings(max_examples=60, deadline=None)
@given(
    batches=st.lists(
        st.tuples(st.lists(st.integers(0, 40), max_size=12), st.integers(0, 3 * MARK_MS)),
        max_size=20,
    )
)
def test_add_batch_is_add_of_each(batches):
    # The append path adds a whole batch at once; the window must end up the same as
    # with one add per id, evictions and time marks included.
    one, log_one = window(max_ids=16, window_ms=2 * MARK_MS, fingerprint=lambda m: int(m) % 7)
    many, log_many = window(max_ids=16, window_ms=2 * MARK_MS, fingerprint=lambda m: int(m) % 7)
    now = 0
    for ids, step in batches:
        now += step
        ids = [b"%d" % n for n in ids]
        for message_id in ids:
            one.add(message_id, log_one.store(message_id), now)
        # As the append path does: look the batch up, then add it with the fingerprints.
        fps, _ = many.find_batch(ids)
        many.add_batch(ids, [log_many.store(m) for m in ids], now, fps)
        one.expire(now)
        many.expire(now)
        assert len(one) == len(many)
        assert one.oldest_offset == many.oldest_offset
        assert list(one._marks) == list(many._marks)
        for n in range(41):
            assert one.find(b"%d" % n) == many.find(b"%d" % n)
        probe = [b"%d" % n for n in range(41)]
        fps, found = one.find_batch(probe)
        assert fps == [n % 7 for n in range(41)]
        assert found == {n: one.find(m) for n, m in enumerate(probe) if one.find(m) is not None}
