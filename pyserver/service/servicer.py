"""The streambatch.v1.Generation servicer: runs on the event loop only and never blocks it."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import grpc
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from pyserver import __version__
from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, Sampling, WorkItem
from pyserver.engine import EngineWorker
from pyserver.service import convert
from pyserver.service.tokenizing import PromptTokenizer
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
# What GetServerInfo advertises ("lora" too when the server serves adapters).
FEATURES = (
    "structured_output",
    "logprobs",
    "prompt_logprobs",
    "n",
    "tokenize",
    "stop_token_ids",
    "min_p",
    "logit_bias",
    "truncate_prompt_tokens",
)


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
        self._tokenizer = PromptTokenizer(worker.tokenizer)
        self.serving = False  # what GetLoad reports, like health: False starting and draining
        # New calls taken: from the start until a drain's accept window closes (a balancer
        # keeps sending for a few health checks after the replica turns NOT_SERVING).
        self.accepting = False
        self.last_call_s = 0.0  # time.monotonic() of the latest call's arrival
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()

    # ---- RPCs ----------------------------------------------------------------------------

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.GenerateResponse]:
        async with contextlib.aclosing(self._deltas("Generate", request, context)) as deltas:
            async for item, index, delta in deltas:
                yield convert.stream_message(item.request_id, delta, index)

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CompleteResponse:
        parts: list[convert.CompletionParts] = []
        async with contextlib.aclosing(self._deltas("Complete", request, context)) as deltas:
            async for item, index, delta in deltas:
                while len(parts) <= index:
                    parts.append(convert.CompletionParts.empty())
                parts[index].add(delta)
                if all(p.last is not None for p in parts) and len(parts) == item.sampling.n:
                    return convert.complete_message(item.request_id, parts)
        raise AssertionError("the delta stream ended without a final delta")

    async def _deltas(
        self, method: str, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncGenerator[tuple[WorkItem, int, Delta], None]:
        """Accept the call, then yield (item, completion index, delta) until every completion
        has had its final delta; owns the call's span, its metrics and the cancel of what is
        left of an abandoned or failed call (all n completions). Callers hold it in
        contextlib.aclosing: a caller that returns (Complete) or is closed (Generate, when gRPC
        drops the stream) mid-iteration would otherwise leave this generator suspended, and
        its cleanup would run later from the loop's async-generator finalizer, after the client
        already had its answer."""
        metadata = {k: _text(v) for k, v in (context.invocation_metadata() or ())}
        span = self._tracer.start(method, metadata)
        outcome = _Outcome()
        items: list[WorkItem] = []
        open_handles: set[int] = set()
        try:
            items = await self._accept(request, context, metadata)
            open_handles.update(it.handle for it in items)
            for item in items:
                item.span = span
            self.in_flight += 1
            self.idle.clear()
            # Headers only once the call is queued and counted: a gRPC client's retry policy
            # may retry a call refused before it received headers (UNAVAILABLE while draining,
            # RESOURCE_EXHAUSTED when the queue is full), never one that got them. Sent here,
            # after the count, so a drain waits for it and a client gone meanwhile is cancelled
            # below like any other.
            await context.send_initial_metadata((("x-request-id", items[0].request_id),))
            async with contextlib.aclosing(_merged(items)) as merged:
                async for index, delta in merged:
                    if delta.final:
                        open_handles.discard(items[index].handle)
                    if delta.error is not None:
                        outcome.fail(delta.error)
                        await self._fail(context, delta.error)
                    if index == 0:  # the call's metrics and span follow completion 0
                        outcome.last = delta
                    if not open_handles:
                        # Set before yielding: a consumer that returns on the final delta
                        # (Complete) closes this generator at the yield, and the call did
                        # succeed.
                        outcome.code = "OK"
                    yield items[index], index, delta
                    if not open_handles:
                        return
        except RequestError as err:  # refused before queueing
            outcome.fail(err)
            self._metrics.rejections.labels(err.kind.value).inc()
            await self._fail(context, err)
        finally:
            if items:
                if outcome.code is None:  # the client went away or cancelled mid-call
                    outcome.code = "CANCELLED"
                for handle in open_handles:  # cancelled, or a sibling completion failed
                    self._worker.cancel(handle)
                self.in_flight -= 1
                if self.in_flight == 0:
                    self.idle.set()
            self._record(method, span, items, outcome)

    def _record(self, method: str, span: Any, items: list[WorkItem], outcome: _Outcome) -> None:
        code = outcome.code or "UNKNOWN"
        item = items[0] if items else None
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
                    "gen_ai.usage.output_tokens": sum(it.completion_tokens for it in items),
                }
            )
            if s.n > 1:
                attributes["gen_ai.request.choice.count"] = s.n
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
            features=FEATURES + (("lora",) if self._worker.adapters else ()),
            max_logprobs=self._limits.max_logprobs,
            max_n=self._limits.max_n,
            adapters=self._worker.adapters,
        )

    async def Tokenize(
        self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.TokenizeResponse:
        """The tokens Generate would give the model for this prompt (no engine involved)."""
        tok = self._tokenizer
        try:
            ids = await asyncio.get_running_loop().run_in_executor(
                None,
                functools.partial(
                    convert.prompt_token_ids, request, tok, self._limits, check_length=False
                ),
            )
        except RequestError as err:
            await context.abort(STATUS[err.kind], err.message)
        limit = self._limits.max_prompt_tokens
        return pb.TokenizeResponse(
            token_ids=ids,
            count=len(ids),
            max_prompt_tokens=limit,
            max_model_len=self._limits.max_model_len,
            fits=len(ids) <= limit,
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
            kv_cache_usage=self._worker.kv.usage,
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
    ) -> list[WorkItem]:
        """Validate and queue the call's completions (sampling.n of them, each a request of its
        own to the queue and the engine; the prefix cache shares their prompt). Raises
        RequestError for a call refused before queueing, with none of it left queued."""
        accepted_ns = time.monotonic_ns()
        self.last_call_s = accepted_ns / 1e9
        if not self.accepting:
            raise RequestError(
                ErrorKind.UNAVAILABLE,
                "the server is starting or draining; retry on another replica",
            )
        request_id = convert.request_id_of(request, metadata.get("x-request-id"))
        priority = convert.priority_of(request, self._limits)
        adapters = self._worker.adapters
        if request.adapter and request.adapter not in adapters:
            served = ", ".join(adapters) if adapters else "none"
            raise convert.invalid(
                "adapter",
                f"no LoRA adapter named {request.adapter[:64]!r} on this server (it serves "
                f"{served}; GetServerInfo lists them)",
            )
        ids = await self._tokenize(request)
        sampling = convert.sampling_of(request.sampling, len(ids), self._limits)
        await self._check_with_engine(sampling)
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
        items: list[WorkItem] = []
        for index in range(sampling.n):
            own = sampling
            if index:  # prompt logprobs once, on completion 0; seeds as vLLM seeds its own n
                seed = None if sampling.seed is None else sampling.seed + index
                own = dataclasses.replace(sampling, seed=seed, prompt_logprobs=None)
            item = WorkItem(
                handle=self._worker.new_handle(),
                request_id=request_id,
                prompt_token_ids=ids,
                sampling=own,
                priority=priority,
                deadline_ns=deadline_ns,
                accepted_ns=accepted_ns,
                mailbox=Mailbox(),
                adapter=request.adapter,
            )
            try:
                self._worker.submit(item, queue_deadline_ns=queue_deadline)
            except RequestError:
                for queued in items:  # all n or none
                    self._worker.cancel(queued.handle)
                raise
            items.append(item)
        return items

    async def _check_with_engine(self, sampling: Sampling) -> None:
        """The engine's own check of the settings, so that what it would refuse (a constraint
        that does not compile, above all) is INVALID_ARGUMENT now, not after a queue wait.
        Compiling a constraint takes milliseconds to seconds: off the event loop."""
        if sampling.structured is None:
            problem = self._worker.check_sampling(sampling)
        else:
            problem = await asyncio.get_running_loop().run_in_executor(
                None, self._worker.check_sampling, sampling
            )
        if problem is not None:
            raise convert.engine_check_error(problem, sampling)

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        tok = self._tokenizer
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
                    # The same hint in gRPC's own name: a client's retryPolicy waits that long.
                    ("grpc-retry-pushback-ms", str(err.retry_after_ms or 1000)),
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


async def _merged(items: list[WorkItem]) -> AsyncGenerator[tuple[int, Delta], None]:
    """The deltas of a call's completions as they come, each with its completion's index,
    until each has had its final delta."""
    if len(items) == 1:
        while True:
            delta = await items[0].mailbox.get()
            yield 0, delta
            if delta.final:
                return
    waiting = {asyncio.ensure_future(it.mailbox.get()): i for i, it in enumerate(items)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.__getitem__):
                index = waiting.pop(future)
                delta = future.result()
                if not delta.final:
                    waiting[asyncio.ensure_future(items[index].mailbox.get())] = index
                yield index, delta
    finally:
        for future in waiting:
            future.cancel()


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


__all__ = ["STATUS", "GenerationServicer"]
