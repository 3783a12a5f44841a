"""The delay server's trio wiring (DESIGN.md, "Layers") over its pure intake rules,
``receiver`` (validation, due times, sequences): ``config`` (ServeConfig and the TOML
file), ``intake`` (appends and acks), ``connection`` (one producer connection),
``listener`` (accepting, two-phase stop), ``metrics`` (/metrics), ``http`` (the HTTP/JSON
API on the same intake), ``app`` (DelayServer: one root nursery); ``delayd serve`` is
delayd/cli/serve.py."""

from delayd.server.app import BoundAddresses, DelayServer
from delayd.server.config import ConfigError, ServeConfig, load_config

__all__ = ["BoundAddresses", "ConfigError", "DelayServer", "ServeConfig", "load_config"]
