"""Which data-parallel engine a request goes to: its prompt's cached prefix, then load."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(slots=True)
class PrefixAwareRouter:
    """Sends a request to the engine that most likely holds its prompt's longest prefix.

    Each engine's prefix cache is mirrored approximately: the chained hashes of the full
    blocks of every prompt routed there, the newest ``capacity`` kept. A request goes to the
    engine with the longest run of matching leading blocks, unless that engine has more than
    ``max_imbalance`` requests in flight above the least loaded one; otherwise (and with no
    match) to the least loaded engine. The engines' real caches may have evicted a block
    this side still remembers: a miss then costs a prefill, never a wrong answer.
    """

    num_engines: int
    block_size: int
    max_imbalance: int
    capacity: int = 1 << 16
    max_blocks: int = 256  # leading blocks looked at per prompt
    _seen: list[OrderedDict[int, None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._seen = [OrderedDict() for _ in range(self.num_engines)]

    def block_hashes(self, prompt_token_ids: list[int]) -> list[int]:
        bs = self.block_size
        n = min(len(prompt_token_ids) // bs, self.max_blocks)
        out: list[int] = []
        h = 0
        for i in range(n):
            h = hash((h, tuple(prompt_token_ids[i * bs: (i + 1) * bs])))
            out.append(h)
        return out

    def choose(self, prompt_token_ids: list[int], load: list[int]) -> int:
        """The engine for this prompt (and remember its blocks there)."""
        hashes = self.block_hashes(prompt_token_ids)
        least = min(range(self.num_engines), key=load.__getitem__)
        best, best_len = least, 0
        for i, seen in enumerate(self._seen):
            n = 0
            while n < len(hashes) and hashes[n] in seen:
                n += 1
            if n > best_len or (n == best_len and n > 0 and load[i] < load[best]):
                best, best_len = i, n
        engine = best if best_len and load[best] - load[least] <= self.max_imbalance \
            else least
        seen = self._seen[engine]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return engine
