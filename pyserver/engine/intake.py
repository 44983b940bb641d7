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
# backlog (a few microseconds per call once its block hashes are known).
SCAN = 128


def resident_prefix_preference(
    items: dict[int, WorkItem], running: dict[int, WorkItem], kv: KvLedger
) -> list[int]:
    """The handles of the queued calls whose prompt is at least half resident beyond what every
    queued call has resident (a system prompt or chat template they all share saves nothing by
    reordering); empty when none or all of them are (the queue's own order then stands).
    `items`: every accepted call in arrival order; `running`: those in the engine. A call that
    asks for prompt logprobs is never preferred: vLLM computes its whole prompt anyway."""
    if not kv.tracks_prefixes:
        return []
    resident: list[tuple[int, int, int]] = []  # (handle, prompt tokens, resident tokens)
    # list(): one atomic copy under the GIL (the event loop adds to the dict).
    queued = (it for it in list(items.values()) if it.handle not in running)
    for item in itertools.islice(queued, SCAN):
        if item.prompt_blocks is None:
            item.prompt_blocks = kv.block_hashes(item.prompt_token_ids, item.adapter)
        cached = (
            0
            if item.sampling.prompt_logprobs is not None
            else kv.resident_tokens(item.prompt_blocks)
        )
        resident.append((item.handle, len(item.prompt_token_ids), cached))
    if not resident:
        return []
    common = min(r for _, _, r in resident)
    warm = [h for h, n, r in resident if r > common and 2 * (r - common) >= n - common]
    return warm if len(warm) < len(resident) else []
