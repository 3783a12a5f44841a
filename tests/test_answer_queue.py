"""AnswerQueue: the acker takes everything queued at once, in order, and ends on close
only once the queue is empty."""

from __future__ import annotations

import trio
import trio.testing

from delayd.serving.answer_queue import AnswerQueue


async def test_take_all_waits_then_returns_everything_queued_in_order(autojump_clock):
    queue: AnswerQueue[int] = AnswerQueue()
    taken: list[list[int]] = []

    async def acker() -> None:
        while (items := await queue.take_all()) is not None:
            taken.append(items)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(acker)
        await trio.sleep(1)
        assert taken == []  # nothing queued: it waits
        queue.append(1)
        queue.append(2)
        await trio.testing.wait_all_tasks_blocked()
        queue.append(3)
        queue.close()  # 3 is still taken before the acker ends
    assert taken == [[1, 2], [3]]
