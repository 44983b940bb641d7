"""The batching core through its Python bindings."""

from __future__ import annotations

import copy
import random
import sys
import threading
import time
from pathlib import Path

import pytest

from pyserver.batching import BatchQueue, ManualClock, PushStatus, ReleaseReason, make_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from queue_ref import ReferenceQueue

MS = 1_000_000


def quiet_config(**kw: object) -> object:
    base = {"max_wait_s": 0.0, "batch_window_s": 0.0, "release_on_urgent": False}
    base.update(kw)
    return make_config(**base)  # type: ignore[arg-type]


def test_priority_then_fifo() -> None:
    q = BatchQueue(quiet_config(), ManualClock())
    for rid, prio in [(1, 0), (2, 1), (3, 0), (4, 1)]:
        assert q.push(rid, 10, 1, prio) == PushStatus.ACCEPTED
    got = q.pop_batch(10, 1000)
    assert got.admitted == [2, 4, 1, 3]
    assert got.reason == ReleaseReason.WINDOW


def test_gil_is_released_while_pop_blocks() -> None:
    q = BatchQueue(quiet_config())
    counter = 0
    stop = threading.Event()

    def spin() -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    start = time.monotonic()
    baseline = counter
    got = q.pop_batch(8, 1000, timeout=0.3)  # blocks: nothing queued
    progressed = counter - baseline
    stop.set()
    spinner.join()
    assert got.reason == ReleaseReason.TIMEOUT
    assert time.monotonic() - start >= 0.29
    # With the GIL held for 0.3 s the spinner could not have counted at all.
    assert progressed > 10_000


def test_pop_wakes_on_push_from_another_thread() -> None:
    q = BatchQueue(quiet_config())
    threading.Timer(0.05, lambda: q.push(5, 1, 1)).start()
    got = q.pop_batch(8, 1000, timeout=5.0)
    assert got.admitted == [5]


def test_deadline_on_python_monotonic_clock() -> None:
    q = BatchQueue(quiet_config(batch_window_s=10.0))
    assert q.push(1, 1, 1, 0, time.monotonic_ns() + 30 * MS) == PushStatus.ACCEPTED
    got = q.pop_batch(8, 1000, timeout=2.0)
    assert got.expired == [1]
    assert got.admitted == []
    assert got.reason == ReleaseReason.EVICTED


def test_statuses_and_stats() -> None:
    q = BatchQueue(quiet_config(capacity=2), ManualClock())
    assert q.push(1, 1, 1) == PushStatus.ACCEPTED
    assert q.push(1, 1, 1) == PushStatus.DUPLICATE_ID
    assert q.push(2, 1, 1) == PushStatus.ACCEPTED
    assert q.push(3, 1, 1) == PushStatus.QUEUE_FULL
    assert q.cancel(2)
    q.close()
    assert q.push(4, 1, 1) == PushStatus.CLOSED
    got = q.pop_batch(8, 1000, timeout=1.0)
    assert got.reason == ReleaseReason.CLOSED
    assert got.admitted == [1]
    assert got.cancelled == [2]
    s = q.stats()
    assert (s.accepted, s.rejected_duplicate, s.rejected_full, s.rejected_closed, s.cancelled) == (
        2,
        1,
        1,
        1,
        1,
    )
    assert s.released["closed"] == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((-1, 1, 1, 0, 0), "id must be"),
        ((1, -1, 1, 0, 0), "prompt_tokens"),
        ((1, 1, -1, 0, 0), "max_new_tokens"),
        ((1, 1, 1, 7, 0), "priority must be in"),
        ((1, 1, 1, -1, 0), "priority must be in"),
        ((1, 1, 1, 0, -5), "deadline"),
        ((1, 1 << 50, 1, 0, 0), "prompt_tokens"),
        ((1, 2_000_000, 1, 0, 0), "more than max_batch_tokens"),
        ((1 << 70, 1, 1, 0, 0), "takes integers"),
        ((1, 1, 1, 1 << 40, 0), "takes integers"),
        (("x", 1, 1, 0, 0), "takes integers"),
        ((1, 1.5, 1, 0, 0), "takes integers"),
        ((1, None, 1, 0, 0), "takes integers"),
        ((1, 1), "takes integers"),
        ((1, 1, 1, 0, 0, 0), "takes integers"),
    ],
)
def test_bad_push_values_raise_value_error(args: tuple[object, ...], message: str) -> None:
    q = BatchQueue(quiet_config(), ManualClock())
    with pytest.raises(ValueError, match=message):
        q.push(*args)  # type: ignore[arg-type]
    assert q.push(1, 1, 1) == PushStatus.ACCEPTED  # still usable


def test_keyword_and_positional_push_agree() -> None:
    """push() has a fast path for positional ints; keywords go through the checked path."""
    q = BatchQueue(quiet_config(), ManualClock())
    assert q.push(1, 5, 5, 1, 0) == PushStatus.ACCEPTED
    assert q.push(id=2, prompt_tokens=5, max_new_tokens=5, priority=1) == PushStatus.ACCEPTED
    assert q.push(2, 5, 5) == PushStatus.DUPLICATE_ID
    assert q.push(id=1, prompt_tokens=5, max_new_tokens=5) == PushStatus.DUPLICATE_ID
    with pytest.raises(ValueError, match="priority must be in"):
        q.push(id=3, prompt_tokens=5, max_new_tokens=5, priority=9)
    assert q.pop_batch(8, 1 << 20).admitted == [1, 2]


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"priority_levels": 0}, "priority_levels"),
        ({"bucket_bounds": [10, 10]}, "ascending"),
        ({"capacity": 0}, "capacity"),
        ({"level_capacity": [1]}, "one entry per priority level"),
        ({"max_wait_s": -1.0}, "must be >= 0"),
        ({"lifo_after_s": -1.0}, "must be >= 0"),
        ({"lifo_after_s": 2.0, "oldest_first_after_s": 2.0}, "must be above lifo_after"),
        ({"lifo_backlog_s": -1.0}, "lifo_backlog must be >= 0"),
        ({"lifo_backlog_s": 3600.001}, "lifo_backlog must be at most 3600 s"),
        ({"oldest_first_turns": -0.5}, r"oldest_first_turns must be in \[0, 1e6\)"),
        ({"oldest_first_turns": float("nan")}, "oldest_first_turns"),
    ],
)
def test_bad_config_raises_value_error(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BatchQueue(quiet_config(**kw))


def test_bad_timeout_raises_value_error() -> None:
    q = BatchQueue(quiet_config())
    with pytest.raises(ValueError, match="timeout"):
        q.pop_batch(1, 1, timeout=float("nan"))
    with pytest.raises(ValueError, match="timeout"):
        q.pop_batch(1, 1, timeout=-1.0)


_ORDER_CASES = [
    (0, 0, 0, 0, 0),
    (5, 0, 0, 0, 0),
    (0, 4, 0, 0, 0),
    (5, 2, 0, 0, 0),
    (0, 0, 3, 0, 0),
    (5, 0, 1, 0, 0),
    (5, 2, 4, 0, 0),
    (0, 2, 0, 6, 0),
    (0, 0, 4, 3, 0),
    (9, 1, 4, 5, 0),
    (5, 0, 0, 2, 0),
    (0, 2, 0, 0, 8),
    (5, 1, 4, 0, 20),
    (0, 2, 0, 6, 4),
    (0, 0, 3, 0, 8),
]


@pytest.mark.parametrize(
    ("aging_ms", "lifo_ms", "overtakes", "oldest_first_ms", "backlog_ms", "turns"),
    # The turns only lengthen the oldest-first bound: with it, and without (0).
    [(*case, 0.0) for case in _ORDER_CASES] + [(*c, 2.0) for c in _ORDER_CASES if c[3]],
)
def test_same_order_as_the_python_reference(
    aging_ms: int, lifo_ms: int, overtakes: int, oldest_first_ms: int, backlog_ms: int, turns: float
) -> None:
    rng = random.Random(
        aging_ms + 11 + 100 * lifo_ms + 1000 * overtakes + 7 * oldest_first_ms + 13 * backlog_ms
    )
    bounds = [32, 128, 512]
    clock = ManualClock(1_000 * MS)
    core = BatchQueue(
        quiet_config(
            priority_levels=3,
            bucket_bounds=bounds,
            aging_interval_s=aging_ms / 1e3,
            lifo_after_s=lifo_ms / 1e3,
            affinity_max_overtakes=overtakes,
            oldest_first_after_s=oldest_first_ms / 1e3,
            oldest_first_turns=turns,
            lifo_backlog_s=backlog_ms / 1e3,
            capacity=100_000,
        ),
        clock,
    )
    ref = ReferenceQueue(
        3,
        bounds,
        aging_ms * MS,
        lifo_ms * MS,
        overtakes,
        oldest_first_ms * MS,
        lifo_backlog_ns=backlog_ms * MS,
        created_ns=clock.now_ns(),
        oldest_first_turns=turns,
    )
    next_id = 0
    drained = 0
    waiting: set[int] = set()
    pushed: dict[int, tuple[int, int, int, int]] = {}  # id: prompt, new tokens, level, when
    running: list[int] = []  # admitted, not put back: what a preemption may requeue
    cancelled = requeued = 0
    overtaken = 0  # pops whose order the preferred requests changed
    held_back = 0  # pops whose order the oldest-first bound changed
    turn_kept = 0  # pops whose order the turns changed (a request not yet overdue)
    kept_in_order = 0  # pops whose order the backlog rule changed
    reordered = 0  # pops whose order newest-first changed
    for round_ in range(300):
        # Bursts that outrun the pops, then lulls that drain them: levels turn newest-first
        # under a backlog and back to arrival order once it clears.
        for _ in range(rng.randint(0, 20 if round_ % 60 < 15 else 1)):
            prompt, new, prio = rng.randint(1, 1000), rng.randint(1, 64), rng.randint(0, 2)
            assert core.push(next_id, prompt, new, prio) == PushStatus.ACCEPTED
            ref.push(next_id, prompt, new, prio, clock.now_ns())
            pushed[next_id] = (prompt, new, prio, clock.now_ns())
            waiting.add(next_id)
            next_id += 1
        clock.advance_ns(rng.randint(0, 3) * MS)
        # A caller gone (or an id already admitted), and a preempted request put back.
        if waiting and rng.random() < 0.2:
            gone = rng.choice([*sorted(waiting), next_id - 1])
            assert core.cancel(gone) == ref.cancel(gone)
            cancelled += gone in waiting
            waiting.discard(gone)
        if running and rng.random() < 0.2:
            back = running.pop(rng.randrange(len(running)))
            prompt, new, prio, at = pushed[back]
            # As the worker puts one back: its output so far joins the prompt (the bucket
            # may change), the rest of its tokens still to come.
            done = rng.randint(0, new - 1)
            pushed[back] = (prompt + done, new - done, prio, at)
            assert core.requeue(back, prompt + done, new - done, prio, 0, at) == PushStatus.ACCEPTED
            assert ref.requeue(back, prompt + done, new - done, prio, at, clock.now_ns())
            waiting.add(back)
            requeued += 1
        max_req, max_tok = rng.randint(1, 16), rng.randint(50, 5000)
        # Some waiting requests preferred (a duplicate and an unknown id among them).
        preferred = [i for i in sorted(waiting) if rng.random() < 0.2]
        preferred += [*preferred[:1], next_id + 7]
        rng.shuffle(preferred)
        plain = copy.deepcopy(ref).pop_batch(max_req, max_tok, clock.now_ns())
        unbounded = copy.deepcopy(ref)
        unbounded._oldest_first_after = 0
        time_only = copy.deepcopy(ref)
        time_only._turns = 0.0
        time_only_order = time_only.pop_batch(max_req, max_tok, clock.now_ns(), preferred)
        unbounded_order = unbounded.pop_batch(max_req, max_tok, clock.now_ns(), preferred)
        any_backlog = copy.deepcopy(ref)
        any_backlog._lifo_backlog = 0
        any_backlog_order = any_backlog.pop_batch(max_req, max_tok, clock.now_ns(), preferred)
        arrival_order = copy.deepcopy(ref)
        arrival_order._lifo_after = 0
        arrival_order_pop = arrival_order.pop_batch(max_req, max_tok, clock.now_ns(), preferred)
        expected = ref.pop_batch(max_req, max_tok, clock.now_ns(), preferred)
        assert core.pop_batch(max_req, max_tok, preferred=preferred).admitted == expected
        overtaken += expected != plain
        held_back += expected != unbounded_order
        turn_kept += expected != time_only_order
        kept_in_order += expected != any_backlog_order
        reordered += expected != arrival_order_pop
        waiting -= set(expected)
        running += expected
        drained += round_ > 20 and len(ref) == 0
    assert len(core) == len(ref)
    assert cancelled > 10 and requeued > 10
    assert drained, "the lulls never cleared the backlog: arrival order after LIFO is untested"
    # With no overtake limit the preferred requests change nothing.
    assert overtaken > 10 if overtakes else overtaken == 0
    # The bound matters only where something overtakes: newest first or a preference.
    assert held_back > 5 if oldest_first_ms and (lifo_ms or overtakes) else held_back == 0
    # The turns change the order only where the bound does, and then they hold it back longer.
    if turns:
        assert turn_kept > 5 if lifo_ms or overtakes else turn_kept == 0
    # The backlog rule matters only where a level would turn newest first.
    assert kept_in_order > 5 if backlog_ms and lifo_ms else kept_in_order == 0
    # ... and leaves newest first acting where the backlog stands.
    assert reordered > 5 if lifo_ms else reordered == 0
