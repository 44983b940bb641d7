"""Which queued calls the queue should take first: those whose prompt vLLM's prefix cache most
likely still holds (pure policy over WorkItems and the KV ledger; the worker applies it).

Such a call's prefill is mostly a cache hit, and one taken before its prefix is evicted saves
recomputing it. With several documents in rotation and a cache too small for them all, arrival
order interleaves the documents and evicts each before its next call comes; taking the calls
over resident documents first keeps them resident (`bench/compare.py --workloads many_docs`).
BatchQueue takes the preferred calls first within their priority level, the call next in line
passed over at most `--prefix-affinity` times. The order matters only when calls wait in
streambatch's queue: with free engine slots every call enters at once.
"""

from __future__ import annotations

import itertools

from pyserver.domain import WorkItem
from pyserver.engine.kv_ledger import KvLedger

# Queued calls looked at per admission, oldest first: bounds the cost of a step under a deep
# backlog (about a microsecond per block looked up).
SCAN = 512


def resident_prefix_preference(
    items: dict[int, WorkItem], running: dict[int, WorkItem], kv: KvLedger
) -> list[int]:
    """The handles of the queued calls whose prompt is at least half resident; empty when
    none or all of them are (the queue's own order then stands). `items`: every accepted call
    in arrival order; `running`: those in the engine."""
    if not kv.tracks_prefixes:
        return []
    warm: list[int] = []
    scanned = 0
    # list(): one atomic copy under the GIL (the event loop adds to the dict).
    queued = (it for it in list(items.values()) if it.handle not in running)
    for item in itertools.islice(queued, SCAN):
        if item.prompt_blocks is None:
            item.prompt_blocks = kv.block_hashes(item.prompt_token_ids)
        resident = kv.resident_tokens(item.prompt_blocks)
        if resident and 2 * resident >= len(item.prompt_token_ids):
            warm.append(item.handle)
        scanned += 1
    return warm if len(warm) < scanned else []
