"""Batched sampling: logit processing, greedy/random choice, and logprobs, on the device.

The order of operations on each row (the same as vLLM's):

1. **masks and bias** (one additive pass): tokens outside ``allowed_token_ids`` are set to
   -inf, ``logit_bias`` is added, single-token bad words are banned, and so are the
   last tokens of multi-token bad words whose other tokens end the output so far, and the
   stop/EOS ids while fewer than ``min_tokens`` outputs exist;
2. **penalties**: ``repetition_penalty`` over prompt and output tokens (divide a positive
   logit, multiply a negative one), then ``frequency_penalty`` times each output token's
   count, then ``presence_penalty`` once per output token seen;
3. **logprobs** are taken here, from the log-softmax of these *processed* logits: after
   masks, bias and penalties, before temperature, min_p, top-k and top-p (so they do not
   change with the sampling temperature, and a banned token reports -inf);
4. **temperature**; then **min_p**, **top-k** and **top-p** (greedy rows skip 4 and 5:
   they cannot change the argmax);
5. **sample**: argmax for greedy rows; for random rows one draw by inverse CDF at the row's
   own uniform (``forerun.worker.rng``: a function of the request's key and output index).

On CPU, steps 4 and 5 run in one C call (``csrc/sampling.c``): a few vectorised passes per
row, no sort of the vocabulary and one random number per row, so sampling costs about
what argmax does. Elsewhere the same functions run as torch ops (a sort when top-k or
top-p is set, a cumulative sum and a search).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from forerun.model import cpu_kernels


@dataclass(slots=True)
class PenaltyBatch:
    """Penalty inputs for the rows that use penalties (gathered from the runner's state)."""

    rows: torch.Tensor  # [P] int64, rows of the step's logits
    output_counts: torch.Tensor  # [P, V] int32, how often each token was output so far
    prompt_mask: torch.Tensor  # [P, V] bool, tokens present in the prompt
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling settings of one step, as device tensors."""

    all_greedy: bool
    all_random: bool
    temperature: torch.Tensor  # [S] float32, 1.0 on greedy rows (never divided by 0)
    greedy_mask: torch.Tensor | None  # [S] bool, None when all rows agree
    top_p: torch.Tensor | None  # [S] float32, None when no row uses it
    top_k: torch.Tensor | None  # [S] int64 (vocab size = off), None when no row uses it
    # [S] float64 in [0, 1): each random row's draw (host memory); None when all greedy.
    uniforms: torch.Tensor | None = None
    min_p: torch.Tensor | None = None  # [S] float32, None when no row uses it
    # Static per-request additive bias (allowed ids, logit_bias, one-token bad words).
    bias_rows: torch.Tensor | None = None  # [B] int64
    bias: torch.Tensor | None = None  # [B, V] float32
    # Bans that depend on the history: (row, token) pairs and whether each applies now.
    ban_rows: torch.Tensor | None = None  # [K] int64
    ban_cols: torch.Tensor | None = None  # [K] int64
    ban_on: torch.Tensor | None = None  # [K] bool
    penalties: PenaltyBatch | None = None
    # Largest top-N any row asked for; None when no row wants logprobs.
    max_num_logprobs: int | None = None


@dataclass(slots=True)
class SamplerOutput:
    """Sampled ids and, if any row asked, their logprobs (all still on the device)."""

    sampled: torch.Tensor  # [S] int64
    logprob_ids: torch.Tensor | None = None  # [S, 1 + N] int64: sampled id, then top-N
    logprobs: torch.Tensor | None = None  # [S, 1 + N] float32
    ranks: torch.Tensor | None = None  # [S] int64, 1-based rank of the sampled id


class Sampler:
    """Turns logits into one token id per row, with no Python loop over the rows.

    See the module docstring for the order in which the settings apply. A random row's
    token is a function of its processed logits and its own uniform only, so a seeded
    request's tokens do not depend on what else is in the batch.
    """

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = process_logits(logits, meta)
        sampled = self.choose(logits, meta)
        if meta.max_num_logprobs is None:
            return SamplerOutput(sampled)
        return SamplerOutput(sampled, *compute_logprobs(logits, sampled, meta.max_num_logprobs))

    def choose(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Steps 4 and 5 on logits that steps 1 and 2 already processed."""
        if meta.all_greedy:
            return argmax_rows(logits)
        if (logits.dtype == torch.float32 and logits.is_contiguous()
                and cpu_kernels.supports(logits.dtype, logits.device)):
            return self._sample_cpu(logits, meta)
        return self._sample_torch(logits, meta)

    @staticmethod
    def _sample_cpu(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        rows = logits.shape[0]
        assert meta.uniforms is not None
        temperature = meta.temperature
        if meta.greedy_mask is not None:
            temperature = temperature.masked_fill(meta.greedy_mask, 0.0)
        top_k = meta.top_k if meta.top_k is not None else torch.zeros(rows, dtype=torch.int64)
        top_p = meta.top_p if meta.top_p is not None else torch.ones(rows)
        min_p = meta.min_p if meta.min_p is not None else torch.zeros(rows)
        return cpu_kernels.sample_rows(logits, temperature, top_k, top_p, min_p,
                                       meta.uniforms)

    @staticmethod
    def _sample_torch(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        assert meta.uniforms is not None
        greedy = None if meta.all_random or meta.greedy_mask is None else argmax_rows(logits)
        logits = logits / meta.temperature.unsqueeze(1)
        if meta.min_p is not None:
            logits = apply_min_p(logits, meta.min_p)
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        cdf = logits.softmax(dim=-1, dtype=torch.float64).cumsum_(dim=-1)
        u = meta.uniforms.to(logits.device, non_blocking=True).unsqueeze(1)
        # The first token whose cumulative mass exceeds u; masked tokens add nothing, so it
        # is never one of them.
        sampled = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        sampled = sampled.clamp_(max=logits.shape[-1] - 1)
        if greedy is None:
            return sampled
        return torch.where(meta.greedy_mask, greedy, sampled)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` for ``[rows, vocab]``; on CPU through the C kernel, which is about
    4x faster than torch's for float32 logits of a 49k vocabulary."""
    if (x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()
            and cpu_kernels.supports(x.dtype, x.device)):
        return cpu_kernels.argmax_rows(x)
    return x.argmax(dim=-1)


def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Steps 1 and 2 of the module docstring; returns a new tensor when anything applies."""
    if meta.bias is not None or meta.ban_rows is not None or meta.penalties is not None:
        logits = logits.float().clone()
    if meta.bias is not None:
        assert meta.bias_rows is not None
        logits.index_add_(0, meta.bias_rows, meta.bias)
    if meta.ban_rows is not None:
        assert meta.ban_cols is not None and meta.ban_on is not None
        # Accumulate, so a (row, token) listed twice is banned if either entry applies.
        hits = torch.zeros_like(logits)
        hits.index_put_((meta.ban_rows, meta.ban_cols), meta.ban_on.to(logits.dtype),
                        accumulate=True)
        logits.masked_fill_(hits > 0, float("-inf"))
    if meta.penalties is not None:
        pen = meta.penalties
        rows = logits.index_select(0, pen.rows)
        rows = apply_penalties(rows, pen)
        logits.index_copy_(0, pen.rows, rows)
    return logits


def apply_penalties(logits: torch.Tensor, pen: PenaltyBatch) -> torch.Tensor:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    counts = pen.output_counts
    seen = counts > 0
    rep = pen.repetition.unsqueeze(1)
    in_any = seen | pen.prompt_mask
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(in_any, scaled, logits)
    logits = logits - pen.frequency.unsqueeze(1) * counts.to(logits.dtype)
    return logits - pen.presence.unsqueeze(1) * seen.to(logits.dtype)


def compute_logprobs(logits: torch.Tensor, sampled: torch.Tensor, n: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids, logprobs, ranks): column 0 is the sampled token, columns 1..n the top-n."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, sampled.unsqueeze(1))
    ranks = (lp > chosen).sum(dim=-1) + 1
    if n > 0:
        top_vals, top_ids = lp.topk(n, dim=-1)
        ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
        vals = torch.cat([chosen, top_vals], dim=1)
    else:
        ids, vals = sampled.unsqueeze(1), chosen
    return ids, vals, ranks


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p`` times the row's largest."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) with -inf."""
    if top_k is None and top_p is None:
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        # Ascending order: the k-th largest sits at index vocab - k.
        kth = sorted_logits.gather(1, (vocab - top_k.clamp(1, vocab)).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
