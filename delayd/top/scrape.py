"""One look at a server: GET its /metrics and parse the text into a Snapshot.

The parser is prometheus_client's (``text_string_to_metric_families``), so anything a
Prometheus server can scrape, ``delayd top`` can read. Samples are kept by their sample
name (``delayd_intake_accepted_messages_total``, ``…_bucket``, ``…_count``), which is what the
model asks for.
"""

from __future__ import annotations

import http.client
import math
import ssl
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from delayd.address import parse_address

MAX_BODY_BYTES = 16 << 20  # a /metrics page larger than this is not a delayd server's


@dataclass(frozen=True, slots=True)
class Target:
    """A server to watch: how it is shown, and the URL of its metrics page."""

    label: str
    url: str


def parse_target(text: str, *, https: bool = False) -> Target:
    """``HOST:PORT`` (``[v6]:PORT``, delayd.address; scraped over ``https`` when asked)
    or an ``http://`` or ``https://`` URL (path defaults to /metrics).

    Raises ValueError for anything else.
    """
    if text.startswith(("http://", "https://")):
        scheme, rest = text.split("://", 1)
        host_port, slash, path = rest.partition("/")
        if not host_port:
            raise ValueError(f"{text!r} has no host")
        return Target(host_port, f"{scheme}://{host_port}/{path if slash else 'metrics'}")
    try:
        address = parse_address(text)
    except ValueError as exc:
        raise ValueError(f"{exc} (or give an http:// URL)") from None
    return Target(text, f"{'https' if https else 'http'}://{address}/metrics")


def fetch(url: str, timeout_s: float, tls: ssl.SSLContext | None = None) -> str:
    """The body of ``url`` (blocking; an https one verified with ``tls``, or with the
    system's trust store). Raises OSError with a short reason when there is none:
    refused, timed out, an HTTP status other than 200, not HTTP at all, a certificate
    not trusted."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s, context=tls) as response:
            body = response.read(MAX_BODY_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise OSError(f"HTTP {exc.code} {exc.reason}") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        text = reason.strerror if isinstance(reason, OSError) else None
        raise OSError(text or str(reason)) from None
    except http.client.HTTPException as exc:
        raise OSError(f"not an HTTP answer: {type(exc).__name__}") from None
    if len(body) > MAX_BODY_BYTES:
        raise OSError(f"metrics page larger than {MAX_BODY_BYTES} bytes")
    return body.decode("utf-8", errors="replace")


Labels = Mapping[str, str]


class Snapshot:
    """The samples of one scrape, by sample name; read-only."""

    __slots__ = ("_samples",)

    def __init__(self, samples: Mapping[str, list[tuple[dict[str, str], float]]]) -> None:
        self._samples = samples

    @classmethod
    def parse(cls, text: str) -> Snapshot:
        """The samples of a Prometheus text exposition. Raises ValueError when the text
        is not one."""
        samples: dict[str, list[tuple[dict[str, str], float]]] = {}
        try:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    samples.setdefault(sample.name, []).append((sample.labels, sample.value))
        except (ValueError, TypeError, IndexError) as exc:
            raise ValueError(f"not a Prometheus metrics page: {exc}") from None
        return cls(samples)

    def has(self, name: str) -> bool:
        return name in self._samples

    def total(self, name: str) -> float | None:
        """The sum of every sample of ``name`` (over all labels); None when absent."""
        series = self._samples.get(name)
        return None if series is None else sum(value for _, value in series)

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Sample values of ``name`` summed by the value of ``label`` (others merged)."""
        out: dict[str, float] = {}
        for labels, value in self._samples.get(name, ()):
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
        return out

    def buckets(self, name: str) -> list[tuple[float, float]]:
        """The cumulative buckets ``(le, count)`` of histogram ``name`` (the
        ``name_bucket`` samples, summed over other labels), by ``le``; +Inf last."""
        counts: dict[float, float] = {}
        for labels, value in self._samples.get(f"{name}_bucket", ()):
            try:
                le = float(labels["le"])
            except (KeyError, ValueError):
                continue
            counts[le] = counts.get(le, 0.0) + value
        return sorted(counts.items())


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q``-quantile (0..1) of cumulative ``buckets``, interpolated linearly inside
    the bucket it falls in — Prometheus's ``histogram_quantile``. None without
    observations or without the +Inf bucket; the highest finite bound when the quantile
    falls in the +Inf bucket."""
    if not buckets or not math.isinf(buckets[-1][0]) or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for upper_bound, count in buckets:
        if count >= rank:
            if math.isinf(upper_bound):
                return lower_bound if len(buckets) > 1 else None
            in_bucket = count - lower_count
            if in_bucket <= 0:
                return upper_bound
            return lower_bound + (upper_bound - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = upper_bound, count
    return None
