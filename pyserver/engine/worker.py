"""The engine worker: one thread that owns the engine and runs its step loop.

Each iteration: apply aborts, preempt for waiting top-priority requests, admit from the C++
BatchQueue what the engine has room for (sequence slots, KV tokens; resident prompt prefixes
first), step the engine once, publish that step's deltas to the event loop in one callback,
retire finished, expired and cancelled requests. The policies: pyserver.engine.{admission,
preemption,intake,kv_ledger,deadlines,prefill_hold}; vLLM only through pyserver.engine.adapter.

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
from pyserver.engine.admission import admission_room, queue_refusal, resumed
from pyserver.engine.deadlines import DeadlineAdmission, EngineView, queue_expiry
from pyserver.engine.intake import resident_prefix_preference
from pyserver.engine.kv_ledger import KvLedger
from pyserver.engine.outputs import StepOutputs
from pyserver.engine.preemption import Preemption
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
            preempts_at_once=preempt_after_s == 0,
        )
        self._view = EngineView(slots=self.concurrency_limit)
        engine.stats.on_preemptions = self._metrics.preemptions.labels("engine").inc
        self._items: dict[int, WorkItem] = {}  # every accepted, unfinished request
        self._running: dict[int, WorkItem] = {}  # in the engine (worker thread only)
        self._preemption = Preemption(
            engine,
            self.queue,
            self.kv,
            self.deadlines,
            self._metrics,
            top=self._top_priority,
            after_s=preempt_after_s,
            suspend=suspend_preempted,
        )
        self._suspended = self._preemption.suspended  # in the engine, no slot (worker thread)
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
        raise queue_refusal(status, item, self.retry_after_ms)

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
                # Priority preemption: requeued victims come off the books here.
                for h in self._preemption.preempt(self._running, self.concurrency_limit):
                    self._leave_engine(h).preemptions += 1
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
            self._preemption.resume(self._running, self._admission_room())
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
        if self._suspended:
            ids = [o.handle for o in outputs]
            self.stats.suspended_stepped += self._preemption.take_back_stepped(ids, self._running)
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
        suspends = self._preemption.can_suspend
        self._view = EngineView.of(running, top, self.concurrency_limit, suspends=suspends)

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
