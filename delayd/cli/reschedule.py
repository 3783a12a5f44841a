"""Move one delayed message to a new time and print the answer as JSON.

    delayd reschedule --server 127.0.0.1:20801 --delay 15m auction-9-end
    delayd reschedule --server 127.0.0.1:20801 --at 2026-11-22T10:00:00Z auction-9-end

--delay counts from now on this machine's clock. The answer is one JSON object:
message_id, outcome (RESCHEDULED; ALREADY_DELIVERED, with dispatched_ms; UNKNOWN;
DELAY_TOO_LONG: beyond the server's max_delay, refused and never clamped), at_ms and
at. The server and the token may come from DELAYD_SERVER and DELAYD_TOKEN.

Exit status: 0 for RESCHEDULED, 3 for another answer, 1 when unreachable, 2 for bad
arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from delayd.cli.args import add_server_options
from delayd.cli.cancel import EXIT_NOT_DONE
from delayd.cli.producing import producer_for
from delayd.cli.send import add_when_options
from delayd.errors import DelaydError
from delayd.timestamps import format_utc


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_options(parser)
    add_when_options(parser, "due this long from now")
    parser.add_argument("message_id", metavar="ID", help="the message's id")


def run(args: argparse.Namespace) -> int:
    try:
        with producer_for(args) as producer:
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
