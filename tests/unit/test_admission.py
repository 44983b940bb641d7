"""Admission room, victim choice and resumption (pyserver.engine.admission), without vLLM."""

from __future__ import annotations

import math
import time

from pyserver.domain import Mailbox, Sampling, Structured, WorkItem
from pyserver.engine.admission import (
    admission_room,
    deadline_slack,
    preemption_victims,
    resumed,
)
from pyserver.engine.kv_ledger import KvLedger


def item(handle: int, priority: int, done: int = 0, deadline_s: float = 0.0) -> WorkItem:
    now = time.monotonic_ns()
    it = WorkItem(
        handle=handle,
        request_id=str(handle),
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=20, min_tokens=5),
        priority=priority,
        deadline_ns=now + int(deadline_s * 1e9) if deadline_s else 0,
        accepted_ns=now,
        mailbox=Mailbox(),
    )
    it.completion_tokens = done
    it.output_token_ids = list(range(done))
    return it


def test_without_a_reserve_every_free_slot_is_room() -> None:
    room = admission_room(limit=8, running=5, running_top=0, reserved_top=0, top_waiting=0)
    assert room == 3


def test_reserved_slots_take_only_waiting_top_requests() -> None:
    # 8 slots, 2 reserved: 6 low requests fill the shared part; the reserve waits for top ones.
    assert admission_room(limit=8, running=6, running_top=0, reserved_top=2, top_waiting=0) == 0
    assert admission_room(limit=8, running=6, running_top=0, reserved_top=2, top_waiting=1) == 1
    # Top requests beyond the reserve use shared slots: of 6, 4 low and 1 top leave 1.
    assert admission_room(limit=8, running=7, running_top=3, reserved_top=2, top_waiting=0) == 1
    assert admission_room(limit=8, running=7, running_top=1, reserved_top=2, top_waiting=0) == 0


def test_victims_are_the_lowest_priority_least_progressed_that_can_wait() -> None:
    running = [item(1, 1, 10), item(2, 0, 30), item(3, 0, 5), item(4, 0, 1, deadline_s=0.5)]
    slack = {4: 1.5}  # could neither wait its rest nor is it predicted to miss: kept
    victims = preemption_victims(
        running, top=2, needed=2, slack=lambda it: slack.get(it.handle, math.inf)
    )
    assert [v.handle for v in victims] == [3, 2]


def test_requests_predicted_to_miss_anyway_go_first() -> None:
    """Stopping a request whose deadline is lost anyway costs its caller nothing; stopping one
    that would still finish may cost it the deadline."""
    running = [item(1, 0, 2), item(2, 0, 40), item(3, 0, 1), item(4, 1, 0)]
    slack = {1: math.inf, 2: 0.6, 3: 1.9, 4: 0.1}
    victims = preemption_victims(running, top=2, needed=3, slack=lambda it: slack[it.handle])
    # Level 0 before level 1; in level 0 the doomed one (2) before the free one (1); 3 kept.
    assert [v.handle for v in victims] == [2, 1, 4]


def test_slack_bounds_are_exclusive_and_the_doomed_go_least_progressed_first() -> None:
    running = [item(1, 0, 9), item(2, 0, 3), item(3, 0, 1), item(4, 0, 1), item(5, 0, 0)]
    # 1 and 2 are doomed (one already past its deadline), 3 and 4 sit exactly on the bounds.
    slack = {1: 0.2, 2: -0.5, 3: 1.0, 4: 2.0, 5: math.inf}
    victims = preemption_victims(running, top=1, needed=5, slack=lambda it: slack[it.handle])
    assert [v.handle for v in victims] == [2, 1, 5]


def test_slack_is_time_left_over_predicted_remaining() -> None:
    now = time.monotonic_ns()
    assert deadline_slack(item(1, 0), now, remaining_service_s=100.0) == math.inf
    assert deadline_slack(item(2, 0, deadline_s=10.0), now, remaining_service_s=4.0) > 2
    assert 1 < deadline_slack(item(3, 0, deadline_s=10.0), now, remaining_service_s=6.0) < 2
    assert deadline_slack(item(4, 0, deadline_s=10.0), now, remaining_service_s=12.0) < 1
    # No prediction yet (a mean of 0): any deadline is far away, not a division by zero.
    assert deadline_slack(item(5, 0, deadline_s=10.0), now, remaining_service_s=0.0) > 2


def test_a_resumed_request_carries_its_output_and_has_that_much_less_to_go() -> None:
    fresh = item(1, 0)
    assert resumed(fresh) == (fresh.prompt_token_ids, fresh.sampling)
    back = item(2, 0, done=7)
    back.last_token_ns = 123
    prompt, sampling = resumed(back)
    assert prompt == [1, 2, 3, *range(7)]
    assert (sampling.max_tokens, sampling.min_tokens) == (13, 0)
    assert back.last_token_ns == 0  # the requeued time is not an inter-token gap


def test_constrained_and_penalised_requests_are_never_victims() -> None:
    """Resuming moves the output into the prompt: a constraint's state and the presence and
    frequency penalties' output history would restart from nothing, so those keep running."""
    constrained, penalised, plain = item(1, 0, 1), item(2, 0, 1), item(3, 0, 9)
    constrained.sampling = Sampling(max_tokens=20, structured=Structured("regex", "[0-9]+"))
    penalised.sampling = Sampling(max_tokens=20, frequency_penalty=0.5)
    victims = preemption_victims(
        [constrained, penalised, plain], top=1, needed=3, slack=lambda it: math.inf
    )
    assert [v.handle for v in victims] == [3]


def test_a_suspending_engine_may_stop_any_lower_request() -> None:
    """Suspended in the engine, a request keeps its constraint and penalty state."""
    constrained, plain = item(1, 0, 1), item(3, 0, 9)
    constrained.sampling = Sampling(max_tokens=20, structured=Structured("regex", "[0-9]+"))
    victims = preemption_victims(
        [constrained, plain], top=1, needed=1, slack=lambda it: math.inf, keeps_state=True
    )
    assert [v.handle for v in victims] == [1]  # the least progressed


def test_a_resumed_request_does_not_ask_for_its_prompt_logprobs_again() -> None:
    it = item(1, 0, done=4)
    it.sampling = Sampling(max_tokens=20, prompt_logprobs=2, logprobs=1)
    _, sampling = resumed(it)
    assert sampling.prompt_logprobs is None and sampling.logprobs == 1


def test_released_blocks_stay_resident_until_their_room_is_needed() -> None:
    kv = KvLedger(capacity_tokens=40, block_size=4)  # room for 10 blocks
    doc_a, doc_b = list(range(100, 112)), list(range(200, 212))  # three blocks each
    kv.reserve(1, [*doc_a, 1], 3)  # 16 tokens
    assert kv.resident_tokens(kv.block_hashes([*doc_a, 7])) == 12  # held by request 1
    kv.release(1)
    assert kv.resident_tokens(kv.block_hashes(doc_a)) == 12  # released, not yet evicted
    kv.reserve(2, [*doc_b, 1, 2, 3, 4, 5], 11)  # 28 tokens: 12 left, room for 3 cached blocks
    assert kv.resident_tokens(kv.block_hashes(doc_a)) == 12
    kv.reserve(3, [9, 9, 9, 9], 0)  # 8 left: the least recently released block goes first
    # doc_a's last block is evicted before its head (vLLM frees a prompt tail first).
    assert kv.resident_tokens(kv.block_hashes(doc_a)) == 8
    kv.reserve(4, [8, 8, 8, 8], 4)  # nothing left
    assert kv.resident_tokens(kv.block_hashes(doc_a)) == 0
    assert kv.resident_tokens(kv.block_hashes(doc_b)) == 12  # held by request 2


def test_without_a_prefix_cache_nothing_is_resident() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=0)
    kv.reserve(1, list(range(64)), 8)
    kv.release(1)
    assert not kv.tracks_prefixes and kv.block_hashes(list(range(64))) == []
    assert kv.resident_tokens(kv.block_hashes(list(range(64)))) == 0
