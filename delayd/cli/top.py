"""A live view of one or more delay servers, read from their Prometheus /metrics
(delayd serve --metrics-listen): throughput, lateness, the wheel and pending messages
by horizon, replay lag, broker groups and their circuits. With --etcd, the view of a
whole cluster instead: every group etcd lists, each with its members and their roles,
pending, lateness, rates, replication lag and where the load is uneven
(delayd/cli/top_cluster.py).

Every --interval seconds each server is scraped (concurrently, each within
--timeout) and the view is drawn again in the terminal's alternate screen. A server
that does not answer shows as unreachable and is asked again next time. Keys: q quits,
1-9 select a server, Tab or n the next one, p the previous one. Ctrl-C quits too.

--once scrapes twice, --interval apart (so that rates exist), prints one frame to
stdout and exits: for scripts, and for a terminal that cannot hold a live view (the
cluster view prints every line, whatever the terminal's height).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import termios
import tty
from collections.abc import Awaitable, Callable, Iterator
from typing import TextIO

import trio
from rich.console import Console
from rich.live import Live

from delayd.cli.args import add_client_tls_options, client_tls, etcd_endpoints, seconds
from delayd.cli.top_cluster import ClusterWatcher
from delayd.cli.top_watch import Screen, Watcher
from delayd.cluster.etcd import EtcdClient
from delayd.cluster.members import check_name, cluster_prefix
from delayd.tls import TlsError
from delayd.top.scrape import parse_target

DEFAULT_INTERVAL_S = 1.0
MAX_DEFAULT_TIMEOUT_S = 2.0
QUIT_KEYS = frozenset("qQ")
NEXT_KEYS = frozenset("\tnj")
PREVIOUS_KEYS = frozenset("pk")


DEFAULT_TARGET = "127.0.0.1:20880"  # delayd serve's default metrics_listen


def _seconds_under_an_hour(text: str) -> float:
    value = seconds(text)
    if value >= 3600:
        raise argparse.ArgumentTypeError(f"{value:g} s is more than an hour")
    return value


def _target(text: str) -> str:
    """``text`` if it names a server to watch (parsed again once --tls-* are known)."""
    try:
        parse_target(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _cluster_name(text: str) -> str:
    try:
        return check_name("cluster name", text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "targets",
        nargs="*",
        type=_target,
        metavar="HOST:PORT",
        help="a server's metrics listener (or an http:// URL of its metrics page); "
        f"default {DEFAULT_TARGET}, where delayd serve listens by default",
    )
    parser.add_argument(
        "--etcd", type=etcd_endpoints, metavar="URL[,URL]",
        help="show the whole cluster these etcd client URLs hold: every group, its "
        "members (found in etcd, no HOST:PORT given) and where the load is uneven",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", type=_cluster_name, metavar="NAME",
        help="with --etcd: the cluster (default: the default cluster)",
    )  # fmt: skip
    add_client_tls_options(parser)  # scrape over https, trusting --tls-ca
    parser.add_argument(
        "--interval",
        type=_seconds_under_an_hour,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between refreshes (default {DEFAULT_INTERVAL_S:g})",
    )
    parser.add_argument(
        "--timeout",
        type=_seconds_under_an_hour,
        metavar="S",
        help=f"per scrape (default: the interval, at most {MAX_DEFAULT_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="scrape twice, --interval apart, print one frame to stdout and exit",
    )


def _select(key: str, selected: int, count: int) -> int:
    if key.isdigit() and 1 <= int(key) <= count:
        return int(key) - 1
    if key in NEXT_KEYS:
        return (selected + 1) % count
    if key in PREVIOUS_KEYS:
        return (selected - 1) % count
    return selected


@contextlib.contextmanager
def _cbreak(stream: TextIO) -> Iterator[int | None]:
    """Keys one at a time, unechoed, while inside; the fd to read them from, or None
    when ``stream`` is not a terminal (then no keys are read)."""
    if not stream.isatty():
        yield None
        return
    fd = stream.fileno()
    saved = termios.tcgetattr(fd)
    tty.setcbreak(fd)
    try:
        yield fd
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


async def _read_keys(
    fd: int, keys: trio.MemorySendChannel[str], quit_scope: trio.CancelScope
) -> None:
    """Forward key presses; ``q`` cancels ``quit_scope`` at once, even mid-scrape."""
    while True:
        await trio.lowlevel.wait_readable(fd)
        data = os.read(fd, 64)
        if not data:
            return  # stdin closed: no more keys
        for key in data.decode(errors="ignore"):
            if key in QUIT_KEYS:
                quit_scope.cancel()
                return
            await keys.send(key)


async def _quit_on_ctrl_c(quit_scope: trio.CancelScope) -> None:
    """Ctrl-C quits as ``q`` does: by cancelling at the next checkpoint. Left to trio's
    KeyboardInterrupt, it could land anywhere — mid-write to the terminal, mid-scrape —
    and leave the screen or the terminal modes half restored."""
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async for _ in signals:
            quit_scope.cancel()
            return


async def _once(screen: Screen, interval_s: float, console: Console) -> None:
    await screen.refresh()
    await trio.sleep(interval_s)
    await screen.refresh()
    width, height = console.size
    console.print(screen.frame(0, interval_s, width, None if screen.prints_all_once else height))


async def _live(screen: Screen, interval_s: float, console: Console) -> None:
    send, receive = trio.open_memory_channel[str](64)
    selected = 0
    with (
        _cbreak(sys.stdin) as keys_fd,
        Live(console=console, screen=True, auto_refresh=False) as live,
        trio.CancelScope() as quit_scope,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_quit_on_ctrl_c, quit_scope)
            if keys_fd is not None:
                nursery.start_soon(_read_keys, keys_fd, send, quit_scope)
            next_refresh = trio.current_time()
            while True:
                if trio.current_time() >= next_refresh:
                    await screen.refresh()
                    next_refresh = max(next_refresh + interval_s, trio.current_time())
                width, height = console.size
                live.update(screen.frame(selected, interval_s, width, height))
                live.refresh()
                with trio.move_on_at(next_refresh):
                    key = await receive.receive()
                    selected = _select(key, selected, max(1, screen.choices))


Show = Callable[[Screen, float, Console], Awaitable[None]]


async def _watch_cluster(
    etcd: EtcdClient, screen: ClusterWatcher, show: Show, interval_s: float, console: Console
) -> None:
    async with etcd:
        await show(screen, interval_s, console)


def _usage_error(text: str) -> int:
    print(f"delayd top: {text}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    if args.etcd and args.targets:
        return _usage_error(
            "give either HOST:PORT (servers) or --etcd (a cluster's members, found in "
            "etcd), not both"
        )
    if args.cluster and not args.etcd:
        return _usage_error("--cluster needs --etcd (where the cluster is)")
    try:
        tls = client_tls(args)
        context = tls.ssl_context if tls is not None else None
    except TlsError as exc:
        return _usage_error(str(exc))
    timeout_s = args.timeout or min(args.interval, MAX_DEFAULT_TIMEOUT_S)
    console = Console()
    show: Show = _once if args.once else _live
    try:
        if args.etcd:
            try:
                etcd = EtcdClient(args.etcd, timeout_s=timeout_s)
            except ValueError as exc:
                return _usage_error(f"--etcd: {exc}")
            cluster = args.cluster or ""
            prefix = cluster_prefix(cluster)
            screen = ClusterWatcher(etcd, prefix, cluster or "default", timeout_s, context)
            trio.run(_watch_cluster, etcd, screen, show, args.interval, console)
        else:
            https = context is not None
            targets = [parse_target(t, https=https) for t in args.targets or [DEFAULT_TARGET]]
            watcher = Watcher(targets, timeout_s, context)
            trio.run(show, watcher, args.interval, console)
    except* KeyboardInterrupt:
        pass  # Ctrl-C is one of the two ways out (trio may wrap it in a group)
    return 0
