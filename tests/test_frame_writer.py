"""FrameWriter: frames to a real socket in order, directly when nothing is queued,
bounded when the peer does not read, and a clear end when the peer is gone."""

from __future__ import annotations

import pytest
import trio

from delayd.serving.frame_writer import FrameWriter


async def socket_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


async def read_exactly(stream: trio.SocketStream, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = await stream.receive_some(1 << 20)
        assert chunk, "the writer's side closed early"
        data += chunk
    return bytes(data)


async def test_a_frame_with_nothing_queued_is_written_by_the_sender_itself():
    ours, peer = await socket_pair()
    writer = FrameWriter(ours)
    # No writer task runs: only the direct path can deliver these.
    await writer.send(b"first;")
    await writer.send(b"second;")
    with trio.fail_after(5):
        assert await read_exactly(peer, 13) == b"first;second;"


async def test_frames_keep_their_order_when_the_socket_is_full(autojump_clock):
    ours, peer = await socket_pair()
    writer = FrameWriter(ours, max_queued=4)
    frames = [bytes([i % 251]) * 100_000 for i in range(40)]  # far beyond socket buffers
    expected = b"".join(frames)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)

        async def produce() -> None:
            for frame in frames:
                await writer.send(frame)
            writer.close()

        nursery.start_soon(produce)
        await trio.sleep(1)  # the peer reads nothing for a while: the sender waits
        assert len(writer._queue) <= 4  # bounded, not grown without limit
        got = await read_exactly(peer, len(expected))
    assert got == expected


async def test_a_peer_that_does_not_read_makes_send_wait(autojump_clock):
    ours, peer = await socket_pair()
    writer = FrameWriter(ours, max_queued=2)
    sent = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        with trio.move_on_after(5):
            while True:
                await writer.send(b"x" * 65536)
                sent += 1
        nursery.cancel_scope.cancel()
    # Socket buffers plus two queued frames, then send waited for room.
    assert 0 < sent < 200
    assert len(writer._queue) <= 2
    await peer.aclose()


async def test_a_gone_peer_fails_send_and_ends_run():
    ours, peer = await socket_pair()
    writer = FrameWriter(ours)
    await peer.aclose()
    with pytest.raises(trio.BrokenResourceError):
        for _ in range(1000):  # the first writes may still land in the dead buffer
            await writer.send(b"y" * 4096)
    assert writer.broken
    with trio.fail_after(5):
        await writer.run()  # returns at once: the connection stops
    with pytest.raises(trio.BrokenResourceError):
        await writer.send(b"z")


async def test_close_lets_run_write_the_queue_first(autojump_clock):
    ours, peer = await socket_pair()
    # Room for all 20 frames: the peer reads only after close.
    writer = FrameWriter(ours, max_queued=64, max_queued_bytes=4 << 20)
    frames = [b"%06d" % i * 20_000 for i in range(20)]
    for frame in frames[:3]:  # the socket buffer fills: the rest queues
        await writer.send(frame)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        for frame in frames[3:]:
            await writer.send(frame)
        writer.close()
        with pytest.raises(trio.ClosedResourceError):
            await writer.send(b"late")
        got = await read_exactly(peer, sum(map(len, frames)))
    assert got == b"".join(frames)


async def test_queued_bytes_are_bounded_whatever_the_frame_count(autojump_clock):
    ours, peer = await socket_pair()
    writer = FrameWriter(ours, max_queued=1000, max_queued_bytes=256 * 1024)
    most = 0
    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer.run)
        with trio.move_on_after(5):  # the peer reads nothing
            while True:
                await writer.send(b"p" * 100_000)
                most = max(most, writer.queued_bytes)
        nursery.cancel_scope.cancel()
    # One frame may start beyond the bound, never two.
    assert 256 * 1024 <= most < 256 * 1024 + 100_000
    await peer.aclose()
