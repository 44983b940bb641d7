"""How many queued requests may enter the engine, and which running ones a top-priority
request preempts (pure policy over counts and WorkItems; the worker applies it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable

from pyserver.batching import BatchQueue, PushStatus
from pyserver.domain import ErrorKind, RequestError, Sampling, WorkItem


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
    slack: Callable[[WorkItem], float],
    keeps_state: bool = False,
) -> list[WorkItem]:
    """The running requests to stop for `needed` waiting top-priority ones. Unless the engine
    keeps their state (`keeps_state`: suspended in it, not aborted and requeued), never one
    whose sampling would not resume as it was (Sampling.resumable). By `slack` (time to
    its deadline ÷ predicted remaining time, inf without a deadline) a request may be stopped
    when it could wait as long as it has left to run and still finish in time (slack > 2), or
    when it is predicted to miss its deadline anyway (slack < 1: more likely than not to miss,
    so stopping it costs its caller little); it is kept in between. The lowest priority first;
    in a level, the ones predicted to miss first, then the least progressed (least work thrown
    away)."""
    candidates = []
    for it in running:
        if it.priority >= top or not (keeps_state or it.sampling.resumable):
            continue
        s = slack(it)
        if s > 2.0 or s < 1.0:
            candidates.append((it.priority, s >= 1.0, it.completion_tokens, it))
    candidates.sort(key=lambda c: c[:3])
    return [c[3] for c in candidates[: max(1, needed)]]


def deadline_slack(item: WorkItem, now: int, remaining_service_s: float) -> float:
    """Time left to the request's deadline ÷ its predicted remaining service time (inf with no
    deadline): above 2 it can wait as long as it has left to run and still finish in time;
    below 1 it is predicted to miss."""
    if not item.deadline_ns:
        return math.inf
    return (item.deadline_ns - now) / 1e9 / max(remaining_service_s, 1e-9)


def top_priority_victims(
    queue: BatchQueue,
    running: dict[int, WorkItem],
    *,
    top: int,
    free: int,
    kv_room: int,
    after_ns: int,
    slack: Callable[[WorkItem], float],
    keeps_state: bool = False,
) -> list[WorkItem]:
    """The running requests that waiting top-priority ones preempt, when those have waited
    `after_ns` and the engine has no room for them (preemption_victims chooses; one about to
    generate its last token finishes this step anyway and is left)."""
    stats = queue.stats()
    waiting = sum(stats.depth[top])
    if kv_room > 0 and waiting <= free:
        return []  # admission takes them all this iteration (reserved slots included)
    if not waiting or stats.oldest_wait_ns_by_level[top] < after_ns:
        return []
    victims = preemption_victims(
        running.values(), top=top, needed=waiting - free, slack=slack, keeps_state=keeps_state
    )
    return [it for it in victims if it.sampling.max_tokens > it.completion_tokens]


def requeue(queue: BatchQueue, item: WorkItem) -> bool:
    """Put a preempted request back in the queue, at the front of its level; it keeps its
    generated tokens and, admitted again, resumes where it stopped. False when the queue is
    closed (draining): it then finishes where it is."""
    status = queue.requeue(
        item.handle,
        len(item.prompt_token_ids) + item.completion_tokens,
        item.sampling.max_tokens - item.completion_tokens,
        item.priority,
        item.deadline_ns,
        item.accepted_ns,
    )
    return status == PushStatus.ACCEPTED


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


def queue_refusal(
    status: PushStatus, item: WorkItem, retry_after_ms: Callable[[], int]
) -> RequestError:
    """The error for a request the queue did not accept."""
    if status == PushStatus.QUEUE_FULL:
        return RequestError(
            ErrorKind.OVERLOADED,
            "the request queue is full; retry later",
            retry_after_ms=retry_after_ms(),
        )
    if status == PushStatus.CLOSED:
        return RequestError(ErrorKind.UNAVAILABLE, "shutting down; retry on another replica")
    cost = len(item.prompt_token_ids) + item.sampling.max_tokens
    return RequestError(ErrorKind.INVALID, f"request rejected by the queue ({cost} tokens)")
