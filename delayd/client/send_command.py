"""``delayd send``: schedule one message on a delay server and print its receipt as JSON.

    delayd send --server 127.0.0.1:20801 --subject orders.timeout --delay 90s \\
        --key order-17 --prop source=cli '{"order": 17}'

``--delay`` is a duration with a unit (``250ms``, ``90s``, ``15m``, ``2h``, ``7d``;
decimals allowed when they come to whole milliseconds, ``1.5h``); ``--at`` an ISO-8601
time with a UTC offset (``2026-11-22T10:00:00Z``). The receipt is one JSON object:
``message_id``, ``due_ms`` (epoch ms) and ``due`` (the same in ISO-8601 UTC), and
``sequence`` (the delay server's message_log sequence). Exit 0 when stored, 1 when
refused or unreachable (the reason on stderr), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import re
import sys
from decimal import Decimal
from typing import Any

from delayd.client import Producer, Receipt
from delayd.client._addr import parse_addr
from delayd.errors import DelaydError
from delayd.tls import add_client_tls_arguments, client_tls_from_args

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_EPOCH = _dt.datetime(1970, 1, 1, tzinfo=_dt.UTC)


def parse_duration_ms(text: str) -> int:
    """``90s`` -> 90000. Raises argparse.ArgumentTypeError (argparse names the flag)."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration; use a number and a unit: ms, s, m, h or d "
            "(for example 250ms, 90s, 15m, 2h, 7d)"
        )
    value = Decimal(match.group(1)) * _UNITS_MS[match.group(2)]
    if value != value.to_integral_value():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of milliseconds")
    return int(value)


def parse_utc_ms(text: str) -> int:
    """``2026-11-22T10:00:00Z`` -> epoch ms. The time must carry a UTC offset (``Z`` or
    ``+hh:mm``). Raises argparse.ArgumentTypeError."""
    try:
        moment = _dt.datetime.fromisoformat(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not an ISO-8601 time such as 2026-11-22T10:00:00Z"
        ) from None
    if moment.tzinfo is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} has no time zone; add Z for UTC (2026-11-22T10:00:00Z)"
        )
    return (moment - _EPOCH) // _dt.timedelta(milliseconds=1)


def parse_server(text: str) -> str:
    """A ``HOST:PORT`` address, checked. Raises argparse.ArgumentTypeError."""
    try:
        parse_addr(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parse_property(text: str) -> tuple[str, str]:
    """``name=value`` -> (name, value). Raises argparse.ArgumentTypeError."""
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=VALUE")
    return name, value


def format_utc(ms: int) -> str:
    """Epoch ms -> ``2026-11-22T10:00:00.000Z``."""
    moment = _EPOCH + _dt.timedelta(milliseconds=ms)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


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


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "send",
        help="schedule one message on a delay server and print the receipt",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--server", required=True, type=parse_server, metavar="HOST:PORT", help="delay server"
    )
    parser.add_argument("--subject", required=True, help="subject to deliver to")
    when = parser.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--delay", type=parse_duration_ms, metavar="DURATION", help="due after this long"
    )
    when.add_argument("--at", type=parse_utc_ms, metavar="TIME", help="due at this UTC time")
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
    parser.add_argument("--token", help="shared secret, if the server requires one")
    add_client_tls_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="give up after this long"
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
        with Producer(
            args.server, token=args.token, tls=client_tls_from_args(args), timeout_s=args.timeout
        ) as producer:
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
