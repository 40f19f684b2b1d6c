"""The pooler, beside the sampler: final-normed hidden states of a prompt -> one vector.

A pooling request's prompt may be computed over several steps (chunked prefill). LAST
reads the last position's row in the step that computes it; CLS keeps the first
position's row; MEAN keeps a float32 running sum and count per request, so the mean over
a chunked prompt is the mean over the whole prompt. The scheduler never gives MEAN or CLS
requests prefix-cache hits (those positions' hidden states would be missing), and a
chunk that starts at position 0 starts the request afresh (after a preemption too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from forerun.worker.request_state import CachedRequestState
from forerun.worker.step_inputs import PoolChunk


@dataclass(slots=True)
class _Partial:
    """What a MEAN or CLS request has gathered from its chunks so far."""

    total: torch.Tensor  # float32 [hidden]: the sum (MEAN) or the first row (CLS)
    count: int


class Pooler:
    """Pools each pooling request of a step; keeps partial results between chunks."""

    def __init__(self) -> None:
        self._partial: dict[str, _Partial] = {}

    def forget(self, req_ids: set[str]) -> None:
        """Drop what finished or preempted requests had gathered."""
        for req_id in req_ids:
            self._partial.pop(req_id, None)

    def __call__(self, hidden: torch.Tensor, chunks: list[PoolChunk],
                 requests: dict[str, CachedRequestState]) -> list[tuple[str, torch.Tensor]]:
        """The vectors (float32, on the device) of the requests whose prompt ended here."""
        done: list[tuple[str, torch.Tensor]] = []
        for c in chunks:
            params = requests[c.req_id].pooling_params
            assert params is not None and params.pooling_type is not None
            kind = params.pooling_type
            if kind == "LAST":
                if c.last:
                    done.append((c.req_id, self._finish(hidden[c.row + c.n - 1].float(),
                                                        params.dimensions, params.normalize)))
                continue
            rows = hidden[c.row: c.row + c.n].float()
            part = self._partial.get(c.req_id)
            if c.start == 0 or part is None:
                assert c.start == 0, (c.req_id, c.start)  # no cache hits for MEAN / CLS
                part = _Partial(torch.zeros_like(rows[0]), 0)
                if kind == "CLS":
                    part.total = rows[0].clone()
                self._partial[c.req_id] = part
            if kind == "MEAN":
                part.total += rows.sum(dim=0)
                part.count += c.n
            if c.last:
                del self._partial[c.req_id]
                vec = part.total / part.count if kind == "MEAN" else part.total
                done.append((c.req_id, self._finish(vec, params.dimensions, params.normalize)))
        return done

    @staticmethod
    def _finish(vec: torch.Tensor, dimensions: int | None, normalize: bool | None
                ) -> torch.Tensor:
        """Matryoshka truncation first, then (if asked) unit length: the kept values are
        renormalised on their own."""
        if dimensions is not None:
            vec = vec[:dimensions]
        if normalize:
            vec = F.normalize(vec, dim=0)
        return vec
