"""Child process for the kill -9 test: appends in `sync` mode and prints each ack.

Usage: python -m tests.helpers.sync_appender DIRECTORY
Prints "ack OFFSET INDEX" after LogWriter.append_batch returned (the records are durable).
"""

from __future__ import annotations

import sys

import trio

from storage.flusher import SYNC, LogWriter
from storage.segmented_log import SegmentedLog


def payload(index: int) -> bytes:
    return b"message-%08d-" % index + b"p" * (index % 50)


async def main(directory: str) -> None:
    log = SegmentedLog.open(directory, segment_size=64 * 1024)
    writer = LogWriter(log, SYNC)
    async with trio.open_nursery() as nursery:
        await nursery.start(writer.run)
        index = 0

        async def producer(lane: int) -> None:
            nonlocal index
            while True:
                batch = list(range(index, index + 10))
                index += 10
                offsets = await writer.append_batch([payload(i) for i in batch])
                print(
                    "\n".join(f"ack {o} {i}" for o, i in zip(offsets, batch, strict=True)),
                    flush=True,
                )

        for lane in range(4):
            nursery.start_soon(producer, lane)


if __name__ == "__main__":
    trio.run(main, sys.argv[1])
