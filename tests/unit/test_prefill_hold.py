"""The prefill rule (pyserver.engine.prefill_hold) on stand-in requests: which requests sit
out a step and the step's token budget. Priorities are vLLM's: -1 is streambatch's top level
here, 0 the one below."""

from __future__ import annotations

from dataclasses import dataclass

from pyserver.engine.prefill_hold import WholePrefillPlan, hold_cut_prefills, plan_urgent_step

TOP = -1
LIMIT = 512  # the engine's full per-step budget


@dataclass
class Req:  # the fields of vllm.v1.request.Request the rule reads
    name: str
    priority: int
    num_computed_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_output_tokens

    @property
    def request_id(self) -> str:
        return self.name


def test_low_prefills_sit_out_while_a_top_request_prefills() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    low_decode = Req("low-decode", 0, 120, 100, 20)
    top_prefill = Req("top-prefill", -1, 0, 50)
    plan = plan_urgent_step([low_prefill, low_decode, top_prefill], [], top=TOP, limit=LIMIT)
    assert plan is not None
    assert plan.held == [low_prefill]  # decodes are never held
    assert plan.token_budget == 1 + 50  # the decode and the whole urgent prompt, nothing more


def test_urgent_prompts_share_the_step_and_its_budget_ends_with_them() -> None:
    # A step costs mostly its fixed part: urgent prompts go together, whole, and nothing else
    # (no low-priority prompt, no chunk of one) lengthens their step.
    low_prefill = Req("low-prefill", 0, 32, 400)
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", -1, 60, 50, 10)]
    top_started = Req("top-started", -1, 64, 100)
    waiting = [Req("top-a", -1, 0, 90), Req("top-b", -1, 0, 130), Req("low-new", 0, 0, 50)]
    plan = plan_urgent_step([low_prefill, *decodes, top_started], waiting, top=TOP, limit=LIMIT)
    assert plan is not None
    assert plan.held == [low_prefill]
    assert plan.token_budget == 2 + 36 + 90 + 130


def test_an_urgent_prompt_that_does_not_fit_whole_waits_for_the_next_step() -> None:
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", 0, 60, 50, 10)]
    waiting = [Req("top-a", -1, 0, 300), Req("top-b", -1, 0, 300)]
    plan = plan_urgent_step(decodes, waiting, top=TOP, limit=LIMIT)
    assert plan is not None and plan.token_budget == 2 + 300  # not 512: top-b is not cut


def test_an_urgent_prompt_longer_than_the_engines_budget_is_chunked() -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(3)]
    plan = plan_urgent_step(decodes, [Req("top-huge", -1, 0, 2000)], top=TOP, limit=LIMIT)
    assert plan is not None and plan.token_budget == LIMIT


def test_a_latency_cap_bounds_the_urgent_step() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    plan = plan_urgent_step([low_prefill], [Req("top", -1, 0, 300)], top=TOP, limit=96)
    assert plan is not None
    assert plan.held == [low_prefill]  # the urgent prompt still goes first
    assert plan.token_budget == 96  # chunked to the cap: the step respects the latency SLO


def test_a_lower_priority_waiting_head_changes_nothing() -> None:
    plan = plan_urgent_step(
        [Req("d", 0, 120, 100, 20)], [Req("low-new", 0, 0, 90)], top=TOP, limit=LIMIT
    )
    assert plan is None


def test_nothing_is_held_without_a_prefilling_top_request() -> None:
    low_prefill = Req("low-prefill", 0, 32, 400)
    top_decode = Req("top-decode", -1, 90, 50, 40)
    assert plan_urgent_step([low_prefill, top_decode], [], top=TOP, limit=LIMIT) is None


def test_a_top_request_resumed_after_an_engine_preemption_counts_as_prefilling() -> None:
    # vLLM recomputes a preempted request from scratch: its prompt and earlier output again.
    resumed = Req("top-resumed", -1, 0, 100, 30)
    low_prefill = Req("low-prefill", 0, 32, 400)
    plan = plan_urgent_step([low_prefill, resumed], [], top=TOP, limit=LIMIT)
    assert plan is not None and plan.held == [low_prefill]
    assert plan.token_budget == 130


def seeded(r: Req) -> bool:
    return r.name.startswith("seeded")


def test_a_seeded_prompt_that_fits_whole_is_left_alone() -> None:
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", 0, 60, 50, 10)]
    waiting = [Req("new", 0, 0, 200), Req("seeded", 0, 0, 300)]
    plan = hold_cut_prefills(decodes, waiting, budget=LIMIT, limit=LIMIT, whole=seeded)
    assert plan == WholePrefillPlan([], False, LIMIT)


def test_a_seeded_prompt_that_would_be_cut_waits_with_everything_behind_it() -> None:
    # 2 decodes + 300 leave 210: vLLM would cut the seeded prompt to 210 tokens. It and the
    # prompt behind it sit out (nobody overtakes it); the one ahead is not held.
    decodes = [Req("d1", 0, 120, 100, 20), Req("d2", 0, 60, 50, 10)]
    ahead, cut, behind = Req("new", 0, 0, 300), Req("seeded", 0, 0, 250), Req("later", 0, 0, 9)
    plan = hold_cut_prefills(decodes, [ahead, cut, behind], budget=LIMIT, limit=LIMIT, whole=seeded)
    assert plan == WholePrefillPlan([cut, behind], False, LIMIT)


def test_unseeded_prompts_are_cut_as_vllm_cuts_them() -> None:
    waiting = [Req("new", 0, 0, 300), Req("long", 0, 0, 900)]
    plan = hold_cut_prefills([], waiting, budget=LIMIT, limit=LIMIT, whole=seeded)
    assert plan == WholePrefillPlan([], False, LIMIT)


def test_a_seeded_prompt_behind_a_running_prefill_chunk_waits() -> None:
    running_prefill = Req("low-prefill", 0, 32, 400)  # takes up to 368 tokens of the step
    cut = Req("seeded", 0, 0, 200)
    # Not first in line behind an unseeded prompt that takes the rest of the step.
    plan = hold_cut_prefills(
        [running_prefill], [Req("new", 0, 0, 100), cut], budget=LIMIT, limit=LIMIT, whole=seeded
    )
    assert plan == WholePrefillPlan([cut], False, LIMIT)


def test_a_seeded_prompt_first_in_line_grows_a_short_step_to_fit_it() -> None:
    # A latency controller's 96-token steps would cut a 300-token prompt forever.
    decodes = [Req("d1", 0, 120, 100, 20)]
    plan = hold_cut_prefills(
        decodes, [Req("seeded", 0, 0, 300), Req("later", 0, 0, 50)], budget=96, limit=LIMIT,
        whole=seeded,
    )  # fmt: skip
    assert plan == WholePrefillPlan([], False, 1 + 300)  # "later" waits: nothing left for it


def test_a_seeded_prompt_first_in_line_gets_a_step_of_its_own_when_the_running_fill_it() -> None:
    # 20 decodes and a 500-token prompt do not fit a 512-token step: the decodes skip one
    # step rather than the prompt waiting for most of them to finish.
    # Nothing else enters beside it: with a prefix-cache hit the budget left would take in a
    # request behind it while the running ones are out, one more than vLLM has slots for.
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    behind = Req("later", 0, 0, 5)
    plan = hold_cut_prefills(
        decodes, [Req("seeded", 0, 0, 500), behind], budget=LIMIT, limit=LIMIT, whole=seeded
    )
    assert plan == WholePrefillPlan([behind], True, 500)


def test_a_seeded_prompt_longer_than_any_step_is_left_to_vllm() -> None:
    # The server refuses such calls at submit; holding it would stop the queue for good.
    plan = hold_cut_prefills(
        [], [Req("seeded", 0, 0, LIMIT + 1)], budget=LIMIT, limit=LIMIT, whole=seeded
    )
    assert plan == WholePrefillPlan([], False, LIMIT)


def test_without_leave_to_hold_the_running_a_seeded_prompt_waits_first_in_line() -> None:
    decodes = [Req(f"d{i}", 0, 120, 100, 20) for i in range(20)]
    waiting = [Req("seeded", 0, 0, 500), Req("later", 0, 0, 10)]
    plan = hold_cut_prefills(
        decodes, waiting, budget=LIMIT, limit=LIMIT, whole=seeded, may_hold_running=False
    )
    assert plan == WholePrefillPlan(waiting, False, LIMIT)
