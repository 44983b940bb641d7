"""Pure-Python reference of the BatchQueue admission policy (csrc/batch_queue.h), heapq-based.

It implements the same order (effective priority with aging, head bucket then nearest buckets,
arrival order: oldest first, newest first in a level past lifo_after_ns whose backlog is more
than lifo_backlog_ns of admissions, except for an overdue request: one that waited
oldest_first_after_ns and, with oldest_first_turns, saw that many times the requests waiting
ahead of it at its arrival leave, never before an older request of its FIFO;
preferred requests first within their level, the request next in line passed over at most
affinity_max_overtakes times and never once it is overdue), the same
token-budget rule and the same cancel and requeue (a request put back goes first, counts in the
backlog but never turns its level newest first, and is never passed over), without the blocking
and release-rule machinery; the benchmark measures the C++ core against it and the tests check
both produce the same order.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True)
class _Entry:
    id: int
    cost: int
    priority: int
    bucket: int
    enqueued_ns: int
    seq: int
    due_departures: int = 0
    overtaken: int = 0


class ReferenceQueue:
    def __init__(
        self,
        priority_levels: int,
        bucket_bounds: list[int],
        aging_interval_ns: int = 0,
        lifo_after_ns: int = 0,
        affinity_max_overtakes: int = 0,
        oldest_first_after_ns: int = 0,
        lifo_backlog_ns: int = 0,
        created_ns: int = 0,
        oldest_first_turns: float = 0.0,
    ) -> None:
        self._turns = oldest_first_turns
        self._departures = 0  # admitted or cancelled: the turn-based bound counts them
        self._lifo_after = lifo_after_ns
        self._lifo_backlog = lifo_backlog_ns
        self._created = created_ns
        self._admitted_ns: list[int] = []
        self._oldest_first_after = oldest_first_after_ns
        self._max_overtakes = affinity_max_overtakes
        self._levels = priority_levels
        self._bounds = list(bucket_bounds)
        self._buckets = len(bucket_bounds) + 1
        self._aging = aging_interval_ns
        self._heaps: list[list[tuple[int, _Entry]]] = [
            [] for _ in range(priority_levels * self._buckets)
        ]
        self._seq = 0
        self._front_seq = -1  # requeued requests: below every arrival, the latest lowest

    def push(
        self, id: int, prompt_tokens: int, max_new_tokens: int, priority: int, now_ns: int
    ) -> None:
        bucket = bisect.bisect_left(self._bounds, prompt_tokens)
        index = priority * self._buckets + bucket
        due = 0
        if self._turns > 0:
            ahead = sum(len(h) for i, h in enumerate(self._heaps) if i // self._buckets >= priority)
            due = self._departures + math.ceil(self._turns * ahead)
            # Never before the newest arrival still waiting in its FIFO: they turn in order.
            due = max([due] + [e.due_departures for _, e in self._heaps[index] if e.seq >= 0])
        entry = _Entry(id, prompt_tokens + max_new_tokens, priority, bucket, now_ns, self._seq, due)
        heapq.heappush(self._heaps[index], (self._seq, entry))
        self._seq += 1

    def requeue(
        self,
        id: int,
        prompt_tokens: int,
        max_new_tokens: int,
        priority: int,
        enqueued_ns: int,
        now_ns: int,
    ) -> bool:
        """False for an id already waiting (the C++ queue's DUPLICATE_ID)."""
        if any(e.id == id for h in self._heaps for _, e in h):
            return False
        bucket = bisect.bisect_left(self._bounds, prompt_tokens)
        h = self._heaps[priority * self._buckets + bucket]
        # As the C++ FIFO: arrived no later than now nor than its current head.
        since = min(enqueued_ns, now_ns)
        if h:
            since = min(since, h[0][1].enqueued_ns)
        entry = _Entry(id, prompt_tokens + max_new_tokens, priority, bucket, since, self._front_seq)
        heapq.heappush(h, (self._front_seq, entry))
        self._front_seq -= 1
        return True

    def cancel(self, id: int) -> bool:
        for h in self._heaps:
            for item in h:
                if item[1].id == id:
                    h.remove(item)
                    heapq.heapify(h)
                    self._departures += 1
                    return True
        return False

    def _effective(self, e: _Entry, now_ns: int) -> int:
        top = self._levels - 1
        if self._aging <= 0 or e.priority >= top:
            return e.priority
        return min(top - 1, e.priority + max(0, (now_ns - e.enqueued_ns) // self._aging))

    def _overdue(self, e: _Entry, now_ns: int) -> bool:
        limit = self._oldest_first_after
        turn_over = self._turns <= 0 or self._departures >= e.due_departures
        return limit > 0 and now_ns - e.enqueued_ns >= limit and turn_over

    def _backlog_standing(self, level: int, now_ns: int) -> bool:
        horizon = self._lifo_backlog
        if horizon <= 0:
            return True
        self._admitted_ns = [t for t in self._admitted_ns if t > now_ns - horizon]
        backlog = sum(len(h) for i, h in enumerate(self._heaps) if i // self._buckets >= level)
        window = min(horizon, now_ns - self._created)
        return float(backlog) * float(window) > float(len(self._admitted_ns)) * float(horizon)

    def pop_batch(
        self, max_requests: int, max_tokens: int, now_ns: int, preferred: Iterable[int] = ()
    ) -> list[int]:
        out = self._select(max_requests, max_tokens, now_ns, preferred)
        self._departures += len(out)
        if self._lifo_backlog > 0 and self._lifo_after > 0:
            self._admitted_ns += [now_ns] * len(out)
        return out

    def _select(
        self, max_requests: int, max_tokens: int, now_ns: int, preferred: Iterable[int]
    ) -> list[int]:
        lifo = [False] * self._levels
        for i, h in enumerate(self._heaps):
            if not h or not self._lifo_after:
                continue
            # The oldest arrival decides: a requeued request's wait includes its running time.
            oldest = h[0] if h[0][0] >= 0 else min((x for x in h if x[0] >= 0), default=None)
            if oldest and now_ns - oldest[1].enqueued_ns >= self._lifo_after:
                lifo[i // self._buckets] = True
        lifo = [on and self._backlog_standing(p, now_ns) for p, on in enumerate(lifo)]

        def candidate(i: int) -> tuple[_Entry, tuple[int, int], int]:
            """The entry taken next from heap i, its arrival-order key (smaller first; a
            newest-first heap after every oldest-first one, as the C++ keys sort) and the
            heap's effective priority (its oldest entry's)."""
            h = self._heaps[i]
            head = h[0][1]  # a requeued request, if any: it goes first either way
            eff = self._effective(head, now_ns)
            if lifo[i // self._buckets] and head.seq >= 0 and not self._overdue(head, now_ns):
                newest = max(h)[1]
                return newest, (1, -newest.seq), eff
            return head, (0, head.seq), eff

        live = [i for i, h in enumerate(self._heaps) if h]
        if not live:
            return []
        head_bucket = min((-eff, key, e.bucket) for e, key, eff in (candidate(i) for i in live))[2]
        wanted = set(preferred) if self._max_overtakes > 0 else set()
        prefs = sorted(
            (-self._effective(e, now_ns), e.seq, i, e)
            for i, h in enumerate(self._heaps)
            for _, e in h
            if e.id in wanted
        )
        taken: set[int] = set()
        out: list[int] = []
        tokens = 0
        while len(out) < max_requests:
            best: int | None = None
            best_key: tuple[int, int, int, tuple[int, int]] | None = None
            for i, h in enumerate(self._heaps):
                if not h:
                    continue
                e, order, eff = candidate(i)
                key = (-eff, abs(e.bucket - head_bucket), e.bucket, order)
                if best_key is None or key < best_key:
                    best, best_key = i, key
            while prefs and prefs[0][3].id in taken:
                prefs.pop(0)
            if prefs:
                neg_eff, _, i, p = prefs[0]
                passed = candidate(best)[0] if best is not None else None
                if passed is None or (
                    best_key is not None
                    and -neg_eff >= -best_key[0]
                    and passed.seq >= 0
                    and passed.overtaken < self._max_overtakes
                    and not self._overdue(passed, now_ns)
                ):
                    if tokens + p.cost > max_tokens:
                        prefs = []  # a preferred call that does not fit passes nobody
                    else:
                        tokens += p.cost
                        if passed is not None:
                            passed.overtaken += 1
                        self._heaps[i].remove((p.seq, p))
                        heapq.heapify(self._heaps[i])
                        taken.add(p.id)
                        out.append(p.id)
                        continue
            if best is None:
                break
            e, _, _ = candidate(best)
            if tokens + e.cost > max_tokens:
                break
            tokens += e.cost
            h = self._heaps[best]
            if h[0][1] is not e:
                h.remove((e.seq, e))
                heapq.heapify(h)
            else:
                heapq.heappop(h)  # the oldest: the heap's own order, as before LIFO existed
            taken.add(e.id)
            out.append(e.id)
        return out

    def __len__(self) -> int:
        return sum(len(h) for h in self._heaps)
