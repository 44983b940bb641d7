"""What of the queue the engine takes in (pyserver.engine.intake), without vLLM."""

from __future__ import annotations

import time

from pyserver.domain import Mailbox, Sampling, WorkItem
from pyserver.engine.intake import plan_intake
from pyserver.engine.kv_ledger import KvLedger

DOC = list(range(100, 116))  # four blocks of 4 tokens


def call(handle: int, prompt: list[int], priority: int = 0) -> WorkItem:
    return WorkItem(
        handle=handle,
        request_id=str(handle),
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=4),
        priority=priority,
        deadline_ns=0,
        accepted_ns=time.monotonic_ns(),
        mailbox=Mailbox(),
    )


def started(kv: KvLedger, items: dict[int, WorkItem], *calls: WorkItem) -> dict[int, WorkItem]:
    """The calls entered the engine (in the ledger, among items); returns the running dict."""
    for c in calls:
        items[c.handle] = c
        kv.reserve(c.handle, c.prompt_token_ids, c.sampling.max_tokens)
    return {c.handle: c for c in calls}


def test_queued_calls_with_a_mostly_resident_prompt_are_preferred() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=4)
    items: dict[int, WorkItem] = {}
    running = started(kv, items, call(1, [*DOC, 1]))
    for c in (
        call(2, [*DOC, 2, 3]),  # 16 of 18 tokens resident
        call(3, list(range(300, 318))),  # another document: cold
        call(4, [*DOC[:4], *range(400, 420)]),  # 4 of 24 resident: cold
        call(5, [*DOC, 5]),
    ):
        items[c.handle] = c
    plan = plan_intake(items, running, kv, free=8, backlog_tokens=0, affinity=True, top=1)
    assert (plan.max_requests, plan.preferred) == (8, [2, 5])
    # The queue takes no preferred calls: nothing to compute.
    plan = plan_intake(items, running, kv, free=8, backlog_tokens=0, affinity=False, top=1)
    assert plan.preferred == []
    # All resident, or none: the queue's own order stands.
    for subset in ((1, 2, 5), (1, 3, 4)):
        some = {k: items[k] for k in subset}
        plan = plan_intake(some, running, kv, free=8, backlog_tokens=0, affinity=True, top=1)
        assert plan.preferred == []


def test_the_prefill_backlog_bounds_what_enters_but_never_the_top_level() -> None:
    kv = KvLedger(capacity_tokens=100_000, block_size=4)
    items: dict[int, WorkItem] = {}
    # Two admitted calls without a first token: 2 x 1,000 uncached prompt tokens pending.
    running = started(kv, items, call(1, list(range(1000))), call(2, list(range(5000, 6000))))
    for h in range(3, 13):  # ten queued calls of 1,000 tokens, nothing of them resident
        items[h] = call(h, list(range(10_000 * h, 10_000 * h + 1000)))

    def room(backlog: int) -> int:
        return plan_intake(
            items, running, kv, free=50, backlog_tokens=backlog, affinity=True, top=1
        ).max_requests

    assert room(0) == 50  # no bound
    assert room(5_000) == 3  # 3,000 tokens of room at 1,000 per call
    assert room(2_000) == 0  # full
    items[7].priority = 1  # a top-priority call waits: it enters whatever the backlog
    assert room(2_000) == 1
    items[7].priority = 0
    running[1].first_token_ns = running[2].first_token_ns = 1  # prefilled: decodes only
    assert room(2_000) == 2
    assert room(500) == 1  # a prompt longer than the bound still enters an idle engine


def test_a_resident_prefix_is_not_counted_as_prefill() -> None:
    kv = KvLedger(capacity_tokens=100_000, block_size=4)
    items: dict[int, WorkItem] = {}
    first = started(kv, items, call(1, [*DOC, 1]))
    started(kv, items, call(2, [*DOC, 2, 3]))
    assert kv.uncached_tokens(1) == 17 and kv.uncached_tokens(2) == 2
    kv.release(2)
    assert kv.uncached_tokens(2) == 0
    items[3] = call(3, [*DOC, 4, 5, 6])  # 3 uncached tokens queued
    del items[2]
    plan = plan_intake(items, first, kv, free=50, backlog_tokens=40, affinity=True, top=1)
    assert plan.max_requests == (40 - 17) // 3
