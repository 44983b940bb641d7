"""The worker's running estimates (deadline-aware admission reads their upper bound)."""

from __future__ import annotations

import pytest

from pyserver.engine.worker import _Estimate


def test_the_first_sample_is_the_estimate() -> None:
    est = _Estimate()
    est.add(0.04)
    # Measured against the empty mean of 0 its deviation would be 0.04, and upper() 0.12: three
    # times every step, enough to refuse a 300-token request with a 120 s deadline.
    assert est.upper() == pytest.approx(0.04)


def test_upper_is_mean_plus_two_deviations_and_follows_a_change_in_load() -> None:
    est = _Estimate()
    for _ in range(100):
        est.add(0.04)
    assert est.upper() == pytest.approx(0.04)
    for _ in range(100):
        est.add(0.08)
    assert 0.08 <= est.upper() < 0.085  # the old level is forgotten
    est.add(0.2)
    assert est.upper() > 0.09  # a spike widens the bound at once
