"""The streambatch.v1.Generation servicer: runs on the event loop only and never blocks it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from pyserver import __version__
from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, WorkItem
from pyserver.engine import EngineWorker
from pyserver.service import convert
from pyserver.telemetry.metrics import Metrics
from pyserver.telemetry.tracing import RequestTracer

log = logging.getLogger(__name__)

STATUS = {
    ErrorKind.INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorKind.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}
# Above this many characters the prompt is tokenized off the event loop.
_INLINE_TOKENIZE_CHARS = 4096


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(
        self,
        worker: EngineWorker,
        limits: convert.Limits,
        model_name: str,
        metrics: Metrics,
        tracer: RequestTracer,
    ) -> None:
        self._worker = worker
        self._metrics = metrics
        self._tracer = tracer
        self._limits = limits
        self._model_name = model_name
        self.serving = False  # False while starting and draining
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    # ---- RPCs ----------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with contextlib.aclosing(self._deltas("Generate", request, context)) as deltas:
            async for item, delta in deltas:
                yield convert.stream_message(item.request_id, delta)

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CompleteResponse:
        text: list[str] = []
        tokens: list[int] = []
        async with contextlib.aclosing(self._deltas("Complete", request, context)) as deltas:
            async for item, delta in deltas:
                text.append(delta.text)
                tokens.extend(delta.token_ids)
                if delta.final:
                    return convert.complete_message(item.request_id, "".join(text), tokens, delta)
        raise AssertionError("the delta stream ended without a final delta")

    async def _deltas(
        self, method: str, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncGenerator[tuple[WorkItem, Delta], None]:
        """Accept the call, then yield its deltas up to the final one; owns the call's span,
        its metrics and the cancel of an abandoned request. Callers hold it in
        contextlib.aclosing: a caller that returns (Complete) or is closed (Generate, when gRPC
        drops the stream) mid-iteration would otherwise leave this generator suspended, and
        its cleanup would run later from the loop's async-generator finalizer, after the client
        already had its answer."""
        metadata = {k: _text(v) for k, v in (context.invocation_metadata() or ())}
        span = self._tracer.start(method, metadata)
        outcome = _Outcome()
        item: WorkItem | None = None
        try:
            item = await self._accept(request, context, metadata)
            item.span = span
            self.in_flight += 1
            self.idle.clear()
            while True:
                delta = await item.mailbox.get()
                if delta.error is not None:
                    outcome.fail(delta.error)
                    await self._fail(context, delta.error)
                outcome.last = delta
                if delta.final:
                    # Set before yielding: a consumer that returns on the final delta (Complete)
                    # closes this generator at the yield, and the call did succeed.
                    outcome.code = "OK"
                yield item, delta
                if delta.final:
                    return
        except RequestError as err:  # refused before queueing
            outcome.fail(err)
            self._metrics.rejections.labels(err.kind.value).inc()
            await self._fail(context, err)
        finally:
            if item is not None:
                if outcome.code is None:  # the client went away or cancelled mid-call
                    outcome.code = "CANCELLED"
                    self._worker.cancel(item.handle)
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle.set()
            self._record(method, span, item, outcome)

    def _record(self, method: str, span: Any, item: WorkItem | None, outcome: _Outcome) -> None:
        code = outcome.code or "UNKNOWN"
        m = self._metrics
        m.requests.labels(method, code).inc()
        last = outcome.last
        exemplar = self._tracer.exemplar(span)
        if code == "OK" and item is not None and last is not None:
            m.request_seconds.observe(last.total_ms / 1e3, exemplar)
            m.ttft_seconds.observe(last.ttft_ms / 1e3, exemplar)
            m.queue_seconds.labels(str(item.priority)).observe(last.queue_ms / 1e3)
        elif code == "CANCELLED" and item is not None:
            stage = "queue" if not item.admitted_ns else "engine"
            m.cancellations.labels(stage).inc()
        if span is None:
            return
        attributes: dict[str, Any] = {
            "gen_ai.system": "vllm",
            "gen_ai.request.model": self._model_name,
        }
        if item is not None:
            s = item.sampling
            attributes.update(
                {
                    "streambatch.request_id": item.request_id,
                    "streambatch.priority": item.priority,
                    "streambatch.preemptions": item.preemptions,
                    "gen_ai.request.max_tokens": s.max_tokens,
                    "gen_ai.request.temperature": s.temperature,
                    "gen_ai.request.top_p": s.top_p,
                    "gen_ai.usage.input_tokens": len(item.prompt_token_ids),
                    "gen_ai.usage.output_tokens": item.completion_tokens,
                }
            )
            if last is not None and last.finish_reason:
                attributes["gen_ai.response.finish_reasons"] = (last.finish_reason,)
                attributes["gen_ai.usage.cached_input_tokens"] = last.cached_tokens
        phases: tuple[tuple[str, int, int], ...] = ()
        if item is not None:
            end = item.finished_ns or time.monotonic_ns()
            phases = (
                ("queue", item.accepted_ns, item.admitted_ns or end),
                (
                    "prefill",
                    item.admitted_ns,
                    item.first_token_ns or (end if item.admitted_ns else 0),
                ),
                ("decode", item.first_token_ns, end if item.first_token_ns else 0),
            )
        self._tracer.finish(
            span, code=code, message=outcome.message, attributes=attributes, phases=phases
        )

    async def GetServerInfo(
        self, request: pb.GetServerInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ServerInfo:
        cfg = self._worker.queue.config
        return pb.ServerInfo(
            model=self._model_name,
            max_model_len=self._limits.max_model_len,
            max_prompt_tokens=self._limits.max_prompt_tokens,
            max_tokens_limit=self._limits.max_tokens_limit,
            priority_levels=self._limits.priority_levels,
            queue_capacity=cfg.capacity,
            max_num_seqs=self._worker.max_num_seqs,
            version=__version__,
            engine=self._worker.engine_version,
        )

    async def GetLoad(
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.Load:
        return self.load()

    def load(self) -> pb.Load:
        stats = self._worker.queue.stats()
        return pb.Load(
            queued_by_priority=[sum(level) for level in stats.depth],
            running=self._worker.running,
            kv_cache_usage=self._worker.kv_cache_usage,
            concurrency_limit=self._worker.concurrency_limit,
            step_token_budget=self._worker.step_token_budget,
            serving=self.serving,
        )

    # ---- helpers -------------------------------------------------------------------------

    async def _accept(
        self,
        request: pb.GenerateRequest,
        context: grpc.aio.ServicerContext[Any, Any],
        metadata: dict[str, str],
    ) -> WorkItem:
        """Validate and queue; raises RequestError for a call refused before queueing."""
        accepted_ns = time.monotonic_ns()
        if not self.serving:
            raise RequestError(
                ErrorKind.UNAVAILABLE,
                "the server is starting or draining; retry on another replica",
            )
        request_id = convert.request_id_of(request, metadata.get("x-request-id"))
        await context.send_initial_metadata((("x-request-id", request_id),))
        priority = convert.priority_of(request, self._limits)
        ids = await self._tokenize(request)
        sampling = convert.sampling_of(request.sampling, len(ids), self._limits)
        remaining = context.time_remaining()
        deadline_ns = accepted_ns + int(remaining * 1e9) if remaining is not None else 0
        queue_deadline = deadline_ns
        defaults = self._limits.queue_timeout_ms_by_level
        queue_timeout_ms = request.queue_timeout_ms or (
            defaults[priority] if priority < len(defaults) else 0
        )
        if queue_timeout_ms:
            limit = accepted_ns + queue_timeout_ms * 1_000_000
            queue_deadline = min(queue_deadline, limit) if queue_deadline else limit
        item = WorkItem(
            handle=self._worker.new_handle(),
            request_id=request_id,
            prompt_token_ids=ids,
            sampling=sampling,
            priority=priority,
            deadline_ns=deadline_ns,
            accepted_ns=accepted_ns,
            mailbox=Mailbox(),
        )
        self._worker.submit(item, queue_deadline_ns=queue_deadline)
        return item

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        tok = self._worker.tokenizer
        size = len(request.text) if request.WhichOneof("prompt") == "text" else 0
        if size <= _INLINE_TOKENIZE_CHARS:
            return convert.prompt_token_ids(request, tok, self._limits)
        return await asyncio.get_running_loop().run_in_executor(
            None, convert.prompt_token_ids, request, tok, self._limits
        )

    async def _fail(self, context: grpc.aio.ServicerContext[Any, Any], err: RequestError) -> None:
        if err.kind is ErrorKind.OVERLOADED:
            load = self.load()
            context.set_trailing_metadata(
                (
                    ("retry-after-ms", str(err.retry_after_ms or 1000)),
                    (
                        "load",
                        json.dumps(
                            {
                                "queued": list(load.queued_by_priority),
                                "running": load.running,
                                "concurrency_limit": load.concurrency_limit,
                            }
                        ),
                    ),
                )
            )
        await context.abort(STATUS[err.kind], err.message)


class _Outcome:
    """How a call ended: a gRPC status name (None while it runs) and the last delta."""

    __slots__ = ("code", "last", "message")

    def __init__(self) -> None:
        self.code: str | None = None
        self.message = ""
        self.last: Delta | None = None

    def fail(self, err: RequestError) -> None:
        self.code = STATUS[err.kind].name
        self.message = err.message


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


__all__ = ["STATUS", "GenerationServicer"]
