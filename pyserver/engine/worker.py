"""The engine worker: one thread that owns vLLM's LLMEngine and runs its step loop.

Each iteration: apply aborts, admit from the C++ BatchQueue what the engine has room for (free
sequence slots under the admitted-concurrency limit, KV tokens), step the engine once, publish
that step's deltas to the event loop in one callback, retire finished, expired and cancelled
requests. The only module that imports vllm.

Priority preemption (abort and requeue): when top-priority requests have waited longer than
`preempt_after_s` and the engine has fewer free slots than there are of them (or no KV room),
as many of the lowest-priority running requests as are needed are aborted in vLLM and put back
at the front of the queue, each with its generated tokens appended to its prompt; when it is
admitted again it resumes where it stopped (the prefix cache usually holds its KV), and its
stream just continues. Measured against vLLM's own priority preemption in docs/benchmarks.md:
vLLM only preempts when KV blocks run out, never for a free sequence slot, so behind a full
batch it does not help a top-priority arrival at all.

Deadline-aware admission (pyserver/engine/prediction.py): every call gets a finish-time
prediction at submit (queue wait from the running and queued requests, plus its own service),
calibrated against the calls that finished. With `--deadline-admission on` a call is refused,
DEADLINE_EXCEEDED without having run, only when even the prediction's lower bound at the
refusal confidence misses its deadline (or, waiting, its queue timeout); the same bound is
checked again when the queue releases it. In shadow mode (the default) the decision is only
recorded (Timings.refusal_predicted, and how each flagged call ended), to measure how many
refusals would have been wrong.

Failure policy: an exception from the engine fails every queued and in-flight request with
UNAVAILABLE, closes the queue and sets `failed`; the server then turns health NOT_SERVING and
exits non-zero so its supervisor (systemd, Kubernetes, compose `restart:`) starts a fresh
process. Restarting vLLM inside a process that just saw it fail is not reliably clean (device
memory, worker processes), so we do not try.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pyserver.batching import BatchQueue, PushStatus, QueueConfig
from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, Sampling, WorkItem
from pyserver.engine.prediction import FinishTimePredictor, Job
from pyserver.scheduling import AdaptiveBatchController
from pyserver.telemetry.metrics import Metrics
from pyserver.telemetry.tracing import StepTracer

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_IDLE_WAIT_S = 0.05
DEADLINE_ADMISSION_MODES = ("on", "shadow", "off")


@dataclass(slots=True)
class EngineOptions:
    """Engine arguments passed through to vLLM's EngineArgs."""

    model: str
    dtype: str = "auto"  # auto: bfloat16 where the CPU computes it natively, else float32
    max_model_len: int = 2048
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = True
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    seed: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    requests_added: int = 0
    max_batch_seen: int = 0


def resolve_dtype(dtype: str) -> str:
    """On a CPU without native bf16 (AVX512_BF16 or AMX) bf16 is emulated and measured ~4x
    slower than fp32 here (AMD EPYC, AVX2 only), so "auto" picks float32 there. On a GPU
    "auto" is left to vLLM (the model's own dtype)."""
    if dtype != "auto":
        return dtype
    import torch

    if torch.cuda.is_available():
        return "auto"
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "float32"
    return "bfloat16" if ("avx512_bf16" in flags or "amx_bf16" in flags) else "float32"


def _construct_engine(options: EngineOptions) -> Any:
    from vllm import EngineArgs, LLMEngine

    kwargs: dict[str, Any] = dict(
        model=options.model,
        dtype=resolve_dtype(options.dtype),
        max_model_len=options.max_model_len,
        max_num_seqs=options.max_num_seqs,
        enable_prefix_caching=options.enable_prefix_caching,
        enforce_eager=options.enforce_eager,
        tensor_parallel_size=options.tensor_parallel_size,
        pipeline_parallel_size=options.pipeline_parallel_size,
        gpu_memory_utilization=options.gpu_memory_utilization,
        scheduling_policy="priority",
        seed=options.seed,
    )
    if options.max_num_batched_tokens:
        kwargs["max_num_batched_tokens"] = options.max_num_batched_tokens
    if options.kv_cache_memory_bytes:
        kwargs["kv_cache_memory_bytes"] = options.kv_cache_memory_bytes
    kwargs.update(options.extra)
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def build_engine(options: EngineOptions) -> Any:
    """The engine, built on a thread that exits once it is built (blocking: call it off the
    event loop). Building runs torch ops, and OpenMP keeps a thread team for every thread that
    ran one, until that thread exits. A team left on a pool thread while the engine steps on its
    own thread puts more OpenMP threads in the process than there are cores, and then libgomp
    cuts its workers' spin-wait to almost nothing: every parallel region of every step wakes
    its workers from sleep. Measured on 2 cores (docs/benchmarks.md): offline generation on a
    second thread ran at the speed of one thread until the building thread was gone."""
    return on_passing_thread(_construct_engine, options)


def on_passing_thread(fn: Callable[..., _T], *args: Any) -> _T:
    """fn(*args) on a new thread that has exited when this returns, so whatever OpenMP team
    fn's torch ops left is gone with it (see build_engine)."""
    with ThreadPoolExecutor(1, thread_name_prefix="torch-setup") as pool:
        return pool.submit(fn, *args).result()


def _scheduler(engine: Any) -> Any | None:
    """vLLM's scheduler when the engine core runs in this process (InprocClient), else None."""
    core = getattr(getattr(engine, "engine_core", None), "engine_core", None)
    return getattr(core, "scheduler", None)


def step_token_budget(engine: Any) -> int:
    """The engine's per-step token budget (prefill chunks + decodes), as configured."""
    return int(engine.vllm_config.scheduler_config.max_num_batched_tokens)


def _vllm_version() -> str:
    import vllm

    return f"vllm {vllm.__version__}"


def _request_error_types() -> tuple[type[Exception], ...]:
    from vllm.exceptions import VLLMClientError

    return (VLLMClientError, ValueError)


def _sampling_params(s: Sampling) -> Any:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k if s.top_k > 0 else -1 if s.top_k < 0 else 0,
        seed=s.seed,
        stop=list(s.stop) or None,
        ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_tokens=s.min_tokens,
        output_kind=RequestOutputKind.DELTA,
    )


class EngineWorker:
    """Owns the engine thread. Thread-safe entry points: submit(), cancel(), stats, close()."""

    def __init__(
        self,
        engine: Any,
        queue_config: QueueConfig,
        loop: asyncio.AbstractEventLoop,
        *,
        metrics: Metrics | None = None,
        step_tracer: StepTracer | None = None,
        controller: AdaptiveBatchController | None = None,
        controller_knob: str = "concurrency",
        step_hook: Callable[[], None] | None = None,
        preempt_after_s: float | None = 0.0,
        reserved_top_slots: int = 0,
        step_tokens: int = 0,
        deadline_admission: str = "shadow",
        refusal_confidence: float = 0.95,
    ) -> None:
        self._engine = engine
        self._metrics = metrics or Metrics()
        self._step_tracer = step_tracer
        self._controller = controller
        self._loop = loop
        self.queue = BatchQueue(queue_config)
        self.tokenizer = engine.get_tokenizer()
        self.max_model_len: int = engine.model_config.max_model_len
        self.max_num_seqs: int = engine.vllm_config.scheduler_config.max_num_seqs
        self.vocab_size: int = engine.model_config.get_vocab_size()
        cache = engine.vllm_config.cache_config
        self.kv_capacity_tokens: int = int(cache.num_gpu_blocks or 0) * int(cache.block_size)
        # With vLLM's prefix cache a full prompt block that a running request already holds is
        # shared, not stored again: the reservation counts it once (see _reserve).
        self._block_size = int(cache.block_size) if cache.enable_prefix_caching else 0
        self._held_blocks: dict[int, int] = {}  # prompt-block hash -> running requests holding it
        self._sched = _scheduler(engine)
        self._request_errors = _request_error_types()
        # The engine's maximum (its input buffers are sized for it) and the budget normal steps
        # get, which may be lower (--step-tokens, or the controller); a top-priority prompt's
        # prefill step may use the maximum (see _hold_lower_prefills).
        self.max_step_tokens = step_token_budget(engine)
        self.step_token_budget = self.max_step_tokens
        if step_tokens:
            if self._sched is None:
                raise ValueError(
                    "--step-tokens needs the engine in this process (--engine-process inproc)"
                )
            if not 0 < step_tokens <= self.max_step_tokens:
                raise ValueError(
                    f"--step-tokens must be in (0, {self.max_step_tokens}] "
                    f"(--max-num-batched-tokens), got {step_tokens}"
                )
            self._sched.max_num_scheduled_tokens = step_tokens
            self.step_token_budget = step_tokens
        if controller_knob not in ("concurrency", "step_tokens"):
            raise ValueError(
                f"controller knob must be concurrency or step_tokens, got {controller_knob!r}"
            )
        if controller_knob == "step_tokens" and controller is not None and self._sched is None:
            raise ValueError(
                "--controller-knob step_tokens needs the engine in this process "
                "(--engine-process inproc): the per-step budget is set on vLLM's scheduler"
            )
        self._knob = controller_knob
        self.concurrency_limit: int = self.max_num_seqs
        if controller is not None:
            self._apply_limit(controller.limit)
        self.engine_version = _vllm_version()
        self.stats = EngineStats()
        self.failed: BaseException | None = None
        self.on_failure: Callable[[BaseException], None] | None = None
        self._step_hook = step_hook  # test-only fault injection; None in production
        self._preempt_after_ns = None if preempt_after_s is None else int(preempt_after_s * 1e9)
        self._top_priority = queue_config.priority_levels - 1
        if not 0 <= reserved_top_slots < self.max_num_seqs:
            raise ValueError(
                f"reserved top-priority slots must be in [0, max_num_seqs), got "
                f"{reserved_top_slots} with max_num_seqs {self.max_num_seqs}"
            )
        self.reserved_top_slots: int = reserved_top_slots
        if deadline_admission not in DEADLINE_ADMISSION_MODES:
            raise ValueError(
                f"deadline admission must be one of {', '.join(DEADLINE_ADMISSION_MODES)}, "
                f"got {deadline_admission!r}"
            )
        self.deadline_admission = deadline_admission
        self.predictor = FinishTimePredictor(refusal_confidence)
        # What the event loop's predictions read of the engine: the running handles, their
        # expected remaining steps and how many are below the top level (preemptable), replaced
        # whole by the worker thread after each iteration.
        self._running_view: tuple[frozenset[int], tuple[float, ...], int] = (frozenset(), (), 0)
        # A fresh engine's first step carries one-time costs (216 ms against ~40 after it, on
        # 2 cores); timings that include it would skew the predictions for the next few dozen
        # steps. They count from the end of that step.
        self._estimates_from_ns = 0
        _count_engine_preemptions(engine, self._metrics)
        self._items: dict[int, WorkItem] = {}  # every accepted, unfinished request
        self._running: dict[int, WorkItem] = {}  # in the engine (worker thread only)
        self._reserved_tokens = 0  # unshared prompt tokens + max_tokens of running requests
        self._mean_request_s = 1.0  # EWMA of admitted -> finished, for retry hints
        self._aborts: list[int] = []
        self._aborts_lock = threading.Lock()
        self._next_handle = 1
        self._handle_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-worker", daemon=True)

    # ---- called from the event loop -------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def new_handle(self) -> int:
        with self._handle_lock:
            handle = self._next_handle
            self._next_handle += 1
            return handle

    def submit(self, item: WorkItem, *, queue_deadline_ns: int = 0) -> None:
        """Queue the request or raise RequestError (overloaded / unavailable).

        queue_deadline_ns bounds the wait for admission; item.deadline_ns bounds the whole call.
        """
        if self.failed is not None:
            raise RequestError(
                ErrorKind.UNAVAILABLE, "the engine has failed; retry on another replica"
            )
        self._predict(item, queue_deadline_ns)
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
        self._settle_refusal_prediction(item)
        if status == PushStatus.QUEUE_FULL:
            raise RequestError(
                ErrorKind.OVERLOADED,
                "the request queue is full; retry later",
                retry_after_ms=self.retry_after_ms(),
            )
        if status == PushStatus.CLOSED:
            raise RequestError(ErrorKind.UNAVAILABLE, "the server is shutting down")
        raise RequestError(ErrorKind.INVALID, f"request rejected by the queue ({cost} tokens)")

    def _predict(self, item: WorkItem, queue_deadline_ns: int) -> None:
        """Predict the call's finish time (kept on the item, checked against what it took) and
        refuse it when the prediction's lower bound misses its deadline or its queue timeout."""
        p = self.predictor
        fixed = _fixed_length(item.sampling)
        item.expected_tokens = p.expected_tokens(item.sampling.max_tokens, fixed)
        if not p.ready:
            return  # nothing measured yet: no prediction, no refusal
        running, remaining, below_top = self._running_view
        queued = [
            it
            for it in list(self._items.values())  # list(): one atomic copy under the GIL
            if it.handle not in running
        ]
        # A top-priority call preempts a lower one at once when the engine is full: no wait
        # unless the top-priority calls queued ahead of it take every preemptable slot.
        preempts = (
            item.priority == self._top_priority
            and self._preempt_after_ns == 0
            and below_top > sum(1 for it in queued if it.priority == item.priority)
        )
        ahead = [Job(it.priority, p.service_steps(it.expected_tokens)) for it in queued]
        pred = p.predict(
            Job(item.priority, p.service_steps(item.expected_tokens)),
            fixed_length=fixed,
            running=remaining,
            ahead=ahead,
            slots=self.concurrency_limit,
            queued=not preempts,
        )
        item.prediction = pred
        now = time.monotonic_ns()
        reason = ""
        if item.deadline_ns and pred.lower_s > (item.deadline_ns - now) / 1e9:
            reason = (
                f"deadline: predicted to finish in {pred.mean_s:.1f} s (at the earliest "
                f"{pred.lower_s:.1f} s, {p.confidence:.0%} confidence: "
                f"{pred.wait_lower_s:.1f} s queued) with "
                f"{max(0, item.deadline_ns - now) / 1e9:.1f} s left; raise the deadline, "
                "lower max_tokens or retry later"
            )
        elif queue_deadline_ns and pred.wait_lower_s > (queue_deadline_ns - now) / 1e9:
            reason = (
                f"deadline: predicted to wait {pred.wait_raw_s:.1f} s in the queue (at the "
                f"least {pred.wait_lower_s:.1f} s, {p.confidence:.0%} confidence), past its "
                f"queue timeout of {max(0, queue_deadline_ns - now) / 1e9:.1f} s; retry later"
            )
        if not reason:
            return
        if self.deadline_admission == "shadow":
            item.refusal_predicted = True
        elif self.deadline_admission == "on":
            self._metrics.deadline_refusals.labels("submit").inc()
            raise RequestError(ErrorKind.DEADLINE, reason)

    def _late_at_admission(self, item: WorkItem, now: int) -> bool:
        """Released by the queue: will it miss its deadline? Only when even the fastest
        plausible service misses (the refusal confidence). Refusing on the calibrated mean when
        other calls wait (tried) refuses calls that finish in time about half the time; the
        collapse that rule was meant to stop came from aged low calls taking the slots that
        preemption freed for high ones (see BatchQueue's aging cap)."""
        if not item.deadline_ns or not self.predictor.ready:
            return False
        steps = self.predictor.service_steps(item.expected_tokens - item.completion_tokens)
        pred = self.predictor.predict(
            Job(item.priority, steps), fixed_length=_fixed_length(item.sampling), queued=False
        )
        late = pred.service_lower_s > (item.deadline_ns - now) / 1e9
        if late and self.deadline_admission == "shadow":
            item.refusal_predicted = True
            return False
        return late and self.deadline_admission == "on"

    def _remaining_service_s(self, item: WorkItem) -> float:
        """Calibrated mean time `item` still needs in the engine."""
        p = self.predictor
        steps = max(1.0, item.expected_tokens - item.completion_tokens)
        fixed = _fixed_length(item.sampling)
        return p.predict(Job(item.priority, steps), fixed_length=fixed, queued=False).mean_s

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
    def kv_cache_usage(self) -> float:
        """KV tokens reserved by running requests (prompt + max_tokens) over the capacity."""
        return self._reserved_tokens / self.kv_capacity_tokens if self.kv_capacity_tokens else 0.0

    def engine_kv_usage(self) -> float | None:
        """vLLM's own KV block usage (0..1) when the engine core runs in this process; None when
        it runs in its own process. Blocks kept only for the prefix cache count as free."""
        manager = getattr(self._sched, "kv_cache_manager", None)
        return float(manager.usage) if manager is not None else None

    def retry_after_ms(self) -> int:
        """A hint for RESOURCE_EXHAUSTED: the time the engine needs to work through the queue
        at its current concurrency, from the measured mean request duration."""
        waiting = self.queue.size()
        estimate = waiting / max(1, self.concurrency_limit) * self._mean_request_s * 1e3
        return int(min(30_000, max(100, estimate)))

    def close(self) -> None:
        """Stop admitting new work; queued and running requests still finish."""
        self.queue.close()

    def join(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # ---- the worker thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                self._apply_aborts()
                self._preempt_for_top_priority()
                self._admit()
                self._publish_running_view()
                if self._running:
                    self._step()
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
        live = [h for h in handles if h in self._running]
        # Preempted and requeued since the client left: it waits in the queue again, so the
        # queue cancels it (reported by the next pop) instead of it running for nobody.
        for h in handles:
            if h not in self._running and h in self._items:
                self.queue.cancel(h)
        if live:
            self._engine.abort_request([str(h) for h in live])
        for h in live:
            item = self._retire(h)
            self._deliver(
                [
                    (
                        item.mailbox,
                        Delta(error=RequestError(ErrorKind.CANCELLED, "cancelled by the client")),
                    )
                ]
            )

    def _admit(self) -> None:
        free = self._admission_room()
        timeout = 0.0 if self._running else _IDLE_WAIT_S
        room = (
            (self.kv_capacity_tokens - self._reserved_tokens)
            if self.kv_capacity_tokens
            else 1 << 40
        )
        if free <= 0 or room <= 0:
            free, room = 0, 0  # still reap expiries and cancellations
        result = self.queue.pop_batch(free, room, timeout)
        out: list[tuple[Mailbox, Delta]] = []
        if result.expired:
            self._metrics.expiries.labels("queue").inc(len(result.expired))
        for h in result.expired:
            if (gone := self._items.pop(h, None)) is not None:
                self._settle_refusal_prediction(gone)
                why = (
                    f"deadline passed while requeued after a priority preemption "
                    f"({gone.completion_tokens} tokens had been streamed)"
                    if gone.completion_tokens
                    else "deadline passed while queued; the request never ran"
                )
                out.append((gone.mailbox, Delta(error=RequestError(ErrorKind.DEADLINE, why))))
        for h in result.cancelled:
            if (gone := self._items.pop(h, None)) is not None:
                self._settle_refusal_prediction(gone)
                out.append(
                    (
                        gone.mailbox,
                        Delta(error=RequestError(ErrorKind.CANCELLED, "cancelled while queued")),
                    )
                )
        now = time.monotonic_ns()
        for h in result.admitted:
            item = self._items.get(h)
            if item is None:
                continue
            if self._late_at_admission(item, now):
                self._items.pop(h, None)
                self._metrics.deadline_refusals.labels("admit").inc()
                err = RequestError(
                    ErrorKind.DEADLINE,
                    "deadline: too little time left to finish when the queue released it; "
                    "the request never ran",
                )
                out.append((item.mailbox, Delta(error=err)))
                continue
            if not item.admitted_ns:
                item.admitted_ns = now
            prompt, sampling = item.prompt_token_ids, item.sampling
            if item.output_token_ids:  # resuming after a preemption
                # The time spent requeued is not a step's inter-token latency: the controller
                # must not shrink the step budget for it (the client sees it; the bench counts it).
                item.last_token_ns = 0
                prompt = prompt + item.output_token_ids
                sampling = dataclasses.replace(
                    sampling,
                    max_tokens=sampling.max_tokens - item.completion_tokens,
                    min_tokens=max(0, sampling.min_tokens - item.completion_tokens),
                )
            try:
                self._engine.add_request(
                    str(h),
                    {"prompt_token_ids": prompt},
                    _sampling_params(sampling),
                    priority=-item.priority,
                )
            except self._request_errors as exc:
                # vLLM validates a request before it touches engine state (its client errors,
                # SamplingParams' ValueErrors): this request is bad, the engine is fine.
                # Anything else still fails the engine (see _run). vLLM's text goes to the log
                # (never the caller's: no prompt, no sampling settings, which hold stop
                # strings); the client gets a stable message and its request id to find it.
                log.warning(
                    "engine refused request %s (%d prompt tokens): %s: %s",
                    item.request_id, len(prompt), type(exc).__name__, exc,
                )  # fmt: skip
                self._items.pop(h, None)
                self._settle_refusal_prediction(item)
                err = RequestError(
                    ErrorKind.INVALID,
                    f"the engine refused request {item.request_id}: a sampling setting or the "
                    "prompt is outside what this model accepts (the server log says which)",
                )
                out.append((item.mailbox, Delta(error=err)))
                continue
            self._running[h] = item
            self._reserve(item, prompt, sampling.max_tokens)
            self.stats.requests_added += 1
            self._metrics.prompt_tokens.inc(len(prompt))
        if out:
            self._deliver(out)

    def _admission_room(self) -> int:
        """How many requests to take from the queue now. With reserved top-priority slots,
        requests below the top level may fill only concurrency_limit - reserved slots; the
        rest is taken only by as many top-level requests as are waiting. The queue hands out
        the highest (effective) priority first, so the first `top_take` of a batch are those."""
        free = self.concurrency_limit - len(self._running)
        reserved = min(self.reserved_top_slots, self.concurrency_limit - 1)
        if free <= 0 or reserved <= 0:
            return free
        top = self._top_priority
        top_take = min(sum(self.queue.stats().depth[top]), free)
        running_top = sum(1 for it in self._running.values() if it.priority == top)
        running_below_top = len(self._running) - running_top
        low_room = self.concurrency_limit - reserved - running_below_top
        # Top-level requests beyond the reserve also use the shared slots.
        low_room -= max(0, running_top - reserved)
        return min(free, top_take + max(0, low_room))

    def _step(self) -> None:
        if self._step_hook is not None:
            self._step_hook()
        started = time.monotonic_ns()
        held = self._hold_lower_prefills()
        # Streams mid-decode; a request resumed after a preemption re-prefills first (its
        # last_token_ns is reset), which is not a skip.
        decoding = {h for h, it in self._running.items() if it.last_token_ns}
        try:
            outputs = self._engine.step()
        finally:
            if held is not None:
                self._release_held(held)
        self.stats.steps += 1
        now = time.monotonic_ns()
        batch = len(self._running)
        if self._estimates_from_ns:
            self.predictor.observe_step((now - started) / 1e9)
        else:
            self._estimates_from_ns = now
        self.stats.max_batch_seen = max(self.stats.max_batch_seen, batch)
        m = self._metrics
        m.batch_size.observe(batch)
        m.observe_step(started, now)
        generated = 0
        out: list[tuple[Mailbox, Delta]] = []
        served: list[Any] = []
        ctl = self._controller
        for o in outputs:
            h = int(o.request_id)
            item = self._running.get(h)
            if item is None:
                continue
            served.append(item.span)
            c = o.outputs[0]
            if c.token_ids:
                decoding.discard(h)
                if not item.first_token_ns:
                    item.first_token_ns = now
                    if item.admitted_ns >= self._estimates_from_ns:
                        self.predictor.observe_first_token((now - item.admitted_ns) / 1e9)
                    if ctl is not None and ctl.metric == "ttft":
                        ctl.observe((now - item.accepted_ns) / 1e6)
                elif item.last_token_ns:
                    itl_s = (now - item.last_token_ns) / 1e9 / len(c.token_ids)
                    m.itl_seconds.observe(itl_s)
                    if ctl is not None and ctl.metric == "itl":
                        ctl.observe(itl_s * 1e3)
                item.last_token_ns = now
            item.completion_tokens += len(c.token_ids)
            item.output_token_ids.extend(c.token_ids)
            generated += len(c.token_ids)
            delta = Delta(text=c.text, token_ids=list(c.token_ids))
            if o.finished:
                delta.finish_reason = "length" if c.finish_reason == "length" else "stop"
                self._fill_usage(delta, item, now, int(o.num_cached_tokens or 0))
                self._observe_finish(item, now, cut=delta.finish_reason == "length")
                self._mean_request_s += 0.1 * (
                    (now - item.admitted_ns) / 1e9 - self._mean_request_s
                )
                item.finished_ns = now
                if ctl is not None and ctl.metric == "e2e":
                    ctl.observe((now - item.accepted_ns) / 1e6)
                self._retire(h)
            out.append((item.mailbox, delta))
        m.generated_tokens.inc(generated)
        if decoding:
            m.decode_skips.inc(len(decoding))
        if self._step_tracer is not None:
            self._step_tracer.on_step(started, now, batch, generated, served)
        if ctl is not None:
            self._apply_limit(ctl.update())
        out.extend(self._expire_running(now))
        self._publish_running_view()
        if out:
            self._deliver(out)

    def _observe_finish(self, item: WorkItem, now: int, *, cut: bool) -> None:
        """Feed a finished call back to the predictor: its natural length and what its
        prediction missed by."""
        fixed = _fixed_length(item.sampling)
        if not fixed:
            self.predictor.observe_length(item.completion_tokens, cut)
        if item.prediction is None:
            return
        ratio = self.predictor.observe_finish(
            item.prediction,
            priority=item.priority,
            waited_s=(item.admitted_ns - item.accepted_ns) / 1e9,
            served_s=(now - item.admitted_ns) / 1e9,
            fixed_length=fixed,
        )
        if ratio is not None:
            self._metrics.finish_time_ratio.observe(ratio)

    def _publish_running_view(self) -> None:
        expected = [
            max(1.0, it.expected_tokens - it.completion_tokens) for it in self._running.values()
        ]
        below_top = sum(1 for it in self._running.values() if it.priority < self._top_priority)
        self._running_view = (frozenset(self._running), tuple(expected), below_top)

    def _hold_lower_prefills(self) -> list[Any] | None:
        """While a top-priority request is prefilling, keep lower-priority requests that are
        still prefilling out of the step, and size the step's token budget to the running
        decodes plus every top-priority prompt that fits whole (up to the engine's full budget,
        above --step-tokens). vLLM schedules every running request (prefill chunks included)
        before any waiting one, then waiting ones in priority order, and preempts for priority
        only when KV blocks run out: without this a top-priority prompt waits behind
        low-priority prompt chunks, and with the budget left over a low-priority prompt would
        start in the urgent step, or the next urgent prompt be cut into a chunk whose first
        token comes a step later anyway, both lengthening the step. Urgent prompts share one
        step rather than taking a step each: a step costs mostly its fixed part (on two CPU
        cores 30-48 ms with the host's speed, against 0.24-0.26 ms per prompt token: `make
        bench-step` and docs/benchmarks.md). A waiting prompt counts in full: if the prefix
        cache holds part of it, the budget left over may start the next waiting request's
        prefill early. Returns the held requests (put back after the step, with the budget) or
        None when nothing was changed. Only with the engine in this process (the scheduler is
        reachable); decodes are never held."""
        sched, top = self._sched, self._top_priority
        if sched is None or not any(
            it.priority == top and not it.first_token_ns for it in self._running.values()
        ):
            return None
        vllm_top = -top  # add_request passes -priority: lower is more urgent in vLLM
        held = [
            r
            for r in sched.running
            if r.priority > vllm_top and r.num_computed_tokens < r.num_prompt_tokens
        ]
        if held:
            ids = {id(r) for r in held}
            sched.running = [r for r in sched.running if id(r) not in ids]
        limit = self._urgent_step_budget()
        need = sum(_tokens_to_compute(r) for r in sched.running)
        urgent = any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.running)
        for r in _waiting_in_order(sched):
            if r.priority > vllm_top or need + _tokens_to_compute(r) > limit:
                break
            need += _tokens_to_compute(r)
            urgent = True
        sched.max_num_scheduled_tokens = min(limit, need) if urgent else limit
        return held

    def _release_held(self, held: list[Any]) -> None:
        """Put the held prefills back behind every other running request, and the step budget
        back. vLLM hands its token budget to running requests in list order, so a prefill chunk
        ahead of decodes can use it all and make those streams skip a step (a doubled token gap
        for each of them); behind them it only gets what the decodes leave."""
        assert self._sched is not None
        self._sched.running = self._sched.running + held
        self._sched.max_num_scheduled_tokens = self.step_token_budget

    def _urgent_step_budget(self) -> int:
        """An urgent prompt's step may use the engine's whole token budget, unless the controller
        holds steps to a latency SLO: then no step, urgent or not, exceeds the controller's
        budget (a step that prefills a whole prompt is a token gap for every other stream)."""
        if self._controller is not None and self._knob == "step_tokens":
            return self.step_token_budget
        return self.max_step_tokens

    def _can_wait(self, item: WorkItem, now: int) -> bool:
        """A request with a deadline is preempted only if it could wait as long as it has left
        to run and still finish in time, so preemption never turns a request that was admitted
        in time into one that misses its deadline."""
        if not item.deadline_ns:
            return True
        return (item.deadline_ns - now) / 1e9 > 2 * self._remaining_service_s(item)

    def _apply_limit(self, limit: int) -> None:
        if self._knob == "concurrency":
            self.concurrency_limit = limit
        elif limit != self.step_token_budget:
            # Read by vLLM's scheduler at every schedule(); applies from the next step.
            assert self._sched is not None  # checked in __init__
            self._sched.max_num_scheduled_tokens = limit
            self.step_token_budget = limit

    def _expire_running(self, now: int) -> list[tuple[Mailbox, Delta]]:
        late = [h for h, it in self._running.items() if it.deadline_ns and it.deadline_ns <= now]
        if not late:
            return []
        self._engine.abort_request([str(h) for h in late])
        self._metrics.expiries.labels("engine").inc(len(late))
        err = RequestError(ErrorKind.DEADLINE, "deadline passed during generation")
        return [(self._retire(h).mailbox, Delta(error=err)) for h in late]

    def _retire(self, handle: int) -> WorkItem:
        item = self._leave_engine(handle)
        self._items.pop(handle, None)
        self._settle_refusal_prediction(item)
        return item

    def _settle_refusal_prediction(self, item: WorkItem) -> None:
        """A call the predictor would have refused (shadow mode serves it anyway) has ended:
        count whether it finished in time, so the refusal rule's error rate is measured on
        every flagged call, also those whose client never saw a final message."""
        if not item.refusal_predicted:
            return
        in_time = bool(item.finished_ns) and (
            not item.deadline_ns or item.finished_ns <= item.deadline_ns
        )
        self._metrics.refusal_predictions.labels("finished" if in_time else "missed").inc()

    def _leave_engine(self, handle: int) -> WorkItem:
        item = self._running.pop(handle)
        self._reserved_tokens -= item.reserved_tokens
        for block in item.kv_blocks:
            if self._held_blocks[block] == 1:
                del self._held_blocks[block]
            else:
                self._held_blocks[block] -= 1
        item.kv_blocks = []
        return item

    def _reserve(self, item: WorkItem, prompt: list[int], max_tokens: int) -> None:
        """Reserve the KV the request will hold at its end: its prompt, less the full blocks a
        running request already holds (the prefix cache shares them), plus max_tokens. Blocks
        are keyed like vLLM's prefix cache: a hash chained over the prompt's full blocks, so a
        block matches only with everything before it. Without this, 29 requests over one
        1.5k-token document filled a 46k-token cache on paper while vLLM stored the document
        once (make bench, shared_prefix)."""
        blocks: list[int] = []
        shared = 0
        if self._block_size:
            size, h = self._block_size, 0
            for start in range(0, len(prompt) - size + 1, size):
                h = hash((h, tuple(prompt[start : start + size])))
                blocks.append(h)
                shared += 1 if h in self._held_blocks else 0
                self._held_blocks[h] = self._held_blocks.get(h, 0) + 1
        item.kv_blocks = blocks
        item.reserved_tokens = len(prompt) - shared * self._block_size + max_tokens
        self._reserved_tokens += item.reserved_tokens

    def _preempt_for_top_priority(self) -> None:
        """Abort-and-requeue the lowest-priority running requests when top-priority ones have
        waited past the threshold and the engine has no room for them."""
        if self._preempt_after_ns is None or not self._running:
            return
        free = max(0, self.concurrency_limit - len(self._running))
        room = self.kv_capacity_tokens - self._reserved_tokens if self.kv_capacity_tokens else 1
        stats = self.queue.stats()
        top = self._top_priority
        waiting = sum(stats.depth[top])
        if room > 0 and waiting <= free:
            return  # admission will take them all this iteration (reserved slots included)
        if not waiting or stats.oldest_wait_ns_by_level[top] < self._preempt_after_ns:
            return
        now = time.monotonic_ns()
        victims = sorted(
            (it for it in self._running.values() if it.priority < top and self._can_wait(it, now)),
            key=lambda it: (it.priority, it.completion_tokens),
        )[: max(1, waiting - free)]
        stopped: list[int] = []
        for item in victims:
            remaining = item.sampling.max_tokens - item.completion_tokens
            if remaining <= 0:
                continue  # finishing this step anyway
            status = self.queue.requeue(
                item.handle,
                len(item.prompt_token_ids) + item.completion_tokens,
                remaining,
                item.priority,
                item.deadline_ns,
                item.accepted_ns,
            )
            if status != PushStatus.ACCEPTED:
                continue  # closed (draining): let it finish where it is
            stopped.append(item.handle)
        if not stopped:
            return
        self._engine.abort_request([str(h) for h in stopped])
        for h in stopped:
            item = self._leave_engine(h)
            item.reserved_tokens = 0
            item.preemptions += 1
        self._metrics.preemptions.labels("priority").inc(len(stopped))

    @staticmethod
    def _fill_usage(delta: Delta, item: WorkItem, now: int, cached: int) -> None:
        # The client's prompt, also for a request resumed after preemption (whose engine prompt
        # carried its earlier output).
        delta.prompt_tokens = len(item.prompt_token_ids)
        delta.completion_tokens = item.completion_tokens
        delta.cached_tokens = cached
        delta.queue_ms = (item.admitted_ns - item.accepted_ns) / 1e6
        delta.ttft_ms = ((item.first_token_ns or now) - item.accepted_ns) / 1e6
        delta.total_ms = (now - item.accepted_ns) / 1e6
        delta.preemptions = item.preemptions
        if item.prediction is not None:
            delta.predicted_total_ms = item.prediction.mean_s * 1e3
        delta.refusal_predicted = item.refusal_predicted

    def _fail_all(self, message: str) -> None:
        err = RequestError(ErrorKind.UNAVAILABLE, message)
        victims = list(self._items.values())
        for item in victims:
            self._settle_refusal_prediction(item)
        self._items.clear()
        self._running.clear()
        self._held_blocks.clear()
        self._reserved_tokens = 0
        self._deliver([(item.mailbox, Delta(error=err)) for item in victims])

    def _deliver(self, out: list[tuple[Mailbox, Delta]]) -> None:
        """One event-loop hop per step, whatever the batch size."""
        self._loop.call_soon_threadsafe(_publish, out)


def _fixed_length(s: Sampling) -> bool:
    """The call runs exactly max_tokens steps (no EOS, no stop string can end it earlier)."""
    return (s.ignore_eos and not s.stop) or s.min_tokens >= s.max_tokens


def _tokens_to_compute(request: Any) -> int:
    """Tokens vLLM schedules for a request in its next step if the budget allows: the rest of
    its prompt while prefilling, one while decoding."""
    return max(1, int(request.num_tokens) - int(request.num_computed_tokens))


def _waiting_in_order(sched: Any) -> Iterator[Any]:
    """vLLM's waiting requests in the order its scheduler takes them (priority, arrival);
    nothing when requests that hold KV blocks go first (KV connectors)."""
    if getattr(sched, "kv_holding_waiting", None):
        return iter(())
    return iter(sched.waiting)


def _count_engine_preemptions(engine: Any, metrics: Metrics) -> None:
    """Count vLLM's own preemptions (KV exhausted: a running request is evicted and recomputed)
    when its scheduler runs in this process; KV-aware admission should keep this at zero."""
    scheduler = _scheduler(engine)
    original = getattr(scheduler, "_preempt_request", None)
    if original is None:
        return
    counter = metrics.preemptions.labels("engine")

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.inc()
        return original(*args, **kwargs)

    scheduler._preempt_request = counted  # type: ignore[union-attr]


def _publish(out: list[tuple[Mailbox, Delta]]) -> None:
    for box, delta in out:
        box.put(delta)
