"""AdaptiveBatchController on synthetic latency streams."""

from __future__ import annotations

import itertools
import logging
import random

import pytest

from pyserver.scheduling import AdaptiveBatchController


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def drive(
    ctl: AdaptiveBatchController,
    clock: FakeClock,
    latency_of,
    seconds: float,  # type: ignore[no-untyped-def]
    rate: int = 100,
    seed: int = 0,
) -> list[int]:
    """Feed `rate` samples per second whose latency depends on the current limit."""
    rng = random.Random(seed)
    limits = []
    for _ in range(int(seconds * 10)):
        for _ in range(rate // 10):
            ctl.observe(latency_of(ctl.limit) * rng.uniform(0.9, 1.1))
        clock.t += 0.1
        limits.append(ctl.update())
    return limits


def test_shrinks_under_overload_and_converges_without_oscillation() -> None:
    clock = FakeClock()
    ctl = AdaptiveBatchController(100.0, 64, cooldown_s=1.0, clock=clock)
    # ITL grows with concurrency: 10 ms + 4 ms per sequence. In-band (50..150 ms) for 10..35.
    limits = drive(ctl, clock, lambda n: 10 + 4 * n, seconds=120)
    final = limits[-1]
    assert 10 <= final <= 35
    assert 10 + 4 * final <= 150
    tail = limits[len(limits) // 2 :]
    assert len(set(tail)) == 1, "the limit kept moving on a steady load"


def test_grows_when_latency_is_far_below_the_slo() -> None:
    clock = FakeClock()
    ctl = AdaptiveBatchController(500.0, 32, initial=2, cooldown_s=1.0, clock=clock)
    limits = drive(ctl, clock, lambda n: 20.0, seconds=60)
    assert limits[-1] == 32  # grown to the bound and held there
    assert max(limits) <= 32


def test_bounded_below_and_seed_rule_steps_of_two() -> None:
    clock = FakeClock()
    ctl = AdaptiveBatchController(10.0, 16, cooldown_s=0.5, clock=clock)
    limits = drive(ctl, clock, lambda n: 100.0 * n, seconds=30)  # above the SLO even at 1
    assert min(limits) == 1 and limits[-1] == 1
    steps = {a - b for a, b in itertools.pairwise(limits) if a != b}
    assert steps <= {2, 1}  # 16 -> 14 -> ... -> 2 -> 1 (clamped)


def test_cooldown_spaces_changes() -> None:
    clock = FakeClock()
    ctl = AdaptiveBatchController(10.0, 64, cooldown_s=5.0, min_samples=1, clock=clock)
    drive(ctl, clock, lambda n: 1000.0, seconds=20)
    assert ctl.changes <= 4  # at most one change per 5 s


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"slo_ms": 0}, "SLO"), ({"metric": "tps"}, "metric"), ({"min_limit": 0}, "min_limit")],
)
def test_bad_settings(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"slo_ms": 100.0, "max_limit": 8} | kwargs
    with pytest.raises(ValueError, match=message):
        AdaptiveBatchController(**args)  # type: ignore[arg-type]


def test_multiplicative_token_budget_finds_the_slo_and_stays() -> None:
    """The step-token knob: latency grows with the per-step budget (prefill chunk size); the
    controller cuts it by a quarter until p99 <= SLO (shrink_above=1.0) and then holds."""
    clock = FakeClock()
    ctl = AdaptiveBatchController(
        100.0,
        2048,
        min_limit=24,
        multiplicative=True,
        shrink_above=1.0,
        grow_below=0.5,
        clock=clock,
    )
    limits = drive(ctl, clock, lambda budget: 40 + budget * 0.2, seconds=60)
    final = limits[-1]
    assert 40 + final * 0.2 * 1.1 <= 100 * 1.05, final  # p99 at or under the SLO
    assert final >= 128, final  # and not shrunk further than needed
    assert len(set(limits[-200:])) == 1  # steady: no oscillation


def test_token_budget_with_a_narrow_band_settles_just_under_the_slo() -> None:
    """shrink above 1.0 x SLO, grow below 0.8 x SLO (what bench/priority.py runs): the budget
    lands in the band, as large as it allows, and stays there."""
    clock = FakeClock()
    ctl = AdaptiveBatchController(
        100.0, 256, min_limit=24, multiplicative=True, shrink_above=1.0, grow_below=0.8,
        clock=clock,
    )  # fmt: skip
    limits = drive(ctl, clock, lambda budget: 30 + budget * 0.4, seconds=120)
    final = limits[-1]
    assert 80 <= 30 + final * 0.4 <= 100 * 1.05, final
    assert len(set(limits[-600:])) == 1, sorted(set(limits[-600:]))


def test_a_shrink_that_does_not_help_is_undone_and_the_limit_holds_there(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Latency falls with the step budget down to 96 tokens and rises below it (almost every
    step then carries a prefill chunk). An SLO no budget meets must not drive the budget to its
    minimum: the shrink past 96 is undone and the limit stays near the best it found."""
    caplog.set_level(logging.INFO, logger="pyserver.scheduling")
    clock = FakeClock()
    ctl = AdaptiveBatchController(
        50.0, 256, min_limit=24, multiplicative=True, shrink_above=1.0, grow_below=0.8,
        floor_hold_s=30.0, clock=clock,
    )  # fmt: skip
    limits = drive(
        ctl, clock, lambda b: 60 + 0.2 * b if b >= 96 else 60 + 0.2 * 96 + (96 - b), seconds=120
    )
    assert ctl.undone_shrinks >= 1
    assert "back to 108" in caplog.text  # 256 -> 192 -> 144 -> 108 -> 81 (worse) -> 108
    assert min(limits) >= 72, min(limits)  # one step below the best (96 * 3 // 4), never lower
    assert sum(1 for b in limits if b >= 96) > 0.8 * len(limits)  # and mostly at or above it


def test_thresholds_are_checked() -> None:
    with pytest.raises(ValueError, match="grow_below"):
        AdaptiveBatchController(100.0, 8, shrink_above=0.5, grow_below=0.5)
