"""Prometheus metrics, all under the `streambatch_` prefix (docs/observability.md lists them).

Per-step and per-request values are observed where they happen (the worker thread, the
servicer); queue depth, running, KV usage and the concurrency limit are read at scrape time by a
collector, so nothing is updated on the hot path just to be scraped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

PREFIX = "streambatch"
_LATENCY_BUCKETS = (
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.0,
    5.0,
    10.0,
    30.0,
)  # the seed's 50 ms .. 5 s, extended
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
_RATIO_BUCKETS = (0.1, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0)


@dataclass(slots=True)
class LoadSnapshot:
    queued_by_priority: list[int]
    running: int
    kv_cache_usage: float
    concurrency_limit: int
    step_token_budget: int
    oldest_wait_s: float
    suspended: int = 0


class BusyWindow:
    """The engine's busy fraction: time inside engine steps over the last `window_s` of wall
    time (the seed article's "GPU utilisation", on any device: the share of time the engine
    computes rather than waits for work). The worker thread adds steps; a scrape reads a copy
    (tuple() of a deque is one C call under the GIL, safe against the worker's appends)."""

    def __init__(
        self, window_s: float = 10.0, clock: Callable[[], int] = time.monotonic_ns
    ) -> None:
        self._window_ns = int(window_s * 1e9)
        self._clock = clock
        self._since_ns = clock()
        self._steps: deque[tuple[int, int]] = deque()

    def add(self, start_ns: int, end_ns: int) -> None:
        self._steps.append((start_ns, end_ns))
        while self._steps and self._steps[0][1] < end_ns - self._window_ns:
            self._steps.popleft()

    def fraction(self) -> float:
        now = self._clock()
        low = now - self._window_ns
        span = min(self._window_ns, now - self._since_ns)
        if span <= 0:
            return 0.0
        busy = sum(end - max(start, low) for start, end in tuple(self._steps) if end > low)
        return min(1.0, busy / span)


class _BusyCollector(Collector):
    def __init__(self, busy: BusyWindow) -> None:
        self._busy = busy

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            f"{PREFIX}_engine_busy_ratio",
            "Time in engine steps / wall time over the last 10 s (0..1)",
            value=self._busy.fraction(),
        )


class _LoadCollector(Collector):
    def __init__(self, read: Callable[[], LoadSnapshot | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        snap = self._read()
        if snap is None:
            return
        queued = GaugeMetricFamily(
            f"{PREFIX}_queue_length", "Requests waiting in the batch queue", labels=["priority"]
        )
        for level, n in enumerate(snap.queued_by_priority):
            queued.add_metric([str(level)], n)
        yield queued
        yield GaugeMetricFamily(
            f"{PREFIX}_waiting_requests",
            "Requests waiting, all levels",
            value=sum(snap.queued_by_priority),
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_running_requests", "Requests in the engine", value=snap.running
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_suspended_requests",
            "Requests a priority preemption suspended in the engine (KV kept, not stepped)",
            value=snap.suspended,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_kv_cache_usage_ratio",
            "KV cache reserved by running requests (prompt + max_tokens), 0..1",
            value=snap.kv_cache_usage,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_concurrency_limit",
            "Admitted-concurrency limit the worker fills",
            value=snap.concurrency_limit,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_step_token_budget",
            "Engine per-step token budget (prefill chunks + decodes) the controller sets",
            value=snap.step_token_budget,
        )
        yield GaugeMetricFamily(
            f"{PREFIX}_queue_oldest_wait_seconds",
            "Wait of the oldest queued request",
            value=snap.oldest_wait_s,
        )


class Metrics:
    """The registry and every metric; injected into the worker and the servicer."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.batch_size = Histogram(
            f"{PREFIX}_batch_size",
            "Sequences in one engine step",
            buckets=_BATCH_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            f"{PREFIX}_engine_step_seconds",
            "Duration of one engine step",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            f"{PREFIX}_request_latency_seconds",
            "Accepted to finished, successful requests",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "Accepted to first token",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.itl_seconds = Histogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Time between a request's consecutive engine outputs, per token",
            buckets=_ITL_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            f"{PREFIX}_queue_time_seconds",
            "Accepted to admitted into the engine",
            ["priority"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.generated_tokens = Counter(
            f"{PREFIX}_generated_tokens",
            "Completion tokens produced (rate() = tokens per second)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens admitted", registry=r
        )
        self.prompt_tokens_cached = Counter(
            f"{PREFIX}_prompt_tokens_cached",
            "Of the prompt tokens admitted, those vLLM's prefix cache served instead of "
            "computing them (a request resumed after a preemption: its earlier output too)",
            registry=r,
        )
        self.resident_prefix_admissions = Counter(
            f"{PREFIX}_resident_prefix_admissions",
            "Calls admitted from those the queue was told to prefer (--prefix-affinity): vLLM's "
            "prefix cache most likely held most of their prompt while colder calls waited",
            registry=r,
        )
        self.requests = Counter(
            f"{PREFIX}_requests", "Finished calls by gRPC status", ["method", "code"], registry=r
        )
        self.rejections = Counter(
            f"{PREFIX}_rejections", "Calls refused before queueing", ["reason"], registry=r
        )
        self.expiries = Counter(f"{PREFIX}_expiries", "Deadlines passed", ["stage"], registry=r)
        self.cancellations = Counter(
            f"{PREFIX}_cancellations", "Calls the client cancelled", ["stage"], registry=r
        )
        self.preemptions = Counter(
            f"{PREFIX}_preemptions",
            "Running requests stopped to make room: kind=suspended (ours, kept in the engine "
            "with their KV and resumed), priority (ours, requeued and recomputed) or engine "
            "(vLLM recomputation when its KV cache ran out)",
            ["kind"],
            registry=r,
        )
        self.decode_skips = Counter(
            f"{PREFIX}_decode_skips",
            "Streams mid-decode that got no token in an engine step (the step's token budget "
            "ran out before them): each is a doubled inter-token gap",
            registry=r,
        )
        self.deadline_refusals = Counter(
            f"{PREFIX}_deadline_refusals",
            "Requests refused because they were predicted to miss their deadline",
            ["stage"],
            registry=r,
        )
        self.refusal_predictions = Counter(
            f"{PREFIX}_refusal_predictions",
            "Calls deadline admission would have refused but served (shadow mode), by how "
            "they ended: finished (in time) or missed; finished / all is the refusal rule's "
            "error rate",
            ["outcome"],
            registry=r,
        )
        self.finish_time_ratio = Histogram(
            f"{PREFIX}_finish_time_ratio",
            "Finished calls: actual accepted-to-finished time / the time predicted at submit "
            "(1 = calibrated; deadline admission refuses on this prediction)",
            buckets=_RATIO_BUCKETS,
            registry=r,
        )
        self.engine_failures = Counter(
            f"{PREFIX}_engine_failures", "Engine step loop failures", registry=r
        )
        self.busy_seconds = Counter(
            f"{PREFIX}_engine_busy_seconds",
            "Time spent inside engine steps (rate() = busy fraction over any window)",
            registry=r,
        )
        self.busy = BusyWindow()
        r.register(_BusyCollector(self.busy))

    def observe_step(self, start_ns: int, end_ns: int) -> None:
        """One engine step: its duration histogram and the busy fraction."""
        seconds = (end_ns - start_ns) / 1e9
        self.step_seconds.observe(seconds)
        self.busy_seconds.inc(seconds)
        self.busy.add(start_ns, end_ns)

    def watch_load(self, read: Callable[[], LoadSnapshot | None]) -> None:
        self.registry.register(_LoadCollector(read))

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics (OpenMetrics with exemplars when the scraper asks for it)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(server.server_port)
