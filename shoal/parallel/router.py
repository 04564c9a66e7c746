"""Which ADP owner takes a new request."""

from __future__ import annotations


class Router:
    """Assigns each ADP request to one owner: the least loaded (fewest unfinished requests);
    among equally loaded owners, the one that last took a request with the same first
    block of tokens (its prefix cache likely holds it); else the lowest rank."""

    def __init__(self, num_owners: int, block_size: int):
        self.load = [0] * num_owners
        self.block_size = block_size
        self._affinity: dict[tuple[int, ...], int] = {}  # first block's tokens -> owner

    def assign(self, prompt_token_ids: list[int]) -> int:
        least = min(self.load)
        candidates = [r for r, n in enumerate(self.load) if n == least]
        key = tuple(prompt_token_ids[:self.block_size])
        preferred = self._affinity.get(key) if len(prompt_token_ids) >= self.block_size else None
        owner = preferred if preferred in candidates else candidates[0]
        if len(prompt_token_ids) >= self.block_size:
            self._affinity[key] = owner
        self.load[owner] += 1
        return owner

    def release(self, owner: int) -> None:
        self.load[owner] -= 1
