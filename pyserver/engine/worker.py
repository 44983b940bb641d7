"""The engine worker: one thread that owns the engine and runs its step loop.

Each iteration: apply aborts, preempt for waiting top-priority requests, admit from the C++
BatchQueue what the engine has room for (sequence slots, KV tokens; resident prompt prefixes
first), step the engine once, publish that step's deltas to the event loop in one callback,
retire finished, expired and cancelled requests. The policies are in
pyserver.engine.{admission,intake,kv_ledger,deadlines,prefill_hold}; vLLM is reached only
through pyserver.engine.adapter.

Failure policy: an exception from the engine fails every queued and in-flight request with
UNAVAILABLE, closes the queue and sets `failed`; the server then turns health NOT_SERVING and
exits non-zero so its supervisor (systemd, Kubernetes, compose `restart:`) starts a fresh
process. Restarting vLLM inside a process that just saw it fail is not reliably clean (device
memory, worker processes), so we do not try.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pyserver.batching import BatchQueue, PushStatus, QueueConfig
from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, WorkItem
from pyserver.engine import adapter
from pyserver.engine.admission import (
    admission_room,
    deadline_slack,
    requeue,
    resumed,
    top_priority_victims,
)
from pyserver.engine.deadlines import DeadlineAdmission, EngineView, queue_expiry
from pyserver.engine.intake import resident_prefix_preference
from pyserver.engine.kv_ledger import KvLedger
from pyserver.engine.outputs import StepOutputs
from pyserver.scheduling import AdaptiveBatchController
from pyserver.telemetry.metrics import Metrics
from pyserver.telemetry.tracing import StepTracer

log = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.05


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests_added: int = 0
    max_batch_seen: int = 0
    suspended_stepped: int = 0  # suspended requests that got tokens anyway (a bug if not 0)


class EngineWorker:
    """Owns the engine thread. Thread-safe entry points: submit(), cancel(), stats, close()."""

    def __init__(
        self,
        engine: adapter.Engine,
        queue_config: QueueConfig,
        loop: asyncio.AbstractEventLoop,
        *,
        metrics: Metrics | None = None,
        step_tracer: StepTracer | None = None,
        controller: AdaptiveBatchController | None = None,
        controller_knob: str = "concurrency",
        preempt_after_s: float | None = 0.0,
        suspend_preempted: bool = True,
        reserved_top_slots: int = 0,
        deadline_admission: str = "shadow",
        refusal_confidence: float = 0.95,
    ) -> None:
        self._engine = engine
        self._metrics = metrics or Metrics()
        self._loop = loop
        self.queue = BatchQueue(queue_config)
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len = engine.max_model_len
        self.max_num_seqs = engine.max_num_seqs
        self.vocab_size = engine.vocab_size
        self.max_seeded_sampling_tokens = engine.max_seeded_sampling_tokens
        self.max_logprobs = engine.max_logprobs
        self.adapters = engine.adapter_names
        self.check_sampling = engine.check  # vLLM's verdict on settings, before any queueing
        shared_block = engine.block_size if engine.prefix_caching else 0  # prefix cache: shared
        self.kv = KvLedger(engine.kv_capacity_tokens, shared_block)
        self._affinity = queue_config.affinity_max_overtakes > 0  # the queue takes preferred
        if controller_knob not in ("concurrency", "step_tokens"):
            raise ValueError(
                f"controller knob must be concurrency or step_tokens, got {controller_knob!r}"
            )
        self._knob = controller_knob
        self._controller = controller
        self.concurrency_limit: int = self.max_num_seqs
        if controller is not None:
            self._apply_limit(controller.limit, force=True)
        self.engine_version = engine.version
        self.stats = EngineStats()
        self.failed: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        # Called before each step; tests pause the engine with it. None in production.
        self._step_hook: Callable[[], None] | None = None
        self._preempt_after_ns = None if preempt_after_s is None else int(preempt_after_s * 1e9)
        self._top_priority = queue_config.priority_levels - 1
        if not 0 <= reserved_top_slots < self.max_num_seqs:
            raise ValueError(
                f"reserved top-priority slots must be in [0, max_num_seqs), got "
                f"{reserved_top_slots} with max_num_seqs {self.max_num_seqs}"
            )
        self.reserved_top_slots: int = reserved_top_slots
        self.deadlines = DeadlineAdmission(
            deadline_admission,
            refusal_confidence,
            self._metrics,
            top_priority=self._top_priority,
            preempts_at_once=self._preempt_after_ns == 0,
        )
        self._view = EngineView(slots=self.concurrency_limit)
        engine.stats.on_preemptions = self._metrics.preemptions.labels("engine").inc
        self._items: dict[int, WorkItem] = {}  # every accepted, unfinished request
        self._running: dict[int, WorkItem] = {}  # in the engine (worker thread only)
        # In the engine but suspended by a priority preemption (worker thread only): no slot,
        # their KV blocks and sampling state kept. Only with the engine core in this process.
        self._suspended: dict[int, WorkItem] = {}
        self._can_suspend = suspend_preempted and engine.can_suspend
        self._outputs = StepOutputs(self._running, self.deadlines, self._metrics, step_tracer)
        self._aborts: list[int] = []
        self._aborts_lock = threading.Lock()
        self._handles = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # ---- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def new_handle(self) -> int:
        return next(self._handles)  # one bytecode-level call: atomic under the GIL

    def submit(self, item: WorkItem, *, queue_deadline_ns: int = 0) -> None:
        """Queue the request or raise RequestError (overloaded / unavailable / deadline).

        queue_deadline_ns bounds the wait for admission; item.deadline_ns bounds the whole call.
        """
        if self.failed is not None:
            raise RequestError(
                ErrorKind.UNAVAILABLE, "the engine has failed; retry on another replica"
            )
        # list(): one atomic copy under the GIL (the worker thread changes the dict).
        self.deadlines.predict(item, queue_deadline_ns, self._view, list(self._items.values()))
        self._items[item.handle] = item
        cost = len(item.prompt_token_ids) + item.sampling.max_tokens
        status = self.queue.push(
            item.handle,
            len(item.prompt_token_ids),
            item.sampling.max_tokens,
            item.priority,
            queue_deadline_ns,
        )
        if status == PushStatus.ACCEPTED:
            return
        del self._items[item.handle]
        self.deadlines.settle(item)
        if status == PushStatus.QUEUE_FULL:
            raise RequestError(
                ErrorKind.OVERLOADED,
                "the request queue is full; retry later",
                retry_after_ms=self.retry_after_ms(),
            )
        if status == PushStatus.CLOSED:
            raise RequestError(ErrorKind.UNAVAILABLE, "shutting down; retry on another replica")
        raise RequestError(ErrorKind.INVALID, f"request rejected by the queue ({cost} tokens)")

    def cancel(self, handle: int) -> None:
        """The client went away: drop it from the queue, or abort it in the engine next step."""
        if self.queue.cancel(handle):
            return
        with self._aborts_lock:
            self._aborts.append(handle)

    @property
    def running(self) -> int:
        """Requests in the engine now (read from any thread; derived, never a stale copy)."""
        return len(self._running)

    @property
    def suspended(self) -> int:
        """Requests suspended in the engine by a priority preemption (read from any thread)."""
        return len(self._suspended)

    def engine_kv_usage(self) -> float | None:
        """vLLM's own KV block usage (0..1); None before the engine has reported one."""
        return self._engine.kv_cache_usage()

    def retry_after_ms(self) -> int:
        """A hint for RESOURCE_EXHAUSTED: the time the engine needs to work through the queue
        at its current concurrency, from the measured mean request duration."""
        waiting = self.queue.size() / max(1, self.concurrency_limit)
        return int(min(30_000, max(100, waiting * self._outputs.mean_request_s * 1e3)))

    def close(self) -> None:
        """Stop admitting new work; queued and running requests still finish."""
        self.queue.close()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def shutdown_engine(self) -> None:
        """Once the worker thread has ended: stop the engine (its core's process, if separate)."""
        if not self._thread.is_alive():
            self._engine.shutdown()

    # ---- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._apply_aborts()
                self._preempt_for_top_priority()
                self._admit()
                self._publish_view()
                if self._running:
                    self._step()
                elif self._suspended:  # nothing steps: their deadlines are checked here
                    self._deliver(self._expire_running(time.monotonic_ns()))
                elif self.queue.closed and self.queue.size() == 0:
                    return
        except BaseException as exc:  # the engine is gone: fail everyone, let the server exit
            log.exception("engine worker failed")
            self.failed = exc
            self._metrics.engine_failures.inc()
            self.queue.close()
            # The client gets a stable message; what failed, and how, is in the log above.
            self._fail_all("the engine failed; retry on another replica")
            if self.on_failure is not None:
                self._loop.call_soon_threadsafe(self.on_failure, exc)

    def _apply_aborts(self) -> None:
        if not self._aborts:
            return
        with self._aborts_lock:
            handles, self._aborts = self._aborts, []
        live = [h for h in handles if h in self._running or h in self._suspended]
        # Preempted and requeued since the client left: it waits in the queue again, so the
        # queue cancels it (reported by the next pop) instead of it running for nobody.
        for h in handles:
            if h not in self._running and h not in self._suspended and h in self._items:
                self.queue.cancel(h)
        self._engine.abort(live)
        err = RequestError(ErrorKind.CANCELLED, "cancelled by the client")
        self._deliver([(self._retire(h).mailbox, Delta(error=err)) for h in live])

    def _admit(self) -> None:
        if self._suspended:
            self._resume_suspended()
        free = self._admission_room()
        timeout = 0.0 if self._running else _IDLE_WAIT_S
        room = self.kv.room
        preferred: list[int] = []
        if free <= 0 or room <= 0:
            free, room = 0, 0  # still reap expiries and cancellations
        elif self._affinity and self.queue.size() > 1:
            in_engine = {**self._running, **self._suspended} if self._suspended else self._running
            preferred = resident_prefix_preference(self._items, in_engine, self.kv)
        result = self.queue.pop_batch(free, room, timeout, preferred)
        if preferred and result.admitted:
            taken = len(set(preferred).intersection(result.admitted))
            self._metrics.resident_prefix_admissions.inc(taken)
        if result.expired:  # not per iteration: the loop runs every step and every idle wait
            self._metrics.expiries.labels("queue").inc(len(result.expired))
        out = [
            self._end(h, queue_expiry(self._items[h])) for h in result.expired if h in self._items
        ]
        cancelled = RequestError(ErrorKind.CANCELLED, "cancelled while queued")
        out += [self._end(h, cancelled) for h in result.cancelled if h in self._items]
        now = time.monotonic_ns()
        for h in result.admitted:
            if (item := self._items.get(h)) is not None and (err := self._enter(item, now)):
                out.append(self._end(h, err))
        self._deliver(out)

    def _resume_suspended(self) -> None:
        """Suspended requests take free slots before queued requests of their level or below
        (where a requeued one would stand: at the front of its level), and before a queued
        request of a higher level only when nothing runs."""
        free = self._admission_room()
        if free <= 0:
            return
        depth = [sum(buckets) for buckets in self.queue.stats().depth]
        back: list[WorkItem] = []
        for item in sorted(self._suspended.values(), key=lambda it: -it.priority):
            # With nothing running they go back before queued higher-level calls too: those may
            # lack the KV room the suspended ones hold, and must not wait on them forever.
            ahead = sum(depth[item.priority + 1 :]) if self._running else 0
            if len(back) + ahead >= free:
                break
            back.append(item)
        if not back:
            return
        self._engine.resume([it.handle for it in back])
        now = time.monotonic_ns()
        for item in back:
            self._running[item.handle] = self._suspended.pop(item.handle)
            if item.last_token_ns:  # the time suspended is no step's inter-token gap
                item.last_token_ns = now

    def _end(self, handle: int, err: RequestError) -> tuple[Mailbox, Delta]:
        """A request outside the engine ends with err."""
        item = self._items.pop(handle)
        self.deadlines.settle(item)
        return item.mailbox, Delta(error=err)

    def _enter(self, item: WorkItem, now: int) -> RequestError | None:
        """Hand a request the queue released to the engine; the error to end it with if not."""
        if self.deadlines.late_at_admission(item, now):
            return RequestError(
                ErrorKind.DEADLINE,
                "deadline: too little time left to finish when the queue released it; "
                "the request never ran",
            )
        item.admitted_ns = item.admitted_ns or now  # a resumed request keeps its first
        prompt, sampling = resumed(item)
        if not self._engine.add(item, prompt, sampling):
            return RequestError(
                ErrorKind.INVALID,
                f"the engine refused request {item.request_id}: a sampling setting or the "
                "prompt is outside what this model accepts (the server log says which)",
            )
        self._running[item.handle] = item
        self.kv.reserve(item.handle, prompt, sampling.max_tokens, item.adapter)
        self.stats.requests_added += 1
        self._metrics.prompt_tokens.inc(len(prompt))
        return None

    def _admission_room(self) -> int:
        top, reserved = self._top_priority, self.reserved_top_slots
        return admission_room(
            limit=self.concurrency_limit,
            running=len(self._running),
            running_top=sum(1 for it in self._running.values() if it.priority == top),
            reserved_top=reserved,
            top_waiting=sum(self.queue.stats().depth[top]) if reserved else 0,
        )

    def _step(self) -> None:
        if self._step_hook is not None:
            self._step_hook()
        started = time.monotonic_ns()
        outputs = self._engine.step()
        self.stats.steps += 1
        stray = [o.handle for o in outputs if o.handle in self._suspended]
        if stray:
            # The scheduler keeps suspended requests out of every step; should one get tokens
            # anyway, it runs again (resumed in the scheduler too) and its tokens reach its
            # caller.
            log.error("suspended requests %s were stepped; resumed", stray)
            self.stats.suspended_stepped += len(stray)
            self._engine.resume(stray)
            for h in stray:
                self._running[h] = self._suspended.pop(h)
        now = time.monotonic_ns()
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, len(self._running))
        out, finished = self._outputs.collect(outputs, started, now, self._controller)
        for h in finished:
            self._retire(h)
        if self._controller is not None:
            self._apply_limit(self._controller.update())
        out.extend(self._expire_running(now))
        self._publish_view()
        self._deliver(out)

    def _publish_view(self) -> None:
        running, top = self._running.values(), self._top_priority
        self._view = EngineView.of(running, top, self.concurrency_limit, suspends=self._can_suspend)

    @property
    def step_token_budget(self) -> int:
        return self._engine.step_token_budget

    def _apply_limit(self, limit: int, *, force: bool = False) -> None:
        if self._knob == "concurrency":
            self.concurrency_limit = limit
        elif force or limit != self._engine.step_token_budget:
            self._engine.set_step_token_budget(limit)

    def _expire_running(self, now: int) -> list[tuple[Mailbox, Delta]]:
        late = [
            h
            for h, it in itertools.chain(self._running.items(), self._suspended.items())
            if it.deadline_ns and it.deadline_ns <= now
        ]
        if not late:
            return []
        self._engine.abort(late)
        self._metrics.expiries.labels("engine").inc(len(late))
        err = RequestError(ErrorKind.DEADLINE, "deadline passed during generation")
        return [(self._retire(h).mailbox, Delta(error=err)) for h in late]

    def _retire(self, handle: int) -> WorkItem:
        item = self._leave_engine(handle)
        self._items.pop(handle, None)
        self.deadlines.settle(item)
        return item

    def _leave_engine(self, handle: int) -> WorkItem:
        if handle in self._suspended:
            item = self._suspended.pop(handle)
        else:
            item = self._running.pop(handle)
        self.kv.release(handle)
        return item

    def _preempt_for_top_priority(self) -> None:
        """Stop the lowest-priority running requests for waiting top-priority ones
        (pyserver.engine.admission). Where the engine core runs in this process and a slot is
        what they lack (not KV room), the victims are suspended in the engine: their KV blocks
        and sampling state stay, so nothing is computed again and any call may be stopped.
        Otherwise they are aborted and requeued, and re-prefill their prompt and output."""
        if self._preempt_after_ns is None or not self._running:
            return
        now = time.monotonic_ns()
        # A suspended request keeps its KV reservation: suspend only while the room left holds
        # the longest request for each waiting top-priority one, else free the room.
        waiting_top = sum(self.queue.stats().depth[self._top_priority])
        suspend = self._can_suspend and self.kv.room >= waiting_top * self.max_model_len
        victims = top_priority_victims(
            self.queue,
            self._running,
            top=self._top_priority,
            free=max(0, self.concurrency_limit - len(self._running)),
            kv_room=self.kv.room,
            after_ns=self._preempt_after_ns,
            slack=lambda it: deadline_slack(it, now, self.deadlines.remaining_service_s(it)),
            keeps_state=suspend,
        )
        if not victims:
            return
        if suspend:
            self._engine.suspend([it.handle for it in victims])
            for item in victims:
                self._suspended[item.handle] = self._running.pop(item.handle)
                item.preemptions += 1
            self._metrics.preemptions.labels("suspended").inc(len(victims))
            return
        stopped = [it.handle for it in victims if requeue(self.queue, it)]
        if not stopped:
            return
        self._engine.abort(stopped)
        for h in stopped:
            self._leave_engine(h).preemptions += 1
        self._metrics.preemptions.labels("priority").inc(len(stopped))

    def _fail_all(self, message: str) -> None:
        err = RequestError(ErrorKind.UNAVAILABLE, message)
        victims = list(self._items.values())
        for item in victims:
            self.deadlines.settle(item)
        self._items.clear()
        self._running.clear()
        self._suspended.clear()
        self.kv.clear()
        self._deliver([(item.mailbox, Delta(error=err)) for item in victims])

    def _deliver(self, out: list[tuple[Mailbox, Delta]]) -> None:
        """One event-loop hop per step, whatever the batch size."""
        if out:
            self._loop.call_soon_threadsafe(_publish, out)


def _publish(out: list[tuple[Mailbox, Delta]]) -> None:
    for box, delta in out:
        box.put(delta)
