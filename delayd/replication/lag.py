"""How far a follower is behind its leader, in records and in time (docs/replication.md,
"Lag"). Bytes are a subtraction of offsets; these two are not:

* ``RecordCounter``: the records of a stream between two offsets (a follower's durable
  end and the leader's end), END_OF_SEGMENT markers not counted. It walks the frames
  of what lies between (``read_raw``: whole records, headers hopped) and remembers the
  count at each offset it was asked about, so the next question counts only from
  there: a follower's end and the leader's only grow, and each byte is walked about
  once per follower rather than at every scrape.
* ``GrowthClock``: when the leader's streams reached each end. A follower durable up
  to ``d`` lacks the records appended since the leader's stream first grew past ``d``:
  its lag in time is how long ago that was — how long ago the leader had what the
  follower has. Records the leader held when it took over count as appended then, so
  the figure is a lower bound for them.

Pure but for reading the streams; time is ``now_ms``, passed in.
"""

from __future__ import annotations

from bisect import bisect_right, insort

from delayd.replication.streams import Stream
from storage.raw_frames import walk_frames

COUNT_CHUNK_BYTES = 4 << 20  # read per step while counting
MAX_GROWTH_SAMPLES = 4096  # per stream; past it every other one goes (coarser, as long)


def count_records(stream: Stream, start: int, end: int) -> int:
    """The records of ``stream`` in [start, end), both record boundaries.
    Raises ValueError when the stream no longer holds ``start`` (retention deleted it)."""
    count = 0
    position = start
    while position < end:
        data = stream.read_raw(position, min(COUNT_CHUNK_BYTES, end - position))
        if not data:
            break
        walk = walk_frames(data, "", position)
        count += len(walk.ends) - len(walk.segment_ends)
        position += walk.complete
    return count


class RecordCounter:
    """Counts records between offsets of the leader's streams (module docstring)."""

    def __init__(self) -> None:
        # stream -> sorted (offset, records before it from an arbitrary origin)
        self._marks: dict[str, list[tuple[int, int]]] = {}

    def between(self, name: str, stream: Stream, start: int, end: int) -> int:
        """The records of ``stream`` (named ``name``) in [start, end). Raises
        ValueError when the stream no longer holds ``start``."""
        if end <= start:
            return 0
        return self._count_at(name, stream, end) - self._count_at(name, stream, start)

    def keep_only(self, wanted: dict[str, set[int]]) -> None:
        """Forget every mark but those at the offsets in ``wanted`` (by stream): what
        the next questions count from. Streams not named are forgotten."""
        self._marks = {
            name: [mark for mark in marks if mark[0] in wanted[name]]
            for name, marks in self._marks.items()
            if name in wanted
        }

    def _count_at(self, name: str, stream: Stream, offset: int) -> int:
        marks = self._marks.setdefault(name, [])
        index = bisect_right(marks, (offset, float("inf"))) - 1
        if index >= 0:
            base, count = marks[index]
            if base == offset:
                return count
            count += count_records(stream, base, offset)
        elif marks:
            first, first_count = marks[0]
            count = first_count - count_records(stream, offset, first)
        else:
            count = 0
        insort(marks, (offset, count))
        return count


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
