"""Telemetry pieces without the engine: the span tree builder and the metric names."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pyserver.telemetry.metrics import LoadSnapshot, Metrics
from pyserver.telemetry.tracing import RequestTracer, StepTracer, make_tracer_provider

ROOT = Path(__file__).resolve().parents[2]


def test_request_tracer_builds_phases_under_the_rpc_span() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider)
    trace_id = "4bf92f3577b34da6a3ce929d0e0e4736"
    span = tracer.start("Generate", {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01"})
    t0 = time.monotonic_ns()
    tracer.finish(
        span,
        code="OK",
        attributes={"gen_ai.usage.output_tokens": 3},
        phases=[
            ("queue", t0, t0 + 10),
            ("prefill", t0 + 10, t0 + 20),
            ("decode", t0 + 20, t0 + 30),
        ],
    )
    spans = {s.name: s for s in exporter.get_finished_spans()}
    rpc = spans["streambatch.v1.Generation/Generate"]
    assert format(rpc.context.trace_id, "032x") == trace_id
    assert [spans[n].parent.span_id for n in ("queue", "prefill", "decode")] == [
        rpc.context.span_id
    ] * 3
    assert spans["prefill"].end_time - spans["prefill"].start_time == 10
    assert RequestTracer.exemplar(span) == {"trace_id": trace_id}


def test_error_outcome_and_disabled_tracer() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = RequestTracer(provider)
    tracer.finish(tracer.start("Complete", {}), code="DEADLINE_EXCEEDED", message="late")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert [e.name for e in span.events] == ["deadline_exceeded"]
    off = RequestTracer(None)
    assert off.start("Generate", {}) is None and not off.enabled
    off.finish(None, code="OK")  # a no-op


def test_tracing_mode_is_validated() -> None:
    assert make_tracer_provider("off") is None
    with pytest.raises(ValueError, match="--tracing"):
        make_tracer_provider("jaeger")


def test_dashboard_queries_only_existing_metrics() -> None:
    metrics = Metrics()
    metrics.watch_load(lambda: LoadSnapshot([1, 0], 2, 0.5, 8, 2048, 0.1))
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",), "gauge": ("",)}
    exposed = {
        family.name + suffix
        for family in metrics.registry.collect()
        for suffix in suffixes[family.type]
    }
    dashboard = json.loads((ROOT / "deploy/grafana/streambatch-dashboard.json").read_text())
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"streambatch_[a-z_]+", target["expr"])
    }
    assert used
    assert used <= exposed, used - exposed


def test_documented_metrics_exist() -> None:
    metrics = Metrics()
    metrics.watch_load(lambda: LoadSnapshot([0, 0], 0, 0.0, 8, 2048, 0.0))
    families = {family.name for family in metrics.registry.collect()}
    documented = set(
        re.findall(r"`(streambatch_[a-z_]+)`", (ROOT / "docs/observability.md").read_text())
    )
    normalized = {d.removesuffix("_total") for d in documented}
    assert normalized <= families, normalized - families


def test_step_tracer_samples_and_links() -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    rpc = RequestTracer(provider).start("Generate", {})
    steps = StepTracer(provider, 0.5)
    t0 = time.monotonic_ns()
    for i in range(10):
        steps.on_step(t0 + i, t0 + i + 1, batch=3, tokens=3, served=[rpc, None])
    spans = [s for s in exporter.get_finished_spans() if s.name == "engine.step"]
    assert len(spans) == 5
    assert all(s.links[0].context.span_id == rpc.get_span_context().span_id for s in spans)
    assert not StepTracer(provider, 0.0).enabled
    with pytest.raises(ValueError, match="ratio"):
        StepTracer(provider, 2.0)


def test_busy_fraction_is_step_time_over_the_recent_window() -> None:
    from pyserver.telemetry.metrics import BusyWindow

    now = [0]
    busy = BusyWindow(window_s=10.0, clock=lambda: now[0])
    s = 1_000_000_000
    now[0] = 4 * s
    busy.add(0, 1 * s)  # 1 s busy of the 4 s since start
    busy.add(3 * s, 4 * s)
    assert busy.fraction() == pytest.approx(0.5)
    now[0] = 20 * s  # both steps are older than the window: idle
    assert busy.fraction() == 0.0
    busy.add(12 * s, 20 * s)  # a step that began before the window counts from the window's start
    now[0] = 24 * s
    assert busy.fraction() == pytest.approx(0.6)  # 6 of the last 10 s (14..20 s) were busy
