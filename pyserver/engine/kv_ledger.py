"""The KV tokens admitted requests will hold at their end, with vLLM's prefix sharing counted,
and which prompt blocks vLLM's prefix cache most likely still holds (pure bookkeeping: the
worker admits a request only while its reservation fits, and prefers queued requests whose
prompt is resident)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KvLedger:
    """Reservations of running requests: each holds its prompt, less the full blocks a running
    request already holds (vLLM's prefix cache shares them), plus its max_tokens. Blocks are
    keyed like vLLM's prefix cache: a hash chained over the prompt's full blocks, so a block
    matches only with everything before it. Without the sharing, 29 requests over one
    1.5k-token document filled a 46k-token cache on paper while vLLM stored the document once
    (make bench, shared_prefix).

    Residency mirrors vLLM's eviction: a block no running request holds stays cached until its
    room is needed, least recently released first, and a request's blocks are released last
    block first (vLLM frees them in reverse, so a prompt's head outlives its tail). The room
    for cached blocks is the capacity less every reservation. An approximation: vLLM also
    caches the output blocks of finished requests, and allocates a running request's blocks as
    it goes rather than all at its start."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.capacity_tokens = capacity_tokens  # 0: unknown, admission is not bounded by KV
        self._block_size = block_size  # 0: no prefix cache, nothing shared
        self._holders: dict[int, int] = {}  # prompt-block hash -> running requests holding it
        self._cached: OrderedDict[int, None] = OrderedDict()  # held by none, oldest first
        self._reservations: dict[int, tuple[int, list[int]]] = {}  # handle -> (tokens, blocks)
        self.reserved_tokens = 0

    @property
    def tracks_prefixes(self) -> bool:
        """Whether residency is modelled: a prefix cache and a known capacity."""
        return bool(self._block_size and self.capacity_tokens)

    @property
    def room(self) -> int:
        """Tokens left to reserve (a large number when the capacity is unknown)."""
        return self.capacity_tokens - self.reserved_tokens if self.capacity_tokens else 1 << 40

    @property
    def usage(self) -> float:
        return self.reserved_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def block_hashes(self, prompt: Sequence[int], adapter: str = "") -> list[int]:
        """The chained hashes of the prompt's full blocks (none without a prefix cache). vLLM's
        block hash includes the LoRA adapter: a document cached for the base model is not
        cached for an adapter."""
        size, h, out = self._block_size, hash(adapter) if adapter else 0, []
        if size:
            for start in range(0, len(prompt) - size + 1, size):
                h = hash((h, tuple(prompt[start : start + size])))
                out.append(h)
        return out

    def resident_tokens(self, blocks: Sequence[int]) -> int:
        """Tokens of the prompt's leading blocks the prefix cache most likely holds."""
        n = 0
        for h in blocks:
            if h not in self._holders and h not in self._cached:
                break
            n += 1
        return n * self._block_size

    def reserve(
        self, handle: int, prompt: Sequence[int], max_tokens: int, adapter: str = ""
    ) -> int:
        """Reserve for a request entering the engine; returns the tokens reserved."""
        blocks = self.block_hashes(prompt, adapter)
        shared = 0
        for h in blocks:
            shared += 1 if h in self._holders else 0
            self._holders[h] = self._holders.get(h, 0) + 1
            self._cached.pop(h, None)
        tokens = len(prompt) - shared * self._block_size + max_tokens
        self._reservations[handle] = (tokens, blocks)
        self.reserved_tokens += tokens
        self._evict()
        return tokens

    def release(self, handle: int) -> None:
        """The request left the engine (finished, aborted, preempted)."""
        tokens, blocks = self._reservations.pop(handle, (0, []))
        self.reserved_tokens -= tokens
        for block in reversed(blocks):
            if self._holders[block] == 1:
                del self._holders[block]
                self._cached[block] = None
            else:
                self._holders[block] -= 1
        self._evict()

    def _evict(self) -> None:
        if not self._block_size or not self.capacity_tokens:
            self._cached.clear()
            return
        room = max(0, self.capacity_tokens - self.reserved_tokens) // self._block_size
        while len(self._cached) > room:
            self._cached.popitem(last=False)

    def clear(self) -> None:
        self._holders.clear()
        self._cached.clear()
        self._reservations.clear()
        self.reserved_tokens = 0
