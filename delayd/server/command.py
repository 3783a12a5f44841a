"""``delayd serve``: the delay server with its embedded broker, until SIGTERM/SIGINT.

Prints ``delayd serve listening on HOST:PORT`` on stdout once it accepts producers (the
real port when ``--listen`` asks for port 0), preceded by ``delayd serve broker
listening on HOST:PORT`` and ``delayd serve metrics on http://HOST:PORT/metrics`` when
those listen. Logs go to stderr, one line each (``--log-format kv|json``,
``--log-level``; delayd.logsetup). On SIGTERM or SIGINT: stop accepting, answer what is in
flight, flush, write the replay checkpoint, exit 0. Exit 2 for a bad configuration, 1
when the data directory cannot be served (corruption, a changed segment_scale).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import signal

import trio

from delayd.errors import DelaydError
from delayd.logsetup import add_logging_arguments, configure_logging
from delayd.server.app import DelayServer
from delayd.server.config import (
    ConfigError,
    ServeConfig,
    load_config,
    parse_address,
    parse_optional_address,
    with_overrides,
)
from storage.errors import StorageError

log = logging.getLogger("delayd.serve")


def _address(text: str) -> tuple[str, int]:
    try:
        return parse_address(text, "address")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _optional_address(text: str) -> tuple[str, int] | None:
    try:
        return parse_optional_address(text, "address")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# Distinguishes "flag not given" from "--metrics-listen off" (None).
_UNSET = object()


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the delay server (with its embedded broker)",
        description=(
            "Run the delay server: accept scheduled messages, make them durable, sort them "
            "into time buckets; an embedded broker runs in the same process."
        ),
    )
    parser.add_argument("--data", required=True, metavar="DIR", help="data directory")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML configuration (docs/configuration.md)"
    )
    parser.add_argument(
        "--listen",
        type=_address,
        metavar="HOST:PORT",
        help="producers connect here (default 127.0.0.1:20801; port 0 picks a free port)",
    )
    parser.add_argument(
        "--broker-listen",
        type=_optional_address,
        default=_UNSET,
        metavar="HOST:PORT",
        help="the embedded broker's listener (default 127.0.0.1:20811; 'off')",
    )
    parser.add_argument(
        "--metrics-listen",
        type=_optional_address,
        default=_UNSET,
        metavar="HOST:PORT",
        help="Prometheus /metrics, /healthz and /readyz (default off)",
    )
    add_logging_arguments(parser)


def build_config(args: argparse.Namespace) -> ServeConfig:
    """The configuration: defaults, then ``--config``, then the flags. Raises ConfigError."""
    config = load_config(args.config) if args.config else ServeConfig()
    config = with_overrides(config, listen=args.listen)
    for name in ("broker_listen", "metrics_listen"):
        value = getattr(args, name)
        if value is not _UNSET:
            config = dataclasses.replace(config, **{name: value})
    return config


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    try:
        config = build_config(args)
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    try:
        trio.run(_serve, args.data, config)
    except BaseException as exc:
        reason = _fatal_reason(exc)
        if reason is None:
            raise
        log.error("cannot serve %s: %s", args.data, reason)
        return 1
    return 0


def _fatal_reason(exc: BaseException) -> str | None:
    """What to print for an error that ends the server for a reason an operator can
    act on (corruption, a changed segment_scale, a port in use), or None for a bug,
    which keeps its traceback. Trio reports task errors in exception groups."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    if isinstance(exc, (DelaydError, StorageError)):
        return str(exc)
    if isinstance(exc, OSError):
        return str(exc)  # names the address or file
    return None


async def _serve(data_dir: str, config: ServeConfig) -> None:
    server = await trio.to_thread.run_sync(DelayServer.open, data_dir, config)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:
            bound = await nursery.start(server.run)
            if bound.broker is not None:
                print("delayd serve broker listening on {}:{}".format(*bound.broker), flush=True)
            if bound.metrics is not None:
                print("delayd serve metrics on http://{}:{}/metrics".format(*bound.metrics))
            print("delayd serve listening on {}:{}".format(*bound.intake), flush=True)
            async for signum in signals:
                log.info("%s: shutting down", signal.Signals(signum).name)
                break
            server.request_stop()
    log.info("delayd serve stopped")
