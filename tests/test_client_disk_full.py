"""The producers treat a full server disk as they treat BUSY: DISK_FULL results are
sent again with back-off, and still refused after the retries they come back as
receipts whose reason says the disk is full (scripted servers; trio, asyncio, blocking).
"""

from __future__ import annotations

import anyio
import pytest

import delayd
from delayd.errors import BusyError
from delayd.protocol import ResultCode, SendBatch, SendResult
from tests.client_support import ScriptedServer, SendHook

REASON = "disk full: cannot write /data/delay/message_log/0 (ENOSPC); 0 bytes free"


def full_for(rounds: int) -> SendHook:
    """Answer DISK_FULL (storing nothing) to the first ``rounds`` batches."""
    seen: list[SendBatch] = []

    def hook(batch: SendBatch) -> list[SendResult] | None:
        seen.append(batch)
        if len(seen) <= rounds:
            return [SendResult(ResultCode.DISK_FULL, REASON) for _ in batch.messages]
        return None

    return hook


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_async_producer_retries_disk_full(backend: str) -> None:
    async def scenario() -> None:
        with ScriptedServer(on_send=full_for(2)) as server:
            async with delayd.open_producer(server.addr) as producer:
                receipt = await producer.send("s", b"x")
            assert receipt.code is ResultCode.OK
            assert len(server.batches) == 3
        with ScriptedServer(on_send=full_for(100)) as server:
            async with delayd.open_producer(server.addr, busy_retries=2) as producer:
                with pytest.raises(BusyError, match="disk full"):
                    await producer.send("s", b"x")
                (receipt,) = await producer.send_batch([("s", b"y")])
            assert receipt.code is ResultCode.DISK_FULL and receipt.reason == REASON

    anyio.run(scenario, backend=backend)


def test_blocking_producer_retries_disk_full() -> None:
    with ScriptedServer(on_send=full_for(2)) as server:
        with delayd.Producer(server.addr) as producer:
            assert producer.send("s", b"x").code is ResultCode.OK
        assert len(server.batches) == 3
    with ScriptedServer(on_send=full_for(100)) as server:
        with delayd.Producer(server.addr, busy_retries=2) as producer:
            with pytest.raises(BusyError, match="disk full"):
                producer.send("s", b"x")
            (receipt,) = producer.send_batch([("s", b"y")])
        assert receipt.code is ResultCode.DISK_FULL and receipt.reason == REASON
