"""PriorityPrefillScheduler applies the prefill rule around vLLM's own schedule(): what vLLM's
schedule() sees while the rule holds, and what the scheduler holds after it. vLLM's schedule()
is replaced here by a recorder (a test seam only: the server never patches vLLM)."""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.core.sched.scheduler import Scheduler

from pyserver.engine.adapter.scheduler import PriorityPrefillScheduler
from unit.test_prefill_hold import Req


@pytest.fixture
def seen(monkeypatch: pytest.MonkeyPatch) -> list[tuple[list[str], int]]:
    calls: list[tuple[list[str], int]] = []

    def schedule(self: Any, *args: Any, **kwargs: Any) -> str:
        calls.append(([r.name for r in self.running], self.max_num_scheduled_tokens))
        self.running.append(Req("taken-in", -1, 50, 50, 1))  # vLLM moved a waiting one in
        return "scheduler-output"

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    return calls


def scheduler(running: list[Req], waiting: list[Req]) -> Any:
    s = PriorityPrefillScheduler.__new__(PriorityPrefillScheduler)  # no engine: the rule's state
    s.running, s.waiting = running, waiting
    s.max_num_scheduled_tokens = 128
    s._top_priority, s._normal_budget, s._urgent_limit, s._cap_urgent_steps = -1, 128, 512, False
    return s


def test_held_prefills_sit_out_and_go_back_behind_the_others(seen: list[Any]) -> None:
    low_prefill, low_decode = Req("low-prefill", 0, 32, 400), Req("low-decode", 0, 120, 100, 20)
    s = scheduler([low_prefill, low_decode], [Req("top", -1, 0, 90)])
    assert s.schedule() == "scheduler-output"
    assert seen == [(["low-decode"], 1 + 90)]
    # vLLM hands its budget to running requests in list order: a prefill put back in front
    # would take it all and make the decodes skip the next step.
    assert [r.name for r in s.running] == ["low-decode", "taken-in", "low-prefill"]
    assert s.max_num_scheduled_tokens == 128  # the normal steps' budget again


def test_without_an_urgent_prompt_vllm_schedules_untouched(seen: list[Any]) -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    s = scheduler([low_prefill], [Req("low-new", 0, 0, 90)])
    s.schedule()
    assert seen == [(["low-prefill"], 128)]


def test_the_controllers_budget_caps_urgent_steps_too(seen: list[Any]) -> None:
    s = scheduler([Req("low-prefill", 0, 32, 400)], [Req("top", -1, 0, 300)])
    s.set_step_token_budget(96, cap_urgent_steps=True)
    s.schedule()
    assert seen == [([], 96)]
    assert s.max_num_scheduled_tokens == 96


def test_requests_holding_kv_blocks_go_first_so_the_budget_is_left_alone(seen: list[Any]) -> None:
    s = scheduler([Req("d", 0, 120, 100, 20)], [Req("top-new", -1, 0, 90)])
    s.kv_holding_waiting = [Req("kv-loading", 0, 0, 90)]
    s.schedule()
    assert seen == [(["d"], 128)]
