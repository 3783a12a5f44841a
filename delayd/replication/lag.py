"""How far a follower is behind its leader, in records and in time (docs/replication.md,
"Lag"). Bytes are a subtraction of offsets; these two are not:

* ``RecordCounter``: the records of a stream between two offsets (a follower's durable
  end and the leader's end), END_OF_SEGMENT markers not counted, by walking the frames
  between (``read_raw``: whole records). It remembers the last answer for each
  follower and stream, and walks what is cheaper: the gap itself, or only what moved
  since (the follower's progress and the leader's growth) — a caught-up follower costs
  its small gap. Never more than ``budget_bytes`` per question, on the event loop:
  past that (a follower far behind, a leader growing fast) the count is estimated from
  the average record size of a sample at the gap's start, and ``estimated`` says so.
* ``GrowthClock``: when the leader's streams reached each end. A follower durable up
  to ``d`` lacks the records appended since the leader's stream first grew past ``d``:
  its lag in time is how long ago that was — how long ago the leader had what the
  follower has. Records the leader held when it took over count as appended then, so
  the figure is a lower bound for them.

Pure but for reading the streams; time is ``now_ms``, passed in.
"""

from __future__ import annotations

from bisect import bisect_right

from delayd.replication.streams import Stream
from storage.raw_frames import walk_frames

COUNT_CHUNK_BYTES = 1 << 20  # read per step while counting
COUNT_BUDGET_BYTES = 4 << 20  # walked per question at most; past it, an estimate
SAMPLE_BYTES = 256 << 10  # what an estimate's average record size is taken from
MAX_GROWTH_SAMPLES = 4096  # per stream; past it every other one goes (coarser, as long)


def count_records(stream: Stream, start: int, end: int) -> tuple[int, int]:
    """The records of ``stream`` in [start, end) (``start`` a record boundary) and the
    bytes they take: up to the last whole record before ``end``. Raises ValueError when
    the stream no longer holds ``start`` (retention deleted it)."""
    count = 0
    position = start
    while position < end:
        data = stream.read_raw(position, min(COUNT_CHUNK_BYTES, end - position))
        walk = walk_frames(data, "", position)
        if walk.complete == 0 or position + walk.complete > end:
            break  # a record that does not end by ``end``
        count += len(walk.ends) - len(walk.segment_ends)
        position += walk.complete
    return count, position - start


class RecordCounter:
    """Counts records between offsets of the leader's streams (module docstring)."""

    def __init__(self, budget_bytes: int = COUNT_BUDGET_BYTES) -> None:
        self.budget_bytes = budget_bytes
        self.estimated = False  # the last answer was an estimate
        # (follower, stream) -> (start, end, records) of the last exact answer
        self._last: dict[tuple[str, str], tuple[int, int, int]] = {}

    def between(self, key: tuple[str, str], stream: Stream, start: int, end: int) -> int:
        """The records of ``stream`` in [start, end) for ``key`` (follower, stream name).
        Raises ValueError when the stream no longer holds ``start``."""
        self.estimated = False
        if end <= start:
            self._last[key] = (start, end, 0)
            return 0
        direct = end - start
        last = self._last.get(key)
        moved = None
        if last is not None and last[0] <= start <= last[1] <= end:
            moved = (start - last[0]) + (end - last[1])
        if moved is not None and moved < direct and moved <= self.budget_bytes:
            assert last is not None
            left, _ = count_records(stream, last[0], start)
            grown, _ = count_records(stream, last[1], end)
            records = last[2] - left + grown
        elif direct <= self.budget_bytes:
            records, _ = count_records(stream, start, end)
        else:
            self.estimated = True
            sampled, size = count_records(stream, start, start + min(SAMPLE_BYTES, direct))
            return round(direct * sampled / size) if size else 0
        self._last[key] = (start, end, records)
        return records

    def keep_only(self, keys: set[tuple[str, str]]) -> None:
        """Forget the answers of every (follower, stream) but ``keys``."""
        self._last = {key: last for key, last in self._last.items() if key in keys}


class GrowthClock:
    """When each of the leader's streams reached each end (module docstring)."""

    def __init__(self, max_samples: int = MAX_GROWTH_SAMPLES) -> None:
        self.max_samples = max_samples
        self._samples: dict[str, list[tuple[int, int]]] = {}  # stream -> (end, time_ms)

    def grew(self, name: str, end: int, now_ms: int) -> None:
        """The leader's stream ``name`` ends at ``end`` at ``now_ms``."""
        samples = self._samples.setdefault(name, [])
        if samples and end <= samples[-1][0]:
            return
        samples.append((end, now_ms))
        if len(samples) > self.max_samples:
            last = samples[-1]
            del samples[1::2]  # the oldest stays: a far-behind follower's age stays right
            if samples[-1] != last:
                samples.append(last)

    def removed(self, name: str) -> None:
        """The leader deleted stream ``name``."""
        self._samples.pop(name, None)

    def lag_ms(self, name: str, durable: int, now_ms: int) -> int:
        """How long ago the leader's stream ``name`` first grew past ``durable``: the
        age of the oldest record a follower durable up to there lacks; 0 when it lacks
        none."""
        samples = self._samples.get(name)
        if not samples or durable >= samples[-1][0]:
            return 0
        index = bisect_right(samples, (durable, float("inf")))
        return max(0, now_ms - samples[index][1])
