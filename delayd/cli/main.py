"""The ``delayd`` command: parses the subcommand's arguments and runs it.

Each subcommand is a module of this package with ``add_arguments(parser)`` and
``run(args) -> int`` (the exit status); its docstring is the description ``--help``
prints. Only the module of the subcommand given is imported: ``delayd --version`` and
``delayd --help`` import none, and a server started by ``delayd serve`` does not pay for
the operator tools (each restart of a crash test would).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from delayd.version import __version__

# subcommand -> (its module, the line `delayd --help` shows for it)
COMMANDS = {
    "serve": ("delayd.cli.serve", "run the delay server (with its embedded broker)"),
    "broker": ("delayd.cli.broker", "run the real-time broker consumers pull from"),
    "send": ("delayd.cli.send", "schedule one message on a delay server and print the receipt"),
    "cancel": ("delayd.cli.cancel", "cancel one delayed message"),
    "reschedule": ("delayd.cli.reschedule", "move one delayed message to a new time"),
    "consume": (
        "delayd.cli.consume",
        "print messages of a subject, as a member of a consumer group",
    ),
    "cluster": ("delayd.cli.cluster", "show replicated groups: members, roles, epochs (etcd)"),
    "top": (
        "delayd.cli.top",
        "live terminal view of delay servers or a whole cluster, from their /metrics",
    ),
    "inspect": (
        "delayd.cli.inspect",
        "read a data directory offline: logs, buckets, dispatch state, checkpoints",
    ),
    "audit": (
        "delayd.cli.audit",
        "check on Spark that every accepted message was dispatched once, on time",
    ),
    "bench": (
        "delayd.cli.bench",
        "measure delivery: lateness, burst, memory, restart (JSON lines)",
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser of ``delayd``, with the arguments of ``command`` (one of COMMANDS) when
    given; the other subcommands are listed by name and summary only."""
    parser = argparse.ArgumentParser(prog="delayd", description="delayd: durable delayed messages")
    parser.add_argument("--version", action="version", version=f"delayd {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, summary) in COMMANDS.items():
        sub = subparsers.add_parser(name, help=summary, description=summary)
        if name == command:
            module = importlib.import_module(module_name)
            sub.description = module.__doc__
            sub.formatter_class = argparse.RawDescriptionHelpFormatter
            module.add_arguments(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    command = words[0] if words and words[0] in COMMANDS else None
    parser = build_parser(command)
    args = parser.parse_args(words)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command][0])
    return module.run(args)
