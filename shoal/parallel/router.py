"""Which ADP owner takes a new request."""

from __future__ import annotations

from collections import OrderedDict

MAX_AFFINITY_KEYS = 65536  # first blocks remembered (the least recently routed forgotten)


class Router:
    """Assigns each ADP request to one owner: the least loaded (fewest unfinished requests);
    among equally loaded owners, the one that last took a request with the same first
    block of tokens (its prefix cache likely holds it, if it was one of the last
    MAX_AFFINITY_KEYS first blocks routed); else the lowest rank."""

    def __init__(self, num_owners: int, block_size: int):
        self.load = [0] * num_owners
        self.block_size = block_size
        # first block's tokens -> owner, least recently routed first (bounded: a server
        # routes without end)
        self._affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()

    def assign(self, prompt_token_ids: list[int]) -> int:
        least = min(self.load)
        candidates = [r for r, n in enumerate(self.load) if n == least]
        key = tuple(prompt_token_ids[:self.block_size])
        preferred = self._affinity.get(key) if len(prompt_token_ids) >= self.block_size else None
        owner = preferred if preferred in candidates else candidates[0]
        if len(prompt_token_ids) >= self.block_size:
            self._affinity[key] = owner
            self._affinity.move_to_end(key)
            if len(self._affinity) > MAX_AFFINITY_KEYS:
                self._affinity.popitem(last=False)
        self.load[owner] += 1
        return owner

    def release(self, owner: int) -> None:
        self.load[owner] -= 1
