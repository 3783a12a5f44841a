"""delayd.nowait_acquire: a free lock or semaphore is taken without a checkpoint;
a taken one is waited for, in turn."""

from __future__ import annotations

import trio
import trio.testing

from delayd.nowait_acquire import acquire, holding


async def test_a_free_lock_and_semaphore_are_taken_without_yielding():
    lock, slots = trio.Lock(), trio.Semaphore(2)
    with trio.testing.assert_no_checkpoints():
        async with holding(lock):
            assert lock.locked()
        await acquire(slots)
        await acquire(slots)
    assert not lock.locked()
    assert slots.value == 0


async def test_a_taken_lock_is_waited_for_in_turn(autojump_clock):
    lock = trio.Lock()
    order: list[str] = []

    async def user(name: str, hold_s: float) -> None:
        async with holding(lock):
            order.append(name)
            await trio.sleep(hold_s)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(user, "first", 1.0)
        await trio.testing.wait_all_tasks_blocked()
        nursery.start_soon(user, "second", 0)
        await trio.testing.wait_all_tasks_blocked()
        assert order == ["first"]  # the second waits: the lock is held
        nursery.start_soon(user, "third", 0)  # and a newcomer queues behind it
    assert order == ["first", "second", "third"]


async def test_an_empty_semaphore_waits_for_a_release(autojump_clock):
    slots = trio.Semaphore(0)
    got = trio.Event()

    async def taker() -> None:
        await acquire(slots)
        got.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(taker)
        await trio.sleep(1)
        assert not got.is_set()
        slots.release()
        await got.wait()
