"""``delayd reschedule``: move one delayed message to a new time; print the answer.

    delayd reschedule --server 127.0.0.1:20801 --delay 15m auction-9-end
    delayd reschedule --server 127.0.0.1:20801 --at 2026-11-22T10:00:00Z auction-9-end

``--delay`` counts from now on this machine's clock. The answer is one JSON object:
``message_id``, ``outcome`` (``RESCHEDULED``, ``ALREADY_DELIVERED`` with
``dispatched_ms``, ``UNKNOWN``, ``DELAY_TOO_LONG``: beyond the server's max_delay,
refused and never clamped), ``at_ms``/``at``. Exit 0 for RESCHEDULED, 3 for another
answer, 1 when unreachable, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from delayd.client import Producer
from delayd.client.cancel_command import EXIT_NOT_DONE, add_common
from delayd.client.send_command import format_utc, parse_duration_ms, parse_utc_ms
from delayd.errors import DelaydError
from delayd.tls import client_tls_from_args


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "reschedule",
        help="move one delayed message to a new time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--delay", type=parse_duration_ms, metavar="DURATION", help="due this long from now"
    )
    when.add_argument("--at", type=parse_utc_ms, metavar="TIME", help="due at this UTC time")
    add_common(parser)


def run(args: argparse.Namespace) -> int:
    try:
        with Producer(
            args.server, token=args.token, tls=client_tls_from_args(args), timeout_s=args.timeout
        ) as producer:
            receipt = producer.reschedule(args.message_id, at_ms=args.at, delay_ms=args.delay)
    except (DelaydError, ValueError) as exc:
        print(f"delayd reschedule: {exc}", file=sys.stderr)
        return 1
    out = {"message_id": receipt.message_id, "outcome": receipt.outcome.name}
    out.update(at_ms=receipt.at_ms, at=format_utc(receipt.at_ms))
    if receipt.dispatched_ms is not None:
        out.update(
            dispatched_ms=receipt.dispatched_ms, dispatched=format_utc(receipt.dispatched_ms)
        )
    print(json.dumps(out))
    return 0 if receipt.rescheduled else EXIT_NOT_DONE
