"""One metric family with one label, filled from ``(label value, sample)`` pairs: the
shape every collector of the two servers repeats for "X, by log / group / reason"."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


def labelled(
    kind: type[Family],
    name: str,
    documentation: str,
    label: str,
    samples: Iterable[tuple[str, float]],
) -> Family:
    """A ``kind`` family ``name{label}`` with one sample per ``(label value, sample)``."""
    family = kind(name, documentation, labels=[label])
    for value, sample in samples:
        family.add_metric([value], sample)
    return family
