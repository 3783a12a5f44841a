"""ArrivalHub's holds (a PULL held without a task) under trio's virtual clock: woken in
the notifying step, or at their deadline to the tick, once; and Broker.hold_pull on
them."""

from __future__ import annotations

import trio
import trio.testing

from delayd.broker import BrokerConfig, open_broker
from delayd.broker.arrivals import ArrivalHub
from delayd.errors import RejectedError
from delayd.protocol import Message
from delayd.protocol.events import EncodedMessages


async def test_a_notify_wakes_a_hold_in_its_own_step_and_only_once(autojump_clock):
    hub = ArrivalHub()
    woken: list[bool] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        hub.hold(["q1", "q2", "group"], trio.current_time() + 5, woken.append)
        assert hub.held == 1
        hub.notify(["q2"])
        assert woken == [True]  # synchronously: no task had to run
        assert hub.held == 0  # gone from q1 and group too
        hub.notify(["q1", "group"])
        await trio.sleep(10)  # past the deadline: not woken again
        assert woken == [True]
        nursery.cancel_scope.cancel()


async def test_holds_time_out_at_their_deadline_in_order(autojump_clock):
    hub = ArrivalHub()
    woken: list[tuple[str, bool, float]] = []
    start = trio.current_time()

    def recorder(name: str):
        return lambda arrived: woken.append((name, arrived, trio.current_time() - start))

    async with trio.open_nursery() as nursery:
        await nursery.start(hub.run)
        hub.hold(["a"], start + 3.0, recorder("late"))
        await trio.sleep(0.5)
        # Earlier than what the timer waits for: it must move, not wait 3 s.
        hub.hold(["b"], start + 1.25, recorder("early"))
        hub.hold(["c"], start + 2.0, recorder("answered"))
        hub.notify(["c"])
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert woken == [("answered", True, 0.5), ("early", False, 1.25), ("late", False, 3.0)]
    assert hub.held == 0


async def test_hold_pull_answers_from_the_reput_at_the_deadline_or_with_the_error(tmp_path):
    config = BrokerConfig(index_slot_count=1009, max_wait_ms=60_000)
    async with open_broker(str(tmp_path), config) as broker:
        broker.join("g", "orders", "c", None, broker.monotonic_ms())
        answers: list[EncodedMessages | Exception] = []

        # 1. Held, then answered by the step that makes the message visible.
        broker.hold_pull("orders", "g", "c", 10, 30_000, None, answers.append)
        assert answers == [] and broker.hub.held == 1
        with trio.fail_after(5):
            await broker.send_batch([Message("wake", "orders")])
        assert len(answers) == 1 and broker.hub.held == 0
        assert isinstance(answers[0], EncodedMessages) and len(answers[0].bounds) == 2

        # 2. Messages already there: answered at once.
        await broker.send_batch([Message("ready", "orders")])
        broker.hold_pull("orders", "g", "c", 10, 30_000, None, answers.append)
        assert len(answers) == 2 and len(answers[1].bounds) == 2

        # 3. Nothing arrives: an empty answer once the wait is over, not before.
        start = trio.current_time()
        broker.hold_pull("orders", "g", "c", 10, 200, None, answers.append)
        while len(answers) == 2:
            await trio.sleep(0.01)
        assert trio.current_time() - start >= 0.2
        assert len(answers[2].bounds) == 1  # no messages

        # 4. The member leaves while held: the rebalance wakes it with the refusal.
        broker.hold_pull("orders", "g", "c", 10, 30_000, None, answers.append)
        broker.connection_closed(None)
        assert len(answers) == 4 and isinstance(answers[3], RejectedError)
        assert "join the group first" in answers[3].reason
