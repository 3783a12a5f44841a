"""Prometheus metrics of client connections, the same for the delay server and the
broker: one ConnectionGate per listener (label ``listener``), read at scrape time.

With them, ``register_connection_metrics`` adds prometheus_client's ProcessCollector
(``process_open_fds``, ``process_max_fds``, ``process_resident_memory_bytes``..., read
from /proc at scrape time): what the connection limits protect, next to what they
refused; and ``delayd_build_info{version}``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Info, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from delayd.serving.connection_gate import CLOSING_CODES, ConnectionGate
from delayd.version import __version__


class ConnectionCollector(Collector):
    """Open, capped and refused connections, and why connections were closed."""

    def __init__(self, gates: Mapping[str, ConnectionGate]) -> None:
        self.gates = gates

    def collect(self) -> Iterator[Metric]:
        gates = sorted(self.gates.items())
        labels = ["listener"]
        open_ = GaugeMetricFamily(
            "delayd_open_connections", "Client connections open now.", labels=labels
        )
        cap = GaugeMetricFamily(
            "delayd_max_connections",
            "The listener's max_connections (from the descriptor limit when configured 0).",
            labels=labels,
        )
        refused = CounterMetricFamily(
            "delayd_refused_connections_total",
            "Connections refused: max_connections reached (answered TOO_MANY_CONNECTIONS), "
            "or accept failed for want of descriptors or memory (EMFILE, ENFILE...).",
            labels=[*labels, "reason"],
        )
        hello = CounterMetricFamily(
            "delayd_connection_hello_failures_total",
            "Connections closed before a successful HELLO, by error code (unauthorized: "
            "a missing or wrong token; timeout: no HELLO within hello_timeout_ms).",
            labels=[*labels, "code"],
        )
        errors = CounterMetricFamily(
            "delayd_connection_protocol_errors_total",
            "Connections closed after HELLO for a protocol error, by error code "
            "(timeout: a frame not finished within frame_timeout_ms).",
            labels=[*labels, "code"],
        )
        unfinished = GaugeMetricFamily(
            "delayd_connection_unfinished_frame_bytes",
            "Bytes reserved now for large frames still arriving (max_unfinished_frame_bytes).",
            labels=labels,
        )
        waiting = GaugeMetricFamily(
            "delayd_connection_budget_waiting_frames",
            "Large frames waiting for room in max_unfinished_frame_bytes before being read.",
            labels=labels,
        )
        for name, gate in gates:
            open_.add_metric([name], gate.open)
            cap.add_metric([name], gate.max_connections)
            for reason, count in sorted(gate.refused.items()):
                refused.add_metric([name, reason], count)
            for code in CLOSING_CODES:
                hello.add_metric([name, code.name.lower()], gate.hello_failures[code])
                errors.add_metric([name, code.name.lower()], gate.protocol_errors[code])
            unfinished.add_metric([name], gate.budget.reserved)
            waiting.add_metric([name], gate.budget.waiting)
        yield from (open_, cap, refused, hello, errors, unfinished, waiting)


def register_connection_metrics(
    registry: CollectorRegistry, gates: Mapping[str, ConnectionGate]
) -> None:
    """The connection metrics of ``gates`` and the process's own (process_*,
    delayd_build_info)."""
    registry.register(ConnectionCollector(gates))
    ProcessCollector(registry=registry)
    Info("delayd_build", "The delayd version this process runs.", registry=registry).info(
        {"version": __version__}
    )
