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

    def __init__(self, stats: Callable[[], dict[str, Any]], run: str) -> None:
        self.stats, self.run = stats, run

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        open_ = GaugeMetricFamily("turnrl_gateway_sessions_open", "Live sessions open (recording).", labels=["run"])
        open_.add_metric([self.run], s["sessions_open"])
        yield open_
        for key, name, doc, label in _BY_LABEL:
            family = CounterMetricFamily(name, doc, labels=["run", label])
            for value, n in sorted(s[key].items()):
                family.add_metric([self.run, value], n)
            yield family
        version = GaugeMetricFamily("turnrl_gateway_policy_version", "Newest weights version served.", labels=["run"])
        version.add_metric([self.run], s["version"])
        yield version
        up = GaugeMetricFamily("turnrl_gateway_engines_up", "Engines requests go to (not found dead in the "
                               "last few seconds).", labels=["run"])
        up.add_metric([self.run], sum(e["up"] for e in s["engines"]))
        yield up
        served = GaugeMetricFamily("turnrl_gateway_engine_version", "Weights version each engine's last answer "
                                   "carried.", labels=["run", "engine"])
        for e in s["engines"]:
            served.add_metric([self.run, str(e["engine"])], e["version"])
        yield served
        calls = CounterMetricFamily("turnrl_gateway_engine_calls", "Calls to each engine by result: answered, "
                                    "or found_dead (the engine died or was restarting).", labels=["run", "engine", "result"])
        for e in s["engines"]:
            for result in ("answered", "found_dead"):
                calls.add_metric([self.run, str(e["engine"]), result], e[result])
        yield calls


_BY_LABEL = (
    ("closed", "turnrl_gateway_sessions_closed", "Live sessions closed, by cause (ended, feedback_idle, "
     "timed_out, evicted, run_ended).", "cause"),
    ("episodes", "turnrl_gateway_episodes", "Live segments by what became of them.", "result"),
    ("feedback", "turnrl_gateway_feedback", "Feedback by result.", "result"),
    ("recorder", "turnrl_gateway_recorder_events",
     "Session recorder events: stitched requests and new segments by cause.", "event"),
)

FAMILIES = frozenset({
    "turnrl_gateway_requests_total", "turnrl_gateway_tokens_total", "turnrl_gateway_sessions_open",
    "turnrl_gateway_sessions_closed_total",
    "turnrl_gateway_episodes_total", "turnrl_gateway_feedback_total", "turnrl_gateway_recorder_events_total",
    "turnrl_gateway_policy_version", "turnrl_gateway_engines_up", "turnrl_gateway_engine_version",
    "turnrl_gateway_engine_calls_total",
    *(f"turnrl_gateway_request_latency_seconds{x}" for x in ("_bucket", "_sum", "_count")),
})
"""Every family name as it appears in a scrape (for dashboards and their tests)."""


class GatewayMetrics:
    """Every sample carries the run's id (``run``), like the run's other metrics."""

    def __init__(self, stats: Callable[[], dict[str, Any]], run: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        requests = Counter("turnrl_gateway_requests", "HTTP requests by route and status.",
                           ["run", "route", "status"], registry=self.registry)
        latency = Histogram("turnrl_gateway_request_latency_seconds",
                            "Chat completion latency, request to last byte.", ["run", "stream"],
                            buckets=LATENCY_BUCKETS, registry=self.registry)
        tokens = Counter("turnrl_gateway_tokens", "Tokens served, by kind (prompt, completion).",
                         ["run", "kind"], registry=self.registry)
        self.requests = _Bound(requests, run)
        self.latency = _Bound(latency, run)
        self.tokens = _Bound(tokens, run)
        self.registry.register(_Snapshot(stats, run))


class _Bound:
    """A metric with its ``run`` label filled in."""

    def __init__(self, metric: Any, run: str) -> None:
        self.metric, self.run = metric, run

    def labels(self, *values: str) -> Any:
        return self.metric.labels(self.run, *values)
