"""Deadline-aware admission: every call gets a finish-time prediction at submit (queue wait from
the running and queued requests, plus its own service; pyserver.engine.prediction), calibrated
against the calls that finished. With mode "on" a call is refused, DEADLINE_EXCEEDED without
having run, only when even the prediction's lower bound at the refusal confidence misses its
deadline (or, waiting, its queue timeout); the same bound is checked again when the queue
releases it. In "shadow" mode (the default) the decision is only recorded on the call, and how
each flagged call ended is counted, to measure how many refusals would have been wrong."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from pyserver.domain import ErrorKind, RequestError, Sampling, WorkItem
from pyserver.engine.prediction import FinishTimePredictor, Job
from pyserver.telemetry.metrics import Metrics

MODES = ("on", "shadow", "off")


@dataclass(frozen=True, slots=True)
class EngineView:
    """What a prediction reads of the engine, replaced whole by the worker thread after each
    iteration (read from the event loop without a lock)."""

    running: frozenset[int] = frozenset()  # handles in the engine
    remaining_steps: tuple[float, ...] = ()  # their expected remaining steps
    below_top: int = 0  # how many of them a top-priority call may preempt
    slots: int = 1  # the admitted-concurrency limit

    @classmethod
    def of(
        cls, running: Collection[WorkItem], top: int, slots: int, *, suspends: bool = False
    ) -> EngineView:
        """suspends: the engine suspends preempted requests (every lower one may be stopped),
        rather than requeueing them (only those whose sampling resumes as it was)."""
        return cls(
            frozenset(it.handle for it in running),
            tuple(max(1.0, it.expected_tokens - it.completion_tokens) for it in running),
            sum(1 for it in running if it.priority < top and (suspends or it.sampling.resumable)),
            slots,
        )


def fixed_length(s: Sampling) -> bool:
    """The call runs exactly max_tokens steps (no EOS, no stop string can end it earlier)."""
    ends_early = s.stop or s.stop_token_ids or s.structured is not None
    return (s.ignore_eos and not ends_early) or s.min_tokens >= s.max_tokens


class DeadlineAdmission:
    def __init__(
        self,
        mode: str,
        confidence: float,
        metrics: Metrics,
        *,
        top_priority: int,
        preempts_at_once: bool,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"deadline admission must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.predictor = FinishTimePredictor(confidence)
        self._metrics = metrics
        self._top = top_priority
        self._preempts_at_once = preempts_at_once  # top-priority calls preempt without waiting

    def predict(
        self, item: WorkItem, queue_deadline_ns: int, view: EngineView, queued: Iterable[WorkItem]
    ) -> None:
        """Predict the call's finish time (kept on the item, checked against what it took) and
        refuse it (RequestError) when the prediction's lower bound misses its deadline or its
        queue timeout. `queued`: the accepted calls not in the engine."""
        p = self.predictor
        fixed = fixed_length(item.sampling)
        item.expected_tokens = p.expected_tokens(item.sampling.max_tokens, fixed)
        if not p.ready:
            return  # nothing measured yet: no prediction, no refusal
        waiting = [it for it in queued if it.handle not in view.running]
        # A top-priority call preempts a lower one at once when the engine is full: no wait
        # unless the top-priority calls queued ahead of it take every preemptable slot.
        preempts = (
            item.priority == self._top
            and self._preempts_at_once
            and view.below_top > sum(1 for it in waiting if it.priority == item.priority)
        )
        ahead = [Job(it.priority, p.service_steps(it.expected_tokens)) for it in waiting]
        pred = p.predict(
            Job(item.priority, p.service_steps(item.expected_tokens)),
            fixed_length=fixed,
            running=view.remaining_steps,
            ahead=ahead,
            slots=view.slots,
            queued=not preempts,
        )
        item.prediction = pred
        now = time.monotonic_ns()
        reason = ""
        if item.deadline_ns and pred.lower_s > (item.deadline_ns - now) / 1e9:
            reason = (
                f"deadline: predicted to finish in {pred.mean_s:.1f} s (at the earliest "
                f"{pred.lower_s:.1f} s, {p.confidence:.0%} confidence: "
                f"{pred.wait_lower_s:.1f} s queued) with "
                f"{max(0, item.deadline_ns - now) / 1e9:.1f} s left; raise the deadline, "
                "lower max_tokens or retry later"
            )
        elif queue_deadline_ns and pred.wait_lower_s > (queue_deadline_ns - now) / 1e9:
            reason = (
                f"deadline: predicted to wait {pred.wait_raw_s:.1f} s in the queue (at the "
                f"least {pred.wait_lower_s:.1f} s, {p.confidence:.0%} confidence), past its "
                f"queue timeout of {max(0, queue_deadline_ns - now) / 1e9:.1f} s; retry later"
            )
        if not reason:
            return
        if self.mode == "shadow":
            item.refusal_predicted = True
        elif self.mode == "on":
            self._metrics.deadline_refusals.labels("submit").inc()
            raise RequestError(ErrorKind.DEADLINE, reason)

    def late_at_admission(self, item: WorkItem, now: int) -> bool:
        """Released by the queue: will it miss its deadline? Only when even the fastest
        plausible service misses (the refusal confidence). Refusing on the calibrated mean when
        other calls wait (tried) refuses calls that finish in time about half the time; the
        collapse that rule was meant to stop came from aged low calls taking the slots that
        preemption freed for high ones (see BatchQueue's aging cap)."""
        if not item.deadline_ns or not self.predictor.ready:
            return False
        steps = self.predictor.service_steps(item.expected_tokens - item.completion_tokens)
        pred = self.predictor.predict(
            Job(item.priority, steps), fixed_length=fixed_length(item.sampling), queued=False
        )
        late = pred.service_lower_s > (item.deadline_ns - now) / 1e9
        if late and self.mode == "shadow":
            item.refusal_predicted = True
            return False
        if late and self.mode == "on":
            self._metrics.deadline_refusals.labels("admit").inc()
            return True
        return False

    def remaining_service_s(self, item: WorkItem) -> float:
        """Calibrated mean time `item` still needs in the engine."""
        steps = max(1.0, item.expected_tokens - item.completion_tokens)
        job = Job(item.priority, steps)
        return self.predictor.predict(
            job, fixed_length=fixed_length(item.sampling), queued=False
        ).mean_s

    def observe_finish(self, item: WorkItem, now: int, *, cut: bool) -> None:
        """Feed a finished call back to the predictor: its natural length and what its
        prediction missed by."""
        fixed = fixed_length(item.sampling)
        if not fixed:
            self.predictor.observe_length(item.completion_tokens, cut)
        if item.prediction is None:
            return
        ratio = self.predictor.observe_finish(
            item.prediction,
            priority=item.priority,
            waited_s=(item.admitted_ns - item.accepted_ns) / 1e9,
            served_s=(now - item.admitted_ns) / 1e9,
            fixed_length=fixed,
        )
        if ratio is not None:
            self._metrics.finish_time_ratio.observe(ratio)

    def settle(self, item: WorkItem) -> None:
        """A call the predictor would have refused (shadow mode serves it anyway) has ended:
        count whether it finished in time, so the refusal rule's error rate is measured on
        every flagged call, also those whose client never saw a final message."""
        if not item.refusal_predicted:
            return
        in_time = bool(item.finished_ns) and (
            not item.deadline_ns or item.finished_ns <= item.deadline_ns
        )
        self._metrics.refusal_predictions.labels("finished" if in_time else "missed").inc()


def queue_expiry(item: WorkItem) -> RequestError:
    """The error for a call whose deadline passed before it (re-)entered the engine."""
    why = (
        f"deadline passed while requeued after a priority preemption "
        f"({item.completion_tokens} tokens had been streamed)"
        if item.completion_tokens
        else "deadline passed while queued; the request never ran"
    )
    return RequestError(ErrorKind.DEADLINE, why)
