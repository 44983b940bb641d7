"""OpenTelemetry tracing: provider construction and the per-request span tree.

Span tree of one call (all times from the worker's own timestamps, so no per-token work):

    streambatch.v1.Generation/Generate   (SERVER span, parent = the client's traceparent)
    ├── queue     accepted  -> admitted to the engine
    ├── prefill   admitted  -> first token
    └── decode    first token -> finished

The RPC span is opened in the servicer rather than by a generic gRPC interceptor: it needs the
request's GenAI attributes, its outcome and the worker's timestamps, which only the servicer
sees. The provider is injected (never set globally), so tests and embedders choose exporters.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.propagate import extract
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SpanExporter,
)
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

TRACING_MODES = ("off", "console", "otlp")
_TRACER_NAME = "streambatch"


def make_tracer_provider(
    mode: str, extra_exporters: Iterable[SpanExporter] = ()
) -> TracerProvider | None:
    """A provider configured from the standard OTEL_* variables (service name, endpoint,
    protocol, sampler); None when tracing is off and no exporter is given."""
    if mode not in TRACING_MODES:
        raise ValueError(f"--tracing must be one of {', '.join(TRACING_MODES)}, got {mode!r}")
    exporters = list(extra_exporters)
    if mode == "console":
        exporters.append(ConsoleSpanExporter())
    elif mode == "otlp":
        exporters.append(_otlp_exporter())
    if not exporters:
        return None
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "streambatch")})
    provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER(_ARG)
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    return provider


def _otlp_exporter() -> SpanExporter:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()  # endpoint: OTEL_EXPORTER_OTLP(_TRACES)_ENDPOINT
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be grpc or http/protobuf, got {protocol!r}")


class RequestTracer:
    """Opens and closes the span tree of each call; a no-op when tracing is off."""

    def __init__(self, provider: TracerProvider | None, *, record_content: bool = False) -> None:
        self._tracer = provider.get_tracer(_TRACER_NAME) if provider is not None else None
        self.record_content = record_content
        # Worker timestamps are time.monotonic_ns(); spans want wall-clock ns.
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def start(self, method: str, metadata: Mapping[str, str]) -> Span | None:
        if self._tracer is None:
            return None
        return self._tracer.start_span(
            f"streambatch.v1.Generation/{method}",
            context=extract(metadata),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "streambatch.v1.Generation",
                "rpc.method": method,
            },
        )

    @staticmethod
    def exemplar(span: Span | None) -> dict[str, str] | None:
        """The trace id as an OpenMetrics exemplar: a slow histogram bucket leads to its trace."""
        if span is None:
            return None
        ctx = span.get_span_context()
        return (
            {"trace_id": format(ctx.trace_id, "032x")}
            if ctx.is_valid and ctx.trace_flags.sampled
            else None
        )

    def finish(
        self,
        span: Span | None,
        *,
        code: str,
        message: str = "",
        attributes: Mapping[str, Any] | None = None,
        phases: Iterable[tuple[str, int, int]] = (),
    ) -> None:
        """End the RPC span with its outcome; phases are (name, start_ns, end_ns) monotonic."""
        if span is None or self._tracer is None:
            return
        if attributes:
            span.set_attributes(dict(attributes))
        span.set_attribute("rpc.grpc.status_code_name", code)
        parent = trace.set_span_in_context(span)
        for name, start, end in phases:
            if start and end and end >= start:
                child = self._tracer.start_span(
                    name, context=parent, start_time=start + self._offset_ns
                )
                child.end(end_time=end + self._offset_ns)
        if code == "OK":
            span.set_status(Status(StatusCode.OK))
        else:
            span.set_status(Status(StatusCode.ERROR, f"{code}: {message}"))
            if code in ("CANCELLED", "DEADLINE_EXCEEDED"):
                span.add_event(code.lower())
        span.end()


class StepTracer:
    """One span per sampled engine step (batch size, tokens), linked to the RPC spans of the
    requests it served. Off unless a sample ratio above 0 is given; called on the worker thread."""

    def __init__(self, provider: TracerProvider | None, sample_ratio: float) -> None:
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"engine step sample ratio must be in [0, 1], got {sample_ratio}")
        self._tracer = provider.get_tracer(_TRACER_NAME) if provider and sample_ratio > 0 else None
        self._every = max(1, round(1 / sample_ratio)) if sample_ratio > 0 else 0
        self._count = 0
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @property
    def enabled(self) -> bool:
        return self._tracer is not None

    def on_step(
        self, start_ns: int, end_ns: int, batch: int, tokens: int, served: Iterable[Span | None]
    ) -> None:
        if self._tracer is None:
            return
        self._count += 1
        if self._count % self._every:
            return
        links = [trace.Link(s.get_span_context()) for s in served if s is not None]
        span = self._tracer.start_span(
            "engine.step",
            start_time=start_ns + self._offset_ns,
            links=links,
            attributes={"streambatch.batch_size": batch, "streambatch.step_tokens": tokens},
        )
        span.end(end_time=end_ns + self._offset_ns)
