"""The allowed-token masks of one step's grammar requests, and applying them to logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = 32


@dataclass(slots=True)
class GrammarBitmask:
    """One packed row (32 tokens per int32 word, xgrammar's layout) per grammar request.

    ``req_ids[i]`` owns row ``i``. The worker's sampled rows come in its own order
    (``sample_req_ids``), so :meth:`apply` maps each request to its logits row.
    """

    req_ids: list[str]
    bitmask: torch.Tensor  # [len(req_ids), ceil(vocab / 32)] int32, on the CPU

    def apply(self, logits: torch.Tensor, sample_req_ids: list[str]) -> torch.Tensor:
        """Set disallowed tokens to -inf in place, before any sampling rule runs."""
        row_of = {r: i for i, r in enumerate(sample_req_ids)}
        mask_rows: list[int] = []
        logit_rows: list[int] = []
        for i, req_id in enumerate(self.req_ids):
            j = row_of.get(req_id)
            if j is not None:
                mask_rows.append(i)
                logit_rows.append(j)
        if not logit_rows:
            return logits
        dev = logits.device
        if dev.type in ("cpu", "cuda"):
            import xgrammar as xgr  # slow to import; see structured/backend.py

            # xgrammar's kernel masks row i of the logits with row i of the mask, for the
            # listed rows only: scatter our rows to their logits rows first.
            full = self.bitmask.new_full((logits.shape[0], self.bitmask.shape[1]), -1)
            for i, j in zip(mask_rows, logit_rows, strict=True):
                full[j].copy_(self.bitmask[i])  # row copies: list-index assignment is slow
            xgr.apply_token_bitmask_inplace(logits, full.to(dev, non_blocking=True),
                                            indices=logit_rows)
            return logits
        return _apply_unpacked(logits, self.bitmask[mask_rows].to(dev), logit_rows)


def _apply_unpacked(logits: torch.Tensor, words: torch.Tensor,
                    logit_rows: list[int]) -> torch.Tensor:
    """Plain-torch fallback for devices without an xgrammar kernel."""
    dev = logits.device
    shifts = torch.arange(_BITS, dtype=torch.int32, device=dev)
    # Bit b of word w allows token 32 * w + b; ">>" sign-extends, "& 1" undoes that.
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    vocab = logits.shape[-1]
    if allowed.shape[1] < vocab:  # logits padded past the grammar's vocabulary
        pad = allowed.new_zeros(allowed.shape[0], vocab - allowed.shape[1])
        allowed = torch.cat([allowed, pad], dim=1)
    rows = torch.tensor(logit_rows, dtype=torch.long, device=dev)
    logits[rows] = logits[rows].masked_fill(~allowed[:, :vocab], float("-inf"))
    return logits
