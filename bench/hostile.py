"""Hostile input for the fuzz test and the soak: hypothesis strategies over every request field
plus raw malformed frames, sent to a live server with bounded concurrency.

Every case must end in OK or a precise client status (INVALID_ARGUMENT, OUT_OF_RANGE,
RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED); INTERNAL, UNKNOWN or a hang is a bug. Cases are sent
asynchronously (up to `concurrency` in flight) so thousands fit in a CI run: most are refused by
validation in a millisecond, the valid ones share engine steps.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections import Counter
from dataclasses import dataclass, field

import grpc
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from streambatch.v1 import generation_pb2 as pb

ALLOWED = frozenset(
    {
        grpc.StatusCode.OK,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.OUT_OF_RANGE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    }
)
GENERATE = "/streambatch.v1.Generation/Generate"
COMPLETE = "/streambatch.v1.Generation/Complete"

floats = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 2.0, 1e30, math.nan, math.inf]),
)
odd_text = st.one_of(
    st.text(max_size=64),
    st.sampled_from(
        ["", " ", "\x00", "\u202e\u200b", "😀" * 50, "a" * 70_000, "\ud7ff\ue000", "\ufeff" * 9]
    ),
)
token_ids = st.lists(st.one_of(st.integers(0, 49151), st.integers(0, 2**32 - 1)), max_size=40)
messages = st.lists(
    st.tuples(st.sampled_from(["user", "system", "assistant", "robot", ""]), odd_text), max_size=4
)


HOSTILE_FIELDS = (
    "prompt",
    "max_tokens",
    "temperature",
    "top_p",
    "penalties",
    "top_k",
    "seed",
    "stop",
    "min_tokens",
    "priority",
    "request_id",
    "queue_timeout_ms",
    "structured",
    "logprobs",
    "n",
    "token_options",  # stop_token_ids, logit_bias, min_p
    "truncate",
    "adapter",
)
constraints = st.one_of(
    st.builds(lambda t: pb.StructuredOutput(json_schema=t),
              st.one_of(odd_text, st.sampled_from(['{"type": "object"}', '{"type": "nonsense"}',
                                                    "[]", "true", '{"enum": []}']))),
    st.builds(lambda t: pb.StructuredOutput(regex=t),
              st.one_of(odd_text, st.sampled_from(["[0-9", "a{3}", "(", ".*", "\\"]))),
    st.builds(lambda t: pb.StructuredOutput(grammar=t),
              st.one_of(odd_text, st.sampled_from(['root ::= "a"', "root ::= (", "x ::= y"]))),
    st.builds(lambda c: pb.StructuredOutput(choice=pb.ChoiceList(choices=c)),
              st.lists(odd_text, max_size=4)),
    st.builds(lambda b: pb.StructuredOutput(json_object=b), st.booleans()),
    st.just(pb.StructuredOutput()),
)  # fmt: skip
sane_text = st.text(
    st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=40
)


@st.composite
def requests(draw: st.DrawFn) -> pb.GenerateRequest:
    """Mostly-sane requests with a few hostile fields each (none in about a quarter of them), so
    both the validation paths and the engine paths are exercised."""
    hostile = set(
        draw(st.one_of(st.just([]), st.lists(st.sampled_from(HOSTILE_FIELDS), max_size=3)))
    )
    req = pb.GenerateRequest()
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"] if "prompt" in hostile
                                else ["text", "token_ids", "chat"]))  # fmt: skip
    if kind == "text":
        req.text = draw(odd_text if "prompt" in hostile else sane_text)
    elif kind == "token_ids":
        req.token_ids.ids.extend(
            draw(token_ids if "prompt" in hostile else st.lists(st.integers(0, 49151), min_size=1))
        )
    elif kind == "chat":
        pairs = draw(
            messages
            if "prompt" in hostile
            else st.lists(st.tuples(st.just("user"), sane_text), min_size=1, max_size=2)
        )
        for role, content in pairs:
            req.chat.messages.add(role=role, content=content)
        if draw(st.booleans()):
            req.chat.add_generation_prompt = draw(st.booleans())
    s = req.sampling
    # Short outputs keep valid requests cheap on the CPU engine; the large values probe limits.
    s.max_tokens = draw(
        st.sampled_from([0, 2047, 2048, 5000, 10**6, 2**32 - 1])
        if "max_tokens" in hostile
        else st.integers(1, 3)
    )
    if "temperature" in hostile:
        s.temperature = draw(floats)
    elif draw(st.booleans()):
        s.temperature = draw(st.floats(0.0, 2.0))
    if "top_p" in hostile:
        s.top_p = draw(floats)
    if "penalties" in hostile:
        for name in ("repetition_penalty", "presence_penalty", "frequency_penalty"):
            if draw(st.booleans()):
                setattr(s, name, draw(floats))
    if "top_k" in hostile:
        s.top_k = draw(st.integers(-(2**31), 2**31 - 1))
    if "seed" in hostile or draw(st.booleans()):
        s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop.extend(draw(st.lists(odd_text, max_size=10) if "stop" in hostile else st.just([])))
    s.ignore_eos = draw(st.booleans())
    if "min_tokens" in hostile:
        s.min_tokens = draw(st.sampled_from([1, 5, 2**32 - 1]))
    req.priority = draw(
        st.sampled_from([2, 7, 2**32 - 1]) if "priority" in hostile else st.sampled_from([0, 1])
    )
    if "request_id" in hostile:
        req.request_id = draw(odd_text)
    if "queue_timeout_ms" in hostile:
        req.queue_timeout_ms = draw(st.sampled_from([1, 1000, 2**32 - 1]))
    if "structured" in hostile:
        s.structured.CopyFrom(draw(constraints))
    if "logprobs" in hostile:
        s.logprobs = draw(st.sampled_from([0, 5, 20, 21, 2**32 - 1]))
        if draw(st.booleans()):
            s.prompt_logprobs = draw(st.sampled_from([0, 1, 21, 2**32 - 1]))
    if "n" in hostile:
        s.n = draw(st.sampled_from([0, 2, 3, 9, 2**32 - 1]))
    if "token_options" in hostile:
        s.stop_token_ids.extend(draw(st.lists(st.integers(0, 2**32 - 1), max_size=20)))
        s.logit_bias.update(draw(st.dictionaries(st.integers(0, 2**32 - 1), floats, max_size=4)))
        if draw(st.booleans()):
            s.min_p = draw(floats)
    if "truncate" in hostile:
        req.truncate_prompt_tokens = draw(st.sampled_from([1, 3, 2**32 - 1]))
    if "adapter" in hostile:
        req.adapter = draw(odd_text)
    return req


# Raw frames: random bytes, truncated valid messages, wrong wire types, a bogus huge length.
raw_frames = st.one_of(
    st.binary(max_size=256),
    requests().map(lambda r: r.SerializeToString()[: max(1, len(r.SerializeToString()) // 2)]),
    st.sampled_from([b"\x0a\xff\xff\xff\xff\x0f", b"\x08", b"\xff" * 16, b"\x12\x05ab", b""]),
)


@dataclass
class FuzzReport:
    seed: int = 0  # hypothesis's seed: the same seed generates the same cases again
    cases: int = 0
    codes: Counter[str] = field(default_factory=Counter)
    bad: list[tuple[str, str, str]] = field(default_factory=list)  # (code, details, case)

    @property
    def internal_errors(self) -> int:
        return len(self.bad)


class _Sender:
    """Fires calls as futures, at most `concurrency` in flight, and classifies each ending."""

    def __init__(self, channel: grpc.Channel, concurrency: int, timeout_s: float) -> None:
        identity = lambda b: b  # noqa: E731 - frames are sent as given
        self._complete = channel.unary_unary(
            COMPLETE, request_serializer=identity, response_deserializer=identity
        )
        self._slots = threading.BoundedSemaphore(concurrency)
        self._lock = threading.Lock()
        self._timeout = timeout_s
        self._pending: list[grpc.Future] = []
        self.report = FuzzReport()

    def send(self, frame: bytes, label: str) -> None:
        self._slots.acquire()
        fut = self._complete.future(frame, timeout=self._timeout)
        fut.add_done_callback(lambda f: self._done(f, label))
        with self._lock:
            self._pending.append(fut)

    def _done(self, fut: grpc.Future, label: str) -> None:
        try:
            err = fut.exception()
            code = grpc.StatusCode.OK if err is None else err.code()  # type: ignore[attr-defined]
            details = "" if err is None else err.details() or ""  # type: ignore[attr-defined]
            with self._lock:
                self.report.cases += 1
                self.report.codes[code.name] += 1
                precise = code in ALLOWED and (
                    code != grpc.StatusCode.INVALID_ARGUMENT or ":" in details
                )
                if not precise:
                    self.report.bad.append((code.name, details, label[:300]))
        finally:
            self._slots.release()

    def wait(self, limit_s: float) -> None:
        """Every sent case must end; a call still open past its own deadline is a hang."""
        with self._lock:
            pending = list(self._pending)
        for fut in pending:
            try:
                fut.result(timeout=limit_s)
            except grpc.RpcError:
                pass  # classified in the callback
            except grpc.FutureTimeoutError:
                with self._lock:
                    self.report.bad.append(("HUNG", "no answer", "?"))


def fuzz(
    channel: grpc.Channel,
    examples: int,
    *,
    raw_share: float = 0.1,
    concurrency: int = 16,
    timeout_s: float = 20.0,
    seed_value: int | None = None,
) -> FuzzReport:
    """Send `examples` hypothesis-generated requests (plus raw malformed frames, raw_share of
    that number) and classify how each ended. Unseeded, every run explores new cases; the
    report carries the seed it drew, and passing it back with the same `examples` and
    `raw_share` generates the same cases (the server's answers may still differ with timing)."""
    sender = _Sender(channel, concurrency, timeout_s)
    sender.report.seed = secrets.randbits(32) if seed_value is None else seed_value
    opts = settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    @seed(sender.report.seed)
    @opts
    @given(req=requests())
    def structured(req: pb.GenerateRequest) -> None:
        sender.send(req.SerializeToString(), repr(req))

    @seed(sender.report.seed)
    @settings(opts, max_examples=max(1, int(examples * raw_share)))
    @given(frame=raw_frames)
    def raw(frame: bytes) -> None:
        sender.send(frame, "raw " + frame[:64].hex())

    structured()
    raw()
    sender.wait(timeout_s + 30)
    return sender.report
