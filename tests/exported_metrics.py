"""What a real ``delayd serve`` exports on /metrics, after a little traffic: the
ground truth that tests/test_metric_names.py holds to Prometheus' naming rules and that
tests/test_deploy.py holds the dashboard and the alert rules to."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

import delayd
from delayd.protocol import Message
from tests.delivery_support import poll
from tests.intake_support import RawClient, ServeProcess

HOUR_MS = 3_600_000
SUBJECT = "orders"
GROUP = "billing"


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family as exposed: its name on the ``# TYPE`` line, its type, its help,
    and the label sets of its samples (``le`` and histogram suffixes included)."""

    name: str
    type: str
    help: str
    samples: list[tuple[str, dict[str, str], float]]

    def sample_names(self) -> set[str]:
        """The names a query can use: histograms' ``_bucket``/``_sum``/``_count``."""
        if self.type == "histogram":
            return {f"{self.name}_{suffix}" for suffix in ("bucket", "sum", "count")}
        return {self.name}


def parse_exposition(text: str) -> dict[str, Family]:
    """The families of a Prometheus text page by exposed name. prometheus_client's parser
    drops ``_total`` from a counter's family name; the ``# TYPE`` line keeps it."""
    types: dict[str, str] = {}
    helps: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line[len("# TYPE ") :].split(" ", 1)
            types[name] = kind
        elif line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP ") :].partition(" ")
            helps[name] = help_text
    samples: dict[str, list[tuple[str, dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        exposed = family.name + "_total" if family.name + "_total" in types else family.name
        for sample in family.samples:
            samples.setdefault(exposed, []).append((sample.name, sample.labels, sample.value))
    return {
        name: Family(name, kind, helps.get(name, ""), samples.get(name, []))
        for name, kind in types.items()
    }


def exported_by_a_live_server(data_dir: Path) -> str:
    """Start ``delayd serve`` on ``data_dir``; send one message due now (delivered to the
    embedded broker and consumed by group ``billing``) and one due in an hour (pending);
    scrape /metrics once both show; stop the server. The page's labelled families then
    have samples: per delivery group, per log, per horizon, per broker queue and group."""
    with ServeProcess(data_dir) as server:
        client = RawClient(server.address)
        results = client.send_batch(
            [
                Message("now-1", SUBJECT, body=b"x", delay_ms=0),
                Message("later-1", SUBJECT, body=b"y", delay_ms=HOUR_MS),
            ]
        )
        client.close()
        assert all(result.code.is_success for result in results), results
        broker = "{}:{}".format(*server.broker_address)
        with delayd.Consumer(broker, subject=SUBJECT, group=GROUP, commit="sync") as consumer:
            message = consumer.receive(timeout_s=15.0)
            assert message is not None and message.message_id == "now-1"
            consumer.commit(message)
        pages: list[str] = []

        def pending_and_lag_show() -> bool:
            pages.append(server.metrics_page())
            families = parse_exposition(pages[-1])
            pending = families.get("delayd_pending_messages")
            lag = families.get("delayd_broker_consumer_lag_messages")
            return bool(pending and pending.samples and lag and lag.samples)

        poll(pending_and_lag_show, 15.0, "the pending and lag series")
        return pages[-1]
