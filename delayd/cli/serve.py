"""Run the delay server: accept scheduled messages, make them durable, sort them into
time buckets and deliver them when due; an embedded broker runs in the same process.

Prints "delayd serve listening on HOST:PORT" on stdout once it accepts producers (the
real port when --listen asks for port 0), preceded by "delayd serve broker listening
on HOST:PORT", "delayd serve metrics on http://HOST:PORT/metrics" and "delayd serve http on
http://HOST:PORT/v1" when those listen (https with TLS; metrics: 127.0.0.1:20880, the
HTTP API: 127.0.0.1:20890, unless configured otherwise). Logs go to stderr, one
line each. On SIGTERM or SIGINT: stop accepting, answer what is in flight, flush,
write the replay checkpoint, exit 0. On SIGHUP: read the TLS certificate, key and CA
files again for new connections (delayd.tls).

Exit status: 0 after a clean stop; 2 for a bad configuration; 1 when the data
directory cannot be served (corruption, a changed segment_scale, another process
holding it) or a port cannot be bound (ports are bound before recovery, so that is
said at once).

The configuration is the defaults, then --config, then DELAYD_<TABLE>_<KEY>
environment variables, then the flags (docs/configuration.md); --print-config prints
it as TOML and exits.

With --etcd URL --group NAME the server is a member of a replicated group
(docs/replication.md): only the group's leader takes requests and delivers; the other
members answer NOT_LEADER naming it. Without --etcd it runs alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
from collections.abc import Mapping
from functools import partial

import trio

from delayd.address import format_address
from delayd.cli.args import (
    add_cluster_options,
    add_logging_options,
    add_server_tls_options,
    listen_address,
    optional_listen_address,
)
from delayd.cluster.config import cluster_with_flags
from delayd.server.app import DelayServer, open_listeners, serve_metrics_early
from delayd.server.config import ConfigError, ServeConfig, with_overrides
from delayd.server.config_env import load_effective_config
from delayd.server.config_print import config_to_toml
from delayd.server.rebuild import RebuildNeeded
from delayd.serving.data_dir import serve_data_dir
from delayd.serving.gc_tuning import tune_gc_for_serving
from delayd.serving.tls import ServerTls, reload_on_sighup
from delayd.structured_logs import (
    DEFAULT_LOG_FORMAT,
    DEFAULT_LOG_LEVEL,
    configure_logging,
)
from delayd.tls import ServerTlsConfig, TlsError

log = logging.getLogger("delayd.serve")


# Distinguishes "flag not given" from "--metrics-listen off" (None).
_UNSET = object()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", metavar="DIR", help="data directory (required to serve)")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML configuration (docs/configuration.md)"
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration (defaults, file, DELAYD_* environment, "
        "flags) as TOML and exit",
    )
    parser.add_argument(
        "--listen",
        type=listen_address,
        metavar="HOST:PORT",
        help="producers connect here (default 127.0.0.1:20801; port 0 picks a free port)",
    )
    parser.add_argument(
        "--broker-listen",
        type=optional_listen_address,
        default=_UNSET,
        metavar="HOST:PORT",
        help="the embedded broker's listener (default 127.0.0.1:20811; 'off')",
    )
    parser.add_argument(
        "--metrics-listen",
        type=optional_listen_address,
        default=_UNSET,
        metavar="HOST:PORT",
        help="Prometheus /metrics, /healthz and /readyz (default 127.0.0.1:20880; 'off')",
    )
    parser.add_argument(
        "--http-listen",
        type=optional_listen_address,
        default=_UNSET,
        metavar="HOST:PORT|off",
        help="the HTTP/JSON API, docs/http.md (default 127.0.0.1:20890; 'off')",
    )
    add_server_tls_options(parser)
    add_cluster_options(parser)
    add_logging_options(parser)
    # None: not given, so that [log] of the file (or DELAYD_LOG_*) applies.
    parser.set_defaults(log_format=None, log_level=None)


def build_config(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> ServeConfig:
    """The configuration: defaults, then ``--config``, then ``DELAYD_*`` variables of
    ``environ`` (the process environment), then the flags. Raises ConfigError."""
    environ = os.environ if environ is None else environ
    config = load_effective_config(args.config, environ)
    config = with_overrides(
        config, listen=args.listen, log_format=args.log_format, log_level=args.log_level
    )
    for name in ("broker_listen", "metrics_listen", "http_listen"):
        value = getattr(args, name)
        if value is not _UNSET:
            config = dataclasses.replace(config, **{name: value})
    if args.tls_cert is not None or args.tls_key is not None or args.tls_client_ca is not None:
        # The flags replace [tls] as a whole: a certificate from one and a key from the
        # other would be a pair nobody chose.
        try:
            tls = ServerTlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
        except ValueError as exc:
            raise ConfigError(f"flags: {exc}") from None
        config = dataclasses.replace(config, tls=tls)
    try:
        cluster = cluster_with_flags(config.cluster, args)
        if cluster is not config.cluster:
            config = dataclasses.replace(config, cluster=cluster)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    config.check_complete()
    return config


def run(args: argparse.Namespace) -> int:
    # The flags' logging until the configuration is read: its errors are logged too.
    configure_logging(args.log_format or DEFAULT_LOG_FORMAT, args.log_level or DEFAULT_LOG_LEVEL)
    try:
        config = build_config(args)
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    configure_logging(config.log_format, config.log_level)
    if args.print_config:
        sys.stdout.write(config_to_toml(config))
        return 0
    if args.data is None:
        log.error("bad configuration: --data DIR is required to serve")
        return 2
    try:
        tls = None if config.tls is None else ServerTls(config.tls)
    except TlsError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    return serve_data_dir(log, args.data, "delayd serve", _serve, args.data, config, tls)


RECOVERY_REPORT_INTERVAL_S = 2.0


async def _open(data_dir: str, config: ServeConfig, tls: ServerTls | None) -> DelayServer:
    """DelayServer.open in a worker thread; while it takes long (recovery of big logs),
    a line every RECOVERY_REPORT_INTERVAL_S says it is still at it, so that a slow
    start does not look like a hung one."""

    async def report(started: float) -> None:
        while True:
            await trio.sleep(RECOVERY_REPORT_INTERVAL_S)
            elapsed = trio.current_time() - started
            log.info("recovering %s: %.0f s so far", data_dir, elapsed)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(report, trio.current_time())
        open_server = partial(DelayServer.open, data_dir, config, tls=tls)
        server = await trio.to_thread.run_sync(open_server)
        nursery.cancel_scope.cancel()
    return server


async def _serve(data_dir: str, config: ServeConfig, tls: ServerTls | None) -> None:
    while True:
        try:
            await _serve_once(data_dir, config, tls)
            return
        except* RebuildNeeded as cut:
            # A member of a group whose message_log the leader cut: what it derived
            # goes, and a start derives it again from message_log. Or one that
            # received a snapshot of the leader's state: it is installed.
            rebuild: BaseException = cut
            while isinstance(rebuild, BaseExceptionGroup):
                rebuild = rebuild.exceptions[0]
            assert isinstance(rebuild, RebuildNeeded)
            rebuild.rebuild(segment_size=config.message_log_segment_bytes)
            log.warning("%s: %s", rebuild, rebuild.after)


async def _serve_once(data_dir: str, config: ServeConfig, tls: ServerTls | None) -> None:
    # Every port first: a clash is reported now, not after a long recovery. Producers'
    # connections wait in the backlog until recovery is done; /healthz answers and
    # /readyz says "recovering" meanwhile.
    listeners = await open_listeners(config)
    async with trio.open_nursery() as early:
        await early.start(reload_on_sighup, tls)  # SIGHUP: the TLS files again
        metrics = None
        if listeners.metrics is not None:
            recovering = f"recovering {data_dir}"
            serve_early = partial(serve_metrics_early, tls=tls)
            metrics = await early.start(serve_early, listeners.metrics, recovering)
            listeners = dataclasses.replace(listeners, metrics=None)  # served from here on
        try:
            server = await _open(data_dir, config, tls)
        except BaseException:
            await listeners.aclose()
            raise
        tune_gc_for_serving()  # after recovery: what it built is frozen (serving.gc_tuning)
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:
                run = partial(server.run, listeners=listeners, metrics=metrics)
                bound = await nursery.start(run)
                scheme = "http" if tls is None else "https"
                if bound.broker is not None:
                    print(f"delayd serve broker listening on {format_address(*bound.broker)}")
                if bound.metrics is not None:
                    metrics_url = f"{scheme}://{format_address(*bound.metrics)}/metrics"
                    print(f"delayd serve metrics on {metrics_url}")
                if bound.http is not None:
                    print(f"delayd serve http on {scheme}://{format_address(*bound.http)}/v1")
                print(f"delayd serve listening on {format_address(*bound.intake)}", flush=True)
                async for signum in signals:
                    log.info("%s: shutting down", signal.Signals(signum).name)
                    break
                server.request_stop()
        early.cancel_scope.cancel()  # /metrics goes last
    log.info("delayd serve stopped")
