"""``delayd cluster route ID...``: where a message id lives in a cluster, for clients
that do not route by themselves (the HTTP API, docs/cluster.md "Over HTTP").

For each id: the delay group a producer over the cluster sends it to (its owner among
the active groups, delayd/client/_routing.py), then the other groups a lookup asks
when the owner does not know it (active and draining), each with its leader's HTTP and
intake addresses ("-" when it has no leader now or serves no HTTP API)::

    order-42  d2 http 10.0.0.12:20802 intake 10.0.0.12:20801
              d1 http 10.0.0.11:20802 intake 10.0.0.11:20801

``--json`` adds ``previous_owners``: the groups a producer asks before sending the id
(those that may hold it from before a change of the active set within
``--resend-window-s``, docs/cluster.md), by the producers' own rule.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from delayd.cli.args import etcd_endpoints, non_negative_seconds


def add_action(actions: Any) -> None:
    parser = actions.add_parser(
        "route", help="the groups that own and may hold message ids (for HTTP clients)"
    )
    parser.add_argument("ids", nargs="+", metavar="ID", help="message ids")
    parser.add_argument(
        "--etcd", type=etcd_endpoints, required=True, metavar="URL[,URL]",
        help="etcd's client URLs",
    )  # fmt: skip
    parser.add_argument("--cluster", metavar="NAME", default="", help="the cluster (default one)")
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument(
        "--resend-window-s", type=non_negative_seconds, metavar="S",
        help="the window of previous_owners (default: the producers', one day)",
    )  # fmt: skip
    parser.set_defaults(run=_route)


def _route(args: argparse.Namespace) -> int:
    import trio

    from delayd.errors import EtcdError

    try:
        routes = trio.run(_read, args)
    except (EtcdError, ValueError, LookupError) as exc:
        print(f"delayd cluster route: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"routes": routes}, indent=2))
        return 0
    width = max(len(message_id) for message_id in args.ids)
    for route in routes:
        for index, ask in enumerate(route["ask"]):
            label = route["id"] if index == 0 else ""
            print(
                f"{label:<{width}}  {ask['group']} http {ask['http'] or '-'} "
                f"intake {ask['intake'] or '-'}"
            )
    return 0


async def _read(args: argparse.Namespace) -> list[dict[str, Any]]:
    from delayd.client._routing import CHANGE_MARGIN_MS, RESEND_WINDOW_S, DelayGroups
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.group_state import read_groups
    from delayd.cluster.members import cluster_prefix
    from delayd.cluster.registry import read_registry
    from delayd.timestamps import wall_ms

    prefix = cluster_prefix(args.cluster)
    async with EtcdClient(args.etcd) as etcd:
        groups = DelayGroups.from_registry(await read_registry(etcd, prefix))
        leaders = {state.group: state.leader for state in await read_groups(etcd, prefix)}
    if not groups.lookup:
        raise LookupError("the cluster has no delay group (delayd cluster status)")
    window_s = RESEND_WINDOW_S if args.resend_window_s is None else args.resend_window_s
    since_ms = wall_ms() - round(window_s * 1000) - CHANGE_MARGIN_MS
    routes = []
    for message_id in args.ids:
        ask = []
        for group in groups.ask_order(message_id):
            leader = leaders.get(group)
            ask.append(
                {
                    "group": group,
                    "http": leader.http if leader else "",
                    "intake": leader.intake if leader else "",
                }
            )
        owner = groups.owner(message_id) if groups.active else None  # None: nothing takes ids
        previous = groups.previous_owners(message_id, since_ms) if owner else []
        routes.append({"id": message_id, "owner": owner, "ask": ask, "previous_owners": previous})
    return routes
