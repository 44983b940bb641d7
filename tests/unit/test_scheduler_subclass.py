"""PriorityPrefillScheduler applies the prefill rule around vLLM's own schedule(): what vLLM's
schedule() sees while the rule holds, and what the scheduler holds after it. vLLM's schedule()
is replaced here by a recorder (a test seam only: the server never patches vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

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
    s._seeded_prompt_limit, s._held_running_last = 0, False  # 0: not the CPU's rule
    s.max_num_running_reqs = 32
    s._suspended = set()
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


def test_suspended_requests_sit_out_every_step_until_resumed(seen: list[Any]) -> None:
    a, b, c = Req("a", 0, 120, 100, 20), Req("b", 0, 130, 100, 30), Req("c", 0, 110, 100, 10)
    s = scheduler([a, b, c], [])
    s.waiting = Waiting([Req("w", 0, 0, 40)])
    s.requests = {r.name: r for r in [a, b, c, *s.waiting]}
    s.suspend(["b", "w"])
    s.schedule()
    s.schedule()
    # Out of vLLM's view for the step (its slots count only the others), then back behind.
    assert seen == [(["a", "c"], 128), (["a", "c", "taken-in"], 128)]
    assert [r.name for r in s.running] == ["a", "c", "taken-in", "taken-in", "b"]
    assert [r.name for r in s.waiting] == ["w"]
    s.resume(["b"])
    s.schedule()
    assert seen[-1][0] == ["a", "c", "taken-in", "taken-in", "b"]


def test_a_suspended_request_that_left_the_engine_is_forgotten(seen: list[Any]) -> None:
    s = scheduler([Req("a", 0, 120, 100, 20)], [])
    s.waiting = Waiting([])
    s.requests = {"a": s.running[0]}
    s.suspend(["aborted"])  # aborted between steps: vLLM no longer has it
    s.schedule()
    assert s._suspended == set()


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


@dataclass
class SeededReq(Req):
    sampling_params: SamplingParams | None = None
    status: RequestStatus = RequestStatus.WAITING

    def __hash__(self) -> int:
        return id(self)


class Waiting(list[Req]):
    """vLLM's priority queue's interface, in order of insertion (the test's requests arrive in
    priority order)."""

    def remove_requests(self, requests: list[Req]) -> None:
        gone = {id(r) for r in requests}
        self[:] = [r for r in self if id(r) not in gone]

    def add_request(self, request: Req) -> None:
        self.append(request)


def test_a_seeded_prompt_that_would_be_cut_leaves_the_queue_for_the_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    queued: list[list[str]] = []

    def schedule(self: Any, *args: Any, **kwargs: Any) -> str:
        queued.append([r.name for r in self.waiting])
        return "scheduler-output"

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    sampled = SamplingParams(temperature=1.0, seed=3)
    ahead = SeededReq("new", 0, 0, 100, sampling_params=SamplingParams(temperature=1.0))
    cut = SeededReq("seeded", 0, 0, 60, sampling_params=sampled)
    behind = SeededReq("later", 0, 0, 5, sampling_params=SamplingParams(temperature=0.0))
    s = scheduler([Req("d", 0, 120, 100, 20)], [])
    s.waiting = Waiting([ahead, cut, behind])
    s._seeded_prompt_limit = 512
    assert s.schedule() == "scheduler-output"
    assert queued == [["new"]]  # 1 + 100 of 128 leave 27: the 60-token prompt would be cut
    assert [r.name for r in s.waiting] == ["new", "seeded", "later"]
    assert s.max_num_scheduled_tokens == 128
    # Greedy and unseeded sampling have no generator to rewind: nothing held for them.
    s.waiting = Waiting(
        [
            ahead,
            behind,
            SeededReq(
                "greedy-seed", 0, 0, 60, sampling_params=SamplingParams(seed=3, temperature=0.0)
            ),
        ]
    )
    s.schedule()
    assert queued[-1] == ["new", "later", "greedy-seed"]


def test_a_seeded_prompt_first_in_line_gets_its_own_step_and_the_decodes_come_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    seen: list[tuple[list[str], list[str], int]] = []

    def schedule(self: Any, *args: Any, **kwargs: Any) -> str:
        seen.append(([r.name for r in self.running], [r.name for r in self.waiting],
                     self.max_num_scheduled_tokens))  # fmt: skip
        return "scheduler-output"

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    prompt = SeededReq("seeded", 0, 0, 500, sampling_params=SamplingParams(temperature=1, seed=1))
    s = scheduler(list(decodes), [])
    s.waiting = Waiting([prompt])
    s._seeded_prompt_limit = 512
    s.schedule()
    assert seen == [([], ["seeded"], 500)]
    assert [r.name for r in s.running] == [d.name for d in decodes]
    assert s.max_num_scheduled_tokens == 128
    # vLLM did not take it in (say its KV blocks ran short): the decodes go on in the next
    # step, the prompt and the queue behind it wait, and the step after may try again.
    s.schedule()
    assert seen[-1] == ([d.name for d in decodes], [], 128)
    s.schedule()
    assert seen[-1] == ([], ["seeded"], 500)


def test_the_seeded_prompt_limit_is_vllms_step_or_its_long_prefill_threshold_on_the_cpu() -> None:
    from types import SimpleNamespace

    from pyserver.engine.adapter.scheduler import seeded_prompt_limit

    sched = SimpleNamespace(max_num_batched_tokens=2048, long_prefill_token_threshold=0)
    config = SimpleNamespace(
        device_config=SimpleNamespace(device_type="cpu"), scheduler_config=sched
    )
    assert seeded_prompt_limit(config) == 2048
    sched.long_prefill_token_threshold = 256
    assert seeded_prompt_limit(config) == 256
    config.device_config.device_type = "cuda"  # its generators rewind: prompts may be cut
    assert seeded_prompt_limit(config) == 0


def _own_step_scheduler(
    monkeypatch: pytest.MonkeyPatch, running: list[Req], head: SeededReq
) -> tuple[Any, list[list[str]]]:
    seen: list[list[str]] = []

    def schedule(self: Any, *args: Any, **kwargs: Any) -> str:
        seen.append([r.name for r in self.running])
        return "scheduler-output"

    monkeypatch.setattr(Scheduler, "schedule", schedule)
    s = scheduler(running, [])
    s.waiting = Waiting([head])
    s._seeded_prompt_limit = 512
    return s, seen


SEEDED = SamplingParams(temperature=1, seed=1)


def test_no_step_of_its_own_past_vllms_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    s, seen = _own_step_scheduler(
        monkeypatch, decodes, SeededReq("seeded", 0, 0, 500, sampling_params=SEEDED)
    )
    s.max_num_running_reqs = 20  # every slot taken: it could not enter beside them anyway
    s.schedule()
    assert seen == [[d.name for d in decodes]]


def test_no_step_of_its_own_for_a_prompt_less_urgent_than_a_running_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(19)] + [Req("top", -1, 120, 100, 20)]
    s, seen = _own_step_scheduler(
        monkeypatch, decodes, SeededReq("seeded", 0, 0, 500, sampling_params=SEEDED)
    )
    s.schedule()
    assert seen == [[d.name for d in decodes]]  # the top stream's decode is never held for it


def test_no_step_of_its_own_for_a_prompt_vllm_would_not_take_in_yet(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    compiling = SeededReq(
        "seeded",
        0,
        0,
        500,
        sampling_params=SEEDED,
        status=RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR,
    )
    s, seen = _own_step_scheduler(monkeypatch, decodes, compiling)
    s.schedule()
    assert seen == [[d.name for d in decodes]]


def test_an_empty_queue_clears_the_last_own_step(monkeypatch: pytest.MonkeyPatch) -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    s, _ = _own_step_scheduler(
        monkeypatch, decodes, SeededReq("seeded", 0, 0, 500, sampling_params=SEEDED)
    )
    s._held_running_last = True
    s.waiting = Waiting([])
    s.schedule()
    assert s._held_running_last is False
