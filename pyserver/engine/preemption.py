"""Priority preemption applied to the engine: which running requests stop for waiting
top-priority ones (the choice is pyserver.engine.admission's), how they stop, and when the
suspended ones go back. Worker thread only, apart from reading how many are suspended.

Where the engine core runs in this process and a slot is what the top-priority calls lack (not
KV room), a victim is suspended in the engine (pyserver.engine.adapter.scheduler keeps it out of
every step): its KV blocks and sampling state stay, so nothing is computed again and any call
may be stopped. Otherwise it is aborted and requeued, and later re-prefills its prompt and
output (pyserver.engine.admission.resumed)."""

from __future__ import annotations

import logging
import time

from pyserver.batching import BatchQueue
from pyserver.domain import WorkItem
from pyserver.engine import adapter
from pyserver.engine.admission import deadline_slack, requeue, top_priority_victims
from pyserver.engine.deadlines import DeadlineAdmission
from pyserver.engine.kv_ledger import KvLedger
from pyserver.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class Preemption:
    def __init__(
        self,
        engine: adapter.Engine,
        queue: BatchQueue,
        kv: KvLedger,
        deadlines: DeadlineAdmission,
        metrics: Metrics,
        *,
        top: int,
        after_s: float | None,
        suspend: bool,
    ) -> None:
        self._engine, self._queue, self._kv = engine, queue, kv
        self._deadlines, self._metrics, self._top = deadlines, metrics, top
        self._after_ns = None if after_s is None else int(after_s * 1e9)
        self._max_model_len = engine.max_model_len
        self.can_suspend = suspend and engine.can_suspend
        # In the engine but suspended: no slot, their KV blocks and sampling state kept.
        self.suspended: dict[int, WorkItem] = {}

    def preempt(self, running: dict[int, WorkItem], limit: int) -> list[int]:
        """Stop the lowest-priority running requests for the waiting top-priority ones: the
        suspended move from `running` to `suspended`; the requeued are aborted in the engine and
        returned, for the caller to take off its books."""
        if self._after_ns is None or not running:
            return []
        now = time.monotonic_ns()
        # A suspended request keeps its KV reservation: suspend only while the room left holds
        # the longest request for each waiting top-priority one, else free the room.
        waiting_top = sum(self._queue.stats().depth[self._top])
        suspend = self.can_suspend and self._kv.room >= waiting_top * self._max_model_len
        victims = top_priority_victims(
            self._queue,
            running,
            top=self._top,
            free=max(0, limit - len(running)),
            kv_room=self._kv.room,
            after_ns=self._after_ns,
            slack=lambda it: deadline_slack(it, now, self._deadlines.remaining_service_s(it)),
            keeps_state=suspend,
        )
        if suspend and victims:
            self._engine.suspend([it.handle for it in victims])
            for item in victims:
                self.suspended[item.handle] = running.pop(item.handle)
                item.preemptions += 1
            self._metrics.preemptions.labels("suspended").inc(len(victims))
            return []
        stopped = [it.handle for it in victims if requeue(self._queue, it)]
        if stopped:
            self._engine.abort(stopped)
            self._metrics.preemptions.labels("priority").inc(len(stopped))
        return stopped

    def resume(self, running: dict[int, WorkItem], free: int) -> None:
        """Suspended requests take free slots before queued requests of their level or below
        (where a requeued one would stand: at the front of its level), and before a queued
        request of a higher level only when nothing runs (that one may lack the KV room the
        suspended hold, and must not wait on them forever)."""
        if free <= 0 or not self.suspended:
            return
        depth = [sum(buckets) for buckets in self._queue.stats().depth]
        back: list[WorkItem] = []
        for item in sorted(self.suspended.values(), key=lambda it: -it.priority):
            ahead = sum(depth[item.priority + 1 :]) if running else 0
            if len(back) + ahead >= free:
                break
            back.append(item)
        self._take_back([it.handle for it in back], running)

    def take_back_stepped(self, handles: list[int], running: dict[int, WorkItem]) -> int:
        """The scheduler keeps suspended requests out of every step; should one get tokens
        anyway, it runs again (resumed in the scheduler too) and its tokens reach its caller.
        Returns how many (a bug if not 0)."""
        stray = [h for h in handles if h in self.suspended]
        if stray:
            log.error("suspended requests %s were stepped; resumed", stray)
        self._take_back(stray, running)
        return len(stray)

    def _take_back(self, handles: list[int], running: dict[int, WorkItem]) -> None:
        if not handles:
            return
        self._engine.resume(handles)
        now = time.monotonic_ns()
        for h in handles:
            item = running[h] = self.suspended.pop(h)
            if item.last_token_ns:  # the time suspended is no step's inter-token gap
                item.last_token_ns = now
