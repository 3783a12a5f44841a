"""delayd: a durable delay / scheduled-message server."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["ClientTls", "Consumer", "Producer", "__version__", "open_consumer", "open_producer"]

if TYPE_CHECKING:
    from delayd.client import ClientTls, Consumer, Producer, open_consumer, open_producer

_CLIENT_NAMES = frozenset({"ClientTls", "Consumer", "Producer", "open_consumer", "open_producer"})


def __getattr__(name: str) -> Any:
    # The clients are imported on first use (PEP 562), so `import delayd` stays cheap for
    # the servers and the CLI, which do not need anyio.
    if name in _CLIENT_NAMES:
        import delayd.client

        return getattr(delayd.client, name)
    raise AttributeError(f"module 'delayd' has no attribute {name!r}")
