"""The KV tokens admitted requests will hold at their end, with vLLM's prefix sharing counted
(pure bookkeeping: the worker admits a request only while its reservation fits)."""

from __future__ import annotations

from collections.abc import Sequence


class KvLedger:
    """Reservations of running requests: each holds its prompt, less the full blocks a running
    request already holds (vLLM's prefix cache shares them), plus its max_tokens. Blocks are
    keyed like vLLM's prefix cache: a hash chained over the prompt's full blocks, so a block
    matches only with everything before it. Without the sharing, 29 requests over one
    1.5k-token document filled a 46k-token cache on paper while vLLM stored the document once
    (make bench, shared_prefix)."""

    def __init__(self, capacity_tokens: int, block_size: int) -> None:
        self.capacity_tokens = capacity_tokens  # 0: unknown, admission is not bounded by KV
        self._block_size = block_size  # 0: no prefix cache, nothing shared
        self._holders: dict[int, int] = {}  # prompt-block hash -> running requests holding it
        self._reservations: dict[int, tuple[int, list[int]]] = {}  # handle -> (tokens, blocks)
        self.reserved_tokens = 0

    @property
    def room(self) -> int:
        """Tokens left to reserve (a large number when the capacity is unknown)."""
        return self.capacity_tokens - self.reserved_tokens if self.capacity_tokens else 1 << 40

    @property
    def usage(self) -> float:
        return self.reserved_tokens / self.capacity_tokens if self.capacity_tokens else 0.0

    def reserve(self, handle: int, prompt: Sequence[int], max_tokens: int) -> int:
        """Reserve for a request entering the engine; returns the tokens reserved."""
        blocks: list[int] = []
        shared = 0
        if self._block_size:
            size, h = self._block_size, 0
            for start in range(0, len(prompt) - size + 1, size):
                h = hash((h, tuple(prompt[start : start + size])))
                blocks.append(h)
                shared += 1 if h in self._holders else 0
                self._holders[h] = self._holders.get(h, 0) + 1
        tokens = len(prompt) - shared * self._block_size + max_tokens
        self._reservations[handle] = (tokens, blocks)
        self.reserved_tokens += tokens
        return tokens

    def release(self, handle: int) -> None:
        """The request left the engine (finished, aborted, preempted)."""
        tokens, blocks = self._reservations.pop(handle, (0, []))
        self.reserved_tokens -= tokens
        for block in blocks:
            if self._holders[block] == 1:
                del self._holders[block]
            else:
                self._holders[block] -= 1

    def clear(self) -> None:
        self._holders.clear()
        self._reservations.clear()
        self.reserved_tokens = 0
