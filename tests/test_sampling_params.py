"""Penalties, min_p, logit_bias, allowed ids, bad words, min_tokens and logprobs.

Checked on a tiny random Llama against a per-request reference written here (full
recompute with transformers, the processing rules applied one request at a time), and
async scheduling against sync, with preemption and chunked prefill.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from forerun import LLM
from forerun.sampling_params import SamplingParams
from tests.tiny_model import write_tiny_llama

VOCAB = 320
EOS = 2
PROMPTS = [
    [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1],
    [9, 8, 7, 6, 5, 9, 8, 7],
    [100, 200, 300, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11],
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny random Llama (with a word-level tokenizer "w0z".."w319z") and its HF model."""
    folder = tmp_path_factory.mktemp("tiny_sampling")
    return folder, write_tiny_llama(folder, VOCAB, EOS)


_ENGINES: dict[tuple, LLM] = {}


def engine(folder: Path, **kw: Any) -> LLM:
    key = (str(folder), *sorted(kw.items()))
    if key not in _ENGINES:
        kw.setdefault("max_model_len", 256)
        _ENGINES[key] = LLM(model=str(folder), dtype="float32", seed=0, **kw)
    return _ENGINES[key]


@pytest.fixture(scope="module", autouse=True)
def _close_engines():
    yield
    for llm in _ENGINES.values():
        llm.shutdown()
    _ENGINES.clear()


# ----- the reference ----------------------------------------------------------------------
def reference_greedy(hf: Any, prompt: list[int], p: SamplingParams, bad: list[list[int]]
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and the log-softmax of each step's processed logits, one request."""
    ids, out, lps = list(prompt), [], []
    stop = {EOS} | set(p.stop_token_ids or [])
    for _ in range(p.max_tokens or 0):
        with torch.no_grad():
            x = hf(torch.tensor([ids])).logits[0, -1].float().clone()
        if p.allowed_token_ids is not None:
            keep = torch.full_like(x, float("-inf"))
            keep[p.allowed_token_ids] = 0.0
            x = x + keep
        for t, b in (p.logit_bias or {}).items():
            x[t] += b
        for w in bad:
            if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1]):
                x[w[-1]] = float("-inf")
        if len(out) < p.min_tokens:
            x[list(stop)] = float("-inf")
        counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=VOCAB).float()
        seen = counts > 0
        in_any = seen.clone()
        in_any[prompt] = True
        r = p.repetition_penalty
        x = torch.where(in_any, torch.where(x > 0, x / r, x * r), x)
        x = x - p.frequency_penalty * counts - p.presence_penalty * seen.float()
        lps.append(x.log_softmax(-1))
        tok = int(x.argmax())
        out.append(tok)
        ids.append(tok)
        if tok in stop and len(out) >= p.min_tokens and not p.ignore_eos:
            break
    return out, lps


def hf_prompt_logprobs(hf: Any, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


GREEDY_CASES: dict[str, dict[str, Any]] = {
    "plain": dict(),
    "presence": dict(presence_penalty=1.5),
    "frequency": dict(frequency_penalty=0.7),
    "repetition": dict(repetition_penalty=1.8),
    "all_penalties": dict(presence_penalty=-0.5, frequency_penalty=0.4, repetition_penalty=0.6),
    "logit_bias": dict(logit_bias={7: 5.0, 11: 3.0, 99: -100.0}),
    "allowed": dict(allowed_token_ids=[3, 5, 7, 11, 13, 250]),
    "min_tokens": dict(min_tokens=4, logit_bias={EOS: 100.0}, ignore_eos=False),
    "bad_words": dict(bad_words=["w7z", "w8z w9z", "w12z w64z w1z"]),
    "mixed": dict(repetition_penalty=1.3, logit_bias={42: 2.0}, min_p=0.3,
                  bad_words=["w5z w17z"]),
}


def _params(case: dict[str, Any], **extra: Any) -> SamplingParams:
    kw: dict[str, Any] = dict(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    kw.update(case)
    kw.update(extra)
    return SamplingParams(**kw)


def _close(a: float, b: float) -> bool:
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) < 1e-4


@pytest.mark.parametrize("async_mode", ["on", "off"])
def test_greedy_matches_reference(tiny_dir, async_mode: str) -> None:
    folder, hf = tiny_dir
    llm = engine(folder, async_scheduling=async_mode)
    names = list(GREEDY_CASES)
    jobs = [(n, i) for n in names for i in range(len(PROMPTS))]
    params = [_params(GREEDY_CASES[n]) for n, _ in jobs]
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for _, i in jobs], params,
                        use_tqdm=False)
    proc = llm.llm_engine.processor
    for (name, i), p, out in zip(jobs, params, outs, strict=True):
        bad = proc.process_params(p).bad_words_token_ids
        ref, ref_lps = reference_greedy(hf, PROMPTS[i], p, bad)
        c = out.outputs[0]
        assert c.token_ids == ref, (name, i)
        assert c.logprobs is not None and len(c.logprobs) == len(ref)
        total = 0.0
        for tok, pos, lp in zip(ref, c.logprobs, ref_lps, strict=True):
            assert _close(pos[tok].logprob, float(lp[tok])), name
            top = lp.topk(3)
            for t, v in zip(top.indices.tolist(), top.values.tolist(), strict=True):
                assert t in pos and _close(pos[t].logprob, v), (name, t)
            assert pos[tok].rank == int((lp > lp[tok]).sum()) + 1
            total += pos[tok].logprob
        assert c.cumulative_logprob == pytest.approx(total, abs=1e-3)


def test_min_tokens_blocks_eos_in_sampler(tiny_dir) -> None:
    folder, _ = tiny_dir
    llm = engine(folder, async_scheduling="on")
    p = SamplingParams(max_tokens=12, temperature=0.0, min_tokens=4, logit_bias={EOS: 100.0})
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], p, use_tqdm=False)
    c = out.outputs[0]
    assert EOS not in c.token_ids[:4] and c.token_ids[4:] == [EOS]
    assert c.finish_reason == "stop"


@pytest.mark.parametrize("kw", [dict(async_scheduling="on"), dict(async_scheduling="off"),
                                dict(async_scheduling="on", num_gpu_blocks_override=12,
                                     block_size=8)])
def test_multi_token_bad_words_hit(tiny_dir, kw: dict[str, Any]) -> None:
    """Bad words taken from the plain greedy output, so their prefixes really occur."""
    folder, hf = tiny_dir
    llm = engine(folder, **kw)
    plain = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": q} for q in PROMPTS],
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)]
    params = [_params({}, max_tokens=12, bad_words=[
        f"w{t[3]}z w{t[4]}z", f"w{t[7]}z w{t[8]}z w{t[9]}z"]) for t in plain]
    outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], params, use_tqdm=False)
    proc = llm.llm_engine.processor
    for q, p, t, out in zip(PROMPTS, params, plain, outs, strict=True):
        ref, _ = reference_greedy(hf, q, p, proc.process_params(p).bad_words_token_ids)
        got = out.outputs[0].token_ids
        assert got == ref
        assert got[:4] == t[:4] and got[4] != t[4]


def test_bad_words_are_tokenised_by_the_processor(tiny_dir) -> None:
    folder, _ = tiny_dir
    proc = engine(folder, async_scheduling="on").llm_engine.processor
    p = proc.process_params(SamplingParams(bad_words=["w7z", "w8z w9z"]))
    assert p.bad_words_token_ids == [[7], [8, 9]]


@pytest.mark.parametrize("async_mode", ["on", "off"])
def test_prompt_logprobs_match_transformers(tiny_dir, async_mode: str) -> None:
    folder, hf = tiny_dir
    # Chunked prefill: the prompt logprobs arrive in several pieces.
    llm = engine(folder, async_scheduling=async_mode, max_num_batched_tokens=8)
    p = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    for _ in range(2):  # the second time the prompt is in the prefix cache
        outs = llm.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
        for q, out in zip(PROMPTS, outs, strict=True):
            ref = hf_prompt_logprobs(hf, q)
            plp = out.prompt_logprobs
            assert plp is not None and len(plp) == len(q) and plp[0] is None
            for j in range(1, len(q)):
                assert _close(plp[j][q[j]].logprob, float(ref[j - 1, q[j]]))
                assert len(plp[j]) in (2, 3)


def test_truncate_prompt_tokens(tiny_dir) -> None:
    folder, _ = tiny_dir
    llm = engine(folder, async_scheduling="on")
    p = SamplingParams(max_tokens=3, temperature=0.0, truncate_prompt_tokens=4)
    (out,) = llm.generate([{"prompt_token_ids": PROMPTS[0]}], p, use_tqdm=False)
    assert out.prompt_token_ids == PROMPTS[0][-4:]
    (ref,) = llm.generate([{"prompt_token_ids": PROMPTS[0][-4:]}],
                          SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


ASYNC_CASES: list[dict[str, Any]] = [
    dict(temperature=0.0, presence_penalty=0.8, frequency_penalty=0.3, repetition_penalty=1.4),
    dict(temperature=0.9, seed=11, presence_penalty=0.8, frequency_penalty=0.3,
         repetition_penalty=1.4),
    dict(temperature=1.0, seed=12, min_p=0.2, top_k=40),
    dict(temperature=1.1, seed=13, logit_bias={7: 3.0}, bad_words=["w7z w7z", "w3z"]),
    dict(temperature=0.8, seed=14, allowed_token_ids=list(range(0, 320, 3)), min_tokens=5,
         ignore_eos=False),
    dict(temperature=0.0, bad_words=["w12z w64z", "w99z"], repetition_penalty=0.7),
]


def _run_async_cases(llm: LLM) -> list[tuple[list[int], list[list[tuple[int, float]]]]]:
    prompts, params = [], []
    for k, case in enumerate(ASYNC_CASES):
        for i, q in enumerate(PROMPTS):
            prompts.append({"prompt_token_ids": q})
            kw: dict[str, Any] = dict(max_tokens=40, ignore_eos=True, logprobs=2)
            kw.update(case)
            if "seed" in kw:
                kw["seed"] += 100 * i
            params.append(SamplingParams(**kw))
        del k
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        assert c.logprobs is not None
        res.append((c.token_ids, [sorted((t, lp.logprob) for t, lp in pos.items())
                                  for pos in c.logprobs]))
    return res


def _assert_same(a: list, b: list) -> None:
    for (ta, la), (tb, lb) in zip(a, b, strict=True):
        assert ta == tb
        for pa, pb in zip(la, lb, strict=True):
            assert [t for t, _ in pa] == [t for t, _ in pb]
            assert all(_close(x, y) for (_, x), (_, y) in zip(pa, pb, strict=True))


def test_async_equals_sync_with_preemption_and_chunking(tiny_dir) -> None:
    folder, _ = tiny_dir
    base = _run_async_cases(engine(folder, async_scheduling="off"))
    for kw in (dict(async_scheduling="on"),
               dict(async_scheduling="on", num_gpu_blocks_override=12, block_size=8),
               dict(async_scheduling="off", num_gpu_blocks_override=12, block_size=8),
               dict(async_scheduling="on", max_num_batched_tokens=8)):
        llm = engine(folder, **kw)
        got = _run_async_cases(llm)
        _assert_same(base, got)
        if "num_gpu_blocks_override" in kw:
            assert llm.stats().scheduler.num_preemptions > 0


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    # The count's form only: the limit (--max-logprobs) is the processor's check.
    (dict(logprobs=-2), "logprobs"),
    (dict(prompt_logprobs=-2), "prompt_logprobs"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_invalid_values(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**kw)
    assert str(e.value).startswith(field)


@pytest.mark.parametrize("kw, field", [
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, VOCAB + 5]), "allowed_token_ids"),
])
def test_unknown_token_ids_rejected_by_processor(tiny_dir, kw: dict[str, Any],
                                                 field: str) -> None:
    folder, _ = tiny_dir
    llm = engine(folder, async_scheduling="on")
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(**kw), use_tqdm=False)
    assert str(e.value).startswith(field)
