"""``delayd cluster drain|activate|retire GROUP``: set a group's registry status
(docs/cluster.md, "Adding and removing a delay group").

- ``drain``: the group takes no new work (producers over the cluster send a delay
  group no new ids; what a draining broker group does is in the broker-group sections
  of docs/cluster.md) but keeps delivering what it holds and answering about it.
  Refused for the cluster's last active group of its kind unless ``--force``.
- ``activate``: the group takes new work again.
- ``retire``: the group holds nothing the cluster still needs, and lookups by id no
  longer ask it. Refused unless the group is draining, has been draining for its
  window (``_check_window``), and, for a delay group, unless its leader reports no
  pending message (``delayd_pending_messages`` plus ``delayd_replay_lag_records`` on
  its metrics page): ``--force`` retires anyway, with a warning saying what is then
  lost.

Also what ``delayd cluster status`` shows of the registry.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

from delayd.cli.args import etcd_endpoints, non_negative_count, non_negative_seconds

if TYPE_CHECKING:
    from delayd.cluster.group_state import GroupState
    from delayd.cluster.registry import Registration

METRICS_TIMEOUT_S = 5.0


def add_actions(actions: Any) -> None:
    """The drain, activate and retire sub-commands of ``delayd cluster``."""
    helps = {
        "drain": "the group takes no new work; it still delivers and answers what it holds",
        "activate": "the group takes new work (again)",
        "retire": "the group is drained and empty: lookups by id stop asking it",
    }
    for action, help_text in helps.items():
        parser = actions.add_parser(action, help=help_text)
        parser.add_argument("group", metavar="GROUP", help="the group's name")
        parser.add_argument(
            "--etcd", type=etcd_endpoints, required=True, metavar="URL[,URL]",
            help="etcd's client URLs",
        )  # fmt: skip
        parser.add_argument(
            "--cluster", metavar="NAME", default="",
            help="the group's cluster (default: the default one)",
        )  # fmt: skip
        parser.add_argument("--prefix", help="the cluster's key prefix (default: the cluster's)")
        if action != "activate":
            parser.add_argument(
                "--force", action="store_true",
                help="skip the safety check (docs/cluster.md); a warning says what it risks",
            )  # fmt: skip
        if action == "retire":
            parser.add_argument(
                "--resend-window-s", type=non_negative_seconds, metavar="SECONDS",
                help="a delay group must have been draining this long (plus 60 s): the "
                "producers' resend_window_s (default: theirs, one day; 0: no wait)",
            )  # fmt: skip
            parser.add_argument(
                "--doubt-hold-ms", type=non_negative_count, metavar="MS",
                help="a broker group must have been draining this long (plus 60 s): the "
                "delay servers' [delivery] doubt_hold_ms (default: theirs, 30000; 0: no wait)",
            )  # fmt: skip
        parser.set_defaults(run=_set_status, status=action)


def _set_status(args: argparse.Namespace) -> int:
    import trio

    from delayd.cluster.members import cluster_prefix
    from delayd.errors import EtcdError

    try:
        prefix = args.prefix or cluster_prefix(args.cluster)
        entry = trio.run(_change, args, prefix)
    except (EtcdError, ValueError, LookupError) as exc:
        print(f"delayd cluster {args.status}: {exc}", file=sys.stderr)
        return 1
    print(f"group {entry.group} ({entry.kind}): {entry.status}")
    return 0


async def _change(args: argparse.Namespace, prefix: str) -> Registration:
    from delayd.cluster.etcd import EtcdClient
    from delayd.cluster.group_state import read_group
    from delayd.cluster.registry import GroupStatus, read_registry, set_status
    from delayd.timestamps import wall_ms

    status = {"drain": GroupStatus.DRAINING, "activate": GroupStatus.ACTIVE}.get(
        args.status, GroupStatus.RETIRED
    )
    async with EtcdClient(args.etcd) as etcd:
        registry = await read_registry(etcd, prefix)
        entry = registry.get(args.group)
        if entry is None:
            raise LookupError(f"the cluster has no group {args.group!r} (delayd cluster status)")
        if status is GroupStatus.DRAINING:
            _check_drain(entry, registry, args.force)
        elif status is GroupStatus.RETIRED:
            state = await read_group(etcd, args.group, prefix)
            _check_retire(entry, state, _window_ms(entry, args), wall_ms(), args.force)
        return await set_status(etcd, prefix, args.group, status, wall_ms())


def _check_drain(entry: Registration, registry: dict[str, Registration], force: bool) -> None:
    from delayd.cluster.registry import GroupKind, GroupStatus

    others = [
        e
        for e in registry.values()
        if e.kind is entry.kind and e.status is GroupStatus.ACTIVE and e.group != entry.group
    ]
    if entry.status is GroupStatus.ACTIVE and not others:
        problem = f"{entry.group} is the cluster's last active {entry.kind} group: " + (
            "producers over the cluster would have nowhere to send"
            if entry.kind is GroupKind.DELAY
            else "delay groups would have no broker group to deliver to"
        )
        _refuse_or_warn(problem, "add or activate another group first", force)


def _window_ms(entry: Registration, args: argparse.Namespace) -> int:
    """How long ``entry``'s group must have been draining before it is retired: a delay
    group, the producers' resend window (a resend asks the groups that may have owned
    its id, but never a retired one); a broker group, the delay servers' doubt hold (a
    message whose send to it went unanswered waits for it that long, but not for a
    retired group)."""
    from delayd.cluster.registry import GroupKind

    if entry.kind is GroupKind.DELAY:
        from delayd.client._routing import RESEND_WINDOW_S

        window_s = RESEND_WINDOW_S if args.resend_window_s is None else args.resend_window_s
        return round(window_s * 1000)
    from delayd.sender.sender import SenderConfig

    return SenderConfig().doubt_hold_ms if args.doubt_hold_ms is None else args.doubt_hold_ms


def _check_window(entry: Registration, window_ms: int, now_ms: int, force: bool) -> None:
    """Refuse to retire a group drained less than ``window_ms`` plus CHANGE_MARGIN_MS
    ago (``changed_ms`` is when its drain was written, by the clock of the host that ran
    it; the margin also covers the registry reads producers and delay servers route
    by). An active group counts as drained now; a window of 0 waits for nothing."""
    from delayd.client._routing import CHANGE_MARGIN_MS
    from delayd.cluster.registry import GroupKind, GroupStatus
    from delayd.durations import format_duration_ms
    from delayd.timestamps import format_utc

    if window_ms == 0 or entry.status is GroupStatus.RETIRED:
        return
    draining = entry.status is GroupStatus.DRAINING
    drained_ms = entry.changed_ms if draining else now_ms
    ready_ms = drained_ms + window_ms + CHANGE_MARGIN_MS
    if now_ms >= ready_ms:
        return
    window = format_duration_ms(window_ms)
    since = (
        f"has been draining for {format_duration_ms((now_ms - drained_ms) // 1000 * 1000)}"
        if draining
        else "is active"
    )
    if entry.kind is GroupKind.DELAY:
        problem = (
            f"{entry.group} {since}, less than the producers' resend window ({window}) plus "
            "60 s: a resend of an id it took within the window would no longer ask it once "
            "it is retired, and the id's new owner would store it a second time"
        )
        option = "--resend-window-s the producers' resend_window_s"
    else:
        problem = (
            f"{entry.group} {since}, less than the delay servers' doubt hold ({window}) plus "
            "60 s: a message whose send to it went unanswered may still be waiting for it, "
            "and would go to another broker group once it is retired, where consumers may "
            "see it a second time"
        )
        option = "--doubt-hold-ms the delay servers' [delivery] doubt_hold_ms"
    _refuse_or_warn(
        problem,
        f"wait {format_duration_ms(ready_ms - now_ms)} more (until {format_utc(ready_ms)}), "
        f"or give {option} when it is shorter",
        force,
    )


def _check_retire(
    entry: Registration, state: GroupState, window_ms: int, now_ms: int, force: bool
) -> None:
    from delayd.cluster.registry import GroupKind, GroupStatus

    if entry.status is not GroupStatus.DRAINING:
        _refuse_or_warn(
            f"{entry.group} is {entry.status}, not draining",
            f"drain it first (delayd cluster drain {entry.group}) and wait until it is empty",
            force,
        )
    _check_window(entry, window_ms, now_ms, force)
    if entry.kind is not GroupKind.DELAY:
        return
    try:
        pending = pending_messages(state)
    except LookupError as exc:
        _refuse_or_warn(f"cannot tell whether {entry.group} is empty: {exc}", "", force)
        return
    if pending:
        _refuse_or_warn(
            f"{entry.group} still holds {pending} pending message(s): retired, they would "
            "still be delivered while its members run, but cancels and reschedules through "
            "the cluster would no longer find them",
            "wait until they are delivered (delayd top, delayd cluster status)",
            force,
        )


def _refuse_or_warn(problem: str, remedy: str, force: bool) -> None:
    if not force:
        raise LookupError(f"{problem}; {remedy + ', or ' if remedy else ''}--force to do it anyway")
    print(f"WARNING: {problem}; going ahead (--force)", file=sys.stderr)


def pending_messages(state: GroupState) -> int:
    """The messages the group's leader holds that are not delivered yet (on its metrics
    page: scheduled and not dispatched, plus accepted and not yet replayed). Raises
    LookupError saying why it cannot be read."""
    from delayd.top.scrape import Snapshot, fetch

    leader = state.leader
    if leader is None:
        raise LookupError(f"group {state.group} has no leader now (is it running?)")
    if not leader.metrics:
        raise LookupError(
            f"its leader {leader.member_id} serves no metrics (start it with --metrics-listen)"
        )
    try:
        page = Snapshot.parse(fetch(f"http://{leader.metrics}/metrics", METRICS_TIMEOUT_S))
    except (OSError, ValueError) as exc:
        raise LookupError(f"metrics of its leader at {leader.metrics}: {exc}") from None
    scheduled = page.total("delayd_pending_messages")
    if scheduled is None:
        raise LookupError(f"the metrics at {leader.metrics} have no delayd_pending_messages")
    return int(scheduled + (page.total("delayd_replay_lag_records") or 0))


def registration_fields(entry: Registration | None) -> dict[str, Any]:
    """What ``delayd cluster status`` shows of a group's registry entry."""
    if entry is None:  # members of an older version, which do not register
        return {"kind": "unregistered", "status": "-"}
    return {"kind": str(entry.kind), "status": str(entry.status)}
