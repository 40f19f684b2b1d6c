"""Parallel sampling (``SamplingParams.n > 1``): one request fanned out into n children.

The engine core only knows single-sequence requests. The frontend turns a request with
``n=k`` into k child requests with the same prompt, added back to back so the scheduler
admits them together and automatic prefix caching shares the prompt's full KV blocks
(the first child publishes them when it is scheduled, the others hit them). The parent's
``RequestOutput`` is assembled here from the children's latest states.
"""

from __future__ import annotations

from forerun.outputs import CompletionOutput, RequestOutput
from forerun.sampling_params import SamplingParams


def child_request_id(parent_id: str, index: int) -> str:
    return f"{parent_id}_{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child ``index``'s params: ``n=1``, and ``seed + index`` when seeded.

    Distinct seeds make the completions differ while staying reproducible; without a
    seed each child draws from the batch's shared stream, so they differ anyway. The sum
    wraps modulo 2**64, as the worker keys streams by the seed modulo 2**64 anyway, so
    every valid seed works with every n.
    """
    p = params.clone()
    p.n = 1
    if p.seed is not None:
        p.seed = (p.seed + index) % (1 << 64)
    return p


class ParentRequest:
    """Tracks the children of one ``n > 1`` request and aggregates their outputs."""

    def __init__(self, request_id: str, n: int) -> None:
        self.request_id = request_id
        self.n = n
        self.child_ids = [child_request_id(request_id, i) for i in range(n)]
        self.index_of = {cid: i for i, cid in enumerate(self.child_ids)}
        self._latest: list[RequestOutput | None] = [None] * n
        self._new_token_ids: list[int] = []

    def unfinished_child_ids(self) -> list[str]:
        return [cid for cid, out in zip(self.child_ids, self._latest, strict=True)
                if out is None or not out.finished]

    @property
    def finished(self) -> bool:
        return all(out is not None and out.finished for out in self._latest)

    def add_child_output(self, out: RequestOutput) -> None:
        """Record a child's newest state (outputs are cumulative, so the last one wins)."""
        self._latest[self.index_of[out.request_id]] = out
        self._new_token_ids.extend(out.new_token_ids)

    def make_output(self) -> RequestOutput:
        """The parent's state: one CompletionOutput per child, ``index`` 0..n-1.

        A child with no output yet shows as an empty completion, so ``outputs[i]`` is
        always child i. ``new_token_ids`` holds every child's tokens since the last call.
        """
        first = next(out for out in self._latest if out is not None)
        completions: list[CompletionOutput] = []
        for i, out in enumerate(self._latest):
            if out is None:
                completions.append(CompletionOutput(index=i, text="", token_ids=[]))
                continue
            c = out.outputs[0]
            completions.append(CompletionOutput(
                index=i, text=c.text, token_ids=c.token_ids,
                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        new_ids, self._new_token_ids = self._new_token_ids, []
        prompt_logprobs = next((o.prompt_logprobs for o in self._latest
                                if o is not None and o.prompt_logprobs is not None), None)
        return RequestOutput(
            request_id=self.request_id, prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids, outputs=completions,
            finished=self.finished,
            # The first child computed the prompt; later ones report the shared hits.
            num_cached_tokens=max(o.num_cached_tokens for o in self._latest if o is not None),
            metrics=first.metrics, new_token_ids=new_ids, prompt_logprobs=prompt_logprobs,
        )


class ParallelSampling:
    """The ``n > 1`` requests in flight: each parent by id, and each child's parent.

    The one place both frontends (``LLMEngine`` and ``AsyncLLM``) keep this bookkeeping.
    """

    def __init__(self) -> None:
        self._parents: dict[str, ParentRequest] = {}
        self._child_parent: dict[str, ParentRequest] = {}

    def fan_out(self, request_id: str,
                params: SamplingParams) -> list[tuple[str, SamplingParams]]:
        """The engine requests for one user request: itself, or its n children."""
        if params.n == 1:
            return [(request_id, params)]
        parent = ParentRequest(request_id, params.n)
        self._parents[request_id] = parent
        for cid in parent.child_ids:
            self._child_parent[cid] = parent
        return [(cid, child_params(params, i)) for i, cid in enumerate(parent.child_ids)]

    def forget(self, request_id: str) -> list[str]:
        """Drop ``request_id``; the engine ids it still has running (children, or itself)."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return [request_id]
        for cid in parent.child_ids:
            self._child_parent.pop(cid, None)
        return parent.unfinished_child_ids()

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace children's outputs by one aggregated output per parent touched."""
        if not self._child_parent:
            return outputs
        merged: list[RequestOutput] = []
        touched: dict[str, ParentRequest] = {}
        for out in outputs:
            parent = self._child_parent.get(out.request_id)
            if parent is None:
                merged.append(out)
                continue
            parent.add_child_output(out)
            touched[parent.request_id] = parent
        for parent in touched.values():
            merged.append(parent.make_output())
            if parent.finished:
                self.forget(parent.request_id)
        return merged

    def __len__(self) -> int:
        return len(self._parents)
