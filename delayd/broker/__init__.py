"""The real-time broker delayd delivers into and consumers pull from.

Modules, bottom up: ``config`` (BrokerConfig), ``record`` (the commitlog record: the
protocol's message layout), ``routing`` (queue selection), ``dedupe`` (the idempotency
window), ``groups`` (membership and queue assignment), ``offsets`` (committed offsets),
``arrivals`` (long-poll wake-ups), ``store`` (commitlog, consume queues, index, reput),
``gate`` (what a replicated group's broker waits for), ``broker`` (the embeddable
Broker), ``replica`` (the broker as a group member), ``server`` (TCP), ``metrics``
(Prometheus);
``delayd broker`` is delayd/cli/broker.py. docs/broker.md describes the design and
the formats.
"""

from delayd.broker.broker import Broker, open_broker
from delayd.broker.config import BrokerConfig, StartFrom

__all__ = ["Broker", "BrokerConfig", "StartFrom", "open_broker"]
