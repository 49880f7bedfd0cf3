"""The gateway's Prometheus metrics, in a registry of its own (served at ``/metrics``).

Request counts and the latency histogram are observed as requests finish; everything the
recorder and the session table already count is read at scrape time, so there is one counter
per fact. Metric failures never fail a request: observing is plain arithmetic.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _Snapshot:
    """Families read from ``stats()`` when scraped."""

    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        open_ = GaugeMetricFamily("turnrl_gateway_sessions_open", "Live sessions open (recording).")
        open_.add_metric([], s["sessions_open"])
        yield open_
        episodes = CounterMetricFamily("turnrl_gateway_episodes", "Live segments by what became of them.",
                                       labels=["result"])
        for result, n in sorted(s["episodes"].items()):
            episodes.add_metric([result], n)
        yield episodes
        feedback = CounterMetricFamily("turnrl_gateway_feedback", "Feedback by result.", labels=["result"])
        for result, n in sorted(s["feedback"].items()):
            feedback.add_metric([result], n)
        yield feedback
        segments = CounterMetricFamily("turnrl_gateway_recorder_events",
                                       "Session recorder events: stitched requests and new segments by cause.",
                                       labels=["event"])
        for event, n in sorted(s["recorder"].items()):
            segments.add_metric([event], n)
        yield segments
        version = GaugeMetricFamily("turnrl_gateway_policy_version", "Newest weights version served.")
        version.add_metric([], s["version"])
        yield version


class GatewayMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("turnrl_gateway_requests", "HTTP requests by route and status.",
                                ["route", "status"], registry=self.registry)
        self.latency = Histogram("turnrl_gateway_request_latency_seconds",
                                 "Chat completion latency, request to last byte.", ["stream"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tokens = Counter("turnrl_gateway_tokens", "Tokens served, by kind (prompt, completion).",
                              ["kind"], registry=self.registry)
        self.registry.register(_Snapshot(stats))
