"""Property-based hostile input against the live server: thousands of generated requests and raw
malformed frames each end in OK or a precise client-error status, never INTERNAL/UNKNOWN or a
hang, and the server keeps serving."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import grpc
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from hostile import fuzz

from integration.helpers import request, stub

pytestmark = pytest.mark.engine

EXAMPLES = int(os.environ.get("STREAMBATCH_FUZZ_EXAMPLES", "2000"))
# A failure's seed replays its cases with the same number of examples (both in its message).
SEED = int(os.environ["STREAMBATCH_FUZZ_SEED"]) if os.environ.get("STREAMBATCH_FUZZ_SEED") else None


# The strategy draws only from Hypothesis and `secrets`; the warning comes from something else
# in this process (the server runs here, on its own threads) moving the global `random` state
# while a case is generated. A use of `random` added to bench/hostile.py would hide behind it.
@pytest.mark.filterwarnings(
    "ignore:Do not use the `random` module inside strategies"
    ":hypothesis.errors.HypothesisDeprecationWarning"
)
def test_hostile_requests_get_precise_statuses(live_server) -> None:  # type: ignore[no-untyped-def]
    with grpc.insecure_channel(live_server.target) as channel:
        report = fuzz(channel, EXAMPLES, timeout_s=20, seed_value=SEED)
    print(f"fuzz: seed {report.seed}, {report.cases} cases, {dict(report.codes)}")
    assert report.cases >= EXAMPLES, report.cases
    replay = f"STREAMBATCH_FUZZ_EXAMPLES={EXAMPLES} STREAMBATCH_FUZZ_SEED={report.seed}"
    assert not report.bad, (replay, report.bad[:5])
    # The generator reached both sides: accepted work and refusals.
    assert report.codes["OK"] > 0 and report.codes["INVALID_ARGUMENT"] > 0, report.codes


def test_oversized_message_is_resource_exhausted(live_server) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    huge = request("x" * (live_server.server.settings.max_message_bytes + 1024), max_tokens=1)
    with pytest.raises(grpc.RpcError) as err:
        s.Complete(huge, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_server_serves_after_fuzzing(live_server) -> None:  # type: ignore[no-untyped-def]
    assert stub(live_server.target).Complete(request("Say hi.", max_tokens=2), timeout=60).tokens
