"""delayd: a durable delay / scheduled-message server.

The client library's public names are here: producers and consumers (async and
blocking), the receipts they return, the messages consumers get and the codes in them,
the errors they raise, and the version. docs/clients.md shows them at work.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from delayd.version import __version__

if TYPE_CHECKING:
    from delayd.client import (
        AsyncConsumer,
        AsyncProducer,
        CancelReceipt,
        ClientTls,
        Consumer,
        Producer,
        Receipt,
        RescheduleReceipt,
        open_consumer,
        open_producer,
    )
    from delayd.errors import (
        BusyError,
        ConnectionClosedError,
        DelaydError,
        DelaydTimeout,
        LocalProtocolError,
        NotLeaderError,
        ProtocolError,
        RejectedError,
        RemoteProtocolError,
    )
    from delayd.protocol import CancelOutcome, Message, RescheduleOutcome, ResultCode

__all__ = [
    "AsyncConsumer",
    "AsyncProducer",
    "BusyError",
    "CancelOutcome",
    "CancelReceipt",
    "ClientTls",
    "ConnectionClosedError",
    "Consumer",
    "DelaydError",
    "DelaydTimeout",
    "LocalProtocolError",
    "Message",
    "NotLeaderError",
    "Producer",
    "ProtocolError",
    "Receipt",
    "RejectedError",
    "RemoteProtocolError",
    "RescheduleOutcome",
    "RescheduleReceipt",
    "ResultCode",
    "__version__",
    "open_consumer",
    "open_producer",
]

# Where each public name is defined. Imported on first use (PEP 562), so `import
# delayd` stays cheap for the servers and the CLI, which do not need anyio.
_ERRORS = {"BusyError", "ConnectionClosedError", "DelaydError", "DelaydTimeout"}
_ERRORS |= {"LocalProtocolError", "ProtocolError", "RejectedError", "RemoteProtocolError"}
_ERRORS |= {"NotLeaderError"}
_PROTOCOL = {"CancelOutcome", "Message", "RescheduleOutcome", "ResultCode"}


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'delayd' has no attribute {name!r}")
    import importlib

    if name in _ERRORS:
        module = "delayd.errors"
    elif name in _PROTOCOL:
        module = "delayd.protocol"
    else:
        module = "delayd.client"
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    """The public names (and the module's dunders), not the typing helpers."""
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})
