"""``delayd cancel``: cancel one delayed message and print the answer as JSON.

    delayd cancel --server 127.0.0.1:20801 order-17-timeout

The answer is one JSON object: ``message_id``, ``outcome`` (``CANCELLED``: it will not
be delivered; ``ALREADY_DELIVERED``: too late, ``dispatched_ms``/``dispatched`` say
when; ``UNKNOWN``: no message with that id). Exit 0 for CANCELLED, 3 for
ALREADY_DELIVERED or UNKNOWN, 1 when the server cannot be reached (reason on stderr),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys

from delayd.client import Producer
from delayd.client.send_command import format_utc, parse_server
from delayd.errors import DelaydError
from delayd.tls import add_client_tls_arguments, client_tls_from_args

EXIT_NOT_DONE = 3  # a definite answer, but not the one asked for


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = subparsers.add_parser(
        "cancel",
        help="cancel one delayed message",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_common(parser)


def add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--server", required=True, type=parse_server, metavar="HOST:PORT", help="delay server"
    )
    parser.add_argument("--token", help="shared secret, if the server requires one")
    add_client_tls_arguments(parser)
    parser.add_argument(
        "--timeout", type=float, default=10.0, metavar="SECONDS", help="give up after this long"
    )
    parser.add_argument("message_id", metavar="ID", help="the message's id")


def answer_json(message_id: str, outcome: str, dispatched_ms: int | None) -> str:
    out = {"message_id": message_id, "outcome": outcome}
    if dispatched_ms is not None:
        out.update(dispatched_ms=dispatched_ms, dispatched=format_utc(dispatched_ms))
    return json.dumps(out)


def run(args: argparse.Namespace) -> int:
    try:
        with Producer(
            args.server, token=args.token, tls=client_tls_from_args(args), timeout_s=args.timeout
        ) as producer:
            receipt = producer.cancel(args.message_id)
    except (DelaydError, ValueError) as exc:
        print(f"delayd cancel: {exc}", file=sys.stderr)
        return 1
    print(answer_json(receipt.message_id, receipt.outcome.name, receipt.dispatched_ms))
    return 0 if receipt.cancelled else EXIT_NOT_DONE
