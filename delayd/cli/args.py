"""The argument types and option blocks the ``delayd`` subcommands share.

Each type is an argparse ``type=`` callable: the parsed value, or ArgumentTypeError
with a message that says what was wrong and gives the right form (argparse prints it
after the option's name and exits 2).

A client's address, token and TLS files may come from the environment
(``DELAYD_SERVER``, ``DELAYD_BROKER``, ``DELAYD_TOKEN``, ``DELAYD_TLS_CA``,
``DELAYD_TLS_CERT``, ``DELAYD_TLS_KEY``), so that a token is not left in the shell's
history or in ``ps``; a flag given wins over its variable.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
from collections.abc import Callable
from typing import Any

from delayd.address import Address, parse_address
from delayd.cluster.config import etcd_urls
from delayd.durations import parse_duration_ms
from delayd.group_address import parse_group_address
from delayd.structured_logs import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    LOG_FORMATS,
    LOG_LEVELS,
)
from delayd.timestamps import parse_utc_ms
from delayd.tls import ClientTls, TlsError

SERVER_VARIABLE = "DELAYD_SERVER"
BROKER_VARIABLE = "DELAYD_BROKER"
TOKEN_VARIABLE = "DELAYD_TOKEN"
TLS_CA_VARIABLE = "DELAYD_TLS_CA"
TLS_CERT_VARIABLE = "DELAYD_TLS_CERT"
TLS_KEY_VARIABLE = "DELAYD_TLS_KEY"


def address(text: str) -> str:
    """A ``HOST:PORT`` to connect to (``[v6]:PORT`` for IPv6), a group's member list
    ``H1:P1,H2:P2`` or ``etcd://HOST:PORT/GROUP`` (delayd.group_address), checked and
    returned as written, which is the form the clients take."""
    try:
        parse_group_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return str(text)


def etcd_endpoints(text: str) -> tuple[str, ...]:
    """etcd's client URLs, comma-separated (``http://10.0.0.1:2379,http://10.0.0.2:2379``)."""
    try:
        return etcd_urls(text, "--etcd")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_cluster_options(parser: argparse.ArgumentParser) -> None:
    """``--etcd``, ``--group``, ``--advertise`` and ``--cluster`` of a server that may
    join a group (docs/replication.md, docs/cluster.md); without ``--etcd`` it runs
    alone."""
    parser.add_argument(
        "--etcd", type=etcd_endpoints, metavar="URL[,URL]",
        help="etcd's client URLs: join the group --group (default: [cluster] etcd; none: "
        "run alone)",
    )  # fmt: skip
    parser.add_argument(
        "--group", metavar="NAME", help="the group this server is a member of ([cluster] group)"
    )
    parser.add_argument(
        "--advertise", metavar="HOST",
        help="the host other members and clients reach this server at (default: the "
        "listen host, which must then not be a wildcard)",
    )  # fmt: skip
    parser.add_argument(
        "--cluster", metavar="NAME",
        help="the cluster the group belongs to ([cluster] name; default: the default "
        "cluster)",
    )  # fmt: skip


def listen_address(text: str) -> Address:
    """A ``HOST:PORT`` to listen on -> (host, port); port 0 picks a free port."""
    try:
        return parse_address(text, allow_port_zero=True)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def optional_listen_address(text: str) -> Address | None:
    """As listen_address, or None for ``off`` (the listener is not opened)."""
    if text.strip().lower() in ("", "off", "none"):
        return None
    return listen_address(text)


def duration_ms(text: str) -> int:
    """A duration with its unit (``90s``, ``1h30m``; delayd.durations) -> milliseconds."""
    try:
        return parse_duration_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def utc_time_ms(text: str) -> int:
    """An ISO-8601 time with its UTC offset (``2026-11-22T10:00:00Z``) -> epoch ms."""
    try:
        return parse_utc_ms(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _integer(text: str) -> int:
    # int() reads " 7", "1_000" and full-width digits; only the first two are meant.
    if not text.strip().replace("_", "").isascii():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number such as 10_000")
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number such as 10_000") from None


def count(text: str) -> int:
    """A whole number above 0 (``1_000`` allowed)."""
    value = _integer(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not positive; give 1 or more")
    return value


def non_negative_count(text: str) -> int:
    """A whole number, 0 or more (``1_000`` allowed)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative; give 0 or more")
    return value


def seconds(text: str) -> float:
    """A number of seconds above 0 (``0.5``, ``30``)."""
    return _seconds(text, zero_ok=False)


def non_negative_seconds(text: str) -> float:
    """A number of seconds, 0 or more (``0``, ``3600``, ``0.5``)."""
    return _seconds(text, zero_ok=True)


def _seconds(text: str, *, zero_ok: bool) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not ((value >= 0 if zero_ok else value > 0) and math.isfinite(value)):
        wanted = ", 0 or more" if zero_ok else " above 0"
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds{wanted}")
    return value


class _FromEnvironment(str):
    """An option's default read from an environment variable. argparse converts a
    ``str`` default with the option's type; an error then names the variable."""

    variable: str


def _naming_variable(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    @functools.wraps(convert)
    def converted(text: str) -> Any:
        try:
            return convert(text)
        except argparse.ArgumentTypeError as exc:
            if isinstance(text, _FromEnvironment):
                raise argparse.ArgumentTypeError(f"{text.variable}: {exc}") from None
            raise

    return converted


def add_env_option(
    parser: argparse.ArgumentParser,
    flag: str,
    variable: str,
    *,
    help: str,
    type: Callable[[str], Any] = str,
    required: bool = False,
    **kwargs: Any,
) -> None:
    """``flag``, whose default is the environment variable ``variable`` when set (the
    flag wins). A required option is satisfied by either. The help names the variable,
    never its value (it may be a secret)."""
    text = os.environ.get(variable) or None
    default = None
    if text is not None:
        default = _FromEnvironment(text)
        default.variable = variable
    parser.add_argument(
        flag,
        type=_naming_variable(type),
        default=default,
        required=required and default is None,
        help=f"{help} (default: ${variable}; the flag wins)",
        **kwargs,
    )


def add_token_option(parser: argparse.ArgumentParser, who: str) -> None:
    """``--token``, or ``$DELAYD_TOKEN``: the shared secret ``who`` requires, if any."""
    add_env_option(
        parser,
        "--token",
        TOKEN_VARIABLE,
        metavar="TOKEN",
        help=f"shared secret, if the {who} requires one; the variable keeps it out of "
        "the shell's history",
    )


def add_peer_options(parser: argparse.ArgumentParser, flag: str, variable: str, who: str) -> None:
    """The address of the ``who`` to connect to (``flag``, or ``variable``) and its token."""
    add_env_option(
        parser, flag, variable, type=address, required=True, metavar="HOST:PORT",
        help=f"the {who}",
    )  # fmt: skip
    add_token_option(parser, who)
    add_client_tls_options(parser)


def add_client_tls_options(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert`` and ``--tls-key`` of a client command (or
    ``$DELAYD_TLS_*``); read them with ``client_tls``."""
    add_env_option(
        parser, "--tls-ca", TLS_CA_VARIABLE, metavar="FILE",
        help="connect with TLS, trusting the CA in FILE (PEM)",
    )  # fmt: skip
    add_env_option(
        parser, "--tls-cert", TLS_CERT_VARIABLE, metavar="FILE",
        help="client certificate for mutual TLS (PEM)",
    )  # fmt: skip
    add_env_option(
        parser, "--tls-key", TLS_KEY_VARIABLE, metavar="FILE",
        help="the client certificate's key (PEM)",
    )  # fmt: skip


def client_tls(args: argparse.Namespace) -> ClientTls | None:
    """The ClientTls of ``add_client_tls_options``, or None (plain TCP) when none of
    them is given. Raises TlsError for a certificate without its key."""
    if args.tls_ca is None and args.tls_cert is None and args.tls_key is None:
        return None
    try:
        return ClientTls(args.tls_ca, args.tls_cert, args.tls_key)
    except ValueError as exc:
        raise TlsError(f"{exc} (--tls-cert, --tls-key)") from None


def add_server_tls_options(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key`` and ``--tls-client-ca`` of a server command (they
    win over its ``[tls]``)."""
    parser.add_argument(
        "--tls-cert", metavar="FILE", help="serve every listener with TLS: certificate (PEM)"
    )
    parser.add_argument("--tls-key", metavar="FILE", help="the certificate's key (PEM)")
    parser.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="require client certificates signed by the CA in FILE (mutual TLS)",
    )


def add_server_options(parser: argparse.ArgumentParser) -> None:
    """``--server``, ``--token`` and ``--timeout`` of a command to a delay server."""
    add_peer_options(parser, "--server", SERVER_VARIABLE, "delay server")
    parser.add_argument(
        "--timeout", type=seconds, default=10.0, metavar="SECONDS",
        help="give up after this long (default 10)",
    )  # fmt: skip


def add_logging_options(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level`` of a command that calls configure_logging."""
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=DEFAULT_LOG_FORMAT,
        help=f"log lines on stderr: key=value (kv) or JSON (default {DEFAULT_LOG_FORMAT})",
    )
    parser.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=DEFAULT_LOG_LEVEL,
        help=f"least severe level logged (default {DEFAULT_LOG_LEVEL})",
    )
