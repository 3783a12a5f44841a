"""Read a delayd data directory without changing it: message_log segments and
schedule_log buckets with their records, dispatch_log state, checkpoints, and where a
message is. Damaged records are reported as corrupt or torn tail.

    delayd inspect --data DIR summary                 segments, buckets, checkpoints, damage
    delayd inspect --data DIR message-log [--from OFFSET] [--limit N]
    delayd inspect --data DIR bucket NAME [--from OFFSET] [--limit N]
    delayd inspect --data DIR dispatch NAME           a bucket's dispatch_log and what is undone
    delayd inspect --data DIR checkpoints             meta, replay, wheel cursors
    delayd inspect --data DIR find MESSAGE_ID         where it is, whether it was delivered

--data and --json go before or after the subcommand. Nothing in the directory is
changed: files are opened read-only and torn tails are reported, not cut, so it is
safe on the data of a running server (it sees what was written when it reads).

Exit status: 0; 1 when find finds nothing; 2 when the request cannot be answered
(not a data directory, no such bucket).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from delayd.cli.args import count, non_negative_count
from delayd.inspect import as_json, report, text
from delayd.inspect.progress import byte_progress
from delayd.inspect.report import InspectError
from delayd.logs.log_files import total_bytes
from storage.fs import REAL_FS

DEFAULT_LIMIT = 50


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", metavar="DIR", help="data directory (required)")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    # The same two options after the subcommand; SUPPRESS keeps a value given before it.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--data", metavar="DIR", default=argparse.SUPPRESS, help="data directory")
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document"
    )
    what = parser.add_subparsers(dest="what", metavar="WHAT", required=True)
    what.add_parser("summary", parents=[common], help="segments, buckets, checkpoints, damage")
    log = what.add_parser("message-log", parents=[common], help="records of message_log")
    log.add_argument(
        "--from", dest="start", type=non_negative_count, metavar="OFFSET", help="a record's offset"
    )
    log.add_argument("--limit", type=count, default=DEFAULT_LIMIT, metavar="N")
    bucket = what.add_parser("bucket", parents=[common], help="records of a schedule_log bucket")
    bucket.add_argument("bucket", metavar="NAME", help="bucket name, yyyyMMddHHmm (UTC)")
    bucket.add_argument(
        "--from", dest="start", type=non_negative_count, default=0, metavar="OFFSET"
    )
    bucket.add_argument("--limit", type=count, default=DEFAULT_LIMIT, metavar="N")
    dispatch = what.add_parser("dispatch", parents=[common], help="a bucket's dispatch_log")
    dispatch.add_argument("bucket", metavar="NAME", help="bucket name, yyyyMMddHHmm (UTC)")
    what.add_parser("checkpoints", parents=[common], help="meta, replay and wheel checkpoints")
    find = what.add_parser("find", parents=[common], help="where a message is, what became of it")
    find.add_argument("message_id", metavar="MESSAGE_ID")


def _answer(args: argparse.Namespace, now_ms: int) -> tuple[Any, list[str], int]:
    """(the JSON document, the text lines, the exit status) for the request."""
    fs, data = REAL_FS, args.data
    if args.what == "summary":
        report.check_data_dir(fs, data)
        with byte_progress(total_bytes(data, fs), "scanning") as on_bytes:
            found = report.summary(fs, data, on_bytes)
        return as_json.summary(found), text.summary_lines(found), 0
    if args.what == "message-log":
        listing = report.list_message_log(fs, data, args.start, args.limit)
        return as_json.message_listing(listing), text.message_listing_lines(listing, data), 0
    if args.what == "bucket":
        rows = report.list_bucket(fs, data, args.bucket, args.start, args.limit)
        return (
            as_json.bucket_listing(args.bucket, rows),
            text.bucket_listing_lines(args.bucket, rows, data),
            0,
        )
    if args.what == "dispatch":
        state = report.dispatch_report(fs, data, args.bucket)
        return as_json.dispatch(state), text.dispatch_lines(state, data), 0
    if args.what == "checkpoints":
        report.check_data_dir(fs, data)
        checkpoints = report.read_checkpoints(fs, data)
        return as_json.checkpoints(checkpoints), text.checkpoint_lines(checkpoints), 0
    assert args.what == "find"
    report.check_data_dir(fs, data)
    with byte_progress(total_bytes(data, fs), f"finding {args.message_id}") as on_bytes:
        result = report.find_message(fs, data, args.message_id, now_ms, on_bytes)
    status = 0 if result.found else 1
    return as_json.find(result), text.find_lines(result, now_ms, data), status


def run(args: argparse.Namespace) -> int:
    if not args.data:
        sys.stderr.write("delayd inspect: --data DIR is required\n")
        return 2
    try:
        document, lines, status = _answer(args, int(time.time() * 1000))
    except (InspectError, OSError) as exc:
        sys.stderr.write(f"delayd inspect: {exc}\n")
        return 2
    if args.json:
        sys.stdout.write(json.dumps(document, indent=2, ensure_ascii=False) + "\n")
    else:
        sys.stdout.write("\n".join(lines) + "\n")
    return status
