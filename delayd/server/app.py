"""DelayServer: the delay server's process — message_log, replayer, intake listener,
the HTTP API, the embedded broker and /metrics — under one root nursery.

Start-up: ``open_listeners`` binds every port first (a clash is reported at once, not
after recovery); ``open`` (blocking, run in a worker thread) recovers: message_log
(torn tail cut), replay (schedule_log cut back to the checkpoint, sequence recovered),
the broker. ``run`` then starts every task with ``nursery.start`` and reports the
bound addresses once all of them listen.

A member of a replicated group (``[cluster] etcd``; docs/replication.md) joins it once
its listeners are bound, answers NOT_LEADER unless it leads, and delivers only while it
leads: delivery starts at each promotion and stops at each demotion.

Shutdown (``request_stop``, on SIGTERM/SIGINT): resign (a member of a group), stop
accepting (binary and HTTP) and let in-flight batches be answered, flush message_log,
let the replayer copy everything durable and write its checkpoint, stop delivery, stop
the broker's listener the same way (appended batches answered), stop the broker (it
flushes and checkpoints itself), close files.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import trio
from prometheus_client import CollectorRegistry

from delayd.broker import Broker
from delayd.broker.metrics import BrokerCollector
from delayd.broker.server import broker_listener
from delayd.cluster.config import DEFAULT_SERVE_REPLICATION_PORT
from delayd.cluster.members import MemberInfo, Role
from delayd.logs import layout
from delayd.logs.known_ids import KnownIds
from delayd.logs.message_status import UNKNOWN, MessageStatus, message_status
from delayd.replay import Replayer, open_replayer
from delayd.server.config import Address, ServeConfig
from delayd.server.connection import DelayConnection
from delayd.server.delivery import Delivery, build_targets
from delayd.server.delivery_metrics import DeliveryCollector
from delayd.server.intake import IntakePath
from delayd.server.listener import IntakeListener
from delayd.server.metrics import IntakeCollector
from delayd.server.pending_metrics import PendingCollector, PendingTracker, chained
from delayd.server.receiver import Receiver
from delayd.server.retention import Retention, remove_orphans, trim_below_leader
from delayd.server.retention_metrics import RetentionCollector
from delayd.server.snapshot import install_received_snapshot
from delayd.serving.connection_gate import ConnectionGate
from delayd.serving.connection_metrics import register_connection_metrics
from delayd.serving.listeners import bound_addresses
from delayd.serving.listeners import open_listeners as bind
from delayd.serving.metrics_http import Readiness, serve_metrics
from delayd.serving.store_metrics import RESUME_FREE_BYTES, StoreMetrics, broker_directories
from delayd.serving.tls import ServerTls
from delayd.write_refusals import WriteRefusals
from storage.errors import StorageError
from storage.flusher import FlushMode, LogWriter
from storage.fs import REAL_FS, FileSystem
from storage.segmented_log import SegmentedLog

if TYPE_CHECKING:
    from delayd.replication import Follower, Leader
    from delayd.server.http import HttpListener
    from delayd.server.replicating import GroupReplication
    from delayd.serving.membership import Membership

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # in-flight batches get this long to be acknowledged
ASYNC_POLL_INTERVAL_S = 0.01  # replayer's look at message_log under the async policy
PROGRESS_INTERVAL_S = 2.0  # a long replay catch-up at start logs a line this often
REBUILD_CHUNK = 20_000  # ids claimed during an id filter rebuild, added a step at a time


@dataclass(frozen=True, slots=True)
class ServeListeners:
    """The server's listening sockets, bound before recovery (``open_listeners``)."""

    intake: list[trio.SocketListener]
    broker: list[trio.SocketListener] | None
    metrics: list[trio.SocketListener] | None
    http: list[trio.SocketListener] | None = None
    # The data path's listener, published in etcd (docs/replication.md): bound with the
    # others so that a clash is said at start; served by the replication code.
    replication: list[trio.SocketListener] | None = None

    async def aclose(self) -> None:
        for group in (self.intake, self.broker, self.metrics, self.http, self.replication):
            for listener in group or ():
                await listener.aclose()


async def open_listeners(config: ServeConfig) -> ServeListeners:
    """Bind the intake, broker, metrics, HTTP and replication listeners ``config`` asks
    for, in that order.
    Raises ListenError naming the first that cannot be bound (those bound before it
    are closed again)."""
    bound: list[list[trio.SocketListener]] = []
    try:
        intake = await bind("intake", *config.listen)
        bound.append(intake)
        broker = metrics = http = replication = None
        if config.broker_listen is not None:
            broker = await bind("the broker", *config.broker_listen)
            bound.append(broker)
        if config.metrics_listen is not None:
            metrics = await bind("metrics", *config.metrics_listen)
            bound.append(metrics)
        if config.http_listen is not None:
            http = await bind("the HTTP API", *config.http_listen)
            bound.append(http)
        if config.cluster.enabled:
            address = config.cluster.replication_address(
                config.listen.host, DEFAULT_SERVE_REPLICATION_PORT
            )
            replication = await bind("replication", *address)
    except BaseException:
        for group in bound:
            for listener in group:
                await listener.aclose()
        raise
    return ServeListeners(intake, broker, metrics, http, replication)


@dataclass(frozen=True, slots=True)
class MetricsEndpoint:
    """/metrics, /healthz and /readyz served from before recovery (``serve_metrics_early``
    on the bound metrics listener), so that a liveness probe is answered while a long
    recovery runs and /readyz says why the server is not ready. ``DelayServer.run``
    then adds its collectors to ``registry`` and drives ``readiness``."""

    registry: CollectorRegistry
    readiness: Readiness
    address: Address


async def serve_metrics_early(
    listeners: list[trio.SocketListener],
    reason: str,
    *,
    tls: ServerTls | None = None,
    task_status: trio.TaskStatus[MetricsEndpoint] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve an empty registry on ``listeners`` (over TLS when ``tls`` is given) until
    cancelled, /readyz answering 503 ``starting: <reason>``; reports the
    MetricsEndpoint to hand to ``run``."""
    registry = CollectorRegistry(auto_describe=False)
    readiness = Readiness(reason)
    address = bound_addresses(listeners)[0]
    serve = partial(serve_metrics, readiness=readiness, listeners=listeners, tls=tls)
    async with trio.open_nursery() as nursery:
        await nursery.start(serve, registry, *address)
        task_status.started(MetricsEndpoint(registry, readiness, address))


@dataclass(frozen=True, slots=True)
class BoundAddresses:
    """Where the started server listens (the real ports when port 0 was asked for)."""

    intake: Address
    broker: Address | None
    metrics: Address | None
    http: Address | None = None


class DelayServer:
    """One delay server over a data directory; see the module docstring."""

    def __init__(
        self,
        config: ServeConfig,
        message_log: SegmentedLog,
        replayer: Replayer,
        broker: Broker,
        delivery: Delivery,
        tls: ServerTls | None = None,
    ) -> None:
        self.config = config
        self.tls = tls  # every listener's TLS (delayd.tls); None: plain TCP
        self.delivery = delivery
        self.message_log = message_log
        self.replayer = replayer
        self.broker = broker
        self.writer = LogWriter(message_log, config.flush)
        # Idempotent intake: an id already held is answered DUPLICATE (docs/protocol.md).
        self.known = None if replayer.index is None else KnownIds(replayer.index)
        replayer.known = self.known
        self.receiver = Receiver(config.limits, replayer.recovery.next_sequence, self.known)
        self.intake = IntakePath(self.receiver, self.writer, replayer)
        self.intake.canceller = delivery.canceller  # cancel/reschedule (docs/cancel.md)
        # A member of a group: only the leader takes requests and delivers.
        self.membership: Membership | None = None
        if config.cluster.enabled:
            # Imported here: only a member needs the etcd client and its HTTP stack.
            from delayd.serving.membership import Membership

            self.membership = Membership(
                config.cluster,
                holds_group_data=self._knows_group,
                before_founding=self._claim_founding,
            )
            # Follower mode until a promotion's take-over: replay decides nothing.
            delivery.derive_tombstones()
        self.replication: GroupReplication | None = None  # built in run (its listener)
        self.snapshots_installed = 0  # at open: a snapshot of the leader's state (metrics)
        self.listener = IntakeListener(
            self._connection, ConnectionGate("intake", config.connection_limits), tls
        )
        # Its gate: the [broker] connection keys (the embedded broker's config).
        self.broker_listener = broker_listener(
            broker, token=config.token, membership=self.membership, tls=tls
        )
        self._stop = trio.Event()
        # Recovery of the logs is done when the server is built; /readyz turns ready
        # once replay has caught up and delivery runs.
        self.readiness = Readiness("replaying message_log before delivery starts")
        # The logs that refuse writes for lack of space, one record for every writer:
        # not ready while any does (docs/operations.md, "A full disk").
        self.refusals = WriteRefusals()
        for writer in (self.intake, replayer, delivery.sender, broker):
            writer.refusals = self.refusals
        self.readiness.watch(self.refusals.reason)
        self._broker_address: str | None = None
        self._delivery_collector: DeliveryCollector | None = None
        self._delivery_stop_lock = trio.Lock()
        self.http: HttpListener | None = None  # the HTTP API, once it serves
        # A member of a group: the id filter misses ids copied from the leader
        # (_ids_from_leader, _keep_id_filter).
        self._ids_copying = False  # following, or promoted and not caught up yet
        self._ids_copies = 0  # times following began
        self._ids_caught_up = trio.Event()
        self._rebuild_id_filter: Callable[[], object] | None = None  # while one waits
        # A promotion's stages, by the epoch they were reached at: what was copied is
        # replayed (_catch_up_intake), then the canceller took over (_take_over).
        self._promotion_epochs: dict[str, int | None] = {"replayed": None, "taken_over": None}
        self._promotion_moved = trio.Event()
        # Set while no take-over or delivery runs (_deliver_while_leading): a follower
        # copies the leader's dispatch_log only then.
        self._delivery_done = trio.Event()
        self._delivery_done.set()
        # Metrics that read the logs, only when someone can scrape them: the pending
        # count adds a call per replayed record and a start-up count.
        self.pending: PendingTracker | None = None
        self.store_metrics: StoreMetrics | None = None
        if config.metrics_listen is not None:
            self.pending = self._pending_tracker(delivery)
            self._chain_pending()
            data_dir = delivery.data_dir
            directories = {
                "message_log": layout.message_log_dir(data_dir),
                "schedule_log": layout.schedule_log_dir(data_dir),
                "dispatch_log": layout.dispatch_log_dir(data_dir),
                "id_index": layout.id_index_dir(data_dir),
                **broker_directories(broker.store.directory),
            }
            # Writes are taken to resume a MiB above intake's reserve: below it intake
            # still refuses, and readiness must say so.
            resume = config.limits.min_free_bytes + RESUME_FREE_BYTES
            self.store_metrics = StoreMetrics(
                directories, data_dir, self.refusals, resume_free_bytes=resume
            )
        # Deletes replayed message_log segments and delivered buckets once they are old
        # enough (docs/operations.md, "Retention"); runs once delivery does. Built
        # whatever the configuration: a bucket the leader retires is deleted by every
        # member's replay through it (Retention.delete_retired).
        self.retention = Retention(
            config.retention, message_log, replayer, delivery, pending=self.pending
        )
        self.retention.append_retirements = self.intake.append_retirements
        self.retention.commit_appended = self.intake.commit_appended

    def _chain_pending(self) -> None:
        """The pending count hears of every record the replayer schedules, after the
        delivery's manager (whose callback Delivery sets)."""
        assert self.pending is not None
        replayer = self.replayer
        replayer.on_scheduled = chained(replayer.on_scheduled, self.pending.on_scheduled)

    @staticmethod
    def _pending_tracker(delivery: Delivery) -> PendingTracker:
        """Built before the replayer runs: it takes every bucket file's length now."""
        manager = delivery.manager
        # Buckets the wheel may have loaded, whose dispatch_log the sender appends to.
        active_ahead_ms = manager.load_ahead_ms + manager.width_ms
        return PendingTracker(delivery.data_dir, delivery.fs, active_ahead_ms=active_ahead_ms)

    @classmethod
    def open(
        cls,
        data_dir: str,
        config: ServeConfig,
        *,
        fs: FileSystem = REAL_FS,
        tls: ServerTls | None = None,
    ) -> DelayServer:
        """Open and recover everything under ``data_dir`` (blocking). ``tls``: the
        listeners' TLS, loaded from ``config.tls`` when not given.

        Raises SegmentScaleMismatchError, CorruptionError, StorageError, TlsError.
        """
        if tls is None and config.tls is not None:
            tls = ServerTls(config.tls)  # first: a bad file is reported before recovery
        # A member that received a snapshot of its leader's state starts from it.
        installed = install_received_snapshot(data_dir, fs)
        message_log = SegmentedLog.open(
            layout.message_log_dir(data_dir), fs=fs, segment_size=config.message_log_segment_bytes
        )
        if message_log.recovery.truncated_bytes:
            log.warning(
                "message_log: cut a torn tail of %d bytes at offset %d",
                message_log.recovery.truncated_bytes,
                message_log.recovery.truncated_at,
            )
        try:
            async_flush = config.flush.mode is FlushMode.ASYNC
            replayer = open_replayer(
                data_dir,
                message_log,
                segment_scale=config.segment_scale_minutes,
                fs=fs,
                max_open_buckets=config.max_open_buckets,
                batch_records=config.replay_batch_records,
                checkpoint_interval_s=config.replay_checkpoint_interval_s,
                poll_interval_s=ASYNC_POLL_INTERVAL_S if async_flush else None,
            )
        except BaseException:
            message_log.close()
            raise
        try:
            # A bucket deletion a crash cut short leaves dispatch_log files without
            # their schedule_log file: gone before the replayer can append.
            remove_orphans(data_dir, fs)
        except BaseException:
            replayer.close()
            message_log.close()
            raise
        report = replayer.recovery
        log.info(
            "replay recovery: checkpoint at %d, %d records after it, %d buckets checked, "
            "%d cut (%d bytes), next sequence %d",
            report.position,
            report.records_after_checkpoint,
            report.buckets_checked,
            len(report.cut_bytes),
            sum(report.cut_bytes.values()),
            report.next_sequence,
        )
        try:
            broker = Broker.open(data_dir, config.broker, fs=fs)
        except BaseException:
            replayer.close()
            message_log.close()
            raise
        try:
            delivery = Delivery(data_dir, config, replayer, build_targets(config, broker), fs=fs)
        except BaseException:
            broker.close()
            replayer.close()
            message_log.close()
            raise
        server = cls(config, message_log, replayer, broker, delivery, tls)
        server.snapshots_installed = int(installed is not None)
        return server

    def _connection(self, stream: trio.abc.Stream) -> DelayConnection:
        return DelayConnection(
            self.intake,
            stream,
            token=self.config.token,
            max_frame_size=self.config.max_frame_bytes,
            stats=self.stats,
            broker_address=self._broker_address,
            gate=self.listener.gate,
            membership=self.membership,
        )

    def stats(self) -> dict[str, str | int | float]:
        """Flat named values for STATS (units in the names)."""
        receiver, replayer = self.receiver, self.replayer
        out: dict[str, str | int | float] = {
            "intake.accepted_total": receiver.accepted_total,
            "intake.refused_total": sum(receiver.refused_total.values()),
            "intake.past_due_total": receiver.past_due_total,
            "intake.duplicate_total": receiver.duplicate_total,
            "intake.pending_acks": self.intake.pending_acks,
            "intake.last_sequence": receiver.last_sequence,
            "message_log.end_offset_bytes": self.message_log.end_offset,
            "message_log.durable_offset_bytes": self.message_log.durable_offset,
            "replay.position_bytes": replayer.position,
            "replay.checkpointed_position_bytes": replayer.checkpointed_position,
            "replay.lag_bytes": replayer.lag_bytes,
            "replay.lag_records": replayer.lag_records,
            "replay.records_total": replayer.replayed_total,
            "replay.records_from_memory_total": replayer.replayed_from_tail,
            "schedule_log.segment_scale_minutes": self.config.segment_scale_minutes,
        }
        for code, count in sorted(receiver.refused_total.items()):
            out[f"intake.refused_total/{code.name.lower()}"] = count
        if self.membership is not None:
            view = self.membership.view
            out["cluster.group"] = self.config.cluster.group
            out["cluster.role"] = view.role.name.lower()
            out["cluster.epoch"] = view.epoch or 0
            out["cluster.leader"] = view.leader.member_id if view.leader else ""
        if self.replication is not None:
            out.update(self.replication.stats())
        return out

    def request_stop(self) -> None:
        """Begin the graceful shutdown; ``run`` returns when it is done."""
        self._stop.set()

    async def run(
        self,
        *,
        listeners: ServeListeners | None = None,
        metrics: MetricsEndpoint | None = None,
        task_status: trio.TaskStatus[BoundAddresses],
    ) -> None:
        """Serve until ``request_stop``, on ``listeners`` (bound before ``open``) or on
        listeners of its own; reports BoundAddresses once every listener is up.
        ``metrics``: the endpoint already served since before recovery (then
        ``listeners.metrics`` is None), which gets this server's collectors. Raises
        whatever stops a task (a StorageError from a log, ListenError)."""
        config = self.config
        if listeners is None:
            listeners = await open_listeners(config)
        try:
            async with trio.open_nursery() as root:
                await root.start(self.writer.run)
                await root.start(self.replayer.run)
                await root.start(self.broker.run)
                broker_bound = None
                if config.broker_listen is not None:
                    host, port = config.broker_listen
                    serve_broker = self.broker_listener.serve
                    bound = await root.start(
                        partial(serve_broker, host, port, listeners=listeners.broker)
                    )
                    broker_bound = bound[0]
                    self._broker_address = "{}:{}".format(*broker_bound)
                metrics_bound = None
                if config.metrics_listen is not None:
                    assert self.pending is not None and self.store_metrics is not None
                    await root.start(self.pending.run)
                    await root.start(self.store_metrics.run)
                    if metrics is not None:
                        registry = metrics.registry
                    else:
                        registry = CollectorRegistry(auto_describe=False)
                    registry.register(IntakeCollector(self.receiver, self.intake, self.replayer))
                    registry.register(BrokerCollector(self.broker))
                    self._delivery_collector = DeliveryCollector(self.delivery)
                    registry.register(self._delivery_collector)
                    if self.membership is not None:
                        from delayd.replication.metrics import ReplicationCollector
                        from delayd.serving.membership_metrics import MembershipCollector

                        registry.register(MembershipCollector(self.membership))
                        registry.register(ReplicationCollector(self._replication_role))
                    registry.register(PendingCollector(self.pending))
                    self.store_metrics.register(registry)
                    if self.config.retention.enabled:
                        registry.register(RetentionCollector(self.retention))
                    gates = {"intake": self.listener.gate, "broker": self.broker_listener.gate}
                    register_connection_metrics(registry, gates)
                    if metrics is not None:  # served since before recovery
                        metrics.readiness.starting(self.readiness.reason or "starting")
                        self.readiness = metrics.readiness
                        self.readiness.watch(self.refusals.reason)  # a full disk
                        metrics_bound = metrics.address
                    else:
                        host, port = config.metrics_listen
                        serve = partial(
                            serve_metrics,
                            readiness=self.readiness,
                            listeners=listeners.metrics,
                            tls=self.tls,
                        )
                        metrics_bound = (await root.start(serve, registry, host, port))[0]
                http_bound = None
                if config.http_listen is not None:
                    http_bound = await root.start(self._serve_http, root, listeners)
                host, port = config.listen
                serve_intake = partial(self.listener.serve, listeners=listeners.intake)
                intake_bound = await root.start(serve_intake, host, port)
                bound = BoundAddresses(intake_bound[0], broker_bound, metrics_bound, http_bound)
                if self.membership is not None:
                    root.start_soon(self._scan_tombstones)
                    await root.start(self._replicate, listeners)
                    await root.start(self.membership.run, self._member_info(bound, listeners))
                task_status.started(bound)
                root.start_soon(self._start_delivery, root, self.message_log.durable_offset)
                await self._stop.wait()
                await self._shutdown()
                root.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await listeners.aclose()  # those never served (a task failed first)
            self.delivery.close()
            self.replayer.close()
            self.message_log.close()
            if self.known is not None:
                self.known.close()

    async def _replicate(
        self, listeners: ServeListeners, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """The group's data path (delayd.server.replicating): message_log, dispatch_log
        and the embedded broker's streams shipped to the followers; acks wait for the
        group; intake waits, after each promotion, until what the member copied as a
        follower is replayed."""
        from delayd.server.broker_member import ReplicatedBroker
        from delayd.server.replicating import GroupReplication

        assert self.membership is not None
        replication = GroupReplication(
            self.delivery.data_dir,
            self.message_log,
            self.replayer,
            self.membership,
            self.config.cluster,
            listeners.replication,
            fs=self.delivery.fs,
            on_promoted=self._catch_up_intake,
            on_demoted=self._replication_leader_stopped,
            on_following=self._start_following,
            tls=self.tls,
            dispatch_files=lambda: self.delivery.dispatch.files,
            on_leader_retained=partial(trim_below_leader, self.message_log, self.replayer),
            # The embedded broker moves with its delay server: its store acks wait for
            # the group before the sender records a delivery.
            broker=ReplicatedBroker(self.broker),
            snapshots_installed=self.snapshots_installed,
        )
        self.replication = replication
        self.retention.replicated_floor = replication.message_log_copied
        self.retention.streams_retired = replication.buckets_retired
        self.retention.streams_deleted = replication.grew
        self.delivery.dispatch.on_durable = replication.grew
        self.delivery.sender.acknowledge = replication.wait_routes_copied
        self.writer.on_durable = replication.grew
        self.intake.replication = replication
        self._hold_intake()
        await replication.run(task_status=task_status)

    def _knows_group(self) -> bool:
        """Whether this member's epoch history names an epoch (or a founding claim):
        false for a new member and for one whose data directory was wiped
        (Membership's eligibility)."""
        return self.replication is not None and self.replication.history.knows_group()

    def _claim_founding(self) -> None:
        if self.replication is not None:
            self.replication.history.claim_founding()

    def _replication_role(self) -> Leader | Follower | None:
        """What /metrics reads the replication figures from: the member's Leader or
        Follower of the moment (delayd.replication.metrics)."""
        replication = self.replication
        if replication is None:
            return None
        return replication.leader or replication.follower

    def _replication_leader_stopped(self, epoch: int) -> None:
        """The replication Leader of ``epoch`` stopped. While the member still leads at
        that epoch (the Leader stopped on its own: the role loop starts another, and
        acks wait for it), delivery and its canceller go on: holding intake here would
        leave the replayer deriving tombstones that no one decides, as the take-over
        that decides them again runs once per epoch. Otherwise intake is held until the
        next promotion."""
        membership = self.membership
        if membership is not None and membership.may_lead() and membership.view.epoch == epoch:
            return
        self._hold_intake()

    def _hold_intake(self) -> None:
        """Until the next promotion's catch-up, intake takes nothing (make_room waits),
        and replay decides no tombstone (follower mode: the leader decides)."""
        if self.intake.ids_ready.is_set():
            self.intake.ids_ready = trio.Event()
        self.delivery.derive_tombstones()

    async def _start_following(self) -> None:
        """Following: the ids copied from the leader (``_ids_from_leader``); once
        delivery and the take-over stopped (the delivery loop stops them when the member
        no longer leads), their dispatch_log files closed: the follower copies the
        leader's into them."""
        self._ids_from_leader()
        await self._delivery_done.wait()  # no task writes dispatch_log any more
        self.delivery.dispatch.forget_all()

    def _ids_from_leader(self) -> None:
        """Following: the replayer indexes ids intake never checked, which the id
        filter does not hold. Cold (every id looked up in the index) until a filter
        built after them is in place (``_keep_id_filter``, after ``_catch_up_intake``)."""
        self.delivery.derive_tombstones()
        if self.known is not None:
            self.known.warm = False
        self._ids_copies += 1
        if not self._ids_copying:
            self._ids_copying = True
            self._ids_caught_up = trio.Event()

    async def _catch_up_intake(self, epoch: int) -> None:
        """Promoted at ``epoch``: replay what was copied, wait for the canceller to take
        over (``_take_over``), number new messages after it, let intake in. The id index
        then holds every id the group acknowledged (DUPLICATE for a producer's retry
        across the failover). Intake stays held if the member stops leading at
        ``epoch`` first — also when it already leads at a newer one: that promotion's
        stages are its own Leader's to reach, after this one's ``_demoted``."""
        replayer = self.replayer
        await self.writer.flush()  # copied records the follower had not flushed yet
        while replayer.position < self.message_log.durable_offset:
            await trio.sleep(0.005)
        self._promotion_reached("replayed", epoch)
        if not await self._promotion_waits("taken_over", epoch):
            return
        self.receiver.resume_after(replayer.next_sequence)
        if self._ids_copying:
            self._ids_copying = False
            self._ids_caught_up.set()
            if self._rebuild_id_filter is not None:
                self._rebuild_id_filter()  # a build now holds every id copied
        self.intake.ids_ready.set()

    def _member_info(self, bound: BoundAddresses, listeners: ServeListeners) -> MemberInfo:
        """This server as the group's members and clients reach it: the advertised host
        and the bound ports."""
        from delayd.serving.membership import data_location, member_id_for

        cluster = self.config.cluster
        host = self.config.listen.host

        def address(where: Address | None) -> str:
            return "" if where is None else cluster.address_of(host, where[1])

        replication = bound_addresses(listeners.replication)[0] if listeners.replication else None
        intake = address(bound.intake)
        return MemberInfo(
            member_id_for(intake),
            intake=intake,
            broker=address(bound.broker),
            replication=address(replication),
            metrics=address(bound.metrics),
            http=address(bound.http),
            **data_location(self.delivery.data_dir),
        )

    async def _serve_http(
        self,
        root: trio.Nursery,
        listeners: ServeListeners,
        *,
        task_status: trio.TaskStatus[Address],
    ) -> None:
        """The HTTP API (delayd.server.http) on the same intake path and broker; a log that
        cannot be written stops the server, as it does from the binary listener."""

        def storage_failed(exc: StorageError) -> None:
            async def fail() -> None:
                raise exc

            root.start_soon(fail)

        # Here, not at the top: the HTTP stack (FastAPI, pydantic) takes half of a start's
        # imports, and a server without the HTTP API does without it.
        from delayd.server.http import Backend, open_api

        assert listeners.http is not None  # bound by open_listeners
        backend = Backend(
            self.intake,
            self.broker,
            self.message_status,
            self.config.token,
            storage_failed,
            membership=self.membership,
        )
        self.http = open_api(
            backend,
            listeners.http,
            max_record_bytes=self.config.limits.max_record_bytes,
            grace_s=SHUTDOWN_GRACE_S,
            tls=self.tls,
        )
        await self.http.serve(task_status=task_status)

    def message_status(self, message_id: str) -> MessageStatus:
        """Where the message with ``message_id`` is (delayd.logs.message_status)."""
        index = self.replayer.index
        if index is None:
            return UNKNOWN
        return message_status(message_id, index, self.delivery.dispatch, self.known)

    async def _start_delivery(self, root: trio.Nursery, replay_target: int) -> None:
        """Start delivery once the replayer has caught up with what message_log held
        at start (delayd.server.delivery says why it waits). A catch-up that takes
        long logs its progress every PROGRESS_INTERVAL_S."""
        replayer = self.replayer
        started = last_report = trio.current_time()
        first, records_before = replayer.position, replayer.replayed_total
        while replayer.position < replay_target:
            await trio.sleep(0.005)
            now = trio.current_time()
            if now - last_report >= PROGRESS_INTERVAL_S:
                last_report = now
                log.info(
                    "replay catch-up: %d of %d bytes of message_log, %d records (%.0f s)",
                    replayer.position - first,
                    replay_target - first,
                    replayer.replayed_total - records_before,
                    now - started,
                )
        # Every id message_log held at start is in the id index now: intake may decide
        # duplicates (it waited until here), and the id filter can be filled. A member
        # of a group lets intake in at each promotion instead (_catch_up_intake).
        if self.membership is None:
            self.intake.ids_ready.set()
        if self.known is not None:
            root.start_soon(self._keep_id_filter)
        if self.membership is not None:
            self.readiness.set_ready()
            log.info("replay caught up at message_log offset %d", replay_target)
            await self._deliver_while_leading()
            return
        await root.start(self.delivery.run)
        if self.config.retention.enabled:
            await root.start(self.retention.run)
        self.readiness.set_ready()
        log.info("delivering: replay caught up at message_log offset %d", replay_target)

    async def _deliver_while_leading(self) -> None:
        """Deliver (and run retention) only while this member leads its group: started
        at each promotion, stopped at each demotion, dispatch_log made durable and the
        cursors written as at a shutdown. A demoted delivery's memory (wheel, sender's
        in-flight entries) is not reused: the next promotion builds a new one from the
        logs, as a restart does."""
        membership = self.membership
        assert membership is not None
        led_before = False
        while True:
            while not membership.may_lead():
                await membership.wait_change()
            self._delivery_done = trio.Event()
            try:
                if led_before:
                    self._renew_delivery()
                led_before = True
                await self._deliver_at(membership.view.epoch)
            finally:
                self._delivery_done.set()

    async def _deliver_at(self, epoch: int | None) -> None:
        """Take over, then deliver until the member no longer leads (``epoch``)."""
        membership = self.membership
        assert membership is not None
        if not await self._take_over(epoch):
            return
        log.info("leading group %s at epoch %s: delivering", membership.keys.group, epoch)
        async with trio.open_nursery() as delivering:
            await delivering.start(self.delivery.run)
            if self.config.retention.enabled:
                await delivering.start(self.retention.run)
            while membership.may_lead():
                await membership.wait_change()
            role = membership.view.role
            log.info(
                "no longer leading group %s (%s): stopping delivery",
                membership.keys.group,
                # Still LEADER here: its lease is no longer trusted and the step-down has
                # not run yet.
                "its lease no longer trusted" if role is Role.LEADER else role.name.lower(),
            )
            await self._stop_delivery()
            delivering.cancel_scope.cancel()

    async def _scan_tombstones(self) -> None:
        """A group member: find the tombstones below where replay began now, while it
        follows, so that a promotion need not wait for it (``Canceller.take_over``)."""
        replayer = self.replayer
        started = trio.current_time()
        await replayer.scan_tombstones()
        log.info(
            "tombstone index complete: %d cancel/reschedule tombstones in message_log "
            "(the scan below offset %d took %.2f s)",
            len(replayer.tombstones),
            replayer.tombstones.replay_start,
            trio.current_time() - started,
        )

    async def _take_over(self, epoch: int | None) -> bool:
        """Promoted at ``epoch``: once what was copied is replayed, the canceller
        decides every tombstone again (``Canceller.take_over``: the follower derived
        them only), then decides those replayed from now on; intake and delivery wait
        for this. False if the member stopped leading at ``epoch`` first."""
        if not await self._promotion_waits("replayed", epoch):
            return False
        delivery = self.delivery
        delivery.dispatch.forget_all()  # read again: copied from the old leader
        decided = await delivery.canceller.take_over(self.replayer)
        delivery.decide_tombstones()
        log.info("promoted at epoch %s: %d cancels and reschedules decided again", epoch, decided)
        self._promotion_reached("taken_over", epoch)
        return True

    def _promotion_reached(self, stage: str, epoch: int | None) -> None:
        self._promotion_epochs[stage] = epoch
        self._promotion_moved.set()
        self._promotion_moved = trio.Event()

    async def _promotion_waits(self, stage: str, epoch: int | None) -> bool:
        """Wait until the promotion at ``epoch`` reached ``stage``; False as soon as
        the member may no longer lead at ``epoch``."""
        membership = self.membership
        assert membership is not None
        while self._promotion_epochs[stage] != epoch:
            if not membership.may_lead() or membership.view.epoch != epoch:
                return False
            with trio.move_on_after(0.05):
                await self._promotion_moved.wait()
        return True

    async def _stop_delivery(self) -> None:
        """Stop delivery once, however many ask (a demotion during the shutdown)."""
        async with self._delivery_stop_lock:
            if self.delivery.running:
                await self.delivery.stop()
                self.delivery.running = False

    def _renew_delivery(self) -> None:
        """A new Delivery in place of a stopped one, wired as ``open`` wires the first."""
        old = self.delivery
        old.close()
        config = self.config
        targets = build_targets(config, self.broker)
        delivery = Delivery(old.data_dir, config, self.replayer, targets, fs=old.fs)
        self.delivery = delivery
        delivery.derive_tombstones()  # until _take_over
        if self.replication is not None:
            delivery.dispatch.on_durable = self.replication.grew
            delivery.sender.acknowledge = self.replication.wait_routes_copied
        self.intake.canceller = delivery.canceller
        delivery.sender.refusals = self.refusals
        if self.pending is not None:
            self._chain_pending()
        self.retention.delivery = delivery
        self.retention.clock = delivery.now_ms
        if self._delivery_collector is not None:
            self._delivery_collector.delivery = delivery

    async def _keep_id_filter(self) -> None:
        """Build the id filter now (until then intake looks every id up), and again,
        twice as big, each time it fills (delayd.logs.known_ids)."""
        known = self.known
        assert known is not None
        while True:
            if self._ids_copying:
                # Following: the replayer indexes ids copied from the leader, which no
                # filter holds. Cold (every id looked up) until the catch-up of a
                # promotion, then a filter built after them.
                known.warm = False
                await self._ids_caught_up.wait()
                continue
            copies_before = self._ids_copies
            started = trio.current_time()
            plan = known.begin_rebuild()
            built = await trio.to_thread.run_sync(known.build_filter, plan)
            # The ids claimed during the build go in a chunk per step, then it replaces
            # the filter in the step that adds the last of them.
            while not known.finish_rebuild(built, REBUILD_CHUNK):
                await trio.lowlevel.checkpoint()
            if built is not None and self._ids_copies != copies_before:
                known.warm = False  # copies began during the build: not all in it
                continue
            if built is None:
                log.warning(
                    "id filter: an id index file could not be read; every id sent is "
                    "looked up in the index (slower intake) until the next start"
                )
                return
            log.info(
                "id filter: %d ids in %d KiB, built in %.2f s",
                built.added,
                built.size_bytes // 1024,
                trio.current_time() - started,
            )
            full = trio.Event()
            known.on_full = full.set
            self._rebuild_id_filter = full.set
            await full.wait()
            self._rebuild_id_filter = None

    async def _shutdown(self) -> None:
        if self.membership is not None:
            # Resign first: a follower takes over now, and the requests still in flight
            # here are answered NOT_LEADER instead of being acknowledged by a leader
            # that is leaving.
            self.membership.resign()
        log.info("shutting down: no new requests; answering those in flight")
        async with trio.open_nursery() as listeners:
            listeners.start_soon(self.listener.stop, SHUTDOWN_GRACE_S)
            if self.http is not None:
                listeners.start_soon(self.http.stop)
        await self.writer.flush()
        await self.replayer.stop()
        await self._stop_delivery()
        # The embedded broker's producers (other delay servers, clients) get the same:
        # every SEND_BATCH appended is answered before its connection closes.
        await self.broker_listener.stop(SHUTDOWN_GRACE_S)
        log.info(
            "replay checkpoint at message_log offset %d (sequence %d)",
            self.replayer.checkpointed_position,
            self.replayer.next_sequence - 1,
        )
