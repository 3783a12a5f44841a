"""The Producer of a client command (send, cancel, reschedule): the address, token and
TLS of its ``--server`` options (cli/args.py ``add_peer_options``), and no retrying of
a first connection, so a mistyped address fails at once."""

from __future__ import annotations

import argparse

from delayd.cli.args import client_tls
from delayd.client import Producer


def producer_for(args: argparse.Namespace) -> Producer:
    return Producer(
        args.server,
        token=args.token,
        tls=client_tls(args),
        timeout_s=args.timeout,
        retry_first_connect=False,
    )
