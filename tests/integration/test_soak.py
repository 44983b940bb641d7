"""The long overload soak (`make soak`, or `pytest -m soak`): not part of `make test`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.soak]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_overload_soak_loses_nothing_and_keeps_memory_flat(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out = subprocess.run(
        [sys.executable, str(SOAK), "--log", str(tmp_path / "server.log")],
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["hung"] == 0 and result["lost"] == 0, result
    assert not result["unexpected"] and result["refusals_without_retry_hint"] == 0, result
    assert result["completed"] > 0 and result["rejected"], result  # it really was overloaded
    assert result["health_not_serving"] == 0, result
    assert result["rss_growth_pct"] <= 10, result
    assert result["fuzz_cases"] >= 2000 and result["fuzz_internal_errors"] == 0, result
    assert result["served_after"], result
