"""Schedule one message on a delay server and print its receipt as JSON.

    delayd send --server 127.0.0.1:20801 --subject orders.timeout --delay 90s \\
        --key order-17 --prop source=cli '{"order": 17}'

--delay is a duration with a unit (250ms, 90s, 15m, 2h, 7d, 1h30m; decimals allowed
when they come to whole milliseconds, 1.5h); --at an ISO-8601 time with a UTC offset
(2026-11-22T10:00:00Z). The receipt is one JSON object: message_id, code, due_ms
(epoch ms) and due (the same in ISO-8601 UTC), and sequence (the delay server's
message_log sequence). The server and the token may come from DELAYD_SERVER and
DELAYD_TOKEN.

Exit status: 0 when stored, 1 when refused or unreachable (the reason on stderr),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from delayd.cli.args import add_server_options, duration_ms, utc_time_ms
from delayd.cli.producing import producer_for
from delayd.client import Receipt
from delayd.errors import DelaydError
from delayd.timestamps import format_utc


def parse_property(text: str) -> tuple[str, str]:
    """``name=value`` -> (name, value). Raises argparse.ArgumentTypeError."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def receipt_json(receipt: Receipt) -> dict[str, Any]:
    """The printed receipt (``Receipt`` already reads the delay server's sequence from
    its result, docs/protocol.md "SEND_BATCH results")."""
    return {
        "message_id": receipt.message_id,
        "code": receipt.code.name,
        "due_ms": receipt.due_ms,
        "due": None if receipt.due_ms is None else format_utc(receipt.due_ms),
        "sequence": receipt.sequence,
    }


def add_when_options(parser: argparse.ArgumentParser, delay_help: str) -> None:
    """``--delay`` or ``--at``, one of them required."""
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument("--delay", type=duration_ms, metavar="DURATION", help=delay_help)
    when.add_argument("--at", type=utc_time_ms, metavar="TIME", help="due at this UTC time")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_options(parser)
    parser.add_argument("--subject", required=True, help="subject to deliver to")
    add_when_options(parser, "due after this long")
    parser.add_argument("--id", dest="message_id", help="message id (default: a unique one)")
    parser.add_argument("--key", help="message key")
    parser.add_argument(
        "--prop",
        action="append",
        type=parse_property,
        default=[],
        metavar="NAME=VALUE",
        help="a property (repeatable)",
    )
    parser.add_argument("body", metavar="BODY", help="message body (UTF-8); '-' reads stdin")


def run(args: argparse.Namespace) -> int:
    properties: dict[str, str] = {}
    for name, value in args.prop:
        if name in properties:
            print(f"delayd send: --prop {name} given twice", file=sys.stderr)
            return 2
        properties[name] = value
    body = sys.stdin.buffer.read() if args.body == "-" else args.body.encode()
    try:
        with producer_for(args) as producer:
            receipt = producer.send(
                args.subject,
                body,
                at_ms=args.at,
                delay_ms=args.delay,
                message_id=args.message_id,
                key=args.key,
                properties=properties,
            )
    except DelaydError as exc:
        print(f"delayd send: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(receipt_json(receipt)))
    return 0
