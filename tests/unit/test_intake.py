"""Which queued calls the queue takes first (pyserver.engine.intake), without vLLM."""

from __future__ import annotations

import time

from pyserver.domain import Mailbox, Sampling, WorkItem
from pyserver.engine.intake import resident_prefix_preference
from pyserver.engine.kv_ledger import KvLedger

DOC = list(range(100, 116))  # four blocks of 4 tokens


def call(handle: int, prompt: list[int]) -> WorkItem:
    return WorkItem(
        handle=handle,
        request_id=str(handle),
        prompt_token_ids=prompt,
        sampling=Sampling(max_tokens=4),
        priority=0,
        deadline_ns=0,
        accepted_ns=time.monotonic_ns(),
        mailbox=Mailbox(),
    )


def test_queued_calls_with_a_mostly_resident_prompt_are_preferred() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=4)
    running = {1: call(1, [*DOC, 1])}
    kv.reserve(1, running[1].prompt_token_ids, 4)
    items = {
        1: running[1],
        2: call(2, [*DOC, 2, 3]),  # 16 of 18 tokens resident
        3: call(3, list(range(300, 318))),  # another document: cold
        4: call(4, [*DOC[:4], *range(400, 420)]),  # 4 of 24 resident: cold
        5: call(5, [*DOC, 5]),
    }
    assert resident_prefix_preference(items, running, kv) == [2, 5]
    kv.release(1)  # finished: its blocks stay cached until their room is needed
    del items[1]
    assert resident_prefix_preference(items, {}, kv) == [2, 5]
    # All resident, or none: the queue's own order stands.
    for subset in ((2, 5), (3, 4)):
        assert resident_prefix_preference({k: items[k] for k in subset}, {}, kv) == []


def test_without_a_prefix_cache_nothing_is_preferred() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=0)
    items = {1: call(1, [*DOC, 1]), 2: call(2, [*DOC, 2]), 3: call(3, [7] * 20)}
    kv.reserve(1, items[1].prompt_token_ids, 4)
    assert resident_prefix_preference(items, {1: items[1]}, kv) == []


def test_a_prefix_every_queued_call_shares_does_not_make_a_call_warm() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=4)
    running = {1: call(1, [*DOC, 1])}
    kv.reserve(1, running[1].prompt_token_ids, 4)
    items = {
        1: running[1],
        2: call(2, [*DOC[:8], 9]),  # only the shared system prompt resident: short, not warm
        3: call(3, [*DOC[:8], *range(500, 508), 1]),  # the same beyond it: cold
        4: call(4, [*DOC, 2]),  # the whole document: warm
    }
    assert resident_prefix_preference(items, running, kv) == [4]


def test_adapters_and_prompt_logprobs_are_not_served_from_the_base_models_cache() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=4)
    running = {1: call(1, [*DOC, 1])}
    kv.reserve(1, running[1].prompt_token_ids, 4)
    lora, logprobs, base = call(2, [*DOC, 2]), call(3, [*DOC, 3]), call(4, [*DOC, 4])
    lora.adapter = "sql"
    logprobs.sampling = Sampling(max_tokens=4, prompt_logprobs=1)
    items = {1: running[1], 2: lora, 3: logprobs, 4: base, 5: call(5, [7] * 20)}
    assert resident_prefix_preference(items, running, kv) == [4]
