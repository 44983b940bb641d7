"""The adaptive batch controller: closes the loop between a latency SLO and a limit the engine
worker applies (the seed article's rule, made safe against oscillation).

Rule (the seed's default): over a sliding window of the chosen latency (TTFT, inter-token or
end-to-end), if p99 > 1.5 x SLO shrink the limit by `step` (2); if p99 < 0.5 x SLO grow it by
`step`; always within [min_limit, max_limit]. After a change the window restarts, so the next
decision sees only latency measured under the new limit, and no change happens within
`cooldown_s` of the last one: together these keep a steady load from oscillating.

What the limit is, is the worker's choice (the "knob"): the admitted concurrency (the seed's
max batch size) or the engine's per-step token budget. On an iteration-level engine the second
is what sets inter-token latency tails (a step that prefills a long prompt stalls every stream
in it), so for it the rule is multiplicative: x0.75 on shrink, x1.25 on grow. Halving, as the
seed does for concurrency, overshot on this engine: a budget cut from 256 to 64 tokens leaves
prefill starved and sequence slots idle, and a band narrow enough to meet an ITL SLO then never
grows it back.

The rule assumes latency falls as the limit falls, which stops being true near the bottom: with
a step budget of a few dozen tokens nearly every step carries a prefill chunk, and inter-token
latency rises again (measured: ITL p99 150 ms and 0.80 x throughput when a tight band drove the
budget to its minimum). So a shrink that did not lower the p99 is undone, and the limit is not
shrunk below that level again for `floor_hold_s`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

METRICS = ("ttft", "itl", "e2e")

log = logging.getLogger(__name__)


class AdaptiveBatchController:
    def __init__(
        self,
        slo_ms: float,
        max_limit: int,
        *,
        metric: str = "itl",
        min_limit: int = 1,
        step: int = 2,
        window: int = 256,
        min_samples: int = 32,
        cooldown_s: float = 2.0,
        initial: int | None = None,
        multiplicative: bool = False,
        shrink_above: float = 1.5,
        grow_below: float = 0.5,
        floor_hold_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not slo_ms > 0:
            raise ValueError(f"latency SLO must be > 0 ms, got {slo_ms}")
        if metric not in METRICS:
            raise ValueError(
                f"controller metric must be one of {', '.join(METRICS)}, got {metric!r}"
            )
        if not 0 < grow_below < shrink_above:
            raise ValueError(
                f"need 0 < grow_below ({grow_below}) < shrink_above ({shrink_above}) x SLO"
            )
        if not 1 <= min_limit <= max_limit:
            raise ValueError(f"need 1 <= min_limit ({min_limit}) <= max_limit ({max_limit})")
        self.slo_ms = slo_ms
        self.metric = metric
        self.min_limit = min_limit
        self.max_limit = max_limit
        self._step = step
        self._multiplicative = multiplicative
        self._shrink_above = shrink_above
        self._grow_below = grow_below
        self._min_samples = min_samples
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._samples: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()
        self._limit = max(min_limit, min(max_limit, initial or max_limit))
        self._last_change = clock()
        self.changes = 0
        self._floor_hold_s = floor_hold_s
        # (limit before the last shrink, the p99 that caused it) until the next decision.
        self._shrunk_from: tuple[int, float] | None = None
        self._floor = min_limit
        self._floor_until = 0.0
        self.undone_shrinks = 0

    @property
    def limit(self) -> int:
        return self._limit

    def observe(self, value_ms: float) -> None:
        with self._lock:
            self._samples.append(value_ms)

    def p99_ms(self) -> float | None:
        with self._lock:
            if len(self._samples) < self._min_samples:
                return None
            return float(np.percentile(np.fromiter(self._samples, float), 99))

    def update(self) -> int:
        """Apply the rule if the cool-down has passed and the window is full enough."""
        now = self._clock()
        if now - self._last_change < self._cooldown_s:
            return self._limit
        p99 = self.p99_ms()
        if p99 is None:
            return self._limit
        if self._shrunk_from is not None:
            before_limit, before_p99 = self._shrunk_from
            self._shrunk_from = None
            if p99 >= before_p99:  # the shrink did not help: below here latency rises again
                self._floor, self._floor_until = before_limit, now + self._floor_hold_s
                self.undone_shrinks += 1
                log.info(
                    "controller: %s p99 %.1f ms at limit %d, not below the %.1f ms at %d; back "
                    "to %d and not lower for %.0f s",
                    self.metric, p99, self._limit, before_p99, before_limit, before_limit,
                    self._floor_hold_s,
                )  # fmt: skip
                return self._change_to(before_limit, now)
        floor = self._floor if now < self._floor_until else self.min_limit
        if p99 > self._shrink_above * self.slo_ms:
            smaller = self._limit * 3 // 4 if self._multiplicative else self._limit - self._step
            new = max(floor, smaller)
            if new < self._limit:
                self._shrunk_from = (self._limit, p99)
        elif p99 < self._grow_below * self.slo_ms:
            larger = (
                max(self._limit + 1, self._limit * 5 // 4)
                if self._multiplicative
                else self._limit + self._step
            )
            new = min(self.max_limit, larger)
        else:
            new = self._limit
        return self._change_to(new, now)

    def _change_to(self, new: int, now: float) -> int:
        if new != self._limit:
            self._limit = new
            self._last_change = now
            self.changes += 1
            with self._lock:
                self._samples.clear()
        return self._limit
