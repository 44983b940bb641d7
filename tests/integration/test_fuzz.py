"""Property-based hostile input against the live server: every generated request ends in OK or a
precise client-error status, never INTERNAL/UNKNOWN, and the server keeps serving."""

from __future__ import annotations

import math
import os

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from streambatch.v1 import generation_pb2 as pb

from integration.helpers import request, stub

pytestmark = pytest.mark.engine

EXAMPLES = int(os.environ.get("STREAMBATCH_FUZZ_EXAMPLES", "300"))
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 2.0, 1e30, math.nan, math.inf]),
)
odd_text = st.one_of(
    st.text(max_size=64),
    st.sampled_from(["", " ", "\x00", "\u202e\u200b", "😀" * 50, "a" * 70_000, "\ud7ff\ue000"]),
)
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=40)
messages = st.lists(
    st.tuples(st.sampled_from(["user", "system", "assistant", "robot", ""]), odd_text), max_size=4
)


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(odd_text)
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(token_ids))
    elif kind == "chat":
        for role, content in draw(messages):
            req.chat.messages.add(role=role, content=content)
        if draw(st.booleans()):
            req.chat.add_generation_prompt = draw(st.booleans())
    s = req.sampling
    # Short outputs keep valid requests cheap on the CPU engine; the large values probe limits.
    s.max_tokens = draw(st.sampled_from([1, 2, 3, 2047, 2048, 5000, 10**6, 2**32 - 1]))
    for name in (
        "temperature",
        "top_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ):
        if draw(st.booleans()):
            setattr(s, name, draw(floats))
    if draw(st.booleans()):
        s.top_k = draw(st.integers(-(2**31), 2**31 - 1))
    if draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(odd_text, max_size=10)))
    s.ignore_eos = draw(st.booleans())
    s.min_tokens = draw(st.sampled_from([0, 1, 5, 2**32 - 1]))
    req.priority = draw(st.sampled_from([0, 1, 2, 2**32 - 1]))
    req.request_id = draw(st.one_of(st.just(""), odd_text))
    req.queue_timeout_ms = draw(st.sampled_from([0, 1, 1000, 2**32 - 1]))
    return req


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(req=requests())
def test_hostile_requests_get_precise_statuses(live_server, req: pb.GenerateRequest) -> None:  # type: ignore[no-untyped-def]
    s = stub(live_server.target)
    try:
        s.Complete(req, timeout=20)
        code = grpc.StatusCode.OK
    except grpc.RpcError as err:
        code = err.code()
        details = err.details() or ""
        assert code in ALLOWED, (code, details, req)
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert ":" in details  # "field: what to fix"
    assert code in ALLOWED


def test_server_serves_after_fuzzing(live_server) -> None:  # type: ignore[no-untyped-def]
    assert stub(live_server.target).Complete(request("Say hi.", max_tokens=2), timeout=60).tokens
