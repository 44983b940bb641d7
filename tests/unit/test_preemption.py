"""Priority preemption applied (pyserver.engine.preemption) with a recording engine in place of
vLLM: who is suspended or requeued, and when suspended requests go back."""

from __future__ import annotations

from typing import Any

from pyserver.batching import BatchQueue, PushStatus, make_config
from pyserver.engine.deadlines import DeadlineAdmission
from pyserver.engine.kv_ledger import KvLedger
from pyserver.engine.preemption import Preemption
from pyserver.telemetry.metrics import Metrics
from unit.test_admission import item


class RecordingEngine:
    max_model_len = 2048

    def __init__(self, *, can_suspend: bool = True) -> None:
        self.can_suspend = can_suspend
        self.calls: list[tuple[str, list[int]]] = []

    def suspend(self, handles: list[int]) -> None:
        self.calls.append(("suspend", list(handles)))

    def resume(self, handles: list[int]) -> None:
        self.calls.append(("resume", list(handles)))

    def abort(self, handles: list[int]) -> None:
        self.calls.append(("abort", list(handles)))


def setup(*, can_suspend: bool = True, kv_tokens: int = 100_000) -> tuple[Any, ...]:
    engine = RecordingEngine(can_suspend=can_suspend)
    queue = BatchQueue(make_config(priority_levels=2, max_wait_s=0.0, batch_window_s=0.0))
    metrics = Metrics()
    deadlines = DeadlineAdmission("shadow", 0.95, metrics, top_priority=1, preempts_at_once=True)
    kv = KvLedger(kv_tokens, 0)
    p = Preemption(
        engine,
        queue,
        kv,
        deadlines,
        metrics,
        top=1,
        after_s=0.0,
        suspend=True,  # type: ignore[arg-type]
    )
    return p, engine, queue


def test_a_full_engine_suspends_the_least_progressed_low_request_for_a_top_one() -> None:
    p, engine, queue = setup()
    running = {h: item(h, 0, done=d) for h, d in [(1, 9), (2, 3), (3, 5)]}
    assert queue.push(10, 8, 8, 1, 0) == PushStatus.ACCEPTED
    assert p.preempt(running, limit=3) == []  # nothing to take off the books: suspended
    assert engine.calls == [("suspend", [2])]
    assert set(running) == {1, 3} and set(p.suspended) == {2}
    assert p.suspended[2].preemptions == 1


def test_without_suspension_the_victim_is_aborted_and_requeued() -> None:
    p, engine, queue = setup(can_suspend=False)
    running = {h: item(h, 0, done=d) for h, d in [(1, 9), (2, 3)]}
    queue.push(10, 8, 8, 1, 0)
    assert p.preempt(running, limit=2) == [2]
    assert engine.calls == [("abort", [2])]
    assert queue.stats().requeued == 1 and not p.suspended


def test_too_little_kv_room_for_the_waiting_top_requests_requeues_instead() -> None:
    p, engine, queue = setup(kv_tokens=1000)  # less than one 2048-token request
    running = {h: item(h, 0, done=3) for h in (1, 2)}
    queue.push(10, 8, 8, 1, 0)
    assert p.preempt(running, limit=2) == [1]
    assert engine.calls == [("abort", [1])]


def test_suspended_requests_wait_for_queued_higher_ones_unless_nothing_runs() -> None:
    p, engine, queue = setup()
    running = {h: item(h, 0, done=3) for h in (1, 2)}
    queue.push(10, 8, 8, 1, 0)
    p.preempt(running, limit=2)
    assert queue.cancel(10)  # (it entered the engine)
    queue.push(11, 8, 8, 1, 0)  # another top-priority call waits
    p.resume(running, free=1)  # the free slot is the queued top call's
    assert 1 in p.suspended
    p.resume(running, free=2)  # one for it, one back
    assert 1 in running and not p.suspended
    assert engine.calls[-1] == ("resume", [1])
    p.preempt(running, limit=2)
    running.clear()  # everything else left: it goes back even before queued top calls
    p.resume(running, free=2)
    assert not p.suspended and len(running) == 1


def test_a_suspended_request_that_was_stepped_anyway_runs_again_and_is_counted() -> None:
    p, engine, queue = setup()
    running = {h: item(h, 0, done=3) for h in (1, 2)}
    queue.push(10, 8, 8, 1, 0)
    p.preempt(running, limit=2)
    assert p.take_back_stepped([2, 1], running) == 1
    assert set(running) == {1, 2} and engine.calls[-1] == ("resume", [1])
