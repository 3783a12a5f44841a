"""Cancel one delayed message and print the answer as JSON.

    delayd cancel --server 127.0.0.1:20801 order-17-timeout

The answer is one JSON object: message_id, outcome (CANCELLED: it will not be
delivered; ALREADY_DELIVERED: too late, dispatched_ms and dispatched say when;
UNKNOWN: no message with that id). The server and the token may come from
DELAYD_SERVER and DELAYD_TOKEN.

Exit status: 0 for CANCELLED, 3 for ALREADY_DELIVERED or UNKNOWN, 1 when the server
cannot be reached (the reason on stderr), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from delayd.cli.args import add_server_options
from delayd.cli.producing import producer_for
from delayd.errors import DelaydError
from delayd.timestamps import format_utc

EXIT_NOT_DONE = 3  # a definite answer, but not the one asked for


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_options(parser)
    parser.add_argument("message_id", metavar="ID", help="the message's id")


def answer_json(message_id: str, outcome: str, dispatched_ms: int | None) -> str:
    out = {"message_id": message_id, "outcome": outcome}
    if dispatched_ms is not None:
        out.update(dispatched_ms=dispatched_ms, dispatched=format_utc(dispatched_ms))
    return json.dumps(out)


def run(args: argparse.Namespace) -> int:
    try:
        with producer_for(args) as producer:
            receipt = producer.cancel(args.message_id)
    except (DelaydError, ValueError) as exc:
        print(f"delayd cancel: {exc}", file=sys.stderr)
        return 1
    print(answer_json(receipt.message_id, receipt.outcome.name, receipt.dispatched_ms))
    return 0 if receipt.cancelled else EXIT_NOT_DONE
