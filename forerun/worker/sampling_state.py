"""Per-request sampling state kept on the device, one stable row (slot) per request."""

from __future__ import annotations

import torch

from forerun.sampling_params import SamplingType
from forerun.worker import rng
from forerun.worker.request_state import CachedRequestState
from forerun.worker.sampler import PenaltyBatch, SamplingMetadata


class SamplingState:
    """History-dependent sampling state, on the device, indexed by the request's slot.

    Output token counts and prompt presence (penalties), a static additive bias row
    (allowed ids, logit_bias, one-token bad words) and the output history (multi-token bad
    words). Each is allocated the first time a request needs it, so plain sampling pays
    nothing, and each is updated right after a sample, so no step reads an id back to the
    host: under async scheduling the rules see the real previous tokens, never placeholders.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None
        self.static_bias: torch.Tensor | None = None
        self.history: torch.Tensor | None = None

    def init_slot(self, state: CachedRequestState) -> None:
        """Fill the request's rows of the sampling state from its known ids.

        For a resumed request these ids include every output so far, so the counts and
        the history are rebuilt exactly as they were before the preemption.
        """
        p, slot, dev = state.sampling_params, state.slot, self.device
        prompt = state.token_ids[: state.num_prompt_tokens]
        outputs = state.token_ids[state.num_prompt_tokens:]
        V = self.vocab_size
        if p.uses_penalties:
            if self.counts is None:
                self.counts = torch.zeros((self.max_num_reqs, V), dtype=torch.int32, device=dev)
                self.prompt_mask = torch.zeros((self.max_num_reqs, V), dtype=torch.bool,
                                                device=dev)
            assert self.prompt_mask is not None
            self.counts[slot].zero_()
            if outputs:
                out_t = torch.tensor(outputs, dtype=torch.long, device=dev)
                self.counts[slot].index_add_(
                    0, out_t, torch.ones(len(outputs), dtype=torch.int32, device=dev))
            self.prompt_mask[slot].zero_()
            self.prompt_mask[slot, torch.tensor(prompt, dtype=torch.long, device=dev)] = True
        single = [w[0] for w in p.bad_words_token_ids if len(w) == 1]
        if p.allowed_token_ids is not None or p.logit_bias or single:
            if self.static_bias is None:
                self.static_bias = torch.zeros((self.max_num_reqs, V), dtype=torch.float32,
                                                device=dev)
            row = torch.zeros(V, dtype=torch.float32)
            if p.allowed_token_ids is not None:
                row.fill_(float("-inf"))
                row[torch.tensor(p.allowed_token_ids, dtype=torch.long)] = 0.0
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
                row[ids] += torch.tensor(list(p.logit_bias.values()), dtype=torch.float32)
            if single:
                row[torch.tensor(single, dtype=torch.long)] = float("-inf")
            self.static_bias[slot].copy_(row)
        state.bad_word_seqs = [w for w in p.bad_words_token_ids if len(w) > 1]
        if state.bad_word_seqs:
            self._ensure_history(len(outputs) + 1)
            assert self.history is not None
            if outputs:
                self.history[slot, : len(outputs)] = torch.tensor(outputs, dtype=torch.long,
                                                                    device=dev)

    def _ensure_history(self, width: int) -> None:
        h = self.history
        if h is not None and h.shape[1] >= width:
            return
        new_w = max(256, width, 2 * (h.shape[1] if h is not None else 0))
        grown = torch.zeros((self.max_num_reqs, new_w), dtype=torch.long, device=self.device)
        if h is not None:
            grown[:, : h.shape[1]] = h
        self.history = grown

    def record_samples(self, states: list[CachedRequestState], sampled: torch.Tensor
                       ) -> None:
        """Append this step's samples to the device state the next steps' rules read."""
        dev = self.device
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        hist_rows: list[int] = []
        hist_slots: list[int] = []
        hist_pos: list[int] = []
        for row, state in enumerate(states):
            if state.sampling_params.uses_penalties:
                pen_rows.append(row)
                pen_slots.append(state.slot)
            if state.bad_word_seqs:
                hist_rows.append(row)
                hist_slots.append(state.slot)
                hist_pos.append(state.num_output_tokens)
            state.num_output_tokens += 1
        if pen_rows:
            assert self.counts is not None
            ids = sampled[torch.tensor(pen_rows, dtype=torch.long, device=dev)]
            slots = torch.tensor(pen_slots, dtype=torch.long, device=dev)
            self.counts.index_put_((slots, ids), torch.ones_like(ids, dtype=torch.int32),
                                    accumulate=True)
        if hist_rows:
            self._ensure_history(max(hist_pos) + 1)
            assert self.history is not None
            ids = sampled[torch.tensor(hist_rows, dtype=torch.long, device=dev)]
            self.history[torch.tensor(hist_slots, dtype=torch.long, device=dev),
                          torch.tensor(hist_pos, dtype=torch.long, device=dev)] = ids

    def record_sample_runs(self, states: list[CachedRequestState], runs: list[list[int]]
                           ) -> None:
        """Append each request's run of delivered tokens (accepted drafts, then the sample);
        the speculative path's :meth:`record_samples`."""
        dev = self.device
        pen_slots: list[int] = []
        pen_ids: list[int] = []
        for state, ids in zip(states, runs, strict=True):
            if state.sampling_params.uses_penalties:
                pen_slots += [state.slot] * len(ids)
                pen_ids += ids
            if state.bad_word_seqs:
                self.write_history(state, ids)
            state.num_output_tokens += len(ids)
        if pen_slots:
            assert self.counts is not None
            ids_t = torch.tensor(pen_ids, dtype=torch.long, device=dev)
            self.counts.index_put_(
                (torch.tensor(pen_slots, dtype=torch.long, device=dev), ids_t),
                torch.ones_like(ids_t, dtype=torch.int32), accumulate=True)

    def write_history(self, state: CachedRequestState, ids: list[int]) -> None:
        """Write ids at the request's next output positions of the bad-word history.

        The speculative path writes its drafts here before verifying them, so that a draft
        row's bad-word check sees the drafts before it; positions past what is accepted are
        overwritten by the token actually delivered there before anything reads them.
        """
        n = state.num_output_tokens
        self._ensure_history(n + len(ids) + 1)
        assert self.history is not None
        self.history[state.slot, n: n + len(ids)] = torch.tensor(ids, dtype=torch.long,
                                                                 device=self.device)

    def add_draft_counts(self, meta: SamplingMetadata,
                         row_prior_drafts: list[list[int]]) -> None:
        """Count, in each penalty row's gathered output counts, the drafts before that row.

        ``row_prior_drafts[i]`` are the drafts verified before row i (empty for a
        request's first row).
        """
        pen = meta.penalties
        if pen is None:
            return
        rows = pen.rows.tolist()
        idx: list[int] = []
        ids: list[int] = []
        for k, row in enumerate(rows):
            for t in row_prior_drafts[row]:
                idx.append(k)
                ids.append(t)
        if idx:
            dev = pen.output_counts.device
            ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
            pen.output_counts = pen.output_counts.clone()
            pen.output_counts.index_put_(
                (torch.tensor(idx, dtype=torch.long, device=dev), ids_t),
                torch.ones_like(ids_t, dtype=torch.int32), accumulate=True)

    def metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        """Per-row settings and masks of one step's sampling rows, as device tensors."""
        temps: list[float] = []
        greedy: list[bool] = []
        top_p: list[float] = []
        top_k: list[int] = []
        min_p: list[float] = []
        keys: list[int] = []
        counters: list[int] = []
        bias_rows: list[int] = []
        bias_slots: list[int] = []
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        pen_values: list[tuple[float, float, float]] = []
        ban_rows: list[int] = []
        ban_cols: list[int] = []
        num_fixed_bans = 0
        # Multi-token bad words: compare history[slot, n_out - L + 1 + j] with prefix[j].
        bw_flat: list[int] = []
        bw_prefix: list[int] = []
        bw_group: list[int] = []
        bw_rows: list[int] = []
        bw_last: list[int] = []
        max_logprobs: int | None = None
        width = self.history.shape[1] if self.history is not None else 0
        for row, state in enumerate(states):
            p = state.sampling_params
            is_greedy = p.sampling_type == SamplingType.GREEDY
            greedy.append(is_greedy)
            temps.append(1.0 if is_greedy else p.temperature)
            top_p.append(p.top_p)
            top_k.append(p.top_k if p.top_k > 0 else -1)
            min_p.append(0.0 if is_greedy else p.min_p)
            keys.append(state.rng_key)
            counters.append(state.num_output_tokens)
            if p.uses_penalties:
                pen_rows.append(row)
                pen_slots.append(state.slot)
                pen_values.append((p.presence_penalty, p.frequency_penalty,
                                   p.repetition_penalty))
            if p.allowed_token_ids is not None or p.logit_bias or any(
                    len(w) == 1 for w in p.bad_words_token_ids):
                bias_rows.append(row)
                bias_slots.append(state.slot)
            n_out = state.num_output_tokens
            if n_out < p.min_tokens:
                for t in p.all_stop_token_ids:
                    if t < self.vocab_size:
                        ban_rows.append(row)
                        ban_cols.append(t)
            for seq in state.bad_word_seqs:
                k = len(seq) - 1
                if n_out >= k:
                    g = len(bw_rows)
                    bw_rows.append(row)
                    bw_last.append(seq[-1])
                    base = state.slot * width + n_out - k
                    bw_flat.extend(range(base, base + k))
                    bw_prefix.extend(seq[:-1])
                    bw_group.extend([g] * k)
            if p.logprobs is not None:
                max_logprobs = max(max_logprobs or 0, p.logprobs)
        num_fixed_bans = len(ban_rows)
        dev = self.device
        all_greedy = all(greedy)
        all_random = not any(greedy)
        use_top_k = any(k > 0 for k in top_k)
        vocab = 1 << 30

        def lt(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=dev)

        meta = SamplingMetadata(
            all_greedy=all_greedy,
            all_random=all_random,
            temperature=torch.tensor(temps, dtype=torch.float32, device=dev),
            greedy_mask=None if (all_greedy or all_random)
            else torch.tensor(greedy, dtype=torch.bool, device=dev),
            top_p=torch.tensor(top_p, dtype=torch.float32, device=dev)
            if any(p < 1.0 for p in top_p) else None,
            top_k=torch.tensor([k if k > 0 else vocab for k in top_k], dtype=torch.long,
                               device=dev) if use_top_k else None,
            uniforms=None if all_greedy else torch.from_numpy(rng.uniforms(keys, counters)),
            min_p=torch.tensor(min_p, dtype=torch.float32, device=dev)
            if any(m > 0.0 for m in min_p) else None,
            max_num_logprobs=max_logprobs,
        )
        if bias_rows:
            assert self.static_bias is not None
            meta.bias_rows = lt(bias_rows)
            meta.bias = self.static_bias[lt(bias_slots)]
        if pen_rows:
            assert self.counts is not None and self.prompt_mask is not None
            slots = lt(pen_slots)
            vals = torch.tensor(pen_values, dtype=torch.float32, device=dev)
            meta.penalties = PenaltyBatch(
                rows=lt(pen_rows), output_counts=self.counts[slots],
                prompt_mask=self.prompt_mask[slots],
                presence=vals[:, 0], frequency=vals[:, 1], repetition=vals[:, 2])
        if ban_rows or bw_rows:
            on = torch.ones(num_fixed_bans, dtype=torch.bool, device=dev)
            if bw_rows:
                assert self.history is not None
                # A group matches when none of its prefix positions differs (no host sync).
                differs = self.history.view(-1)[lt(bw_flat)] != lt(bw_prefix)
                mismatches = torch.zeros(len(bw_rows), dtype=torch.long, device=dev)
                mismatches.index_add_(0, lt(bw_group), differs.long())
                on = torch.cat([on, mismatches == 0])
            meta.ban_rows = lt(ban_rows + bw_rows)
            meta.ban_cols = lt(ban_cols + bw_last)
            meta.ban_on = on
        return meta
