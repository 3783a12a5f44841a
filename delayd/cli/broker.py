"""Run a delayd broker until SIGTERM or SIGINT: a durable commitlog, consumer groups,
long polling.

Prints "delayd broker listening on HOST:PORT" on stdout once it accepts connections
(the actual port when --listen asks for port 0); everything else goes to the log on
stderr, one line each. Shutdown: stop accepting and reading, answer every SEND_BATCH
already appended, close connections (FIN after the last answer), then flush the
commitlog, checkpoint the consume queues and index, persist offsets, exit 0. SIGHUP
reads the TLS files again (--tls-cert, --tls-key, --tls-client-ca; delayd.tls) for new
connections.

Start-up takes the data directory's lock (one writer at a time), then binds its ports,
then recovers: another process holding the directory or a port in use ends it at
once, exit 1, with a message naming the holder or the listener and address. Exit 2
for a bad configuration.

With --etcd URL --group NAME (or DELAYD_CLUSTER_* variables) the broker is a member of
a replicated broker group (docs/replication.md): only its leader serves; the other
members answer NOT_LEADER naming the leader's address and copy the leader's commitlog
and committed offsets (delayd.server.broker_member); under ack = "sync" stores and
commits are answered once the group has them, and consumers see only those records.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from functools import partial

import trio
from prometheus_client import CollectorRegistry

from delayd.address import format_address
from delayd.broker.broker import Broker
from delayd.broker.config import DAY_MS, BrokerConfig, StartFrom
from delayd.broker.metrics import collect_broker_metrics
from delayd.broker.server import broker_listener
from delayd.cli.args import (
    add_cluster_options,
    add_logging_options,
    add_server_tls_options,
    add_token_option,
    count,
    listen_address,
    non_negative_count,
    optional_listen_address,
)
from delayd.cluster.config import (
    DEFAULT_BROKER_REPLICATION_PORT,
    ClusterConfig,
    cluster_from_environment,
    cluster_with_flags,
)
from delayd.cluster.members import MemberInfo
from delayd.serving.connection_limits import (
    DEFAULT_FRAME_TIMEOUT_MS,
    DEFAULT_HELLO_TIMEOUT_MS,
    DEFAULT_MAX_UNFINISHED_FRAME_BYTES,
)
from delayd.serving.data_dir import serve_data_dir
from delayd.serving.gc_tuning import tune_gc_for_serving
from delayd.serving.listeners import bound_addresses, open_listeners
from delayd.serving.metrics_http import Readiness, serve_metrics
from delayd.serving.tls import ServerTls, reload_on_sighup
from delayd.structured_logs import configure_logging
from delayd.tls import ServerTlsConfig, TlsError
from storage.flusher import FlushMode, FlushPolicy

log = logging.getLogger("delayd.broker")

DEFAULT_LISTEN = "127.0.0.1:20811"
DEFAULT_METRICS_LISTEN = "127.0.0.1:20881"
SHUTDOWN_GRACE_S = 5.0  # appended SEND_BATCHes get this long to be answered


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data", required=True, metavar="DIR", help="data directory")
    parser.add_argument(
        "--listen",
        type=listen_address,
        default=DEFAULT_LISTEN,
        metavar="HOST:PORT",
        help=f"protocol listener (default {DEFAULT_LISTEN}; port 0 picks a free port)",
    )
    parser.add_argument(
        "--metrics-listen",
        type=optional_listen_address,
        default=DEFAULT_METRICS_LISTEN,
        metavar="HOST:PORT",
        help=f"/metrics, /healthz and /readyz (default {DEFAULT_METRICS_LISTEN}; 'off')",
    )
    add_token_option(parser, "broker")
    parser.add_argument(
        "--flush",
        choices=[m.value for m in FlushMode],
        default="sync",
        help="sync: ack after fsync (group commit, default); async: fsync every 100 ms",
    )
    parser.add_argument("--queues", type=count, default=4, metavar="N", help="queues per subject")
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=count,
        default=10_000,
        metavar="MS",
        help="drop a consumer silent this long (default 10000)",
    )
    parser.add_argument(
        "--start-from",
        choices=[s.value for s in StartFrom],
        default="earliest",
        help="where a new consumer group starts",
    )
    parser.add_argument(
        "--dedupe-window-ms", type=count, default=DAY_MS, metavar="MS", help="idempotency"
    )
    parser.add_argument(
        "--dedupe-max-ids", type=count, default=10_000_000, metavar="N", help="idempotency"
    )
    parser.add_argument(
        "--max-connections",
        type=non_negative_count,
        default=0,
        metavar="N",
        help="client connections at most; more are refused (default 0: by the fd limit)",
    )
    parser.add_argument(
        "--hello-timeout-ms",
        type=count,
        default=DEFAULT_HELLO_TIMEOUT_MS,
        metavar="MS",
        help=f"close a connection without HELLO after this (default {DEFAULT_HELLO_TIMEOUT_MS})",
    )
    parser.add_argument(
        "--frame-timeout-ms",
        type=count,
        default=DEFAULT_FRAME_TIMEOUT_MS,
        metavar="MS",
        help=f"close a connection whose frame is not complete after this "
        f"(default {DEFAULT_FRAME_TIMEOUT_MS})",
    )
    parser.add_argument(
        "--max-unfinished-frame-bytes",
        type=count,
        default=DEFAULT_MAX_UNFINISHED_FRAME_BYTES,
        metavar="BYTES",
        help="large frames still arriving, all connections together; more wait",
    )
    add_server_tls_options(parser)
    add_cluster_options(parser)
    add_logging_options(parser)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_format, args.log_level)
    try:
        config = BrokerConfig(
            queues_per_subject=args.queues,
            flush=FlushPolicy(FlushMode(args.flush)),
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            start_from=StartFrom(args.start_from),
            dedupe_window_ms=args.dedupe_window_ms,
            dedupe_max_ids=args.dedupe_max_ids,
            max_connections=args.max_connections,
            hello_timeout_ms=args.hello_timeout_ms,
            frame_timeout_ms=args.frame_timeout_ms,
            max_unfinished_frame_bytes=args.max_unfinished_frame_bytes,
        )
        cluster = cluster_with_flags(cluster_from_environment(os.environ), args)
        if cluster.enabled:
            cluster.advertised(args.listen.host)  # a wildcard listen host needs --advertise
        tls_config = ServerTlsConfig.from_files(args.tls_cert, args.tls_key, args.tls_client_ca)
        tls = None if tls_config is None else ServerTls(tls_config)
    except (ValueError, TlsError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    return serve_data_dir(log, args.data, "delayd broker", _serve, args, config, cluster, tls)


async def _serve(
    args: argparse.Namespace, config: BrokerConfig, cluster: ClusterConfig, tls: ServerTls | None
) -> None:
    # Ports first: a clash is reported at once, not after recovery (delayd.serving.listeners).
    # Clients wait in the backlog while the broker recovers; /healthz answers and
    # /readyz says "recovering" meanwhile.
    listeners = await open_listeners("the broker", *args.listen)
    replication = None
    if cluster.enabled:
        address = cluster.replication_address(args.listen.host, DEFAULT_BROKER_REPLICATION_PORT)
        try:
            replication = await open_listeners("replication", *address)
        except BaseException:
            for listener in listeners:
                await listener.aclose()
            raise
    membership = None
    if cluster.enabled:
        # Imported here: only a member needs the etcd client and its HTTP stack.
        from delayd.serving.membership import Membership

        membership = Membership(cluster)
    async with trio.open_nursery() as early:
        await early.start(reload_on_sighup, tls)  # SIGHUP: the TLS files again
        registry = CollectorRegistry(auto_describe=False)
        readiness = Readiness(f"recovering {args.data}")
        try:
            if args.metrics_listen is not None:
                metrics_listeners = await open_listeners("metrics", *args.metrics_listen)
                serve = partial(
                    serve_metrics, readiness=readiness, listeners=metrics_listeners, tls=tls
                )
                m_bound = await early.start(serve, registry, *args.metrics_listen)
                scheme = "http" if tls is None else "https"
                log.info("metrics on %s://%s:%d/metrics", scheme, *m_bound[0])
            broker = await trio.to_thread.run_sync(partial(Broker.open, args.data, config))
        except BaseException:
            for listener in [*listeners, *(replication or ())]:
                await listener.aclose()
            raise
        tune_gc_for_serving()
        async with trio.open_nursery() as root:
            await root.start(broker.run)
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async with trio.open_nursery() as front:
                    host, port = args.listen
                    server = broker_listener(
                        broker, token=args.token, membership=membership, tls=tls
                    )
                    serve = partial(server.serve, host, port, listeners=listeners)
                    bound = await front.start(serve)
                    if membership is not None:
                        # The data path first (acks wait for it), then the membership
                        # that gives it its role.
                        from delayd.server.broker_member import (
                            BrokerGroupReplication,
                            ReplicatedBroker,
                        )

                        runner = BrokerGroupReplication(
                            ReplicatedBroker(broker),
                            args.data,
                            membership,
                            cluster,
                            replication,
                            tls=tls,
                        )
                        # Eligibility reads the broker's own epoch history: a member
                        # whose disk was wiped holds nothing the group acknowledged.
                        membership.holds_group_data = runner.history.knows_group
                        membership.before_founding = runner.history.claim_founding
                        await root.start(runner.run)
                        metrics_port = None if args.metrics_listen is None else m_bound[0][1]
                        info = _member_info(
                            cluster, args.listen.host, bound[0][1], replication, metrics_port
                        )
                        await root.start(membership.run, info)
                        if args.metrics_listen is not None:
                            from delayd.replication.metrics import ReplicationCollector
                            from delayd.serving.membership_metrics import MembershipCollector

                            registry.register(MembershipCollector(membership))
                            registry.register(
                                ReplicationCollector(lambda: runner.leader or runner.follower)
                            )
                    if args.metrics_listen is not None:
                        gate = server.gate  # connection metrics of the broker's listener
                        collect = partial(
                            collect_broker_metrics, broker, registry, gate=gate, readiness=readiness
                        )
                        await front.start(collect)
                    readiness.set_ready()
                    print(f"delayd broker listening on {format_address(*bound[0])}", flush=True)
                    async for signum in signals:
                        log.info("%s: shutting down", signal.Signals(signum).name)
                        break
                    if membership is not None:
                        # Resign first: a follower takes over at once; what is in flight
                        # here is answered NOT_LEADER, not acknowledged.
                        membership.resign()
                    # Every SEND_BATCH appended is answered before its connection closes.
                    await server.stop(SHUTDOWN_GRACE_S)
                    front.cancel_scope.cancel()
            root.cancel_scope.cancel()
        early.cancel_scope.cancel()  # /metrics goes last
    for listener in replication or ():
        await listener.aclose()
    log.info("delayd broker stopped")


def _member_info(
    cluster: ClusterConfig,
    listen_host: str,
    port: int,
    replication: list[trio.SocketListener] | None,
    metrics_port: int | None,
) -> MemberInfo:
    """This broker as the group's members and clients reach it, and its /metrics as
    ``delayd top --etcd`` and ``delayd cluster retire`` read it (None: not served)."""
    from delayd.serving.membership import member_id_for

    broker = cluster.address_of(listen_host, port)
    replication_address = ""
    if replication:
        replication_address = cluster.address_of(listen_host, bound_addresses(replication)[0][1])
    metrics = "" if metrics_port is None else cluster.address_of(listen_host, metrics_port)
    return MemberInfo(
        member_id_for(broker), broker=broker, replication=replication_address, metrics=metrics
    )
