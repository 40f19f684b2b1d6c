"""The model runner: persistent per-request state, flat inputs, forward, sampling."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from forerun.core.output import (
    ModelRunnerOutput,
    PromptLogprobs,
    SchedulerOutput,
    TokenLogprobs,
)
from forerun.model.attention import AttentionMetadata, new_kv_cache
from forerun.sampling_params import SamplingType
from forerun.spec_decode.config import SpeculativeConfig, supports_spec_decode
from forerun.spec_decode.proposer import make_proposer
from forerun.trace import WORKER_LANE, Tracer
from forerun.worker import rng
from forerun.worker.rejection_sampler import verify
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import Sampler, SamplerOutput, compute_logprobs, process_logits
from forerun.worker.sampling_state import SamplingState

if TYPE_CHECKING:
    from forerun.worker.pipeline import PipelineComm

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _StepState:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]
    sample_req_ids: list[str]
    sample_slots: torch.Tensor | None
    logits: torch.Tensor | None
    step_id: int
    # (req_id, start, ids [m, 1+n], logprobs [m, 1+n], ranks [m]) per prompt chunk.
    prompt_logprobs: list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]] = \
        field(default_factory=list)
    # With a drafter: each sampling request's drafts verified this step (its logits rows
    # are len(drafts) + 1 consecutive rows).
    drafts: list[list[int]] | None = None


@dataclass(slots=True)
class _StepInputs:
    """The flat inputs of one step, as ``_prepare_inputs`` builds them."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # flat rows whose logits are sampled
    sample_req_ids: list[str]
    sample_slots: torch.Tensor
    drafts: list[list[int]] | None  # with a drafter: per sampling request, its drafts
    num_tokens_of: dict[str, int]  # tokens computed per request (drafts found, not reserved)


class DeferredOutput(Protocol):
    """A step's output that is not on the host yet; ``get_output`` waits for it."""

    def get_output(self) -> ModelRunnerOutput: ...


class AsyncModelRunnerOutput:
    """Sampled ids (and logprobs) still being copied device -> host.

    The worker returns this at once so that it can start the next step without a
    device-to-host sync; only the engine, when it needs the ids, waits on the event.
    """

    def __init__(self, host: list[torch.Tensor], event: torch.cuda.Event,
                 build: Callable[[list[list]], ModelRunnerOutput]) -> None:
        self._host, self._event, self._build = host, event, build

    def get_output(self) -> ModelRunnerOutput:
        self._event.synchronize()
        return self._build([t.tolist() for t in self._host])


def _make_output(req_ids: list[str], sample_req_ids: list[str], ids: list[int]) -> ModelRunnerOutput:
    sampled: dict[str, list[int]] = {r: [t] for r, t in zip(sample_req_ids, ids, strict=True)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
    )


@dataclass(slots=True)
class _OutputPlan:
    """Which device tensors one step returns, and how to read them on the host."""

    req_ids: list[str]
    sample_req_ids: list[str]
    logprob_rows: list[tuple[str, int, int]]  # (req_id, row, top-N) of rows that asked
    prompt_reqs: list[tuple[str, int]]  # (req_id, start position) of prompt chunks
    tensors: list[torch.Tensor]

    def build(self, host: list[list]) -> ModelRunnerOutput:
        out = _make_output(self.req_ids, self.sample_req_ids, host[0])
        i = 1
        if self.logprob_rows:
            ids, vals, ranks = host[1], host[2], host[3]
            i = 4
            for req_id, row, n in self.logprob_rows:
                out.logprobs[req_id] = [
                    TokenLogprobs(ids[row][: n + 1], vals[row][: n + 1], ranks[row])]
        for req_id, start in self.prompt_reqs:
            ids, vals, ranks = host[i], host[i + 1], host[i + 2]
            i += 3
            out.prompt_logprobs[req_id] = PromptLogprobs(
                start, [TokenLogprobs(a, b, r) for a, b, r in zip(ids, vals, ranks, strict=True)])
        return out


class ModelRunner:
    """Owns the model and the paged KV cache; runs one step at a time, in FIFO order.

    Worker-side substitution: after sampling, the ids stay in ``last_sampled`` (one stable
    row per request); when the next step schedules the position after a request's known
    ids, that row is scattered into the flat input on the device.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_layers: int,
        dtype: torch.dtype,
        device: torch.device,
        max_num_seqs: int,
        tracer: Tracer | None = None,
        vocab_size: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
        pipeline: PipelineComm | None = None,
    ) -> None:
        self.model = model
        # Pipeline parallel: this runner is one stage (forerun/worker/pipeline.py).
        self.pipeline = pipeline
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tracer = tracer or Tracer()
        self.kv_caches = [
            new_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
            for _ in range(num_layers)
        ]
        self.requests: dict[str, CachedRequestState] = {}
        # Stable rows: preempted and finished requests give theirs back.
        self.max_num_reqs = max_num_seqs
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.sampler = Sampler()
        self.vocab_size = vocab_size if vocab_size is not None else _vocab_of(model)
        # Penalty counts, bias rows and bad-word history, per slot, on the device.
        self.sampling_state = SamplingState(max_num_seqs, self.vocab_size, device)
        self._step: _StepState | None = None
        self.speculative_config = speculative_config
        self.drafter = make_proposer(speculative_config) if speculative_config else None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ----- state ------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_slots.append(state.slot)
                self._drop_drafter_state(state, req_id in so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self._free_slots.append(old.slot)
                self._drop_drafter_state(old, False)
            params = new.sampling_params
            # A seeded request's uniforms depend on its seed and output index only, so a
            # resumed request continues its random stream exactly where it stopped.
            if params.seed is not None:
                key = rng.key_from_seed(params.seed)
            else:
                key = rng.random_key() if params.sampling_type == SamplingType.RANDOM else 0
            ids = new.prompt_token_ids
            num_prompt = new.num_prompt_tokens if new.num_prompt_tokens >= 0 else len(ids)
            state = CachedRequestState(
                req_id=new.req_id,
                token_ids=ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=params,
                rng_key=key,
                slot=self._free_slots.pop(),
                num_prompt_tokens=num_prompt,
                num_output_tokens=len(ids) - num_prompt,
                want_prompt_logprobs=new.want_prompt_logprobs,
            )
            self.requests[new.req_id] = state
            self.sampling_state.init_slot(state)
            if self.drafter is not None:
                state.token_ids = list(ids)  # grows with every sample
                state.spec_enabled = supports_spec_decode(params)
                self.drafter.add_request(new.req_id, state.token_ids, num_prompt)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            if self.drafter is None:
                state.num_computed_tokens = computed
            else:
                # The scheduler counted in-flight drafts as accepted; this side knows how
                # many were, and keeps its own count.
                assert computed >= state.num_computed_tokens, (req_id, computed, state)

    def _drop_drafter_state(self, state: CachedRequestState, finished: bool) -> None:
        if self.drafter is not None:
            self.drafter.remove_request(state.req_id, state.token_ids, state.num_prompt_tokens,
                                        finished)

    # ----- the two calls ----------------------------------------------------------------
    def _prepare(self, so: SchedulerOutput) -> _StepInputs | None:
        """Apply the step's request changes and build its inputs; None (and an empty step
        left for sample_tokens) when it schedules nothing."""
        with self.tracer.span("prepare", WORKER_LANE, so.step_id):
            self._update_states(so)
            req_ids = list(so.num_scheduled_tokens)
            if not req_ids:
                self._step = _StepState([], [], None, None, so.step_id)
                return None
            return self._prepare_inputs(so, req_ids)

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        inputs = self._prepare(so)
        if inputs is None:
            return
        with self.tracer.span("forward", WORKER_LANE, so.step_id):
            if self.pipeline is None:
                hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches,
                                    inputs.meta)
            else:
                hidden = self._forward_stage(self.pipeline, inputs)
                if hidden is None:  # not the last stage: no logits here
                    self._step = _StepState(list(inputs.num_tokens_of), inputs.sample_req_ids,
                                            inputs.sample_slots, None, so.step_id)
                    return
            logits = (self.model.compute_logits(hidden[inputs.logits_rows])
                      if inputs.sample_req_ids else None)
            prompt_lps = self._prompt_logprobs(inputs.num_tokens_of, hidden)
        self._step = _StepState(list(inputs.num_tokens_of), inputs.sample_req_ids,
                                inputs.sample_slots, logits, so.step_id, prompt_lps,
                                inputs.drafts)

    def _forward_stage(self, pp: PipelineComm, inputs: _StepInputs) -> torch.Tensor | None:
        """One pipeline stage's share of the forward: the last stage's hidden states, or
        None after sending this stage's intermediate on."""
        intermediate = None if pp.is_first else pp.recv_intermediate(len(inputs.input_ids))
        out = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta,
                         intermediate)
        if pp.is_last:
            return out
        pp.send_intermediate(out)
        return None

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: object | None = None
                      ) -> ModelRunnerOutput | DeferredOutput:
        pp = self.pipeline
        if pp is None:
            return self._sample_tokens(grammar_bitmask)
        if not pp.is_last:
            step = self._step
            assert step is not None, "sample_tokens without execute_model"
            self._step = None
            if not pp.is_first:
                return _make_output(step.req_ids, [], [])
            slots = step.sample_slots.tolist() if step.sample_slots is not None else []
            return pp.expect_output(step.sample_req_ids, slots)
        out = self._sample_tokens(grammar_bitmask)
        if not isinstance(out, ModelRunnerOutput):
            out = out.get_output()
        pp.send_output(out)
        return out

    def _sample_tokens(self, grammar_bitmask: object | None
                       ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step = self._step
        assert step is not None, "sample_tokens without execute_model"
        self._step = None
        if step.logits is None:
            plan = self._output_plan(step, None)
            if not plan.prompt_reqs:
                return _make_output(step.req_ids, [], [])
            return self._finish_output(plan)
        if step.drafts is not None:
            with self.tracer.span("sample", WORKER_LANE, step.step_id):
                return self._sample_with_drafts(step, grammar_bitmask)
        with self.tracer.span("sample", WORKER_LANE, step.step_id):
            logits = step.logits
            if grammar_bitmask is not None:
                logits = self._apply_bitmask(logits, step.sample_req_ids, grammar_bitmask)
            states = [self.requests[r] for r in step.sample_req_ids]
            out = self.sampler(logits, self.sampling_state.metadata(states))
            # The next step reads these on the device; no host round trip.
            self.last_sampled[step.sample_slots] = out.sampled
            self.sampling_state.record_samples(states, out.sampled)
            return self._finish_output(self._output_plan(step, out))

    def _output_plan(self, step: _StepState, out: SamplerOutput | None) -> _OutputPlan:
        tensors: list[torch.Tensor] = []
        rows: list[tuple[str, int, int]] = []
        sample_req_ids = step.sample_req_ids if out is not None else []
        if out is not None:
            tensors.append(out.sampled)
            if out.logprob_ids is not None:
                assert out.logprobs is not None and out.ranks is not None
                for row, req_id in enumerate(step.sample_req_ids):
                    n = self.requests[req_id].sampling_params.logprobs
                    if n is not None:
                        rows.append((req_id, row, n))
                tensors += [out.logprob_ids, out.logprobs, out.ranks]
        else:
            tensors.append(torch.zeros(0, dtype=torch.long, device=self.device))
        prompt_reqs: list[tuple[str, int]] = []
        for req_id, start, ids, vals, ranks in step.prompt_logprobs:
            prompt_reqs.append((req_id, start))
            tensors += [ids, vals, ranks]
        return _OutputPlan(step.req_ids, sample_req_ids, rows, prompt_reqs, tensors)

    def _finish_output(self, plan: _OutputPlan) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        if self._copy_stream is None:
            return plan.build([t.tolist() for t in plan.tensors])
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = []
            for t in plan.tensors:
                h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                h.copy_(t, non_blocking=True)
                t.record_stream(stream)
                host.append(h)
            event = torch.cuda.Event()
            event.record(stream)
        return AsyncModelRunnerOutput(host, event, plan.build)

    def _prompt_logprobs(self, num_tokens_of: dict[str, int], hidden: torch.Tensor
                         ) -> list[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
        """Raw logprobs of the prompt tokens this step's chunks predict.

        Logits are computed only for the rows of requests that asked. The hidden state at
        position p predicts prompt token p + 1, so a chunk [start, end) yields the logprobs
        of tokens start + 1 .. min(end, num_prompt - 1).
        """
        out = []
        row0 = 0
        for req_id, n in num_tokens_of.items():
            state = self.requests[req_id]
            if state.want_prompt_logprobs:
                end = state.num_computed_tokens  # already advanced by _prepare_inputs
                start = end - n
                last = min(end, state.num_prompt_tokens - 1)
                if last > start:
                    m = last - start
                    dev = self.device
                    logits = self.model.compute_logits(hidden[row0: row0 + m])
                    targets = torch.tensor(state.token_ids[start + 1: last + 1],
                                           dtype=torch.long, device=dev)
                    k = state.sampling_params.prompt_logprobs or 0
                    ids, vals, ranks = compute_logprobs(logits, targets, k)
                    out.append((req_id, start + 1, ids, vals, ranks))
                if end >= state.num_prompt_tokens:
                    state.want_prompt_logprobs = False
            row0 += n
        return out

    def _apply_bitmask(self, logits: torch.Tensor, sample_req_ids: list[str],
                       bitmask: object) -> torch.Tensor:
        apply = getattr(bitmask, "apply", None)
        if apply is None:
            raise TypeError(f"unsupported grammar bitmask {type(bitmask).__name__}")
        return apply(logits, sample_req_ids)

    # ----- inputs -----------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]) -> _StepInputs:
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_req_ids: list[str] = []
        sample_slots: list[int] = []
        fill_rows: list[int] = []  # flat rows whose input is a sample still on the device
        fill_slots: list[int] = []
        fill_req_ids: list[str] = []
        tables: list[list[int]] = []
        spec = so.scheduled_spec_decode_tokens
        step_drafts: list[list[int]] | None = [] if self.drafter is not None else None
        num_tokens_of: dict[str, int] = {}  # computed this step (drafts found, not reserved)
        for req_id in req_ids:
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            known = len(state.token_ids)
            drafts: list[int] = []
            num_spec = spec.get(req_id, 0)
            if num_spec:
                # The scheduler reserved num_spec draft positions; verify the drafts the
                # drafter has (it may have found fewer), at this side's own positions.
                drafts = state.spec_token_ids[:num_spec]
                n = n - num_spec + len(drafts)
            end = start + n
            row0 = len(token_ids)
            if drafts:
                assert start + n - len(drafts) == known, (req_id, start, n, known)
                token_ids.extend(state.token_ids[start:known])
                token_ids.extend(drafts)
            elif end <= known:
                token_ids.extend(state.token_ids[start:end])
            else:
                # Only the newest position can be unknown here, and it is the request's
                # own last sample.
                token_ids.extend(state.token_ids[start:known])
                token_ids.extend([0] * (end - max(start, known)))
                assert state.last_sampled_pos == end - 1, (req_id, state.last_sampled_pos, end)
                fill_rows.append(row0 + n - 1)
                fill_slots.append(state.slot)
                fill_req_ids.append(req_id)
            positions.extend(range(start, end))
            blocks = state.block_ids
            if n == 1:
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                slots.extend((np.asarray(blocks)[pos // bs] * bs + pos % bs).tolist())
            query_start_loc.append(query_start_loc[-1] + n)
            num_tokens_of[req_id] = n
            seq_lens.append(end)
            tables.append(blocks)
            state.num_computed_tokens = end
            if end - len(drafts) >= known:  # reached the end of the sequence: this step samples
                logits_rows.extend(range(row0 + n - 1 - len(drafts), row0 + n))
                sample_req_ids.append(req_id)
                sample_slots.append(state.slot)
                state.last_sampled_pos = end
                if step_drafts is not None:
                    step_drafts.append(drafts)
        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
        if fill_rows and self.pipeline is not None:
            if not self.pipeline.is_first:  # the ids are the first stage's input only
                fill_rows = []
            else:  # the samples come from the last stage: wait for the ones fed here
                self.pipeline.apply_outputs(self.last_sampled, set(fill_req_ids))
        if fill_rows:
            rows = torch.tensor(fill_rows, dtype=torch.long, device=dev)
            input_ids[rows] = self.last_sampled[torch.tensor(fill_slots, device=dev)]
        max_blocks = max(len(t) for t in tables)
        table = np.zeros((len(tables), max_blocks), dtype=np.int64)
        for i, t in enumerate(tables):
            table[i, : len(t)] = t
        meta = AttentionMetadata.build(
            query_start_loc, seq_lens, torch.from_numpy(table),
            torch.tensor(slots, dtype=torch.long), bs, dev,
        )
        return _StepInputs(
            input_ids,
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sample_req_ids,
            torch.tensor(sample_slots, dtype=torch.long, device=dev),
            step_drafts,
            num_tokens_of,
        )

    # ----- speculative decoding ---------------------------------------------------------
    def _sample_with_drafts(self, step: _StepState, grammar_bitmask: object | None
                            ) -> ModelRunnerOutput:
        """Verify each request's drafts, record what was accepted, and draft again.

        Every row gets the sampling state of the output index it samples (a request's
        ``num_output_tokens`` plus the row's offset), so ``min_tokens`` and the uniforms
        are per position; a row's penalty counts and bad-word history include the drafts
        before it. Grammar requests never have drafts (one row each).
        """
        assert step.logits is not None and step.drafts is not None and self.drafter is not None
        states = [self.requests[r] for r in step.sample_req_ids]
        row_states: list[CachedRequestState] = []
        row_req_ids: list[str] = []
        row_prior: list[list[int]] = []
        for state, drafts in zip(states, step.drafts, strict=True):
            if drafts and state.bad_word_seqs:
                self.sampling_state.write_history(state, drafts)
            for j in range(len(drafts) + 1):
                row_states.append(state if j == 0 else
                                  replace(state, num_output_tokens=state.num_output_tokens + j))
                row_req_ids.append(state.req_id)
                row_prior.append(drafts[:j])
        logits = step.logits
        if grammar_bitmask is not None:
            logits = self._apply_bitmask(logits, row_req_ids, grammar_bitmask)
        meta = self.sampling_state.metadata(row_states)
        self.sampling_state.add_draft_counts(meta, row_prior)
        logits = process_logits(logits, meta)
        accept_u = None if meta.all_greedy else rng.acceptance_uniforms(
            [s.rng_key for s in row_states], [s.num_output_tokens for s in row_states])
        result = verify(self.sampler, logits, meta, step.drafts, accept_u)
        self.sampling_state.record_sample_runs(states, result.token_ids)
        out = _make_output(step.req_ids, [], [])
        cfg = self.speculative_config
        assert cfg is not None
        k = cfg.num_speculative_tokens
        # vLLM's disable_by_batch_size: no drafts while more requests than that run.
        drafting = (cfg.disable_by_batch_size is None
                    or len(self.requests) <= cfg.disable_by_batch_size)
        for state, drafts, ids in zip(states, step.drafts, result.token_ids, strict=True):
            out.sampled_token_ids[out.req_id_to_index[state.req_id]] = ids
            # Positions of rejected drafts hold KV that later steps overwrite.
            state.num_computed_tokens -= len(drafts) - (len(ids) - 1)
            state.token_ids.extend(ids)
            limit = k if state.num_draft_limit < 0 else state.num_draft_limit
            if drafts:
                out.num_draft_tokens[state.req_id] = len(drafts)
                # Dynamic draft length: a rejection costs the verification of every draft
                # after it, so draft fewer where guesses fail and more where they hold.
                limit = min(k, limit + 2) if len(ids) > len(drafts) else max(1, limit - 1)
            state.num_draft_limit = limit
            state.spec_token_ids = []
            if drafting and state.spec_enabled:
                state.spec_token_ids = self.drafter.propose(state.req_id, state.token_ids,
                                                            limit)
                out.num_next_draft_tokens[state.req_id] = len(state.spec_token_ids)
        if self.tracer.enabled and out.num_draft_tokens:
            self._trace_acceptance(step.step_id, step.drafts, result.token_ids)
        if meta.max_num_logprobs is not None:
            self._draft_logprobs(out, states, logits, result.rows, result.token_ids)
        if step.prompt_logprobs:
            plan = self._output_plan(step, None)
            built = plan.build([t.tolist() for t in plan.tensors])
            out.prompt_logprobs = built.prompt_logprobs
        return out

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

def _vocab_of(model: torch.nn.Module) -> int:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise ValueError("ModelRunner needs vocab_size for this model")
    return int(vocab)
