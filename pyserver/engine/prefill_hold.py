"""Which requests sit out an engine step while a top-priority prompt prefills (pure policy).

vLLM schedules every running request (prefill chunks included) before any waiting one, then
waiting ones in priority order, and preempts for priority only when KV blocks run out. Without
this rule a top-priority prompt waits behind low-priority prompt chunks; and with the budget
left over, a low-priority prompt would start in the urgent step, or the next urgent prompt be
cut into a chunk whose first token comes a step later anyway, both lengthening the step.

So while a top-priority request is prefilling (or waiting to), lower-priority requests that are
still prefilling sit out the step, and the step's token budget is sized to the running decodes
plus every top-priority prompt that fits whole (up to the engine's full budget). Urgent prompts
share one step rather than taking a step each: a step costs mostly its fixed part (on two CPU
cores 30-48 ms with the host's speed, against 0.24-0.26 ms per prompt token: `make bench-step`).
A waiting prompt counts in full: if the prefix cache holds part of it, the budget left over may
start the next waiting request's prefill early. Decodes are never held.

Applied inside vLLM's scheduler by pyserver.engine.adapter.scheduler; priorities here are
vLLM's (lower is more urgent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class EngineRequest(Protocol):
    """The fields of vLLM's Request the rule reads."""

    @property
    def priority(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...


R = TypeVar("R", bound=EngineRequest)


@dataclass(frozen=True, slots=True)
class StepPlan(Generic[R]):
    held: list[R]  # lower-priority prefills that sit out this step, in their running order
    token_budget: int  # this step's budget (prefill chunks + decodes)


def is_prefilling(request: EngineRequest) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens


def tokens_to_compute(request: EngineRequest) -> int:
    """Tokens vLLM schedules for a request in its next step if the budget allows: the rest of
    its prompt while prefilling, one while decoding."""
    return max(1, int(request.num_tokens) - int(request.num_computed_tokens))


def plan_urgent_step(
    running: Sequence[R], waiting: Iterable[R], *, top: int, limit: int
) -> StepPlan[R] | None:
    """The plan for the next step, or None when no request at vLLM priority `top` is prefilling
    or waiting (then the step runs as vLLM would). `waiting` is in the order vLLM takes it
    (priority, then arrival); `limit` is the most an urgent step may use."""
    waiting = list(waiting)
    if not any(r.priority <= top and is_prefilling(r) for r in running) and not any(
        r.priority <= top for r in waiting
    ):
        return None
    held = [r for r in running if r.priority > top and is_prefilling(r)]
    kept = [r for r in running if not (r.priority > top and is_prefilling(r))]
    need = sum(tokens_to_compute(r) for r in kept)
    urgent = any(is_prefilling(r) for r in kept)
    for r in waiting:
        if r.priority > top or need + tokens_to_compute(r) > limit:
            break
        need += tokens_to_compute(r)
        urgent = True
    return StepPlan(held, min(limit, need) if urgent else limit)


@dataclass(frozen=True, slots=True)
class WholePrefillPlan(Generic[R]):
    held_waiting: list[R]  # sit out the step, with their place in the queue kept
    hold_running: bool  # every running request sits out the step (a seeded prompt's own step)
    token_budget: int


def hold_cut_prefills(
    running: Sequence[R],
    waiting: Sequence[R],
    *,
    budget: int,
    limit: int,
    whole: Callable[[R], bool],
    may_hold_running: bool = True,
) -> WholePrefillPlan[R]:
    """The plan for the next step under which no request for which `whole` holds is cut into
    prompt chunks.

    Such a request is scheduled only when its whole remaining prompt fits in what the step has
    left after the running requests and the waiting ones ahead of it (each counted in full: the
    prefix cache only lowers what they take). When one ahead of it leaves too little, it and
    every request behind it sit out, so that nobody overtakes it. When it is first in line, it
    goes now: the step's budget grows to fit it (up to `limit`, the most a step may compute),
    and if even that is too little beside the running requests, the step is its own: the running
    requests and every waiting one behind it sit out (a one-step gap for their streams instead
    of a wait of many for it) when `may_hold_running` (the caller's guard: never two such steps
    in a row, so the running requests always move on; never for a prompt less urgent than one
    of them), else it waits with everything behind it. A request longer than
    `limit` cannot be helped and is left to vLLM (the server refuses such calls at submit).
    `waiting` is in the order vLLM takes it."""
    running_need = sum(tokens_to_compute(r) for r in running)
    left = budget - running_need
    for i, r in enumerate(waiting):
        need = tokens_to_compute(r)
        if whole(r) and left < need <= limit:
            if i > 0:
                return WholePrefillPlan(list(waiting[i:]), False, budget)
            if running_need + need <= limit:
                budget = max(budget, running_need + need)
                left = budget - running_need
            elif may_hold_running:  # its own step: nothing else may enter beside it
                return WholePrefillPlan(list(waiting[1:]), True, need)
            else:
                return WholePrefillPlan(list(waiting), False, budget)
        left -= need
    return WholePrefillPlan([], False, budget)
