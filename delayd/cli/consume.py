"""Print messages of a subject as a member of a consumer group.

    delayd consume --broker 127.0.0.1:20811 --subject orders.timeout --group billing

--broker etcd://HOST:PORT/[CLUSTER/]* reads every broker group of a cluster
(docs/cluster.md); a member list or etcd://HOST:PORT/GROUP one group.

One line per message, committed once printed (auto-commit), so a second run of the
same group continues where the first stopped; with --commit sync each commit is
durable before the next line is printed. The broker and the token may come from
DELAYD_BROKER and DELAYD_TOKEN.

Exit status: 0 after --count messages, or when no message came for --timeout
seconds; 1 when the broker cannot be reached or refuses; 2 for bad arguments; 130 on
Ctrl-C.
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
from typing import Any, TextIO

from delayd.cli.args import (
    BROKER_VARIABLE,
    add_peer_options,
    client_tls,
    non_negative_count,
    seconds,
)
from delayd.client._consumer_state import COMMIT_MODES
from delayd.errors import DelaydError
from delayd.protocol import Message


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_peer_options(parser, "--broker", BROKER_VARIABLE, "broker")
    parser.add_argument("--subject", required=True, help="subject to consume")
    parser.add_argument("--group", required=True, help="consumer group (offsets are per group)")
    parser.add_argument("--json", action="store_true", help="print JSON lines")
    parser.add_argument(
        "--count",
        type=non_negative_count,
        metavar="N",
        help="exit after N messages (default: no limit)",
    )
    parser.add_argument(
        "--timeout",
        type=seconds,
        metavar="SECONDS",
        help="exit when no message came for this long (default: wait for ever)",
    )
    parser.add_argument(
        "--commit",
        choices=COMMIT_MODES,
        default="periodic",
        help="periodic: commits ride on the next PULL, answered from the broker's memory "
        "(default); sync: each line's commit is on the broker's disk before the next "
        "line is printed, so a crash prints at most one line again",
    )


def _body_fields(body: bytes) -> dict[str, str]:
    try:
        return {"body": body.decode("utf-8"), "body_encoding": "utf-8"}
    except UnicodeDecodeError:
        return {"body": base64.b64encode(body).decode("ascii"), "body_encoding": "base64"}


def message_json(message: Message) -> dict[str, Any]:
    """The JSON object printed for ``message`` (times in epoch ms, None when absent)."""
    return {
        "id": message.message_id,
        "subject": message.subject,
        "key": message.key,
        "properties": dict(message.properties),
        **_body_fields(message.body),
        "queue": message.queue,
        "queue_offset": message.queue_offset,
        "due_ms": message.due_ms,
        "dispatched_ms": message.dispatched_ms,
        "store_ms": message.store_ms,
    }


def message_line(message: Message) -> str:
    """The plain one-line form: ``queue:offset id key=... body`` (body as JSON string
    when UTF-8, so newlines stay on one line; else ``base64:...``)."""
    fields = _body_fields(message.body)
    body = (
        json.dumps(fields["body"])
        if fields["body_encoding"] == "utf-8"
        else ("base64:" + fields["body"])
    )
    key = f" key={message.key}" if message.key is not None else ""
    return f"{message.queue}:{message.queue_offset} {message.message_id}{key} {body}"


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    from delayd.client.blocking_consumer import Consumer

    out = out or sys.stdout
    if args.count == 0:
        return 0
    printed = 0
    try:
        with Consumer(
            args.broker,
            subject=args.subject,
            group=args.group,
            token=args.token,
            tls=client_tls(args),
            commit=args.commit,
            retry_first_connect=False,
        ) as consumer:
            while args.count is None or printed < args.count:
                message = consumer.receive(timeout_s=args.timeout)
                if message is None:
                    break  # nothing for --timeout seconds
                line = json.dumps(message_json(message)) if args.json else message_line(message)
                out.write(line + "\n")
                out.flush()
                printed += 1
    except ValueError as exc:
        print(f"delayd consume: {exc}", file=sys.stderr)
        return 2
    except DelaydError as exc:
        print(f"delayd consume: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
