"""streambatch's engine-side policy as a vLLM Scheduler subclass, passed through vLLM's
`scheduler_cls` so it runs wherever vLLM's engine core runs (in this process or its own).

The rules (pyserver.engine.prefill_hold): while a top-priority prompt prefills, lower-priority
prefills sit out the step and the step's token budget ends with the urgent prompts. On the CPU,
a seeded sampling prompt is never cut into chunks: vLLM's CPU backend cannot rewind a seeded
request's random generator after sampling the token it discards at the end of every chunk but
the last, and its engine fails there ("CPU Generator does not use offset"); such a prompt waits
until it fits whole, with the requests behind it. The subclass changes only its own state, and
only for the span of its own schedule(): the held running requests leave its running list and
come back behind every other running request (vLLM hands its token budget to running requests
in list order, so a prefill chunk ahead of decodes could take it all and make those streams
skip a step), held waiting requests leave its waiting queue and go back in their place (the
queue orders by priority, then arrival), and the budget goes back to the normal one.

And the worker may suspend requests (a priority preemption that keeps the request's KV blocks
and sampling state): a suspended request sits out every step, wherever vLLM keeps it, until
resumed, and does not count against vLLM's slots meanwhile. Only where the engine core runs in
this process (the worker reaches the scheduler object); elsewhere a preemption aborts and
requeues.

Configured through vLLM's `additional_config` (key "streambatch": `top_priority`, vLLM's
priority of streambatch's top level); imported by vLLM by qualified name, in the engine core's
process.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

from vllm.sampling_params import SamplingType
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from pyserver.engine.prefill_hold import hold_cut_prefills, plan_urgent_step

CONFIG_KEY = "streambatch"
QUALNAME = "pyserver.engine.adapter.scheduler.PriorityPrefillScheduler"
# Where vLLM schedules asynchronously (on a GPU: the next step is scheduled while the device
# runs this one), on top of its AsyncScheduler. Not exercised here: no GPU build of vLLM.
ASYNC_QUALNAME = "pyserver.engine.adapter.scheduler.AsyncPriorityPrefillScheduler"

# In-process schedulers by the id of their VllmConfig, the object LLMEngine hands its core.
_local: dict[int, weakref.ref[_PriorityPrefill]] = {}
_local_lock = threading.Lock()


class _PriorityPrefill(Scheduler):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        extra = self.vllm_config.additional_config
        conf = extra.get(CONFIG_KEY, {}) if isinstance(extra, dict) else {}
        self._top_priority = int(conf.get("top_priority", 0))
        self._normal_budget = int(self.max_num_scheduled_tokens)
        self._urgent_limit = int(self.scheduler_config.max_num_batched_tokens)
        self._cap_urgent_steps = False
        self._seeded_prompt_limit = seeded_prompt_limit(self.vllm_config)
        self._held_running_last = False
        self._suspended: set[str] = set()  # request ids kept out of every step (suspend())
        with _local_lock:
            _local[id(self.vllm_config)] = weakref.ref(self)

    def set_step_token_budget(self, tokens: int, *, cap_urgent_steps: bool) -> None:
        """The budget of normal steps from the next one on (a latency controller's knob; call
        it between steps, from the thread that steps the engine). With cap_urgent_steps no step,
        urgent or not, exceeds it: a step that prefills a whole prompt is a token gap for every
        other stream, which a latency SLO counts."""
        self._normal_budget = tokens
        self._cap_urgent_steps = cap_urgent_steps
        self.max_num_scheduled_tokens = tokens

    def suspend(self, request_ids: Iterable[str]) -> None:
        """Keep these requests out of every step until resumed, with their KV blocks and
        sampling state kept (call it between steps, from the thread that steps the engine)."""
        self._suspended.update(request_ids)

    def resume(self, request_ids: Iterable[str]) -> None:
        self._suspended.difference_update(request_ids)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if not self._suspended:
            return self._schedule_with_holds(*args, **kwargs)
        # Suspended requests leave the running list and the waiting queue for the span of the
        # step (vLLM's admission then counts only the others against its slots) and come back
        # behind the others; ids vLLM no longer has were finished or aborted: forgotten.
        self._suspended.intersection_update(self.requests)
        out_running = [r for r in self.running if r.request_id in self._suspended]
        out_waiting = [r for r in self.waiting if r.request_id in self._suspended]
        if out_running:
            self.running = [r for r in self.running if r.request_id not in self._suspended]
        if out_waiting:
            self.waiting.remove_requests(out_waiting)
        try:
            return self._schedule_with_holds(*args, **kwargs)
        finally:
            self.running = self.running + out_running
            for r in out_waiting:
                self.waiting.add_request(r)

    def _schedule_with_holds(self, *args: Any, **kwargs: Any) -> Any:
        # Requests that hold KV blocks (KV connectors) go before the waiting queue: the waiting
        # order is then not the one the rules size the budget for.
        holding = getattr(self, "kv_holding_waiting", None)
        waiting = [] if holding else list(self.waiting)
        limit = self._normal_budget if self._cap_urgent_steps else self._urgent_limit
        plan = plan_urgent_step(self.running, waiting, top=self._top_priority, limit=limit)
        held_running = plan.held if plan is not None else []
        budget = plan.token_budget if plan is not None else self._normal_budget
        held_waiting: list[Any] = []
        own_step = False
        if self._seeded_prompt_limit and any(_seeded_sampling(r) for r in waiting):
            held = {id(r) for r in held_running}
            whole = hold_cut_prefills(
                [r for r in self.running if id(r) not in held],
                waiting,
                budget=budget,
                limit=self._seeded_prompt_limit,
                whole=_seeded_sampling,
                may_hold_running=self._may_hold_running_for(waiting[0]),
            )
            held_waiting, budget, own_step = (
                whole.held_waiting,
                whole.token_budget,
                whole.hold_running,
            )
            if own_step:
                held_running = list(self.running)
        self._held_running_last = own_step
        if not held_running and not held_waiting and budget == self._normal_budget:
            return super().schedule(*args, **kwargs)
        if held_running:
            held = {id(r) for r in held_running}
            self.running = [r for r in self.running if id(r) not in held]
        if held_waiting:
            self.waiting.remove_requests(held_waiting)
        self.max_num_scheduled_tokens = budget
        try:
            return super().schedule(*args, **kwargs)
        finally:
            if held_running:
                self.running = self.running + held_running
            for r in held_waiting:
                self.waiting.add_request(r)
            self.max_num_scheduled_tokens = self._normal_budget

    def _may_hold_running_for(self, head: Any) -> bool:
        """Whether every running request may sit out the next step so that the seeded prompt
        first in line gets it whole: never two such steps in a row (the running requests must
        move on, to free what the prompt may wait for), never for a prompt vLLM would not take
        in now (a constraint still compiling), never one less urgent than a running request,
        and never where taking it in would exceed vLLM's slots."""
        return (
            not self._held_running_last
            and head.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            and all(head.priority <= r.priority for r in self.running)
            and len(self.running) < self.max_num_running_reqs
        )


def _seeded_sampling(request: Any) -> bool:
    """A request with its own seeded random generator (vLLM makes one for seeded sampling)."""
    params = request.sampling_params
    return params is not None and params.sampling_type == SamplingType.RANDOM_SEED


class PriorityPrefillScheduler(_PriorityPrefill):
    pass


class AsyncPriorityPrefillScheduler(_PriorityPrefill, AsyncScheduler):
    pass


def local_instance(vllm_config: Any) -> _PriorityPrefill | None:
    """The scheduler of the engine built from `vllm_config` if its core runs in this process."""
    with _local_lock:
        ref = _local.get(id(vllm_config))
    sched = ref() if ref is not None else None
    return sched if sched is not None and sched.vllm_config is vllm_config else None


def seeded_prompt_limit(vllm_config: Any) -> int:
    """The longest seeded sampling prompt this engine takes whole, 0 where prompts may be cut
    (not on the CPU). It is the longest prompt vLLM schedules in one step: its per-step
    maximum, or its long-prefill threshold when set (vLLM cuts every longer prompt to it)."""
    if vllm_config.device_config.device_type != "cpu":
        return 0
    scheduler_config = vllm_config.scheduler_config
    limit = int(scheduler_config.max_num_batched_tokens)
    threshold = int(scheduler_config.long_prefill_token_threshold or 0)
    return min(limit, threshold) if threshold > 0 else limit
