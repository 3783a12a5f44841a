"""`delayd top`: the model (rates, lateness percentiles from histogram buckets, groups)
from two scrapes of metric pages a prometheus_client registry wrote; the renderer's
80x24 frame; `--once` against a real /metrics endpoint; the live view in a pseudo
terminal (keys select and quit, Ctrl-C quits)."""

from __future__ import annotations

import contextlib
import fcntl
import io
import math
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from functools import partial

import pytest
import trio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from rich.console import Console

from delayd.logs.buckets import bucket_name
from delayd.serving.metrics_http import serve_metrics
from delayd.top import (
    Scrape,
    ServerView,
    Snapshot,
    TopModel,
    histogram_quantile,
    parse_target,
    render,
    server_view,
)
from delayd.top.render import fmt_bytes, fmt_rate, fmt_seconds
from tests.process_support import ROOT, child_env

T = 1_795_341_600_000  # 2026-11-22T10:00:00Z
HORIZON_PENDING = {"1m": 12_000, "10m": 3_000, "1h": 600, "1d": 0, "later": 6_000}


class FakeServer:
    """A delay server's metrics as the issue names them, in a registry of their own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.accepted = Counter("delayd_intake_accepted_messages", "accepted", registry=r)
        self.refused = Counter("delayd_intake_refused_messages", "refused", ["reason"], registry=r)
        self.lag_records = Gauge("delayd_replay_lag_records", "lag", registry=r)
        self.lag_bytes = Gauge("delayd_replay_lag_bytes", "lag", registry=r)
        self.entries = Gauge("delayd_wheel_entries", "entries", registry=r)
        self.ahead = Gauge("delayd_wheel_loaded_ahead_seconds", "ahead", registry=r)
        self.loading_bucket = Gauge(
            "delayd_wheel_loading_bucket_start_timestamp_seconds", "b", registry=r
        )
        self.loading_offset = Gauge("delayd_wheel_loading_offset_bytes", "o", registry=r)
        self.loaded_offset = Gauge("delayd_wheel_loaded_offset_bytes", "o", registry=r)
        self.pending = Gauge("delayd_pending_messages", "pending", ["horizon"], registry=r)
        self.lateness = Histogram(
            "delayd_delivery_lateness_seconds",
            "lateness",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 1.0),
            registry=r,
        )
        self.batch = Histogram(
            "delayd_delivery_batch_size_messages", "batch", buckets=(1, 10, 100, 1000), registry=r
        )
        group = ["group"]
        self.sent = Counter("delayd_delivery_sent_messages", "sent", group, registry=r)
        self.failed = Counter("delayd_delivery_failed_messages", "failed", group, registry=r)
        self.retried = Counter("delayd_delivery_retried_messages", "retried", group, registry=r)
        self.dead = Counter("delayd_delivery_dead_lettered_messages", "dead", group, registry=r)
        self.circuit = Gauge("delayd_delivery_circuit_state", "circuit", group, registry=r)

    def page(self) -> str:
        return generate_latest(self.registry).decode()


def first_state(server: FakeServer) -> None:
    server.accepted.inc(1000)
    server.refused.labels("busy").inc(4)
    server.lag_records.set(12)
    server.lag_bytes.set(3482)  # 3.4 KiB
    server.entries.set(12_345)
    server.ahead.set(118)
    server.loading_bucket.set(T / 1000)
    server.loading_offset.set(1_300_000)
    server.loaded_offset.set(1_200_000)
    for horizon, count in HORIZON_PENDING.items():
        server.pending.labels(horizon).set(count)
    for _ in range(1000):
        server.lateness.observe(0.5)  # before the interval: slow
    server.batch.observe(100)
    for group, state in (("billing", 0), ("orders", 2), ("audit", 1)):
        server.sent.labels(group).inc(100)
        server.failed.labels(group)
        server.retried.labels(group)
        server.dead.labels(group)
        server.circuit.labels(group).set(state)


def second_state(server: FakeServer) -> None:
    """What happened in the 2 s between the scrapes."""
    server.accepted.inc(2000)
    server.sent.labels("billing").inc(1200)
    server.failed.labels("orders").inc(40)
    server.retried.labels("orders").inc(10)
    server.dead.labels("orders").inc(2)
    # 100 deliveries: cumulative buckets 50 (<=1 ms), 90 (<=5), 98 (<=10), 100 (<=50)
    for seconds, count in ((0.0005, 50), (0.003, 40), (0.008, 8), (0.04, 2)):
        for _ in range(count):
            server.lateness.observe(seconds)
    for size in (20, 40):
        server.batch.observe(size)


def two_scrapes() -> tuple[Scrape, Scrape]:
    server = FakeServer()
    first_state(server)
    before = Scrape(100.0, Snapshot.parse(server.page()))
    second_state(server)
    return before, Scrape(102.0, Snapshot.parse(server.page()))


def frame(model: TopModel, width: int = 80, height: int = 24) -> list[str]:
    """The frame as text lines, rendered as a terminal of that size would show it."""
    console = Console(width=width, height=height, record=True, file=io.StringIO())
    console.print(render(model, width, height))
    lines = console.export_text().splitlines()
    assert len(lines) <= height and all(len(line) <= width for line in lines), "\n".join(lines)
    return lines


def line_with(lines: list[str], *words: str) -> str:
    (found,) = [line for line in lines if all(w in line for w in words)]
    return found


# ---------------------------------------------------------------- pure parts


def test_histogram_quantile_interpolates_inside_the_bucket():
    buckets = [(0.001, 50.0), (0.005, 90.0), (0.01, 98.0), (0.05, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.03)
    assert histogram_quantile(0.95, buckets) == pytest.approx(0.005 + 0.005 * 5 / 8)
    # in the +Inf bucket: the highest finite bound, as Prometheus
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 10.0)]) == 0.1
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None  # nothing observed
    assert histogram_quantile(0.5, [(0.1, 5.0)]) is None  # no +Inf: not a whole histogram


def test_model_rates_percentiles_and_groups_from_two_scrapes():
    before, after = two_scrapes()
    view = server_view("a:1", after, before)
    assert view.in_per_s == pytest.approx(1000.0)
    assert view.refused_per_s == 0.0
    assert view.out_per_s == pytest.approx(600.0)
    assert view.batch_mean == pytest.approx(30.0)  # (20 + 40) / 2 in the interval
    # percentiles of the 100 deliveries in the interval, not of the 1000 slow ones before
    assert view.lateness_p50_s == pytest.approx(0.001)
    assert view.lateness_p99_s == pytest.approx(0.03)
    assert not view.lateness_since_start
    assert (view.replay_lag_records, view.replay_lag_bytes) == (12, 3482)
    assert (view.wheel_entries, view.loaded_ahead_s, view.loading_bucket_ms) == (12_345, 118, T)
    assert view.pending == HORIZON_PENDING
    assert [(g.name, g.circuit) for g in view.groups] == [
        ("orders", "OPEN"),
        ("audit", "half-open"),
        ("billing", "closed"),
    ]
    orders = view.groups[0]
    assert (orders.sent_per_s, orders.failed_per_s, orders.retried_per_s) == (0.0, 20.0, 5.0)
    assert orders.dead_lettered_per_s == 1.0
    assert view.open_circuits == 1


def on_time_lateness(buckets: tuple[float, ...], deliveries: int) -> Snapshot:
    registry = CollectorRegistry()
    lateness = Histogram(
        "delayd_delivery_lateness_seconds", "lateness", buckets=buckets, registry=registry
    )
    for _ in range(deliveries):
        lateness.observe(0.0)
    return Snapshot.parse(generate_latest(registry).decode())


@pytest.mark.parametrize("buckets", [(0.001, 0.005), (0.0, 0.0005, 0.001, 0.005)])
def test_on_time_deliveries_read_as_zero_lateness(buckets):
    """Every delivery at its due millisecond: p50 and p99 are 0, over the interval and
    since start, from a server with a 0 bucket and from one whose lowest bound is 1 ms
    (interpolation alone would say 500 µs and 990 µs)."""
    before, after = on_time_lateness(buckets, 10), on_time_lateness(buckets, 30)
    for view in (
        server_view("a:1", Scrape(2.0, after), Scrape(1.0, before)),
        server_view("a:1", Scrape(2.0, after)),
    ):
        assert (view.lateness_p50_s, view.lateness_p99_s) == (0.0, 0.0)
    lines = frame(TopModel([server_view("a:1", Scrape(2.0, after))], now_ms=T))
    assert "0 µs" in line_with(lines, "lateness p50")
    # One late delivery among them: the quantiles are the buckets' again.
    registry = CollectorRegistry()
    lateness = Histogram(
        "delayd_delivery_lateness_seconds", "lateness", buckets=buckets, registry=registry
    )
    lateness.observe(0.004)
    late = Snapshot.parse(generate_latest(registry).decode())
    assert server_view("a:1", Scrape(1.0, late)).lateness_p99_s > 0.001


def test_model_without_a_previous_scrape_or_after_a_restart():
    before, after = two_scrapes()
    alone = server_view("a:1", after)
    assert alone.in_per_s is None and alone.out_per_s is None and alone.batch_mean is None
    assert alone.lateness_since_start  # whole histogram: 1100 deliveries, mostly 0.5 s
    assert alone.lateness_p99_s == pytest.approx(0.1 + 0.9 * (1089 - 100) / 1000)
    # counters that went down: the server restarted, what it has now is the increase
    restarted = server_view("a:1", Scrape(104.0, before.snapshot), Scrape(102.0, after.snapshot))
    assert restarted.in_per_s == pytest.approx(1000 / 2.0)
    assert restarted.out_per_s == pytest.approx(300 / 2.0)


def test_a_failed_scrape_or_a_server_without_delivery_metrics():
    down = server_view("a:1", Scrape(1.0, error="connection refused"))
    assert down.error == "connection refused"
    accepted = "delayd_intake_accepted_messages_total"
    page = f"# TYPE {accepted} counter\n{accepted} 7\n"
    intake_only = server_view("a:1", Scrape(2.0, Snapshot.parse(page)))
    assert intake_only.error is None and intake_only.wheel_entries is None
    assert intake_only.groups == [] and intake_only.pending == {}
    lines = frame(TopModel([intake_only], now_ms=T))
    assert "—" in line_with(lines, "lateness p99") and "no delivery metrics" in "\n".join(lines)
    with pytest.raises(ValueError, match="not a Prometheus metrics page"):
        Snapshot.parse("this is { not metrics\n")


def test_targets():
    assert parse_target("10.0.0.1:20880").url == "http://10.0.0.1:20880/metrics"
    assert parse_target("[::1]:9").url == "http://[::1]:9/metrics"
    assert parse_target("http://h:1/custom").url == "http://h:1/custom"
    assert parse_target("http://h:1").url == "http://h:1/metrics"
    assert parse_target("10.0.0.1:20880", https=True).url == "https://10.0.0.1:20880/metrics"
    assert parse_target("http://h:1", https=True).url == "http://h:1/metrics"  # as written
    for bad in ("h", "h:x", ":1", "h:70000"):
        with pytest.raises(ValueError):
            parse_target(bad)


def test_number_formats():
    assert [fmt_seconds(s) for s in (None, 0.0004, 0.0012, 0.03, 1.5, 118, 4000, 200_000)] == [
        "—",
        "400 µs",
        "1.2 ms",
        "30 ms",
        "1.50 s",
        "1m 58s",
        "1h 6m",
        "2d 7h",
    ]
    assert fmt_seconds(-5) == "-5.00 s"  # the wheel loaded less far than now
    assert [fmt_bytes(b) for b in (1023, 3482, 1_300_000, 5 * 2**30)] == [
        "1023 B",
        "3.4 KiB",
        "1.2 MiB",
        "5.0 GiB",
    ]
    assert [fmt_rate(r) for r in (12.34, 123_456, 2.5e6)] == ["12.3/s", "123.5k/s", "2.50M/s"]


# ---------------------------------------------------------------- the frame


def test_one_server_frame_shows_every_panel_at_80x24():
    before, after = two_scrapes()
    lines = frame(TopModel([server_view("127.0.0.1:20880", after, before)], now_ms=T))
    assert lines[0].startswith("delayd top  127.0.0.1:20880  2026-11-22 10:00:00Z")
    assert "throughput" in lines[1] and "wheel" in lines[1]
    assert "1,000.0/s" in line_with(lines, "│ in ")
    assert "600.0/s" in line_with(lines, "│ out ")
    assert "30.0" in line_with(lines, "batch mean")
    assert "1.0 ms" in line_with(lines, "lateness p50")
    assert "30 ms" in line_with(lines, "lateness p99")
    assert "12 · 3.4 KiB" in line_with(lines, "replay lag")
    assert "entries 12,345 · ahead 1m 58s" in "\n".join(lines)
    assert f"loading {bucket_name(T)} 1.1/1.2 MiB" in "\n".join(lines)
    # horizon bars: proportional to the counts, the largest full
    bars = {}
    for label, horizon in (("≤ 1m", "1m"), ("1m-10m", "10m"), ("1h-1d", "1d"), ("> 1d", "later")):
        row = line_with(lines, label)
        assert f"{HORIZON_PENDING[horizon]:,}" in row
        bars[horizon] = row.count("█")
    assert bars["1m"] >= 15 and bars["1d"] == 0
    for horizon in ("10m", "later"):
        share = HORIZON_PENDING[horizon] / HORIZON_PENDING["1m"]
        assert abs(bars[horizon] - bars["1m"] * share) <= 0.5
    # groups, OPEN first with its rates
    group_rows = lines[lines.index(line_with(lines, "circuit", "sent/s")) + 1 :][:3]
    assert [row.split()[1:3] for row in group_rows] == [
        ["orders", "OPEN"],
        ["audit", "half-open"],
        ["billing", "closed"],
    ]
    assert group_rows[0].split()[3:7] == ["0.0", "20.0", "5.0", "1.0"]
    assert "600.0" in group_rows[2]


def busy_server() -> ServerView:
    """A server with 23 groups, 4 of them OPEN: orders and g00, g07, g14."""
    server = FakeServer()
    first_state(server)
    for i in range(20):
        server.circuit.labels(f"g{i:02d}").set(2 if i % 7 == 0 else 0)
    return server_view("busy:1", Scrape(1.0, Snapshot.parse(server.page())))


def test_several_servers_with_a_selector_and_groups_cut_to_the_room_left():
    before, after = two_scrapes()
    views = [server_view("a:1", after, before), busy_server()]
    views.append(server_view("c:1", Scrape(1.0, error="timed out")))
    lines = frame(TopModel(views, selected=1, now_ms=T))
    assert "3 servers" in lines[0] and "select" in lines[0]
    assert "1,000.0" in line_with(lines, " 1 ", "a:1")
    assert "OPEN" in line_with(lines, "▶2", "busy:1")  # it has open circuits
    assert "unreachable" in line_with(lines, " 3 ", "c:1")
    header = lines.index(line_with(lines, "circuit", "sent/s"))
    rows = [line.split()[1:3] for line in lines[header + 1 : header + 6]]
    assert rows == [
        ["g00", "OPEN"],
        ["g07", "OPEN"],
        ["g14", "OPEN"],
        ["orders", "OPEN"],
        ["audit", "half-open"],
    ]
    assert "… 18 more" in lines[header + 6] and "OPEN" not in lines[header + 6]
    assert len(lines) == 24  # the groups panel took every line left


def test_many_servers_scroll_to_the_selected_one_and_an_unreachable_one_says_why():
    views = [busy_server()]
    views += [server_view(f"10.0.0.{i}:20880", Scrape(1.0, error="timed out")) for i in range(11)]
    lines = frame(TopModel(views, selected=0, now_ms=T))
    assert line_with(lines, "▶1", "busy:1")
    assert line_with(lines, " 8 ", "10.0.0.6:20880")
    assert not any("10.0.0.7:" in line for line in lines)  # below the window of 8 rows
    assert "… 23 more, 4 OPEN" in "\n".join(lines)  # room for one line of groups
    lines = frame(TopModel(views, selected=11, now_ms=T))
    assert line_with(lines, "▶12", "10.0.0.10:20880")
    assert not any("busy:1" in line for line in lines)  # above the window
    assert "10.0.0.10:20880: unreachable — timed out" in "\n".join(lines)


# ---------------------------------------------------------------- the command


def delayd_env() -> dict[str, str]:
    env = child_env()
    env.update(COLUMNS="80", LINES="24")
    return env


async def test_once_against_a_real_metrics_endpoint():
    server = FakeServer()
    first_state(server)
    second_state(server)

    async def keep_accepting() -> None:
        while True:
            server.accepted.inc(10)
            await trio.sleep(0.01)

    async with trio.open_nursery() as nursery:
        address, *_ = await nursery.start(partial(serve_metrics, server.registry, "127.0.0.1", 0))
        nursery.start_soon(keep_accepting)
        target = "{}:{}".format(*address)
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "delayd",
                "top",
                "--once",
                "--interval",
                "0.3",
                "--timeout",  # not the interval: this loop answers late on a loaded machine
                "5",
                target,
                "127.0.0.1:1",
            ],
            capture_stdout=True,
            capture_stderr=True,
            cwd=ROOT,
            env=delayd_env(),
        )
        nursery.cancel_scope.cancel()
    lines = done.stdout.decode().splitlines()
    assert done.returncode == 0, done.stderr.decode()
    assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
    assert "2 servers" in lines[0]
    assert "unreachable" in line_with(lines, "127.0.0.1:1 ")
    assert re.search(r"│ in\s+[\d,]+\.\d/s", line_with(lines, "│ in "))  # a rate, not "—"
    assert "entries 12,345" in done.stdout.decode()
    assert line_with(lines, "orders", "OPEN")


@contextlib.contextmanager
def top_in_a_terminal(*targets: str) -> Iterator[tuple[subprocess.Popen, int]]:
    """`delayd top` on a pseudo terminal of 80x24: the process and the master fd. On
    leaving, a process still running is killed and the terminal closed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
    env = child_env()
    env.update(TERM="xterm-256color")
    for name in ("COLUMNS", "LINES"):
        env.pop(name, None)
    # As a shell starts a foreground job: Ctrl-C at its default. A test run started in
    # the background inherits SIGINT ignored, and Python then keeps ignoring it.
    default_sigint = (
        "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.executable, sys.argv[1:])"
    )
    top = [sys.executable, "-m", "delayd", "top", "--interval", "0.2", *targets]
    proc = subprocess.Popen(
        [sys.executable, "-c", default_sigint, *top],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
        start_new_session=True,
    )
    os.close(slave)
    try:
        yield proc, master
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(master)


ANSI = re.compile(r"\x1b(\[[0-9;?]*[A-Za-z]|\][^\x07]*\x07|[()][A-Z0-9]|[=>])")


def screen_until(master: int, pattern: str, timeout_s: float = 20.0) -> str:
    """What the terminal showed, once ``pattern`` appears in it (ANSI codes dropped)."""
    seen = ""
    deadline = time.monotonic() + timeout_s
    while not re.search(pattern, seen):
        ready, _, _ = select.select([master], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"no {pattern!r} on the screen:\n{seen[-2000:]}"
        try:
            seen += ANSI.sub("", os.read(master, 65536).decode(errors="replace"))
        except OSError:  # the child closed the terminal
            break
    return seen


def exit_status(proc: subprocess.Popen, master: int, timeout_s: float = 10.0) -> int:
    """``proc``'s exit status, reading its terminal meanwhile as a terminal emulator does:
    a pty nobody reads fills up, and a child that redraws (or restores the screen on
    exit) then blocks in write() and never gets to exit."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        left = deadline - time.monotonic()
        assert left > 0, f"delayd top still running after {timeout_s} s"
        ready, _, _ = select.select([master], [], [], min(left, 0.05))
        if ready:
            with contextlib.suppress(OSError):  # the child closed the terminal
                os.read(master, 65536)
    return proc.wait()


def assert_terminal_restored(master: int) -> None:
    """Line mode and echo are back (top had the terminal in cbreak mode)."""
    lflag = termios.tcgetattr(master)[3]
    assert lflag & termios.ICANON and lflag & termios.ECHO


@pytest.mark.slow
def test_live_view_selects_with_digits_and_quits_on_q():
    with top_in_a_terminal("127.0.0.1:1", "127.0.0.1:2") as (proc, master):
        screen_until(master, r"▶1\s+127\.0\.0\.1:1 ")
        assert not termios.tcgetattr(master)[3] & termios.ICANON  # keys one at a time
        os.write(master, b"2")
        screen_until(master, r"▶2\s+127\.0\.0\.1:2 ")
        os.write(master, b"q")
        assert exit_status(proc, master) == 0
        assert_terminal_restored(master)


@pytest.mark.slow
def test_live_view_quits_on_ctrl_c():
    with top_in_a_terminal("127.0.0.1:1") as (proc, master):
        screen_until(master, "unreachable")
        proc.send_signal(signal.SIGINT)
        assert exit_status(proc, master) == 0
        assert_terminal_restored(master)
