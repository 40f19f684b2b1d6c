"""Speculative decoding on the worker: the drafter's view of the requests, and the step
that verifies each request's drafts, records what was accepted and drafts again."""

from __future__ import annotations

from dataclasses import replace

import torch

from forerun.core.output import ModelRunnerOutput, TokenLogprobs
from forerun.spec_decode.config import SpeculativeConfig
from forerun.spec_decode.proposer import make_proposer
from forerun.trace import Tracer
from forerun.worker import rng
from forerun.worker.grammar_bitmask import apply_grammar_bitmask
from forerun.worker.output_plan import OutputPlan, make_output
from forerun.worker.rejection_sampler import verify
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import Sampler, compute_logprobs, process_logits
from forerun.worker.sampling_state import SamplingState
from forerun.worker.step_backend import StepState


class SpecDecodeStep:
    """The drafter and the verification of its drafts (see :meth:`sample`).

    A request's ``token_ids`` here grow with every sample (the drafter reads the text on
    the host), and its ``num_computed_tokens`` is this side's own count: the scheduler
    counts in-flight drafts as accepted, only the worker knows how many were.
    """

    def __init__(self, config: SpeculativeConfig, sampler: Sampler,
                 sampling_state: SamplingState, tracer: Tracer, device: torch.device) -> None:
        self.config = config
        self.drafter = make_proposer(config)
        self.sampler = sampler
        self.sampling_state = sampling_state
        self.tracer = tracer
        self.device = device

    def add_request(self, state: CachedRequestState) -> None:
        """A request's row was (re)built: the drafter starts from its known ids."""
        state.token_ids = list(state.token_ids)  # grows with every sample
        state.spec_enabled = state.sampling_params.supports_spec_decode
        self.drafter.add_request(state.req_id, state.token_ids, state.num_prompt_tokens)

    def remove_request(self, state: CachedRequestState, finished: bool) -> None:
        """A request's row goes (``finished`` False for a preemption)."""
        self.drafter.remove_request(state.req_id, state.token_ids, state.num_prompt_tokens,
                                    finished)

    def sample(self, step: StepState, grammar_bitmask: object | None,
               requests: dict[str, CachedRequestState]) -> ModelRunnerOutput:
        """Verify each request's drafts, record what was accepted, and draft again.

        Every row gets the sampling state of the output index it samples (a request's
        ``num_output_tokens`` plus the row's offset), so ``min_tokens`` and the uniforms
        are per position; a row's penalty counts and bad-word history include the drafts
        before it. Grammar requests never have drafts (one row each).
        """
        assert step.logits is not None and step.drafts is not None
        states = [requests[r] for r in step.sample_req_ids]
        row_states, row_req_ids, row_prior = self._rows(states, step.drafts)
        logits = step.logits
        if grammar_bitmask is not None:
            logits = apply_grammar_bitmask(logits, row_req_ids, grammar_bitmask)
        meta = self.sampling_state.metadata(row_states)
        self.sampling_state.add_draft_counts(meta, row_prior)
        logits = process_logits(logits, meta)
        accept_u = None if meta.all_greedy else rng.acceptance_uniforms(
            [s.rng_key for s in row_states], [s.num_output_tokens for s in row_states])
        result = verify(self.sampler, logits, meta, step.drafts, accept_u)
        self.sampling_state.record_sample_runs(states, result.token_ids)
        out = make_output(step.req_ids, [], [])
        # vLLM's disable_by_batch_size: no drafts while more requests than that run.
        limit = self.config.disable_by_batch_size
        self._accept(out, states, step.drafts, result.token_ids,
                     drafting=limit is None or len(requests) <= limit)
        if self.tracer.enabled and out.num_draft_tokens:
            self._trace_acceptance(step.step_id, step.drafts, result.token_ids)
        if meta.max_num_logprobs is not None:
            self._draft_logprobs(out, states, logits, result.rows, result.token_ids)
        if step.prompt_logprobs or step.pooled:
            built = OutputPlan.of(step, None, requests, self.device).build_now()
            out.prompt_logprobs = built.prompt_logprobs
            out.pooler_output = built.pooler_output
        return out

    def _rows(self, states: list[CachedRequestState], drafts: list[list[int]]
              ) -> tuple[list[CachedRequestState], list[str], list[list[int]]]:
        """Per logits row: the state it samples with, its request, the drafts before it."""
        row_states: list[CachedRequestState] = []
        row_req_ids: list[str] = []
        row_prior: list[list[int]] = []
        for state, ds in zip(states, drafts, strict=True):
            if ds and state.bad_word_seqs:
                self.sampling_state.write_history(state, ds)
            for j in range(len(ds) + 1):
                row_states.append(state if j == 0 else
                                  replace(state, num_output_tokens=state.num_output_tokens + j))
                row_req_ids.append(state.req_id)
                row_prior.append(ds[:j])
        return row_states, row_req_ids, row_prior

    def _accept(self, out: ModelRunnerOutput, states: list[CachedRequestState],
                drafts: list[list[int]], token_ids: list[list[int]], drafting: bool) -> None:
        """Deliver each request's accepted run, and (if ``drafting``) draft its next
        positions."""
        k = self.config.num_speculative_tokens
        for state, ds, ids in zip(states, drafts, token_ids, strict=True):
            out.sampled_token_ids[out.req_id_to_index[state.req_id]] = ids
            # Positions of rejected drafts hold KV that later steps overwrite.
            state.num_computed_tokens -= len(ds) - (len(ids) - 1)
            state.token_ids.extend(ids)
            limit = k if state.num_draft_limit < 0 else state.num_draft_limit
            if ds:
                out.num_draft_tokens[state.req_id] = len(ds)
                # Dynamic draft length: a rejection costs the verification of every draft
                # after it, so draft fewer where guesses fail and more where they hold.
                limit = min(k, limit + 2) if len(ids) > len(ds) else max(1, limit - 1)
            state.num_draft_limit = limit
            state.spec_token_ids = []
            if drafting and state.spec_enabled:
                state.spec_token_ids = self.drafter.propose(state.req_id, state.token_ids,
                                                            limit)
                out.num_next_draft_tokens[state.req_id] = len(state.spec_token_ids)

    def _trace_acceptance(self, step_id: int, drafts: list[list[int]],
                          token_ids: list[list[int]]) -> None:
        """A counter track in the trace: per draft position, how many requests of this step
        had a draft there and how many had it accepted."""
        width = max(len(d) for d in drafts)
        values: dict[str, float] = {}
        for j in range(width):
            values[f"drafted@{j}"] = sum(1 for d in drafts if len(d) > j)
            values[f"accepted@{j}"] = sum(1 for ids in token_ids if len(ids) - 1 > j)
        self.tracer.counter("spec_decode", step_id, values)

    def _draft_logprobs(self, out: ModelRunnerOutput, states: list[CachedRequestState],
                        logits: torch.Tensor, rows: list[list[int]], ids: list[list[int]]
                        ) -> None:
        """Logprobs of every delivered token, from the row it was chosen from."""
        want = [(s, r, t) for s, r, t in zip(states, rows, ids, strict=True)
                if s.sampling_params.logprobs is not None]
        flat_rows = [r for _, rs, _ in want for r in rs]
        chosen = torch.tensor([t for _, _, ts in want for t in ts], dtype=torch.long,
                              device=logits.device)
        n_max = max(s.sampling_params.logprobs or 0 for s, _, _ in want)
        sel = logits.index_select(0, torch.tensor(flat_rows, dtype=torch.long,
                                                  device=logits.device))
        lp_ids, lp_vals, ranks = (t.tolist() for t in compute_logprobs(sel, chosen, n_max))
        i = 0
        for state, rs, _ in want:
            n = state.sampling_params.logprobs or 0
            out.logprobs[state.req_id] = [
                TokenLogprobs(lp_ids[i + j][: n + 1], lp_vals[i + j][: n + 1], ranks[i + j])
                for j in range(len(rs))]
            i += len(rs)
