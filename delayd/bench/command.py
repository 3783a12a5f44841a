"""`delayd bench`: the delivery benchmark (delayd.bench.delivery) against a fresh
`delayd serve` process — lateness, a burst, memory with pending messages, restart."""

from __future__ import annotations

import argparse

from delayd.bench import delivery


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="measure delivery: lateness, burst, memory, restart (JSON lines)",
        description=delivery.DESCRIPTION + " One JSON object per figure on stdout.",
    )
    delivery.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    return delivery.run(args)
