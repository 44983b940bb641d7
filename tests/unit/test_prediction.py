"""The finish-time predictor on step sequences like the engine's (no vLLM)."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest

from pyserver.domain import Mailbox, RequestError, Sampling, WorkItem
from pyserver.engine.deadlines import DeadlineAdmission, EngineView
from pyserver.engine.kv_ledger import KvLedger
from pyserver.engine.prediction import MIN_SAMPLES, FinishTimePredictor, Job, Prediction, Ratios
from pyserver.telemetry.metrics import Metrics


def mixed_steps(n: int, seed: int = 0) -> list[float]:
    """Decode steps of ~40 ms with one prefill step of ~110 ms in five, with jitter: the shape
    `make bench-step` measured on two CPU cores."""
    rng = random.Random(seed)
    return [(0.11 if rng.random() < 0.2 else 0.04) * rng.uniform(0.85, 1.25) for _ in range(n)]


def fed(steps: list[float]) -> FinishTimePredictor:
    p = FinishTimePredictor(0.95)
    for s in steps:
        p.observe_step(s)
        p.observe_first_token(s)
    return p


def test_a_call_of_many_mixed_steps_is_predicted_on_average_not_at_a_per_step_bound() -> None:
    steps = mixed_steps(4000)
    p = fed(steps[:1000])
    tokens = 64
    predicted = p.predict(Job(0, p.service_steps(tokens)), fixed_length=True, queued=False)
    # What 64-step calls later in the same sequence actually took.
    actual = [sum(steps[i : i + tokens]) for i in range(1000, 4000 - tokens, tokens)]
    ratio = float(np.median(actual)) / predicted.mean_s
    assert 0.85 <= ratio <= 1.15, ratio


def test_wait_is_simulated_slot_by_slot_and_lower_priorities_do_not_count() -> None:
    p = fed([0.05] * 10)
    job = Job(priority=0, steps=20)
    # Two slots, freeing after 10 and 30 steps; one same-priority request of 5 steps ahead
    # takes the first, so this one starts when that ends (step 15); a lower-priority request
    # queued earlier is not ahead of it.
    ahead = [Job(priority=0, steps=5), Job(priority=-1, steps=100)]
    assert p.wait_steps(job, [10, 30], ahead, slots=2) == 15
    assert p.wait_steps(job, [10], [], slots=2) == 0  # a free slot: no wait
    higher = [Job(priority=1, steps=50)] * 2
    assert p.wait_steps(job, [10, 30], higher, slots=2) == 60
    pred = p.predict(job, fixed_length=True, running=[10, 30], ahead=ahead, slots=2)
    assert pred.wait_raw_s == pytest.approx(15 * 0.05)
    assert pred.service_raw_s == pytest.approx(20 * 0.05)


def test_ratios_calibrate_the_mean_and_bound_the_fast_side() -> None:
    r = Ratios(prior_low=0.5)
    for _ in range(MIN_SAMPLES - 1):
        r.add(2.0)
    assert r.median() == 1.0 and r.low(0.95) == 0.5  # too few: prior
    rng = random.Random(1)
    for _ in range(500):
        r.add(rng.uniform(1.6, 2.4))
    assert r.median() == pytest.approx(2.0, abs=0.05)
    assert r.low(0.95) == pytest.approx(1.64, abs=0.04)
    r.add(float("inf"))
    r.add(0.0)
    assert r.low(0.95) > 1.5  # nonsense ratios are dropped


def test_a_predictor_that_runs_slow_learns_it_from_finished_calls() -> None:
    p = fed([0.04] * 50)
    for _ in range(100):
        pred = p.predict(Job(0, 50), fixed_length=True, queued=False)
        # The call took 1.5x its raw prediction (e.g. the batch grew after it was admitted).
        ratio = p.observe_finish(
            pred,
            priority=0,
            waited_s=0.0,
            served_s=pred.service_raw_s * 1.5,
            fixed_length=True,
        )
        assert ratio is not None
    pred = p.predict(Job(0, 50), fixed_length=True, queued=False)
    assert pred.mean_s == pytest.approx(50 * 0.04 * 1.5)
    assert pred.lower_s == pytest.approx(pred.mean_s)  # no spread seen, so none assumed


def test_refusal_bound_misses_at_most_the_stated_share() -> None:
    """Calls whose service varies +-40 % around the model: the lower bound at 95 % confidence
    is beaten by at most ~5 % of later calls, so refusing below it refuses few that would
    have made it."""
    rng = random.Random(2)
    p = fed([0.04] * 50)

    def run(pred: Prediction) -> float:
        return pred.service_raw_s * rng.uniform(0.6, 1.4)

    for _ in range(256):
        pred = p.predict(Job(0, 64), fixed_length=True, queued=False)
        p.observe_finish(pred, priority=0, waited_s=0.0, served_s=run(pred), fixed_length=True)
    pred = p.predict(Job(0, 64), fixed_length=True, queued=False)
    faster = sum(run(pred) < pred.lower_s for _ in range(4000)) / 4000
    assert faster <= 0.08, faster


def test_expected_length_with_eos_counts_calls_cut_at_max_tokens_as_at_least_that_long() -> None:
    p = FinishTimePredictor()
    assert p.expected_tokens(200, fixed_length=False) == 200  # nothing seen: max_tokens
    for tokens in (20, 40, 60):
        p.observe_length(tokens, cut_at_max=False)
    p.observe_length(32, cut_at_max=True)  # stopped by its own max_tokens of 32
    # E[min(L, 50)]: 20, 40, 50 and the censored call, which ran at least 32 -> 50.
    assert p.expected_tokens(50, fixed_length=False) == pytest.approx((20 + 40 + 50 + 50) / 4)
    assert p.expected_tokens(30, fixed_length=False) == pytest.approx((20 + 30 + 30 + 30) / 4)
    assert p.expected_tokens(30, fixed_length=True) == 30


def test_nothing_is_predicted_before_a_step_is_measured() -> None:
    p = FinishTimePredictor()
    assert not p.ready
    assert p.predict(Job(0, 10), fixed_length=True).mean_s == 0.0
    with pytest.raises(ValueError, match="confidence"):
        FinishTimePredictor(1.0)


def _admission(
    predictor: FinishTimePredictor, running: list[tuple[int, float]]
) -> tuple[DeadlineAdmission, EngineView]:
    """Deadline admission with `predictor`, and an engine running (priority, remaining steps)."""
    d = DeadlineAdmission("on", 0.95, Metrics(), top_priority=1, preempts_at_once=True)
    d.predictor = predictor
    view = EngineView(
        frozenset(range(len(running))),
        tuple(steps for _, steps in running),
        sum(1 for prio, _ in running if prio < 1),
        slots=len(running),
    )
    return d, view


def _item(handle: int, priority: int, max_tokens: int, deadline_s: float) -> WorkItem:
    now = time.monotonic_ns()
    return WorkItem(
        handle=handle,
        request_id=str(handle),
        prompt_token_ids=[1, 2, 3],
        sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
        priority=priority,
        deadline_ns=now + int(deadline_s * 1e9),
        accepted_ns=now,
        mailbox=Mailbox(),
    )


def test_a_top_priority_call_that_will_preempt_is_predicted_without_a_queue_wait() -> None:
    d, view = _admission(fed([0.05] * 20), running=[(0, 50.0), (0, 60.0)])  # full of low calls
    high, low = _item(100, 1, 20, 60.0), _item(101, 0, 20, 60.0)
    d.predict(high, 0, view, [])
    d.predict(low, 0, view, [])
    assert high.prediction.wait_raw_s == 0.0
    assert low.prediction.wait_raw_s == pytest.approx(50 * 0.05)


def test_the_worker_refuses_below_the_lower_bound_and_shadow_only_records() -> None:
    d, view = _admission(fed([0.05] * 20), running=[(0, 5.0)])
    # 200 fixed steps of 50 ms: at least 0.5 x 10 s (the prior) against a 2 s deadline.
    with pytest.raises(RequestError, match="predicted to finish in"):
        d.predict(_item(1, 0, 200, 2.0), 0, view, [])
    d.predict(fine := _item(2, 0, 200, 30.0), 0, view, [])
    assert not fine.refusal_predicted
    d.mode = "shadow"
    d.predict(late := _item(3, 0, 200, 2.0), 0, view, [])
    assert late.refusal_predicted


def test_a_flagged_call_is_counted_by_how_it_ended() -> None:
    """Shadow mode's error rate counts every flagged call, also one that missed (its client
    saw no final message carrying the flag)."""
    metrics = Metrics()
    d = DeadlineAdmission("shadow", 0.95, metrics, top_priority=1, preempts_at_once=True)
    count = metrics.refusal_predictions
    finished, missed = _item(1, 0, 10, 30.0), _item(2, 0, 10, 30.0)
    finished.refusal_predicted = missed.refusal_predicted = True
    finished.finished_ns = time.monotonic_ns()
    d.settle(finished)
    d.settle(missed)  # expired or cancelled: never finished
    d.settle(_item(3, 0, 10, 30.0))  # not flagged: not counted
    assert count.labels("finished")._value.get() == 1
    assert count.labels("missed")._value.get() == 1


def test_kv_reservation_counts_a_prompt_block_that_a_running_request_holds_once() -> None:
    kv = KvLedger(capacity_tokens=1000, block_size=4)
    doc = list(range(100, 112))  # three full blocks of a shared document
    reserved = (
        kv.reserve(1, [*doc, 1, 2], 8),
        kv.reserve(2, [*doc, 3, 4, 5, 6], 8),  # the document's blocks are shared, its own new
        kv.reserve(3, [0, *doc], 8),  # shifted by one token: no block matches
    )
    assert reserved == (14 + 8, 4 + 8, 13 + 8)
    assert kv.room == 1000 - sum(reserved)
    kv.release(1)
    assert kv.reserve(4, [*doc, 9], 8) == 1 + 8  # request 2 still holds the document
    for h in (2, 3, 4):
        kv.release(h)
    assert kv.reserved_tokens == 0 and kv.room == 1000
    assert kv.reserve(5, doc, 0) == 12  # no holder left: the document counts in full again
