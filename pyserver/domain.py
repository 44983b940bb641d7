"""Plain request/response types shared by the service and the engine worker (no vLLM, no pb2)."""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field
from typing import Any


class ErrorKind(enum.Enum):
    """Why a request ended without completing; the service maps each to a gRPC status."""

    INVALID = "invalid"
    OVERLOADED = "overloaded"
    DEADLINE = "deadline"
    CANCELLED = "cancelled"
    UNAVAILABLE = "unavailable"


class RequestError(Exception):
    def __init__(self, kind: ErrorKind, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_ms = retry_after_ms


@dataclass(slots=True, frozen=True)
class Structured:
    """An output constraint: kind is json_schema, regex, choice, grammar or json_object."""

    kind: str
    value: str | tuple[str, ...] | bool


@dataclass(slots=True, frozen=True)
class Sampling:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # alternatives per generated token; None: no logprobs
    prompt_logprobs: int | None = None
    structured: Structured | None = None
    n: int = 1

    @property
    def resumable(self) -> bool:
        """Whether the call may be stopped and resumed with its output moved into its prompt
        (streambatch's priority preemption). A constraint's state, the presence/frequency
        penalties' output history and a seeded generator's position would restart from
        nothing, so such calls are not."""
        return (
            self.structured is None
            and self.presence_penalty == 0
            and self.frequency_penalty == 0
            and self.seed is None
        )


@dataclass(slots=True, frozen=True)
class TopToken:
    token_id: int
    token: str
    logprob: float
    rank: int


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """A token's logprob and the most likely tokens at its position (by rank)."""

    token_id: int
    token: str
    logprob: float
    rank: int
    top: tuple[TopToken, ...] = ()


@dataclass(slots=True)
class Delta:
    """New output since the last delivery; deltas merge when the reader lags the engine."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length" on the last delta
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    preemptions: int = 0
    predicted_total_ms: float = 0.0
    refusal_predicted: bool = False
    error: RequestError | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token in token_ids
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    stop_string: str | None = None  # what ended a "stop" finish: a stop string ...
    stop_token_id: int | None = None  # ... or a token (a stop token id or end of sequence)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None

    def merge(self, later: Delta) -> None:
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        self.logprobs.extend(later.logprobs)
        self.prompt_logprobs.extend(later.prompt_logprobs)
        if later.stop_string is not None:
            self.stop_string = later.stop_string
        if later.stop_token_id is not None:
            self.stop_token_id = later.stop_token_id
        for name in (
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cached_tokens",
            "queue_ms",
            "ttft_ms",
            "total_ms",
            "preemptions",
            "predicted_total_ms",
            "refusal_predicted",
            "error",
        ):
            value = getattr(later, name)
            if value:
                setattr(self, name, value)


class Mailbox:
    """A single-slot, merging collector for one request's output (lives on the event loop).

    The worker's deltas for a step arrive in one loop callback; a slow reader finds them merged
    into one pending Delta, so memory per request stays bounded by the text itself, never by the
    number of steps.
    """

    __slots__ = ("_event", "_pending")

    def __init__(self) -> None:
        self._pending: Delta | None = None
        self._event = asyncio.Event()

    def put(self, delta: Delta) -> None:
        if self._pending is None:
            self._pending = delta
        elif not self._pending.final:
            self._pending.merge(delta)
        self._event.set()

    async def get(self) -> Delta:
        await self._event.wait()
        self._event.clear()
        delta, self._pending = self._pending, None
        assert delta is not None
        return delta


@dataclass(slots=True)
class WorkItem:
    """One accepted request as the worker sees it."""

    handle: int
    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    priority: int
    deadline_ns: int  # absolute, time.monotonic_ns(); 0 = none
    accepted_ns: int
    mailbox: Mailbox
    admitted_ns: int = 0
    first_token_ns: int = 0
    last_token_ns: int = 0
    finished_ns: int = 0
    completion_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # kept to resume after preemption
    preemptions: int = 0
    span: Any = None  # the call's RPC span, for engine-step span links (opaque here)
    prediction: Any = None  # the worker's finish-time Prediction at submit (opaque here)
    expected_tokens: float = 0.0  # output tokens the worker expects it to generate
    refusal_predicted: bool = False  # shadow deadline admission would have refused it
    adapter: str = ""  # a LoRA adapter's name; empty: the base model
    prompt_blocks: list[int] | None = None  # prefix-cache block hashes (the worker's, lazily)
