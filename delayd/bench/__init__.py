"""Benchmarks that ship with delayd: ``delayd bench`` (the delivery benchmark of
docs/benchmarks.md) and what every benchmark in tools/ shares (``common``)."""
