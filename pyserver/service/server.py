"""Server assembly and lifecycle: gRPC aio server, health, reflection, engine start, drain.

Lifecycle: the gRPC port opens first with health NOT_SERVING (calls get UNAVAILABLE) while the
engine loads; then health turns SERVING. On SIGTERM: health NOT_SERVING at once, new calls still
served while they keep coming (the accept window, while balancers notice), then UNAVAILABLE; the
queue closes (queued and running requests still finish), and the process exits 0 once in-flight
calls are done or the grace period ends. SIGINT: the same without the window. If the engine
fails, in-flight calls end UNAVAILABLE and the process exits 1 for its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from pyserver.batching import make_config
from pyserver.engine import Engine, EngineOptions, EngineWorker, build_engine
from pyserver.scheduling import AdaptiveBatchController
from pyserver.service.convert import Limits
from pyserver.service.security import (
    BearerAuthInterceptor,
    MalformedFrameInterceptor,
    server_credentials,
)
from pyserver.service.servicer import GenerationServicer
from pyserver.telemetry.metrics import LoadSnapshot, Metrics
from pyserver.telemetry.tracing import RequestTracer, StepTracer, make_tracer_provider

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass(slots=True)
class ServerSettings:
    engine: EngineOptions
    host: str = "127.0.0.1"
    port: int = 50051
    priority_levels: int = 2
    queue_capacity: int = 1024
    bucket_bounds: tuple[int, ...] = ()
    batch_window_s: float = 0.0
    max_wait_s: float = 0.0
    aging_interval_s: float = 2.0
    lifo_after_s: float = 1.0  # a level whose oldest waited this long is served newest first
    prefix_affinity: int = 8  # resident-prefix requests may pass the next in line this often
    oldest_first_after_s: float = 60.0  # newer requests pass a waiting one this long at most,
    oldest_first_turns: float = 2.0  # or until twice the calls ahead of it left, if longer
    lifo_backlog_s: float = 5.0  # newest first only for a backlog over this long's admissions
    level_capacity: tuple[int, ...] = ()  # per priority level; 0 or empty = only the total
    preempt_after_s: float | None = 0.0  # None: no priority preemption
    preemption: str = "suspend"  # suspend (engine core in this process) | requeue
    reserved_top_slots: int = 0  # engine sequence slots only the top priority level may use
    step_tokens: int = 0  # per-step token budget of normal steps (0: max_num_batched_tokens)
    level_queue_timeout_ms: tuple[int, ...] = ()  # default queue timeout per level (0: none)
    deadline_admission: str = "shadow"  # on | shadow (predict, record, serve anyway) | off
    refusal_confidence: float = 0.95  # refuse only when this sure the call misses its deadline
    max_prompt_tokens: int = 0  # 0: max_model_len - 1
    max_tokens_limit: int = 0  # 0: max_model_len - 1
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 1024
    drain_grace_s: float = 30.0
    # After SIGTERM, new calls are still served while they keep coming (none for drain_quiet_s
    # ends it), at most drain_accept_s: a balancer sends calls until its health checks see
    # NOT_SERVING, and refusing them meanwhile fails calls a healthy replica would have taken.
    drain_accept_s: float = 10.0
    drain_quiet_s: float = 2.0
    reflection: bool = True
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""  # set: mutual TLS, a client certificate signed by this CA required
    auth_tokens: tuple[bytes, ...] = ()  # non-empty: bearer-token auth on all but health
    tracing: str = "off"  # off | console | otlp (OTEL_* variables configure the exporter)
    record_content: bool = False  # prompts/completions in spans: never unless asked
    latency_slo_ms: float = 0.0  # > 0 turns the adaptive batch controller on
    controller_metric: str = "itl"  # ttft | itl | e2e
    controller_knob: str = "concurrency"  # concurrency | step_tokens
    controller_shrink_above: float = 1.5  # x SLO: the seed's rule
    controller_grow_below: float = 0.5
    trace_engine_steps: float = 0.0  # fraction of engine steps traced; 0 = off
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = 9400  # None: no metrics endpoint; 0: any free port
    extra_options: dict[str, Any] = field(default_factory=dict)


class StreambatchServer:
    def __init__(
        self,
        settings: ServerSettings,
        *,
        tracer_provider: Any | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.settings = settings
        self.tracer_provider = tracer_provider or make_tracer_provider(settings.tracing)
        self.metrics = metrics or Metrics()
        self.metrics_port = 0
        self.health = HealthServicer()
        self.worker: EngineWorker | None = None
        self.servicer: GenerationServicer | None = None
        self.port = 0
        self._server: grpc.aio.Server | None = None
        self._stopped = asyncio.Event()
        self.exit_code = 0
        self._draining = False
        self._drain_task: asyncio.Future[None] | None = None
        self._window_closed = asyncio.Event()  # set: a drain's accept window must end now

    async def start(self, *, engine: Engine | None = None) -> None:
        """Open the port, then load the engine (off the loop) and turn SERVING."""
        s = self.settings
        interceptors: list[grpc.aio.ServerInterceptor] = []
        if s.auth_tokens:
            interceptors.append(BearerAuthInterceptor(s.auth_tokens))
        interceptors.append(MalformedFrameInterceptor())
        credentials = server_credentials(s.tls_cert, s.tls_key, s.tls_client_ca)
        self._server = grpc.aio.server(
            interceptors=interceptors,
            options=[
                ("grpc.max_receive_message_length", s.max_message_bytes),
                ("grpc.max_send_message_length", s.max_message_bytes),
                ("grpc.max_concurrent_streams", s.max_concurrent_streams),
                # A peer that vanished without closing its socket (power loss, partition) is
                # found by keepalive pings, and its streams are cancelled like any other.
                ("grpc.keepalive_time_ms", 30_000),
                ("grpc.keepalive_timeout_ms", 10_000),
            ],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        if s.reflection:
            reflection.enable_server_reflection(
                (
                    SERVICE_NAME,
                    health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                    reflection.SERVICE_NAME,
                ),
                self._server,
            )
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _NOT_SERVING)
        address = f"{s.host}:{s.port}"
        if credentials is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, credentials)
        if self.port == 0:
            raise RuntimeError(f"cannot listen on {s.host}:{s.port}")
        # The servicer is registered before the engine exists so calls during start get a clear
        # UNAVAILABLE instead of UNIMPLEMENTED.
        self._starting = _StartingServicer()
        pb_grpc.add_GenerationServicer_to_server(self._starting, self._server)
        await self._server.start()
        self.metrics.watch_load(self._load_snapshot)
        if s.metrics_port is not None:
            self.metrics_port = self.metrics.serve_http(s.metrics_host, s.metrics_port)
            log.info("metrics on http://%s:%d/metrics", s.metrics_host, self.metrics_port)
        log.info("listening on %s:%d; loading the engine", s.host, self.port)

        loop = asyncio.get_running_loop()
        if engine is None:
            options = dataclasses.replace(
                s.engine, step_tokens=s.step_tokens, top_priority=s.priority_levels - 1
            )
            try:
                engine = await loop.run_in_executor(None, build_engine, options)
            except BaseException:
                await self._server.stop(0)  # no gRPC server left running on a closed loop
                raise
        step_tracer = StepTracer(self.tracer_provider, s.trace_engine_steps)
        controller = None
        if s.latency_slo_ms > 0:
            tokens = s.controller_knob == "step_tokens"
            max_limit = engine.max_step_tokens if tokens else s.engine.max_num_seqs
            controller = AdaptiveBatchController(
                s.latency_slo_ms,
                max_limit,
                metric=s.controller_metric,
                # Every running sequence needs its decode token in a step.
                min_limit=min(max_limit, s.engine.max_num_seqs + 16) if tokens else 1,
                multiplicative=tokens,
                initial=(s.step_tokens or None) if tokens else None,
                shrink_above=s.controller_shrink_above,
                grow_below=s.controller_grow_below,
            )
        self.worker = EngineWorker(
            engine,
            self._queue_config(),
            loop,
            metrics=self.metrics,
            step_tracer=step_tracer if step_tracer.enabled else None,
            controller=controller,
            controller_knob=s.controller_knob,
            preempt_after_s=s.preempt_after_s,
            suspend_preempted=s.preemption == "suspend",
            reserved_top_slots=s.reserved_top_slots,
            deadline_admission=s.deadline_admission,
            refusal_confidence=s.refusal_confidence,
        )
        self.worker.on_failure = self._on_engine_failure
        limits = self._limits(self.worker)
        tracer = RequestTracer(self.tracer_provider, record_content=s.record_content)
        self.servicer = GenerationServicer(
            self.worker, limits, s.engine.model, self.metrics, tracer
        )
        self._starting.target = self.servicer
        # Everything allocated so far (the model, vLLM's and torch's objects) lives as long as
        # the server: keep it out of the cyclic GC's full collections, whose pause grows with
        # the heap and stops the engine thread with the rest (the GIL).
        gc.collect()
        gc.freeze()
        if self._draining:  # a signal came while the engine loaded: never serve, stop it
            log.info("stopping: a signal came while the engine loaded")
            self.worker.close()
            self.worker.shutdown_engine()
            return
        self.worker.start()
        self.servicer.serving = self.servicer.accepting = True
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)
        log.info("serving %s on %s:%d", s.engine.model, s.host, self.port)

    def _queue_config(self) -> Any:
        s = self.settings
        return make_config(
            priority_levels=s.priority_levels,
            capacity=s.queue_capacity,
            level_capacity=s.level_capacity,
            bucket_bounds=s.bucket_bounds,
            max_batch_requests=s.engine.max_num_seqs,
            max_batch_tokens=1 << 40,
            batch_window_s=s.batch_window_s,
            max_wait_s=s.max_wait_s,
            aging_interval_s=s.aging_interval_s,
            lifo_after_s=s.lifo_after_s,
            affinity_max_overtakes=s.prefix_affinity,
            oldest_first_after_s=s.oldest_first_after_s,
            oldest_first_turns=s.oldest_first_turns,
            lifo_backlog_s=s.lifo_backlog_s,
        )

    def _limits(self, worker: EngineWorker) -> Limits:
        s = self.settings
        longest = worker.max_model_len - 1
        return Limits(
            max_model_len=worker.max_model_len,
            vocab_size=worker.vocab_size,
            priority_levels=s.priority_levels,
            max_prompt_tokens=min(s.max_prompt_tokens or longest, longest),
            max_tokens_limit=min(s.max_tokens_limit or longest, longest),
            max_prompt_chars=max(worker.max_model_len * 32, 4096),
            queue_timeout_ms_by_level=s.level_queue_timeout_ms,
            max_logprobs=worker.max_logprobs,
            # Each completion is a request of its own in the engine: n may not exceed its slots.
            max_n=min(8, worker.max_num_seqs),
            max_seeded_sampling_tokens=worker.max_seeded_sampling_tokens,
        )

    def _load_snapshot(self) -> LoadSnapshot | None:
        w = self.worker
        if w is None:
            return None
        stats = w.queue.stats()
        return LoadSnapshot(
            queued_by_priority=[sum(level) for level in stats.depth],
            running=w.running,
            kv_cache_usage=w.kv.usage,
            suspended=w.suspended,
            concurrency_limit=w.concurrency_limit,
            step_token_budget=w.step_token_budget,
            oldest_wait_s=stats.oldest_wait_ns / 1e9,
        )

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        # SIGTERM is what an orchestrator or balancer-managed restart sends: the drain keeps an
        # accept window. SIGINT is an operator's Ctrl-C: no window. A second signal of either
        # kind (or an engine failure) ends a window still open.
        loop.add_signal_handler(signal.SIGTERM, self._start_drain)
        loop.add_signal_handler(signal.SIGINT, self._start_drain, False)

    def _start_drain(self, accept_window: bool = True) -> None:
        if self._draining:  # a second signal or an engine failure: no more new calls
            if self.servicer is not None and self.servicer.accepting:  # the window is open
                log.info("draining: the accept window ends early")
            self._window_closed.set()
            return
        self._drain_task = asyncio.ensure_future(self.drain(accept_window=accept_window))

    async def drain(self, *, accept_window: bool = True) -> None:
        """Graceful stop: health NOT_SERVING at once; new calls still served while they keep
        arriving (the accept window, while balancers notice), then refused; in-flight calls
        finish within the grace period."""
        if self._draining:
            return
        self._draining = True
        await self.health.enter_graceful_shutdown()
        grace = self.settings.drain_grace_s
        if self.servicer is not None and self.worker is not None:
            self.servicer.serving = False
            if accept_window and self.settings.drain_accept_s > 0:
                log.info("draining: health NOT_SERVING; serving new calls until none arrives "
                         "for %.1f s (at most %.1f s)",
                         self.settings.drain_quiet_s, self.settings.drain_accept_s)  # fmt: skip
                await self._accept_until_quiet(self.servicer)
            log.info("draining: refusing new calls, %d in flight", self.servicer.in_flight)
            self.servicer.accepting = False
            self.worker.close()
            try:
                await asyncio.wait_for(self.servicer.idle.wait(), grace)
            except asyncio.TimeoutError:
                log.warning("grace period over with %d calls in flight", self.servicer.in_flight)
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self.worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.worker.join, 5.0)
            self.worker.shutdown_engine()
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()  # flushes the batch span processors
        self._stopped.set()

    def _on_engine_failure(self, exc: BaseException) -> None:
        log.error("engine failed (%s); exiting for the supervisor to restart", exc)
        self.exit_code = 1
        self._start_drain(False)  # a new call could only fail: no window, or end the open one

    async def _accept_until_quiet(self, servicer: GenerationServicer) -> None:
        """Return once no call has arrived for drain_quiet_s since the drain began,
        drain_accept_s after it began, or when the window is closed (a second signal, an
        engine failure), whichever is first."""
        began = time.monotonic()
        limit = began + self.settings.drain_accept_s
        while not self._window_closed.is_set():
            now = time.monotonic()
            quiet_until = max(began, servicer.last_call_s) + self.settings.drain_quiet_s
            if now >= min(quiet_until, limit):
                return
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._window_closed.wait(), min(quiet_until, limit) - now)

    async def wait(self) -> int:
        await self._stopped.wait()
        return self.exit_code


class _StartingServicer(pb_grpc.GenerationServicer):
    """Forwards to the real servicer once the engine is up; UNAVAILABLE before that."""

    def __init__(self) -> None:
        self.target: GenerationServicer | None = None

    async def _starting(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is starting; retry shortly")

    async def Generate(self, request: Any, context: Any) -> Any:
        if self.target is None:
            await self._starting(context)
        assert self.target is not None
        async for msg in self.target.Generate(request, context):
            yield msg

    async def Complete(self, request: Any, context: Any) -> Any:
        if self.target is None:
            await self._starting(context)
        assert self.target is not None
        return await self.target.Complete(request, context)

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        if self.target is None:
            await self._starting(context)
        assert self.target is not None
        return await self.target.GetServerInfo(request, context)

    async def GetLoad(self, request: Any, context: Any) -> Any:
        if self.target is None:
            return pb.Load(serving=False)
        return await self.target.GetLoad(request, context)

    async def Tokenize(self, request: Any, context: Any) -> Any:
        if self.target is None:
            await self._starting(context)
        assert self.target is not None
        return await self.target.Tokenize(request, context)
