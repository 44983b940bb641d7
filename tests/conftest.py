"""Shared fixtures: the real server with the real vLLM engine on the default model, once per
test session, in a background thread with its own event loop, reached over gRPC on loopback."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

# vLLM reads these at import time.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

ENGINE_SEQS = 8
# Longer than any queue wait the other tests make, so only the test of the overload order
# (which waits past it on purpose) sees a level served newest first.
LIFO_AFTER_S = 6.0
# Below what the test of the overload order waits (LIFO_AFTER_S + 0.5), so the admissions
# that filled the engine have left the window when a slot frees, and long enough for the
# admissions of those tests to stay in it on a slow machine (the default is 5 s).
LIFO_BACKLOG_S = 4.0
QUEUE_CAPACITY = 24


class OtlpReceiver:
    """A real OTLP/gRPC trace receiver built from opentelemetry-proto, on loopback."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        receiver = self
        self.requests: list[Any] = []
        self._lock = threading.Lock()

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                with receiver._lock:
                    receiver.requests.append(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    def spans(self) -> list[Any]:
        with self._lock:
            return [
                span
                for req in self.requests
                for rs in req.resource_spans
                for ss in rs.scope_spans
                for span in ss.spans
            ]

    def stop(self) -> None:
        self._server.stop(0)


@dataclass
class LiveServer:
    server: Any  # StreambatchServer
    loop: asyncio.AbstractEventLoop
    target: str
    memory_spans: Any  # InMemorySpanExporter
    otlp: OtlpReceiver

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.server.metrics_port}/metrics"

    @property
    def worker(self) -> Any:
        return self.server.worker

    def engine_idle(self) -> bool:
        return not self.worker._running and not self.worker._engine.has_unfinished_requests()


def _run_server(separate_process: bool) -> Iterator[LiveServer]:
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pyserver.engine import EngineOptions
    from pyserver.model import pull_default_model
    from pyserver.service.server import ServerSettings, StreambatchServer
    from pyserver.telemetry.tracing import make_tracer_provider

    settings = ServerSettings(
        engine=EngineOptions(
            model=str(pull_default_model()),
            max_num_seqs=ENGINE_SEQS,
            separate_process=separate_process,
        ),
        port=0,
        queue_capacity=QUEUE_CAPACITY,
        aging_interval_s=60.0,
        lifo_after_s=LIFO_AFTER_S,
        lifo_backlog_s=LIFO_BACKLOG_S,
        deadline_admission="on",  # the refusal tests need it acting (the default is shadow)
        metrics_port=0,
        trace_engine_steps=1.0,
    )
    otlp = OtlpReceiver()
    memory = InMemorySpanExporter()
    otlp_exporter = OTLPSpanExporter(endpoint=f"127.0.0.1:{otlp.port}", insecure=True)
    provider = make_tracer_provider("off", extra_exporters=(memory, otlp_exporter))
    server = StreambatchServer(settings, tracer_provider=provider)
    loop = asyncio.new_event_loop()
    started = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        asyncio.set_event_loop(loop)

        async def main() -> None:
            try:
                await server.start()
            except BaseException as exc:
                failure.append(exc)
                raise
            finally:
                started.set()
            await server.wait()

        loop.run_until_complete(main())

    thread = threading.Thread(target=run, name="test-server", daemon=True)
    thread.start()
    assert started.wait(600), "the server did not start within 10 minutes"
    if failure:
        raise failure[0]
    yield LiveServer(server, loop, f"127.0.0.1:{server.port}", memory, otlp)
    asyncio.run_coroutine_threadsafe(server.drain(accept_window=False), loop).result(60)
    thread.join(30)
    otlp.stop()


@pytest.fixture(scope="session")
def live_server() -> Iterator[LiveServer]:
    """The server with vLLM's engine core in this process (streambatch's CPU default)."""
    yield from _run_server(separate_process=False)


@pytest.fixture(scope="session", params=["inproc", "separate"])
def engine_server(request: pytest.FixtureRequest, live_server: LiveServer) -> Iterator[LiveServer]:
    """The engine-facing tests run with the engine core in this process and in its own: the
    same scheduling must hold either way."""
    if request.param == "inproc":
        yield live_server
    else:
        yield from _run_server(separate_process=True)
