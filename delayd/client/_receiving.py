"""``async for message in consumer``, for every async consumer: receive() with no time
limit, over and over."""

from __future__ import annotations

from typing import Self

from delayd.protocol import Message


class ReceivingIterator:
    """Iteration over ``receive()``, which a subclass defines."""

    async def receive(self, timeout_s: float | None = None) -> Message | None:
        raise NotImplementedError

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Message:
        message = await self.receive()
        assert message is not None  # no time limit: a message, or an exception
        return message
