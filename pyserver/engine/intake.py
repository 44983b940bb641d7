"""What of the queue the engine takes in now, beyond free slots and KV room (pure policy over
WorkItems and the KV ledger; the worker applies it).

Two rules, for the calls the engine would otherwise hold in its own first-come-first-served
waiting list:
- **A bounded prefill backlog.** The engine gets at most `backlog_tokens` of prompt tokens not
  yet computed (its prefix cache's hits excluded) ahead of its prefill at once, a couple of
  steps' worth; the rest waits in streambatch's queue, where priority, length buckets and the
  rule below order it. Decodes are not affected: every admitted call keeps its slot.
- **Resident prefixes first.** Queued calls whose prompt the prefix cache most likely holds
  (KvLedger's model of it) go first, each call next in line passed over a bounded number of
  times (BatchQueue's preferred requests): their prefill is mostly a cache hit, and one taken
  before its prefix is evicted saves recomputing it. With several documents in rotation and a
  cache too small for them all, arrival order interleaves the documents and evicts each before
  its next call comes (`bench/compare.py --workloads many_docs`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pyserver.domain import WorkItem
from pyserver.engine.kv_ledger import KvLedger

# Queued calls looked at per admission, oldest first: bounds the cost of a step under a deep
# backlog (about a microsecond per block looked up).
SCAN = 512


@dataclass(slots=True)
class Intake:
    max_requests: int  # to take from the queue now
    preferred: list[int] = field(default_factory=list)  # handles for the queue to take first


def plan_intake(
    items: dict[int, WorkItem],
    running: dict[int, WorkItem],
    kv: KvLedger,
    *,
    free: int,
    backlog_tokens: int,
    affinity: bool,
    top: int,
) -> Intake:
    """`items`: every accepted call, in arrival order; `running`: those in the engine; `free`:
    the slots admission allows; `backlog_tokens`: the prefill backlog bound (0: none); `top`:
    the top priority level, whose calls the bound never holds back (the queue hands them out
    first, and the engine's scheduler starts them before any other prefill); `affinity`: the
    queue takes preferred calls (BatchQueue's affinity_max_overtakes > 0)."""
    prefer_resident = affinity and kv.tracks_prefixes
    if free <= 0 or (not backlog_tokens and not prefer_resident):
        return Intake(max(0, free))
    warm: list[int] = []
    uncached = scanned = top_waiting = 0
    # list(): one atomic copy under the GIL (the event loop adds to the dict).
    queued = (it for it in list(items.values()) if it.handle not in running)
    for item in itertools.islice(queued, SCAN):
        if item.prompt_blocks is None:
            item.prompt_blocks = kv.block_hashes(item.prompt_token_ids)
        resident = kv.resident_tokens(item.prompt_blocks)
        if resident and 2 * resident >= len(item.prompt_token_ids):
            warm.append(item.handle)
        uncached += len(item.prompt_token_ids) - resident
        scanned += 1
        top_waiting += item.priority == top
    # None or all of them resident: the queue's own order stands.
    preferred = warm if prefer_resident and 0 < len(warm) < scanned else []
    if not backlog_tokens or not scanned:
        return Intake(free, preferred)
    # Admitted calls still waiting for their first token are the engine's prefill backlog.
    pending = sum(kv.uncached_tokens(h) for h, it in running.items() if not it.first_token_ns)
    room = 0
    if pending < backlog_tokens:
        # As many as fill the backlog at the queue's mean prefill per call; at least one, so
        # a prompt longer than the bound still enters an idle engine.
        room = max(1, int((backlog_tokens - pending) / max(1.0, uncached / scanned)))
    return Intake(min(free, max(room, top_waiting)), preferred)
