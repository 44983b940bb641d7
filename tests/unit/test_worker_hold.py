"""EngineWorker._hold_lower_prefills on a stand-in scheduler: which requests sit out a step."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from pyserver.engine.worker import EngineWorker


@dataclass
class Req:  # the fields of vllm.v1.request.Request the rule reads
    name: str
    priority: int  # vLLM's: -(our priority)
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens


def worker(
    running_items: list[Any], sched_running: list[Req], waiting: list[Req] | None = None
) -> EngineWorker:
    w = EngineWorker.__new__(EngineWorker)  # no engine: only the fields the rule reads
    w._sched = SimpleNamespace(
        running=sched_running,
        waiting=waiting or [],  # vLLM's RequestQueue iterates in its scheduling order
        kv_holding_waiting=[],
        max_num_scheduled_tokens=128,
    )
    w.max_step_tokens = 512
    w.step_token_budget = 128
    w._controller = None
    w._knob = "concurrency"
    w._top_priority = 1
    w._running = {i: it for i, it in enumerate(running_items)}
    return w


def item(priority: int, first_token_ns: int) -> Any:
    return SimpleNamespace(priority=priority, first_token_ns=first_token_ns)


def test_low_prefills_sit_out_while_a_top_request_prefills() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    low_decode = Req("low-decode", 0, 120, 100, 20)
    top_decode = Req("top-decode", -1, 90, 50, 40)
    w = worker([item(1, 0), item(0, 5)], [low_prefill, low_decode, top_decode])
    held = w._hold_lower_prefills()
    assert held == [low_prefill]
    assert w._sched.running == [low_decode, top_decode]  # decodes are never held
    assert w._sched.max_num_scheduled_tokens == 512  # the urgent prompt gets the full budget


def test_held_prefills_go_back_behind_the_decodes() -> None:
    # vLLM gives its token budget to running requests in list order: a prefill put back in
    # front would take the whole budget and make the decodes skip the next step.
    low_prefill = Req("low-prefill", 0, 32, 400)
    low_decode = Req("low-decode", 0, 120, 100, 20)
    w = worker([item(1, 0), item(0, 5)], [low_prefill, low_decode])
    held = w._hold_lower_prefills()
    top_now_decoding = Req("top", -1, 60, 50, 10)  # vLLM appended it when it took it in
    w._sched.running.append(top_now_decoding)
    assert held is not None
    w._release_held(held)
    assert w._sched.running == [low_decode, top_now_decoding, low_prefill]
    assert w._sched.max_num_scheduled_tokens == 128  # the normal steps' budget again


def test_with_a_token_budget_controller_the_urgent_step_keeps_its_budget() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    w = worker([item(1, 0), item(0, 0)], [low_prefill])
    w._controller, w._knob, w.step_token_budget = object(), "step_tokens", 96
    assert w._hold_lower_prefills() == [low_prefill]  # the urgent prompt still goes first
    assert w._sched.max_num_scheduled_tokens == 96  # but its step respects the latency SLO


def test_urgent_prompts_share_the_step_and_its_budget_ends_with_them() -> None:
    # A step costs mostly its fixed part: urgent prompts go together, whole, and nothing else
    # (no low-priority prompt, no chunk of one) lengthens their step.
    low_prefill = Req("low-prefill", 0, 32, 400)
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", -1, 60, 50, 10)]
    top_started = Req("top-started", -1, 64, 100)
    waiting = [Req("top-a", -1, 0, 90), Req("top-b", -1, 0, 130), Req("low-new", 0, 0, 50)]
    w = worker(
        [item(1, 0), item(1, 0), item(1, 0), item(0, 5)],
        [low_prefill, *decodes, top_started],
        waiting,
    )
    assert w._hold_lower_prefills() == [low_prefill]
    assert w._sched.running == [*decodes, top_started]
    assert w._sched.max_num_scheduled_tokens == 2 + 36 + 90 + 130


def test_an_urgent_prompt_that_does_not_fit_whole_waits_for_the_next_step() -> None:
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", 0, 60, 50, 10)]
    waiting = [Req("top-a", -1, 0, 300), Req("top-b", -1, 0, 300)]
    w = worker([item(1, 0), item(1, 0)], decodes, waiting)
    w._hold_lower_prefills()
    assert w._sched.max_num_scheduled_tokens == 2 + 300  # not 512: top-b is not cut in two


def test_an_urgent_prompt_longer_than_the_engines_budget_is_chunked() -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(3)]
    w = worker([item(1, 0)], decodes, [Req("top-huge", -1, 0, 2000)])
    w._hold_lower_prefills()
    assert w._sched.max_num_scheduled_tokens == 512


def test_a_lower_priority_waiting_head_leaves_the_budget_uncut() -> None:
    w = worker([item(1, 0)], [Req("d", 0, 120, 100, 20)], [Req("low-new", 0, 0, 90)])
    w._hold_lower_prefills()
    assert w._sched.max_num_scheduled_tokens == 512


def test_nothing_is_held_without_a_prefilling_top_request() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    w = worker([item(1, 123), item(0, 0)], [low_prefill])
    assert w._hold_lower_prefills() is None
    assert w._sched.running == [low_prefill]
    assert w._sched.max_num_scheduled_tokens == 128


def test_requests_holding_kv_blocks_go_first_so_the_budget_is_left_alone() -> None:
    w = worker([item(1, 0)], [Req("d", 0, 120, 100, 20)], [Req("top-new", -1, 0, 90)])
    w._sched.kv_holding_waiting = [Req("kv-loading", 0, 0, 90)]
    w._hold_lower_prefills()
    assert w._sched.max_num_scheduled_tokens == 512


def test_nothing_is_held_when_the_scheduler_is_in_another_process() -> None:
    w = worker([item(1, 0)], [])
    w._sched = None
    assert w._hold_lower_prefills() is None
