"""The streambatch.v1.Generation servicer: runs on the event loop only and never blocks it."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from streambatch.v1 import generation_pb2 as pb
from streambatch.v1 import generation_pb2_grpc as pb_grpc

from pyserver import __version__
from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, WorkItem
from pyserver.engine import EngineWorker
from pyserver.service import convert

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
    def __init__(self, worker: EngineWorker, limits: convert.Limits, model_name: str) -> None:
        self._worker = worker
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
        item = await self._accept(request, context)
        finished = False
        try:
            while True:
                delta = await item.mailbox.get()
                if delta.error is not None:
                    finished = True
                    await self._fail(context, delta.error)
                yield convert.stream_message(item.request_id, delta)
                if delta.final:
                    finished = True
                    return
        finally:
            self._release(item, finished)

    async def Complete(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CompleteResponse:
        item = await self._accept(request, context)
        finished = False
        text: list[str] = []
        tokens: list[int] = []
        try:
            while True:
                delta = await item.mailbox.get()
                if delta.error is not None:
                    finished = True
                    await self._fail(context, delta.error)
                text.append(delta.text)
                tokens.extend(delta.token_ids)
                if delta.final:
                    finished = True
                    return convert.complete_message(item.request_id, "".join(text), tokens, delta)
        finally:
            self._release(item, finished)

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
            running=self._worker.stats.running,
            kv_cache_usage=self._worker.stats.kv_cache_usage,
            concurrency_limit=self._worker.concurrency_limit,
            serving=self.serving,
        )

    # ---- helpers -------------------------------------------------------------------------

    async def _accept(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> WorkItem:
        accepted_ns = time.monotonic_ns()
        metadata = dict(context.invocation_metadata() or ())
        try:
            if not self.serving:
                raise RequestError(
                    ErrorKind.UNAVAILABLE,
                    "the server is starting or draining; retry on another replica",
                )
            request_id = convert.request_id_of(request, _text(metadata.get("x-request-id")))
            await context.send_initial_metadata((("x-request-id", request_id),))
            priority = convert.priority_of(request, self._limits)
            ids = await self._tokenize(request)
            sampling = convert.sampling_of(request.sampling, len(ids), self._limits)
            remaining = context.time_remaining()
            deadline_ns = accepted_ns + int(remaining * 1e9) if remaining is not None else 0
            queue_deadline = deadline_ns
            if request.queue_timeout_ms:
                limit = accepted_ns + request.queue_timeout_ms * 1_000_000
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
        except RequestError as err:
            await self._fail(context, err)
            raise AssertionError("unreachable") from None
        self.in_flight += 1
        self.idle.clear()
        return item

    async def _tokenize(self, request: pb.GenerateRequest) -> list[int]:
        tok = self._worker.tokenizer
        size = len(request.text) if request.WhichOneof("prompt") == "text" else 0
        if size <= _INLINE_TOKENIZE_CHARS:
            return convert.prompt_token_ids(request, tok, self._limits)
        return await asyncio.get_running_loop().run_in_executor(
            None, convert.prompt_token_ids, request, tok, self._limits
        )

    def _release(self, item: WorkItem, finished: bool) -> None:
        if not finished:  # the client went away or the call was cancelled mid-stream
            self._worker.cancel(item.handle)
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

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


def _text(value: str | bytes | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


__all__ = ["STATUS", "Delta", "GenerationServicer"]
