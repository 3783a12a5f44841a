"""A group member's replication Leader that stops on its own while the member still
leads (the in-sync set could not be saved to etcd, say) is replaced at the same epoch;
the delay server's delivery and canceller go on meanwhile. They did not: the
demotion hook held intake and left the replayer deriving tombstones with no one to
decide them — the take-over that decides them again runs once per epoch — so every
cancel and reschedule after it went unanswered while sends were still acknowledged.

In this process, one member of a group on the session's etcd (a real DelayServer)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import trio

import delayd
from delayd.address import Address
from delayd.cluster.config import ClusterConfig
from delayd.protocol import CancelOutcome
from delayd.server.app import DelayServer, open_listeners
from delayd.server.config import ServeConfig


async def leading_leader(server: DelayServer, epoch: int | None = None):
    """The member's running replication Leader (at ``epoch``, when given) once intake is
    let in."""
    replication = server.replication
    assert replication is not None
    with trio.fail_after(20):
        while True:
            leader = replication.leader
            if (
                leader is not None
                and leader.stopped is None
                and (epoch is None or leader.epoch == epoch)
                and server.intake.ids_ready.is_set()
            ):
                return leader
            await trio.sleep(0.01)


async def test_a_leader_restarted_at_the_same_epoch_still_decides_cancels(
    tmp_path: Path, etcd_server, etcd_prefix
) -> None:
    config = ServeConfig(
        listen=Address("127.0.0.1", 0),
        broker_listen=None,
        metrics_listen=None,
        http_listen=None,
        cluster=ClusterConfig(
            etcd=(etcd_server.url,),
            group="g1",
            prefix=etcd_prefix,
            lease_ttl_ms=6000,  # no step-down on a loaded machine: one epoch throughout
            min_in_sync=0,  # a lone member
            replication_listen=Address("127.0.0.1", 0),
        ),
    )
    listeners = await open_listeners(config)
    server = await trio.to_thread.run_sync(DelayServer.open, str(tmp_path / "d"), config)
    async with trio.open_nursery() as nursery:
        run = partial(server.run, listeners=replace(listeners, metrics=None))
        bound = await nursery.start(run)
        first = await leading_leader(server)
        address = f"{bound.intake[0]}:{bound.intake[1]}"
        async with delayd.open_producer(address, timeout_s=10) as producer:

            async def send_and_cancel(message_id: str) -> CancelOutcome:
                await producer.send("s", b"x", message_id=message_id, delay_ms=600_000)
                with trio.fail_after(10):  # unanswered before the fix
                    return (await producer.cancel(message_id)).outcome

            assert await send_and_cancel("before") is CancelOutcome.CANCELLED
            first.stop()  # on its own: the member still leads at its epoch
            second = await leading_leader(server, first.epoch)
            assert second is not first and server.membership.may_lead()
            assert await send_and_cancel("after") is CancelOutcome.CANCELLED
        server.request_stop()
