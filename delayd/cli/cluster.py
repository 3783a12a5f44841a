"""Show the groups of a cluster as etcd holds them, and set their registry status.

    delayd cluster status --etcd http://127.0.0.1:2379 [--group NAME] [--json]
    delayd cluster drain|activate GROUP --etcd URL [--cluster NAME]
    delayd cluster retire GROUP --etcd URL [--cluster NAME] [--force]
    delayd cluster route ID... --etcd URL [--cluster NAME] [--json]

status: for each group under the key prefix, its kind and registry status
(docs/cluster.md, "The registry"), its leader and epoch (the revision that created
the leader key), its in-sync set (the members that may lead), and every registered
member with its role and addresses, and each follower's lag as the leader measures it
(records, ms, bytes: read from the leader's /metrics, delayd.cli.cluster_lag; "?" when
the leader does not know the follower or cannot be read, and why).

drain / activate / retire set a group's registry status
(delayd/cli/cluster_registry.py says what each checks first). route names the
groups that own and may hold message ids (delayd/cli/cluster_route.py).

Exit status: 0; 1 when etcd cannot be read, or a status change is refused (the reason
on stderr); 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from delayd.cli.args import etcd_endpoints


def add_arguments(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    status = actions.add_parser(
        "status", help="groups, members, roles, epochs, in-sync sets, followers' lag"
    )
    status.add_argument(
        "--etcd", type=etcd_endpoints, required=True, metavar="URL[,URL]",
        help="etcd's client URLs",
    )  # fmt: skip
    status.add_argument("--group", metavar="NAME", help="only this group")
    status.add_argument(
        "--cluster", metavar="NAME", default="",
        help="the cluster's groups (default: the default cluster)",
    )  # fmt: skip
    status.add_argument("--prefix", help="the groups' key prefix in etcd (default: the cluster's)")
    status.add_argument("--json", action="store_true", help="one JSON object on stdout")
    status.set_defaults(run=_status)
    from delayd.cli import cluster_registry, cluster_route

    cluster_registry.add_actions(actions)
    cluster_route.add_action(actions)


def run(args: argparse.Namespace) -> int:
    return int(args.run(args))


def _status(args: argparse.Namespace) -> int:
    import trio

    from delayd.cluster.members import cluster_prefix
    from delayd.errors import EtcdError

    try:
        prefix = args.prefix or cluster_prefix(args.cluster)
        groups = trio.run(_read, args.etcd, prefix, args.group)
    except (EtcdError, ValueError) as exc:
        print(f"delayd cluster status: {exc}", file=sys.stderr)
        return 1
    for group in groups:
        add_lag(group)
    if args.json:
        print(json.dumps({"groups": groups}, indent=2))
    else:
        sys.stdout.write(render(groups))
    return 0


async def _read(etcd: tuple[str, ...], prefix: str, group: str | None) -> list[dict[str, Any]]:
    from delayd.cli.cluster_registry import registration_fields
    from delayd.cluster.cluster_state import read_cluster
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.group_state import GroupState, read_group
    from delayd.cluster.registry import read_registry

    async with EtcdClient(etcd) as client:
        if group:
            state = await read_group(client, group, prefix)
            registry = await read_registry(client, prefix)
            return [{**_as_dict(state), **registration_fields(registry.get(group))}]
        # Registered groups with no member up are the cluster's too (no keys: empty).
        cluster = await read_cluster(client, prefix)
    return [
        {
            **_as_dict(found.state or GroupState(found.name, (), None, None, None)),
            **registration_fields(found.registration),
        }
        for found in cluster
    ]


def _as_dict(state: Any) -> dict[str, Any]:
    in_sync = state.in_sync
    members = [
        {
            "member_id": m.member_id,
            "role": state.role_of(m.member_id),
            "in_sync": in_sync is None or m.member_id in in_sync,
            "intake": m.intake,
            "broker": m.broker,
            "replication": m.replication,
            "metrics": m.metrics,
        }
        for m in sorted(state.members, key=lambda m: m.member_id)
    ]
    return {
        "group": state.group,
        "leader": state.leader.member_id if state.leader else None,
        "epoch": state.epoch,
        "in_sync": sorted(in_sync) if in_sync is not None else None,
        "members": members,
    }


def add_lag(group: dict[str, Any]) -> None:
    """Each member's ``lag_records``, ``lag_ms`` and ``lag_bytes`` (None for the leader
    and for a follower the leader does not know; ``lag_records`` None too for one that
    lacks records the leader no longer holds, ``lacks_deleted`` true for it), and the
    group's ``lag_error``."""
    from delayd.cli.cluster_lag import GroupLag, leader_lag

    leader = next((m for m in group["members"] if m["member_id"] == group["leader"]), None)
    if leader is None:
        lag = GroupLag(
            {}, "no leader to ask" if group["leader"] is None else "leader not registered"
        )
    else:
        lag = leader_lag(leader["metrics"])
    group["lag_error"] = lag.error
    for member in group["members"]:
        known = lag.by_member.get(member["member_id"])
        member["lag_records"] = None if known is None else known.records
        member["lag_ms"] = None if known is None else known.ms
        member["lag_bytes"] = None if known is None else known.bytes
        member["lacks_deleted"] = known is not None and known.lacks_deleted


def _lag_cell(member: dict[str, Any], key: str) -> str:
    if member["role"] == "leader":
        return "-"
    if key == "lag_records" and member.get("lacks_deleted"):
        return "deleted"  # it lacks records the leader's retention deleted
    value = member.get(key)
    return "?" if value is None else str(value)


def render(groups: list[dict[str, Any]]) -> str:
    """The text form: a block per group, a line per member."""
    if not groups:
        return "no groups\n"
    lines = []
    for group in groups:
        leader = group["leader"] or (
            "none (election under way)" if group["members"] else "none (no member up)"
        )
        epoch = group["epoch"] if group["epoch"] is not None else "-"
        in_sync = group["in_sync"]
        in_sync_text = ", ".join(in_sync) if in_sync is not None else "not written yet (new group)"
        lines.append(f"group {group['group']}: leader {leader}, epoch {epoch}")
        lines.append(f"  {group['kind']} group, {group['status']}")
        lines.append(f"  in sync: {in_sync_text}")
        if group.get("lag_error"):
            lines.append(f"  lag unknown: {group['lag_error']}")
        header = (
            "member", "role", "in_sync", "lag_records", "lag_ms",
            "intake", "broker", "replication", "metrics",
        )  # fmt: skip
        rows = [header] + [
            (
                m["member_id"],
                m["role"],
                "yes" if m["in_sync"] else "no",
                _lag_cell(m, "lag_records"),
                _lag_cell(m, "lag_ms"),
                m["intake"] or "-",
                m["broker"] or "-",
                m["replication"] or "-",
                m["metrics"] or "-",
            )
            for m in group["members"]
        ]
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        for row in rows:
            lines.append(
                "  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            )
        lines.append("")
    return "\n".join(lines)
