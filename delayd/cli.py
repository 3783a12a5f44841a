"""The `delayd` command. Each subcommand lives with the layer it drives and registers
itself here through ``add_parser(subparsers)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

from delayd.version import __version__

# subcommand -> module providing add_parser() and run(); imported lazily so that
# `delayd --version` stays fast and one broken command cannot break the others.
COMMANDS = {
    "serve": "delayd.server.command",
    "broker": "delayd.broker.command",
    "send": "delayd.client.send_command",
    "cancel": "delayd.client.cancel_command",
    "reschedule": "delayd.client.reschedule_command",
    "consume": "delayd.client.consume_command",
    "top": "delayd.top.command",
    "inspect": "delayd.inspect.command",
    "audit": "delayd.audit.command",
    "bench": "delayd.bench.command",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand, or of ``only`` that one: a server started by
    `delayd serve` need not import the operator tools (each restart of a crash test
    pays for every import)."""
    parser = argparse.ArgumentParser(prog="delayd", description="delayd: durable delayed messages")
    parser.add_argument("--version", action="version", version=f"delayd {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is not None and name != only:
            continue
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue  # not built yet
        module.add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=words[0] if words and words[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    module = importlib.import_module(COMMANDS[args.command])
    return module.run(args)


if __name__ == "__main__":
    sys.exit(main())
