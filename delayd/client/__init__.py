"""delayd clients: async (anyio: trio or asyncio) and blocking, over one protocol core.

- ``open_producer(addr)`` / ``open_consumer(addr, subject=, group=)``: async context
  managers (async_producer.py, async_consumer.py);
- ``Producer(addr)`` / ``Consumer(addr, subject=, group=)``: the same for synchronous code
  on plain sockets (blocking_producer.py, blocking_consumer.py);
- ``Receipt``: what a send returns; consumers yield ``delayd.protocol.Message``;
  ``CancelReceipt`` / ``RescheduleReceipt``: what ``cancel`` / ``reschedule`` return;
- ``ClientTls(ca_file=, cert_file=, key_file=)``: ``tls=`` of every client, for a
  server that listens with TLS (delayd.tls).

Shared, I/O-free pieces: ``_backoff``, ``_messages`` (send
arguments to Messages, frames), ``_consumer_state`` (prefetch, dedupe, offsets),
``_session_base`` (address, back-off, first connection). The links (``_async_link``,
``_blocking_link``) move bytes through ``delayd.protocol.Connection`` and open with
``delayd.protocol.handshake``; the sessions reconnect them with back-off.
``new_message_id`` (delayd.message_ids) makes the ids of messages sent without one.
"""

from delayd.client.async_consumer import AsyncConsumer, open_consumer
from delayd.client.async_producer import AsyncProducer, open_producer
from delayd.client.blocking_consumer import Consumer
from delayd.client.blocking_producer import Producer
from delayd.client.cancel_receipt import CancelReceipt, RescheduleReceipt
from delayd.client.receipt import Receipt
from delayd.message_ids import new_message_id
from delayd.tls import ClientTls, TlsError

__all__ = [
    "AsyncConsumer",
    "AsyncProducer",
    "CancelReceipt",
    "ClientTls",
    "Consumer",
    "Producer",
    "Receipt",
    "RescheduleReceipt",
    "TlsError",
    "new_message_id",
    "open_consumer",
    "open_producer",
]
