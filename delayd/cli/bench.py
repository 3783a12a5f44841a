"""The delivery benchmark against a fresh delayd serve process: how late messages
arrive, how fast a burst is delivered, how much memory pending messages take, how
quick a restart is. One JSON object per figure on stdout, progress on stderr.

    delayd bench                        the figures of docs/benchmarks.md
    delayd bench --quick                the same cases, smaller (under a minute)
    delayd bench --only lateness,burst
    delayd bench --only lateness --consumer async

Exit status: 0 when every case ran; 2 for bad arguments.
"""

from __future__ import annotations

import argparse

from delayd.bench import delivery
from delayd.cli.args import count

CONSUMERS = ("blocking", "async")


def cases(text: str) -> set[str]:
    """Comma-separated names of delivery.CASES."""
    chosen = {name.strip() for name in text.split(",")}
    unknown = chosen - delivery.CASES
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown case(s) {', '.join(sorted(unknown))}; "
            f"choose from {', '.join(sorted(delivery.CASES))}"
        )
    return chosen


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="smaller runs (under a minute)")
    parser.add_argument(
        "--only",
        type=cases,
        default=set(delivery.CASES),
        metavar="CASES",
        help=f"comma-separated cases ({','.join(sorted(delivery.CASES))}; default all)",
    )
    parser.add_argument(
        "--consumer", choices=CONSUMERS, default="blocking", help="the lateness case's consumer"
    )
    parser.add_argument("--pending", type=count, metavar="N", help="messages for memory/restart")


def run(args: argparse.Namespace) -> int:
    delivery.run(args.only, quick=args.quick, consumer=args.consumer, pending=args.pending)
    return 0
