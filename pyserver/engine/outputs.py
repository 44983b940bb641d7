"""One engine step's outputs turned into what the clients and the measurements get: a Delta
per stream, token timings for the predictor and the latency controller, usage on the last
message, and the step's metrics and trace."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyserver.domain import Delta, ErrorKind, Mailbox, RequestError, TokenLogprob, WorkItem
from pyserver.engine.adapter.engine import StepOutput
from pyserver.engine.deadlines import DeadlineAdmission
from pyserver.scheduling import AdaptiveBatchController
from pyserver.telemetry.metrics import Metrics
from pyserver.telemetry.tracing import StepTracer


class StepOutputs:
    def __init__(
        self,
        running: dict[int, WorkItem],
        deadlines: DeadlineAdmission,
        metrics: Metrics,
        step_tracer: StepTracer | None,
    ) -> None:
        self._running = running  # the worker's: read here, never changed
        self._deadlines = deadlines
        self._metrics = metrics
        self._step_tracer = step_tracer
        self.mean_request_s = 1.0  # EWMA of admitted -> finished, for retry hints
        # A fresh engine's first step carries one-time costs (216 ms against ~40 after it, on
        # 2 cores); timings that include it would skew the predictions for the next few dozen
        # steps. They count from the end of that step.
        self._estimates_from_ns = 0

    def collect(
        self,
        outputs: Sequence[StepOutput],
        started: int,
        now: int,
        ctl: AdaptiveBatchController | None,
    ) -> tuple[list[tuple[Mailbox, Delta]], list[int]]:
        """The deltas to deliver and the handles that finished in the step [started, now]."""
        predictor = self._deadlines.predictor
        if self._estimates_from_ns:
            predictor.observe_step((now - started) / 1e9)
        else:
            self._estimates_from_ns = now
        m = self._metrics
        batch = len(self._running)
        m.batch_size.observe(batch)
        m.observe_step(started, now)
        # Streams mid-decode; a request resumed after a preemption re-prefills first (its
        # last_token_ns is reset), which is not a skip.
        decoding = {h for h, it in self._running.items() if it.last_token_ns}
        generated = 0
        out: list[tuple[Mailbox, Delta]] = []
        finished: list[int] = []
        served: list[Any] = []
        for o in outputs:
            item = self._running.get(o.handle)
            if item is None:
                continue
            served.append(item.span)
            if o.token_ids:
                decoding.discard(o.handle)
                if not item.last_token_ns:  # its first token since it entered the engine
                    m.prompt_tokens_cached.inc(o.cached_tokens)
                self._observe_tokens(item, len(o.token_ids), now, ctl)
            item.completion_tokens += len(o.token_ids)
            item.output_token_ids.extend(o.token_ids)
            generated += len(o.token_ids)
            delta = Delta(text=o.text, token_ids=o.token_ids)
            s = item.sampling
            if o.logprobs is not None and s.logprobs is not None:
                delta.logprobs = _trimmed(o.logprobs, s.logprobs)
            if o.prompt_logprobs is not None and s.prompt_logprobs is not None:
                delta.prompt_logprobs = _trimmed(o.prompt_logprobs, s.prompt_logprobs)
            if o.finished and o.finish_reason == "error":
                delta.error = _engine_error(item)
                finished.append(o.handle)
            elif o.finished:
                delta.finish_reason = "length" if o.finish_reason == "length" else "stop"
                if delta.finish_reason == "stop":
                    _fill_stop(delta, item, o.stop_reason)
                _fill_usage(delta, item, now, o.cached_tokens)
                self._deadlines.observe_finish(item, now, cut=delta.finish_reason == "length")
                self.mean_request_s += 0.1 * ((now - item.admitted_ns) / 1e9 - self.mean_request_s)
                item.finished_ns = now
                if ctl is not None and ctl.metric == "e2e":
                    ctl.observe((now - item.accepted_ns) / 1e6)
                finished.append(o.handle)
            out.append((item.mailbox, delta))
        m.generated_tokens.inc(generated)
        if decoding:
            m.decode_skips.inc(len(decoding))
        if self._step_tracer is not None:
            self._step_tracer.on_step(started, now, batch, generated, served)
        return out, finished

    def _observe_tokens(
        self, item: WorkItem, count: int, now: int, ctl: AdaptiveBatchController | None
    ) -> None:
        if not item.first_token_ns:
            item.first_token_ns = now
            if item.admitted_ns >= self._estimates_from_ns:
                self._deadlines.predictor.observe_first_token((now - item.admitted_ns) / 1e9)
            if ctl is not None and ctl.metric == "ttft":
                ctl.observe((now - item.accepted_ns) / 1e6)
        elif item.last_token_ns:
            itl_s = (now - item.last_token_ns) / 1e9 / count
            self._metrics.itl_seconds.observe(itl_s)
            if ctl is not None and ctl.metric == "itl":
                ctl.observe(itl_s * 1e3)
        item.last_token_ns = now


def _engine_error(item: WorkItem) -> RequestError:
    """vLLM ended the request with an error (finish reason "error"): with a constraint, the
    constraint could not be applied (its compile failed in the engine core, or it rejected
    every token), which is the caller's to fix; otherwise the engine's."""
    if item.sampling.structured is not None:
        return RequestError(
            ErrorKind.INVALID,
            f"sampling.structured.{item.sampling.structured.kind}: the engine could not apply "
            "the constraint (it did not compile there, or no token could satisfy it)",
        )
    return RequestError(ErrorKind.UNAVAILABLE, "the engine ended the request with an error")


def _trimmed(positions: list[TokenLogprob], k: int) -> list[TokenLogprob]:
    """The k most likely alternatives per position (vLLM adds the chosen token when it ranks
    below k)."""
    return [
        TokenLogprob(p.token_id, p.token, p.logprob, p.rank, tuple(t for t in p.top if t.rank <= k))
        for p in positions
    ]


def _fill_stop(delta: Delta, item: WorkItem, stop_reason: str | int | None) -> None:
    if isinstance(stop_reason, str):
        delta.stop_string = stop_reason
    elif isinstance(stop_reason, int):
        delta.stop_token_id = stop_reason
    elif item.output_token_ids:  # vLLM names no reason for the model's end of sequence
        delta.stop_token_id = item.output_token_ids[-1]


def _fill_usage(delta: Delta, item: WorkItem, now: int, cached: int) -> None:
    # The client's prompt, also for a request resumed after preemption (whose engine prompt
    # carried its earlier output).
    delta.prompt_tokens = len(item.prompt_token_ids)
    delta.completion_tokens = item.completion_tokens
    delta.cached_tokens = cached
    delta.queue_ms = (item.admitted_ns - item.accepted_ns) / 1e6
    delta.ttft_ms = ((item.first_token_ns or now) - item.accepted_ns) / 1e6
    delta.total_ms = (now - item.accepted_ns) / 1e6
    delta.preemptions = item.preemptions
    if item.prediction is not None:
        delta.predicted_total_ms = item.prediction.mean_s * 1e3
    delta.refusal_predicted = item.refusal_predicted
