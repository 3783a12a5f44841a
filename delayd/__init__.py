"""delayd: a durable delay / scheduled-message server."""

__version__ = "0.1.0"
