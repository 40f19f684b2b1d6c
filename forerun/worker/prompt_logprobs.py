"""Prompt logprobs: the logprobs of the prompt tokens a step's prefill chunks predict."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import compute_logprobs


@dataclass(slots=True)
class PromptLogprobsChunk:
    """One request's prompt logprobs from one step, still on the device."""

    req_id: str
    start: int  # position of the first prompt token these rows score
    ids: torch.Tensor  # [m, 1 + k] the token itself, then the top k
    logprobs: torch.Tensor  # [m, 1 + k]
    ranks: torch.Tensor  # [m]


def prompt_logprobs(model: torch.nn.Module, requests: dict[str, CachedRequestState],
                    num_tokens_of: dict[str, int], hidden: torch.Tensor,
                    device: torch.device) -> list[PromptLogprobsChunk]:
    """Raw logprobs of the prompt tokens this step's chunks predict.

    Logits are computed only for the rows of requests that asked. The hidden state at
    position p predicts prompt token p + 1, so a chunk [start, end) yields the logprobs
    of tokens start + 1 .. min(end, num_prompt - 1).
    """
    out = []
    row0 = 0
    for req_id, n in num_tokens_of.items():
        state = requests[req_id]
        if state.want_prompt_logprobs:
            end = state.num_computed_tokens  # already advanced by prepare_inputs
            start = end - n
            last = min(end, state.num_prompt_tokens - 1)
            if last > start:
                m = last - start
                logits = model.compute_logits(hidden[row0: row0 + m])
                targets = torch.tensor(state.token_ids[start + 1: last + 1],
                                       dtype=torch.long, device=device)
                k = state.sampling_params.prompt_logprobs or 0
                ids, vals, ranks = compute_logprobs(logits, targets, k)
                out.append(PromptLogprobsChunk(req_id, start + 1, ids, vals, ranks))
            if end >= state.num_prompt_tokens:
                state.want_prompt_logprobs = False
        row0 += n
    return out
