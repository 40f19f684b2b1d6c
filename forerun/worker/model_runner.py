"""The model runner: persistent per-request state, flat inputs, forward, sampling."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.model.attention import AttentionMetadata
from forerun.sampling_params import SamplingParams, SamplingType
from forerun.trace import WORKER_LANE, Tracer
from forerun.worker.sampler import Sampler, SamplingMetadata

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class CachedRequestState:
    """What the worker remembers about a request between steps.

    ``token_ids`` holds only the ids the scheduler sent (the prompt, or every known id when
    a preempted request resumes). Output ids are never sent back: the position after the
    last known id is fed from ``ModelRunner.last_sampled`` on the device.
    """

    req_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling_params: SamplingParams
    generator: torch.Generator | None
    slot: int  # stable row of this request in the runner's device tensors
    last_sampled_pos: int = -1  # position of the token held in last_sampled[slot]


@dataclass(slots=True)
class _StepState:
    """What execute_model leaves for sample_tokens."""

    req_ids: list[str]
    sample_req_ids: list[str]
    sample_slots: torch.Tensor | None
    logits: torch.Tensor | None
    sampling: SamplingMetadata | None
    step_id: int


class AsyncModelRunnerOutput:
    """Sampled ids still being copied device -> host; ``get_output`` waits for the copy.

    The worker returns this at once so that it can start the next step without a
    device-to-host sync; only the engine, when it needs the ids, waits on the event.
    """

    def __init__(self, req_ids: list[str], sample_req_ids: list[str], host: torch.Tensor,
                 event: torch.cuda.Event) -> None:
        self._req_ids, self._sample_req_ids = req_ids, sample_req_ids
        self._host, self._event = host, event

    def get_output(self) -> ModelRunnerOutput:
        self._event.synchronize()
        return _make_output(self._req_ids, self._sample_req_ids, self._host.tolist())


def _make_output(req_ids: list[str], sample_req_ids: list[str], ids: list[int]) -> ModelRunnerOutput:
    sampled: dict[str, list[int]] = {r: [t] for r, t in zip(sample_req_ids, ids, strict=True)}
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={r: i for i, r in enumerate(req_ids)},
        sampled_token_ids=[sampled.get(r, []) for r in req_ids],
    )


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
    ) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.tracer = tracer or Tracer()
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.requests: dict[str, CachedRequestState] = {}
        # Stable rows: preempted and finished requests give theirs back.
        self.max_num_reqs = max_num_seqs
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))
        self.last_sampled = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.sampler = Sampler()
        self._step: _StepState | None = None
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    # ----- state ------------------------------------------------------------------------
    def _update_states(self, so: SchedulerOutput) -> None:
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self._free_slots.append(state.slot)
        for new in so.scheduled_new_reqs:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self._free_slots.append(old.slot)
            params = new.sampling_params
            gen = None
            if params.sampling_type == SamplingType.RANDOM_SEED:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                token_ids=new.prompt_token_ids,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                sampling_params=params,
                generator=gen,
                slot=self._free_slots.pop(),
            )
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.requests[req_id]
            state.block_ids.extend(new_blocks)
            state.num_computed_tokens = computed

    # ----- the two calls ----------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> None:
        with self.tracer.span("prepare", WORKER_LANE, so.step_id):
            self._update_states(so)
            req_ids = list(so.num_scheduled_tokens)
            if not req_ids:
                self._step = _StepState([], [], None, None, None, so.step_id)
                return
            inputs = self._prepare_inputs(so, req_ids)
        with self.tracer.span("forward", WORKER_LANE, so.step_id):
            input_ids, positions, meta, logits_rows, sample_req_ids, sample_slots = inputs
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            logits = self.model.compute_logits(hidden[logits_rows]) if sample_req_ids else None
        sampling = self._sampling_metadata(sample_req_ids) if sample_req_ids else None
        self._step = _StepState(req_ids, sample_req_ids, sample_slots, logits, sampling,
                                so.step_id)

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: object | None = None
                      ) -> ModelRunnerOutput | AsyncModelRunnerOutput:
        step = self._step
        assert step is not None, "sample_tokens without execute_model"
        self._step = None
        if step.logits is None:
            return _make_output(step.req_ids, [], [])
        with self.tracer.span("sample", WORKER_LANE, step.step_id):
            logits = step.logits
            if grammar_bitmask is not None:
                logits = self._apply_bitmask(logits, step.sample_req_ids, grammar_bitmask)
            sampled = self.sampler(logits, step.sampling)
            # The next step reads these on the device; no host round trip.
            self.last_sampled[step.sample_slots] = sampled
            if self._copy_stream is None:
                return _make_output(step.req_ids, step.sample_req_ids, sampled.tolist())
            return self._async_copy(step, sampled)

    def _async_copy(self, step: _StepState, sampled: torch.Tensor) -> AsyncModelRunnerOutput:
        stream = self._copy_stream
        assert stream is not None
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            host.copy_(sampled, non_blocking=True)
            sampled.record_stream(stream)
            event = torch.cuda.Event()
            event.record(stream)
        return AsyncModelRunnerOutput(step.req_ids, step.sample_req_ids, host, event)

    def _apply_bitmask(self, logits: torch.Tensor, sample_req_ids: list[str],
                       bitmask: object) -> torch.Tensor:
        apply = getattr(bitmask, "apply", None)
        if apply is None:
            raise TypeError(f"unsupported grammar bitmask {type(bitmask).__name__}")
        return apply(logits, sample_req_ids)

    # ----- inputs -----------------------------------------------------------------------
    def _prepare_inputs(self, so: SchedulerOutput, req_ids: list[str]):
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
        tables: list[list[int]] = []
        for req_id in req_ids:
            state = self.requests[req_id]
            n = so.num_scheduled_tokens[req_id]
            start = state.num_computed_tokens
            end = start + n
            known = len(state.token_ids)
            row0 = len(token_ids)
            if end <= known:
                token_ids.extend(state.token_ids[start:end])
            else:
                # Only the newest position can be unknown here, and it is the request's
                # own last sample.
                token_ids.extend(state.token_ids[start:known])
                token_ids.extend([0] * (end - max(start, known)))
                assert state.last_sampled_pos == end - 1, (req_id, state.last_sampled_pos, end)
                fill_rows.append(row0 + n - 1)
                fill_slots.append(state.slot)
            positions.extend(range(start, end))
            blocks = state.block_ids
            if n == 1:
                slots.append(blocks[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end)
                slots.extend((np.asarray(blocks)[pos // bs] * bs + pos % bs).tolist())
            query_start_loc.append(query_start_loc[-1] + n)
            seq_lens.append(end)
            tables.append(blocks)
            state.num_computed_tokens = end
            if end >= known:  # reached the end of the sequence: this step samples
                logits_rows.append(row0 + n - 1)
                sample_req_ids.append(req_id)
                sample_slots.append(state.slot)
                state.last_sampled_pos = end
        dev = self.device
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=dev)
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
        return (
            input_ids,
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
            torch.tensor(logits_rows, dtype=torch.long, device=dev),
            sample_req_ids,
            torch.tensor(sample_slots, dtype=torch.long, device=dev),
        )

    def _sampling_metadata(self, sample_req_ids: list[str]) -> SamplingMetadata:
        temps: list[float] = []
        greedy: list[bool] = []
        top_p: list[float] = []
        top_k: list[int] = []
        generators: dict[int, torch.Generator] = {}
        for row, req_id in enumerate(sample_req_ids):
            state = self.requests[req_id]
            p = state.sampling_params
            is_greedy = p.sampling_type == SamplingType.GREEDY
            greedy.append(is_greedy)
            temps.append(1.0 if is_greedy else p.temperature)
            top_p.append(p.top_p)
            top_k.append(p.top_k if p.top_k > 0 else -1)
            if state.generator is not None:
                generators[row] = state.generator
        dev = self.device
        all_greedy = all(greedy)
        all_random = not any(greedy)
        use_top_k = any(k > 0 for k in top_k)
        vocab = 1 << 30
        return SamplingMetadata(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            greedy_mask=None if (all_greedy or all_random)
            else torch.tensor(greedy, dtype=torch.bool, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev)
            if any(p < 1.0 for p in top_p) else None,
            top_k=torch.tensor([k if k > 0 else vocab for k in top_k], dtype=torch.long,
                               device=dev) if use_top_k else None,
            generators=generators,
        )
