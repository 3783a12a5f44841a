"""``python -m delayd.cluster``: one group member that prints each change of its role as a
JSON line on stdout (a demo, and the child process the kill -9 tests run). SIGTERM or
Ctrl-C resigns. Logs go to stderr."""

from __future__ import annotations

import argparse
import json
import signal
from collections.abc import Sequence

import trio

from delayd.cluster.election import GroupMember
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.lease_guard import DEFAULT_LEASE_TTL_MS
from delayd.cluster.members import DEFAULT_PREFIX, MemberInfo, View
from delayd.structured_logs import configure_logging


async def _demo(args: argparse.Namespace) -> None:
    def show(previous: View, current: View, reason: str) -> None:
        line = {
            "member": args.member_id,
            "role": current.role.name.lower(),
            "epoch": current.epoch,
            "leader": current.leader.member_id if current.leader else None,
            "reason": reason,
        }
        print(json.dumps(line), flush=True)

    async with EtcdClient(args.etcd.split(",")) as etcd:
        member = GroupMember(
            etcd,
            args.group,
            MemberInfo(args.member_id, intake=args.intake),
            prefix=args.prefix,
            lease_ttl_ms=args.lease_ttl_ms,
            on_change=show,
        )
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(member.run)
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    break


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m delayd.cluster",
        description="Join a group as one member and print each change of role as JSON.",
    )
    parser.add_argument("--etcd", required=True, help="etcd URLs, comma-separated")
    parser.add_argument("--group", required=True)
    parser.add_argument("--member-id", required=True)
    parser.add_argument("--intake", default="", help="the address to advertise, host:port")
    parser.add_argument("--prefix", default=DEFAULT_PREFIX)
    parser.add_argument("--lease-ttl-ms", type=int, default=DEFAULT_LEASE_TTL_MS)
    args = parser.parse_args(argv)
    configure_logging()
    trio.run(_demo, args)


if __name__ == "__main__":
    main()
