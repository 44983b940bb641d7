"""Finish-time prediction for deadline admission: right on average, honest about its spread.

A call's time from acceptance to its last token is predicted in two parts, both in engine
steps converted to seconds by the measured mean step time:
- the queue wait: when a sequence slot frees for it, from a slot-by-slot simulation of the
  requests running now (their expected remaining steps) and the requests queued ahead of it
  (same or higher priority), over the engine's admitted concurrency;
- the service: the first-token time measured after admission, plus one step per further
  expected output token. With EOS allowed the expected length is E[min(L, max_tokens)] over the
  natural lengths L of recent calls (a call cut at its max_tokens counts as at least that long).

The mean of a sum of steps is the sum of the means, but its quantile is not the sum of per-step
quantiles, so no per-step upper bound is used. The spread is learned instead, conformally: for
every finished call the ratio actual / raw prediction of each part is kept over a recent window,
the median ratio corrects the prediction (calibration), and a low quantile of it bounds how fast
the call could plausibly go. A call is refused only when even that lower bound misses its
deadline: at confidence c, it would finish in time in at most 1 - c of similar past cases.

Pure Python, no vLLM: the worker feeds it step times and finished calls.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

# Fewer finished calls than this in a window and its quantiles are not trusted: until then a
# part's lower bound uses the prior (no refusals from an unmeasured part).
MIN_SAMPLES = 16
WINDOW = 256
# Queue waits predicted below this are too short to calibrate against (ratios of tiny numbers).
_MIN_WAIT_TO_CALIBRATE_S = 0.25


@dataclass(frozen=True, slots=True)
class Prediction:
    """Seconds from now. `*_raw` are the model's means; `mean_s` is calibrated; `lower_s` is
    the time the call beats only with probability 1 - confidence."""

    wait_raw_s: float
    service_raw_s: float
    mean_s: float
    lower_s: float
    wait_lower_s: float
    service_lower_s: float


@dataclass(frozen=True, slots=True)
class Job:
    """What the model needs of a request: its priority and its expected engine steps."""

    priority: int
    steps: float


class Ratios:
    """A recent window of actual / predicted ratios with a prior for when it is nearly empty."""

    __slots__ = ("_prior_low", "_values")

    def __init__(self, prior_low: float) -> None:
        self._values: deque[float] = deque(maxlen=WINDOW)
        self._prior_low = prior_low

    def add(self, ratio: float) -> None:
        if ratio > 0 and np.isfinite(ratio):
            self._values.append(ratio)

    def __len__(self) -> int:
        return len(self._values)

    def median(self) -> float:
        return float(np.median(self._values)) if len(self._values) >= MIN_SAMPLES else 1.0

    def low(self, confidence: float) -> float:
        if len(self._values) < MIN_SAMPLES:
            return self._prior_low
        return float(np.quantile(self._values, 1.0 - confidence))


class _Mean:
    """EWMA that starts at its first sample and follows load changes within a few dozen."""

    __slots__ = ("_n", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self._n = 0

    def add(self, x: float) -> None:
        self._n += 1
        self.value += max(0.05, 1.0 / self._n) * (x - self.value)

    @property
    def known(self) -> bool:
        return self._n > 0


class FinishTimePredictor:
    """Not thread-safe on its own: the worker calls observe_* from its thread and predict from
    the event loop; each call reads or replaces whole floats and deques, which is safe in
    CPython, and a prediction one step stale is as good as a fresh one."""

    def __init__(self, confidence: float = 0.95) -> None:
        if not 0.5 <= confidence < 1.0:
            raise ValueError(f"refusal confidence must be in [0.5, 1), got {confidence}")
        self.confidence = confidence
        self._step = _Mean()
        self._first_token = _Mean()  # admitted -> first token
        self._lengths: deque[tuple[int, bool]] = deque(maxlen=WINDOW)  # (tokens, cut at max)
        # Per priority level: a high call's wait (it preempts, it skips the queue) is a
        # different distribution from a low call's; pooled, the quantile would fit neither.
        self._wait: dict[int, Ratios] = {}
        # A fixed-length call (ignore_eos) runs its max_tokens steps: half the mean step time
        # is a safe floor before any are measured. An EOS call may stop after one token.
        self.service_fixed = Ratios(prior_low=0.5)
        self.service_eos = Ratios(prior_low=0.0)
        self.total = Ratios(prior_low=0.0)

    # ---- fed by the worker ----------------------------------------------------------------

    def observe_step(self, seconds: float) -> None:
        self._step.add(seconds)

    def observe_first_token(self, seconds: float) -> None:
        self._first_token.add(seconds)

    def observe_length(self, tokens: int, cut_at_max: bool) -> None:
        self._lengths.append((tokens, cut_at_max))

    def observe_finish(
        self,
        predicted: Prediction,
        *,
        priority: int,
        waited_s: float,
        served_s: float,
        fixed_length: bool,
    ) -> float | None:
        """Record one finished call's actual times against what was predicted at submit;
        returns actual / calibrated prediction (None when nothing was predicted)."""
        if predicted.wait_raw_s >= _MIN_WAIT_TO_CALIBRATE_S:
            self.wait(priority).add(waited_s / predicted.wait_raw_s)
        if predicted.service_raw_s > 0:
            (self.service_fixed if fixed_length else self.service_eos).add(
                served_s / predicted.service_raw_s
            )
        raw = predicted.wait_raw_s + predicted.service_raw_s
        if raw > 0:
            self.total.add((waited_s + served_s) / raw)
        return (waited_s + served_s) / predicted.mean_s if predicted.mean_s > 0 else None

    def wait(self, priority: int) -> Ratios:
        if priority not in self._wait:
            self._wait[priority] = Ratios(prior_low=0.0)
        return self._wait[priority]

    # ---- the model ------------------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """True once a step time is known (before that every prediction is 0)."""
        return self._step.known

    @property
    def step_s(self) -> float:
        return self._step.value

    def expected_tokens(self, max_tokens: int, fixed_length: bool) -> float:
        """E[min(L, max_tokens)] over recent natural lengths L; max_tokens when fixed or
        before any call has finished."""
        if fixed_length or not self._lengths:
            return float(max_tokens)
        total = 0
        lengths = tuple(self._lengths)  # one copy: the worker thread appends meanwhile
        for tokens, cut in lengths:
            total += max_tokens if cut and tokens < max_tokens else min(tokens, max_tokens)
        return max(1.0, total / len(lengths))

    def service_steps(self, expected_tokens: float) -> float:
        """Engine steps of a call once admitted, counting the first-token time as steps."""
        first = self._first_token.value / self._step.value if self._step.value else 1.0
        return max(1.0, first) + max(0.0, expected_tokens - 1.0)

    def wait_steps(
        self, job: Job, running: Sequence[float], ahead: Iterable[Job], slots: int
    ) -> float:
        """Steps until a slot frees for `job`: each of `slots` slots frees when its running
        request's remaining steps are done; queued requests of the same or higher priority
        take the freed slots first, in turn."""
        slots = max(1, slots)
        # More running than slots (the limit just shrank): the extra ones must finish first.
        free_at = sorted(running)[-slots:] if len(running) > slots else sorted(running)
        free_at += [0.0] * (slots - len(free_at))
        heapq.heapify(free_at)
        for other in ahead:
            if other.priority >= job.priority:
                start = heapq.heappop(free_at)
                heapq.heappush(free_at, start + other.steps)
        return free_at[0]

    def predict(
        self,
        job: Job,
        *,
        fixed_length: bool,
        running: Sequence[float] = (),
        ahead: Iterable[Job] = (),
        slots: int = 1,
        queued: bool = True,
    ) -> Prediction:
        step = self._step.value
        wait_raw = self.wait_steps(job, running, ahead, slots) * step if queued else 0.0
        service_raw = job.steps * step
        service = self.service_fixed if fixed_length else self.service_eos
        wait_ratios = self.wait(job.priority)
        wait_lower = wait_raw * wait_ratios.low(self.confidence)
        service_lower = service_raw * service.low(self.confidence)
        mean = wait_raw * wait_ratios.median() + service_raw * service.median()
        return Prediction(
            wait_raw_s=wait_raw,
            service_raw_s=service_raw,
            mean_s=mean,
            lower_s=wait_lower + service_lower,
            wait_lower_s=wait_lower,
            service_lower_s=service_lower,
        )


__all__ = ["MIN_SAMPLES", "FinishTimePredictor", "Job", "Prediction", "Ratios"]
