"""How many queued requests may enter the engine, and which running ones a top-priority
request preempts (pure policy over counts and WorkItems; the worker applies it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

from pyserver.batching import BatchQueue, PushStatus
from pyserver.domain import Sampling, WorkItem


def admission_room(
    *, limit: int, running: int, running_top: int, reserved_top: int, top_waiting: int
) -> int:
    """Requests to take from the queue now. With reserved top-priority slots, requests below
    the top level may fill only limit - reserved slots; the rest is taken only by as many
    top-level requests as are waiting. The queue hands out the highest (effective) priority
    first, so the first `top_take` of a batch are those."""
    free = limit - running
    reserved = min(reserved_top, limit - 1)
    if free <= 0 or reserved <= 0:
        return free
    top_take = min(top_waiting, free)
    low_room = limit - reserved - (running - running_top)
    # Top-level requests beyond the reserve also use the shared slots.
    low_room -= max(0, running_top - reserved)
    return min(free, top_take + max(0, low_room))


def preemption_victims(
    running: Iterable[WorkItem],
    *,
    top: int,
    needed: int,
    can_wait: Callable[[WorkItem], bool],
) -> list[WorkItem]:
    """The running requests to abort and requeue for `needed` waiting top-priority ones: the
    lowest priority first, and of those the least progressed (least work thrown away), never
    one that could not wait as long as it has left to run and still finish in time, nor one
    whose sampling would not resume as it was (Sampling.resumable)."""
    candidates = (
        it for it in running if it.priority < top and it.sampling.resumable and can_wait(it)
    )
    return sorted(candidates, key=lambda it: (it.priority, it.completion_tokens))[: max(1, needed)]


def can_wait_for(item: WorkItem, now: int, remaining_service_s: float) -> bool:
    """A request with a deadline is preempted only if it could wait as long as it has left to
    run and still finish in time, so preemption never turns a request that was admitted in
    time into one that misses its deadline."""
    if not item.deadline_ns:
        return True
    return (item.deadline_ns - now) / 1e9 > 2 * remaining_service_s


def requeue_for_top_priority(
    queue: BatchQueue,
    running: dict[int, WorkItem],
    *,
    top: int,
    free: int,
    kv_room: int,
    after_ns: int,
    can_wait: Callable[[WorkItem], bool],
) -> list[int]:
    """Put back in the queue (at the front of their level) the running requests that waiting
    top-priority ones preempt, when those have waited `after_ns` and the engine has no room for
    them; returns their handles, for the caller to abort in the engine. A requeued request keeps
    its generated tokens: admitted again, it resumes where it stopped."""
    stats = queue.stats()
    waiting = sum(stats.depth[top])
    if kv_room > 0 and waiting <= free:
        return []  # admission takes them all this iteration (reserved slots included)
    if not waiting or stats.oldest_wait_ns_by_level[top] < after_ns:
        return []
    stopped: list[int] = []
    for item in preemption_victims(
        running.values(), top=top, needed=waiting - free, can_wait=can_wait
    ):
        remaining = item.sampling.max_tokens - item.completion_tokens
        if remaining <= 0:
            continue  # finishing this step anyway
        status = queue.requeue(
            item.handle,
            len(item.prompt_token_ids) + item.completion_tokens,
            remaining,
            item.priority,
            item.deadline_ns,
            item.accepted_ns,
        )
        if status == PushStatus.ACCEPTED:  # else closed (draining): it finishes where it is
            stopped.append(item.handle)
    return stopped


def resumed(item: WorkItem) -> tuple[list[int], Sampling]:
    """The prompt and sampling to hand the engine: a request resumed after a preemption carries
    its earlier output in its prompt and has that much less to generate."""
    if not item.output_token_ids:
        return item.prompt_token_ids, item.sampling
    # The time spent requeued is not a step's inter-token latency: the controller must not
    # shrink the step budget for it (the client sees it; the bench counts it).
    item.last_token_ns = 0
    s = item.sampling
    return item.prompt_token_ids + item.output_token_ids, dataclasses.replace(
        s,
        max_tokens=s.max_tokens - item.completion_tokens,
        min_tokens=max(0, s.min_tokens - item.completion_tokens),
        prompt_logprobs=None,  # sent with the first admission; the prompt now holds output
    )
