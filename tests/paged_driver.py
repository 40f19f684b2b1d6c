"""A minimal paged-cache driver for tests and debugging, independent of the real runner.

Test code, kept out of the installed package; ``benchmarks/host_contention.py`` uses it too.

It owns a KV cache, hands out blocks in a scrambled order (so tests exercise non-contiguous
paging), and runs arbitrary mixes of prefill chunks and decodes through a ``CausalLM``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from forerun.model.attention import AttentionMetadata, KVCache, new_kv_cache
from forerun.model.base import CausalLM


@dataclass(slots=True)
class _Seq:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedDriver:
    """Runs a model over a private paged KV cache; sequences are identified by any hashable."""

    def __init__(
        self, model: CausalLM, num_blocks: int = 256, block_size: int = 4, seed: int = 0,
        cache_dtype: torch.dtype | None = None,
    ) -> None:
        cfg = model.config
        param = next(model.parameters())
        self.model = model
        self.block_size = block_size
        self.device = param.device
        self.kv_caches: list[KVCache] = [
            new_kv_cache(num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                         param.dtype, self.device, cache_dtype)
            for _ in range(cfg.num_hidden_layers)
        ]
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)
        self._seqs: dict[object, _Seq] = {}

    def _slots(self, seq: _Seq, n: int) -> list[int]:
        slots = []
        for pos in range(seq.num_tokens, seq.num_tokens + n):
            if pos // self.block_size >= len(seq.blocks):
                seq.blocks.append(self._free.pop())
            slots.append(seq.blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
        return slots

    def step(self, batch: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """Feed new tokens for each sequence in one forward; returns per-sequence logits ``[q, V]``."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for key, tokens in batch:
            seq = self._seqs.setdefault(key, _Seq())
            slots += self._slots(seq, len(tokens))
            positions += range(seq.num_tokens, seq.num_tokens + len(tokens))
            ids += tokens
            seq.num_tokens += len(tokens)
            qsl.append(qsl[-1] + len(tokens))
            seq_lens.append(seq.num_tokens)
        width = max(len(self._seqs[k].blocks) for k, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.long)
        for i, (key, _) in enumerate(batch):
            blocks = self._seqs[key].blocks
            tables[i, : len(blocks)] = torch.tensor(blocks)
        meta = AttentionMetadata.build(
            qsl, seq_lens, tables, torch.tensor(slots), self.block_size, self.device
        )
        dev = self.device
        hidden = self.model(
            torch.tensor(ids, device=dev), torch.tensor(positions, device=dev),
            self.kv_caches, meta,
        )
        logits = self.model.compute_logits(hidden)
        return [logits[qsl[i] : qsl[i + 1]] for i in range(len(batch))]

    def greedy(self, key: object, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill ``prompt`` then decode greedily one token per step."""
        logits = self.step([(key, prompt)])[0]
        out = [int(logits[-1].argmax())]
        while len(out) < max_new_tokens:
            out.append(int(self.step([(key, [out[-1]])])[0][-1].argmax()))
        return out
