"""Drawing a ClusterModel: the whole cluster in one table, a line per figure that matters.

``render_cluster(model, width, height)`` is pure, and returns lines no wider than
``width`` (designed for 80 and up) and, when ``height`` is given, no more of them than
that (the last then says how many are hidden). Top to bottom:

* a title line (the cluster, the time, the interval, the keys);
* what etcd could not be read, if anything;
* the uneven load: each group past its even share, with its shares;
* a table: a line per group (kind, registry status, pending and its share, intake rate
  and its share, delivery rate, lateness p50 and p99), under it a line per member (its
  role; a follower's replication lag; why a member could not be scraped).
"""

from __future__ import annotations

import datetime as _dt

from rich.console import Group, RenderableType
from rich.text import Text

from delayd.top.cluster import UNEVEN_FACTOR, ClusterModel, GroupRow, MemberRow, Share
from delayd.top.render import UNKNOWN, fmt_bytes, fmt_count, fmt_rate, fmt_seconds

UNEVEN_MARK = "▲"
# (heading, width) of every column after the group's name, which takes the rest.
COLUMNS = (
    ("kind", 6),
    ("status", 8),
    ("pending", 9),
    ("share", 5),
    ("in/s", 8),
    ("share", 5),
    ("out/s", 8),
    ("p50", 6),
    ("p99", 6),
)
MIN_NAME_WIDTH = 10
ROLE_WIDTH = 9


def _fmt_share(share: Share | None) -> str:
    if share is None:
        return UNKNOWN
    return f"{share.of_total * 100:.0f}%" + (UNEVEN_MARK if share.uneven else "")


def _cells(row: GroupRow) -> list[str]:
    return [
        row.kind,
        row.status or UNKNOWN,
        fmt_count(row.pending),
        _fmt_share(row.pending_share),
        fmt_rate(row.in_per_s).removesuffix("/s"),
        _fmt_share(row.in_share),
        fmt_rate(row.out_per_s).removesuffix("/s"),
        fmt_seconds(row.lateness_p50_s),
        fmt_seconds(row.lateness_p99_s),
    ]


def _line(name: str, cells: list[str], name_width: int) -> str:
    if len(name) > name_width:
        name = name[: name_width - 1] + "…"
    parts = [name.ljust(name_width)]
    for index, (cell, (_, width)) in enumerate(zip(cells, COLUMNS, strict=True)):
        parts.append(cell.ljust(width) if index < 2 else cell.rjust(width))
    return " ".join(parts)


def _member_state(member: MemberRow) -> Text:
    if not member.watched:
        return Text("not watched — it publishes no metrics address", style="dim")
    if member.error is not None:
        return Text(f"unreachable — {member.error}", style="bold red")
    if member.role != "follower":
        return Text("up", style="green")
    if member.lag_bytes == 0 and member.lag_s == 0:
        return Text("up · caught up", style="green")
    lag = f"lag {fmt_bytes(member.lag_bytes)} · {fmt_seconds(member.lag_s)}"
    return Text(f"up · {lag}", style="yellow")


def _member_line(member: MemberRow, id_width: int) -> Text:
    return Text.assemble(
        f"  {member.member_id.ljust(id_width)} ",
        (member.role.ljust(ROLE_WIDTH), "bold" if member.role == "leader" else ""),
        " ",
        _member_state(member),
    )


def _group_lines(row: GroupRow, name_width: int) -> list[Text]:
    style = "bold yellow" if row.uneven else "bold"
    lines = [Text(_line(row.name, _cells(row), name_width), style=style)]
    if not row.members:
        lines.append(Text("  no live member (all down, or none started yet)", style="red"))
    id_width = max((len(m.member_id) for m in row.members), default=0)
    lines += [_member_line(member, id_width) for member in row.members]
    return lines


def _uneven_lines(groups: list[GroupRow]) -> list[Text]:
    shared = [g for g in groups if g.pending_share is not None or g.in_share is not None]
    if not shared:
        return []
    uneven = [g for g in shared if g.uneven]
    if not uneven:
        note = f"load even: no group past {UNEVEN_FACTOR:g}x its even share"
        return [Text(note, style="green")]
    lines = []
    for group in uneven:
        shares = [
            (what, share)
            for what, share in (("pending", group.pending_share), ("in/s", group.in_share))
            if share is not None and share.uneven
        ]
        held = ", ".join(f"{share.of_total * 100:.0f}% of {what}" for what, share in shares)
        even = f"(even {shares[0][1].even * 100:.0f}%)"
        text = f"{UNEVEN_MARK} uneven: {group.kind} group {group.name} has {held} {even}"
        lines.append(Text(text, style="bold yellow"))
    return lines


def _title(model: ClusterModel) -> Text:
    moment = _dt.datetime.fromtimestamp(model.now_ms / 1000, _dt.UTC)
    return Text.assemble(
        ("delayd top", "bold"),
        f"  cluster {model.cluster}  {moment:%Y-%m-%d %H:%M:%S}Z  {model.interval_s:g} s  ",
        f"{len(model.groups)} group{'' if len(model.groups) == 1 else 's'}  ",
        ("q quit", "dim"),
    )


def render_cluster(model: ClusterModel, width: int = 80, height: int | None = 24) -> RenderableType:
    """The frame for ``model``: ``width`` columns, at most ``height`` lines (None: all)."""
    name_width = max(MIN_NAME_WIDTH, width - sum(w + 1 for _, w in COLUMNS))
    head: list[Text] = [_title(model)]
    etcd_error = None
    if model.etcd_error is not None:
        etcd_error = Text(f"etcd: {model.etcd_error} — showing the groups last read")
        etcd_error.stylize("bold red")
        head.append(etcd_error)
    head += _uneven_lines(model.groups)
    headings = [heading for heading, _ in COLUMNS]
    head.append(Text(_line("group", headings, name_width), style="dim"))
    body = [line for row in model.groups for line in _group_lines(row, name_width)]
    if not model.groups:
        empty = "no groups read yet" if etcd_error else "no groups in this cluster"
        body.append(Text(empty, style="dim"))
    if height is not None and len(head) + len(body) > height:
        room = max(0, height - len(head) - 1)
        hidden = len(body) - room
        more = f"… {hidden} more lines (a taller terminal shows them; --once prints all)"
        body = [*body[:room], Text(more, style="dim")]
    lines = head + body
    if height is not None:
        lines = lines[:height]  # a terminal too short even for the head
    for line in lines:
        if line is etcd_error and height is None:
            continue  # all of the reason, over several lines if need be
        line.no_wrap = True
        line.truncate(width, overflow="ellipsis")
    return Group(*lines)
