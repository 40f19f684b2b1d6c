"""Speculative decoding end to end: drafts change how fast tokens come, never which.

Oracle: the synchronous engine without drafting on the same weights (float32), token for
token for greedy requests, in every engine configuration (sync and async, chunked prefill,
prefix caching off, preemption under KV pressure), for both drafters, and for max_tokens
around K. Tiny random Llama first (greedy loops give the drafters plenty to accept), then
the default model on prompts that ask it to copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from forerun import LLM, SamplingParams
from tests.conftest import LLMCache, assert_all_blocks_free
from tests.tiny_model import write_tiny_llama

K = 3
PROMPTS = [
    [5, 17, 25, 3, 9, 42, 7, 30, 12, 4, 1],
    [9, 8, 7, 6, 5, 9, 8, 7, 6, 5, 9, 8],
    [10, 20, 30, 10, 20, 30, 40, 5, 6, 7, 8, 9, 11, 10, 20, 30, 10],
    [44, 45, 46],
]
CONFIGS: dict[str, dict[str, Any]] = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "preemption": {"num_gpu_blocks_override": 16, "max_num_batched_tokens": 64},
}
METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4},
    "suffix": {"method": "suffix", "num_speculative_tokens": K},
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_spec")
    # A small vocabulary: greedy decoding of a random model then falls into loops that
    # the drafters predict, so drafts are accepted as well as rejected.
    write_tiny_llama(folder, vocab=48, eos=2, seed=3)
    return folder


@pytest.fixture(scope="module")
def engines(tiny_dir: Path):
    cache = LLMCache(model=str(tiny_dir), dtype="float32", seed=0, max_model_len=128,
                     block_size=4)
    yield cache
    cache.close()


def run(llm: LLM, params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("mode", ["off", "on"])
@pytest.mark.parametrize("method", list(METHODS))
def test_greedy_with_drafts_equals_greedy_without(engines, method, mode, config):
    base = engines(async_scheduling="off", **CONFIGS[config])
    spec = engines(async_scheduling=mode, speculative_config=METHODS[method],
                  **CONFIGS[config])
    params = [greedy(40), greedy(1), greedy(K), greedy(K + 1)]
    if config == "preemption":
        params = [greedy(40)] * len(PROMPTS)  # all four at once overflow the pool
    before = spec.stats().scheduler
    assert run(spec, params) == run(base, params)
    after = spec.stats().scheduler
    assert after.spec_num_draft_tokens > before.spec_num_draft_tokens
    assert after.spec_num_accepted_tokens > before.spec_num_accepted_tokens
    if config == "preemption":
        assert after.num_preemptions > before.num_preemptions, "the pool should preempt"
    assert_all_blocks_free(spec)


def test_max_tokens_and_stop_tokens_inside_an_accepted_run(engines):
    base = engines(async_scheduling="off")
    for mode in ("off", "on"):
        spec = engines(async_scheduling=mode, speculative_config=METHODS["ngram"])
        for n in (1, 2, K, K + 1, 2 * K + 1):
            assert run(spec, greedy(n)) == run(base, greedy(n)), (mode, n)
        # Stop on a token the greedy loops produce mid-run: it must end the output there.
        loop = run(base, greedy(40))[1]
        stop = loop[7]
        p = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop])
        got, want = run(spec, p), run(base, p)
        assert got == want and got[1][-1] == stop
        assert_all_blocks_free(spec)


def test_logprobs_of_accepted_drafts_equal_the_plain_engines(engines):
    base = engines(async_scheduling="off")
    spec = engines(async_scheduling="on", speculative_config=METHODS["ngram"])
    p = greedy(30, logprobs=3)
    a = base.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    b = spec.generate([{"prompt_token_ids": q} for q in PROMPTS], p, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, strict=True):
            assert list(lx) == list(ly)
            for tok in lx:
                assert abs(lx[tok].logprob - ly[tok].logprob) < 1e-4
                assert lx[tok].rank == ly[tok].rank


def test_penalties_min_tokens_and_bad_words_are_exact_with_drafts(engines):
    base = engines(async_scheduling="off")
    for mode in ("off", "on"):
        spec = engines(async_scheduling=mode, speculative_config=METHODS["ngram"])
        for kw in ({"repetition_penalty": 1.3}, {"frequency_penalty": 0.3},
                   {"presence_penalty": 0.4, "repetition_penalty": 1.1},
                   {"min_tokens": 12, "stop_token_ids": [7, 8, 9]},
                   {"bad_words": ["w25z w25z"]}, {"bad_words": ["w4z w25z", "w41z"]}):
            p = SamplingParams(max_tokens=30, temperature=0.0, **kw)
            before = spec.stats().scheduler.spec_num_draft_tokens
            assert run(spec, p) == run(base, p), (mode, kw)
            assert spec.stats().scheduler.spec_num_draft_tokens > before, (mode, kw)
        assert_all_blocks_free(spec)


def test_seeded_sampling_with_drafts_is_reproducible_whatever_the_batch(engines):
    spec = engines(async_scheduling="on", speculative_config=METHODS["ngram"])
    p = SamplingParams(max_tokens=30, temperature=0.8, top_k=20, seed=123)
    alone = spec.generate([{"prompt_token_ids": PROMPTS[1]}], p, use_tqdm=False)
    crowd = spec.generate([{"prompt_token_ids": q} for q in PROMPTS],
                          [SamplingParams(max_tokens=30, temperature=1.0)] + [p] * 3,
                          use_tqdm=False)
    assert crowd[1].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert_all_blocks_free(spec)


def test_suffix_drafts_from_earlier_responses(engines):
    spec = engines(async_scheduling="on", speculative_config=METHODS["suffix"],
                  enable_prefix_caching=False)
    prompt = [{"prompt_token_ids": [33, 7, 25, 16, 40, 4]}]
    p = greedy(40)
    first = spec.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    s0 = spec.stats().scheduler
    again = spec.generate(prompt, p, use_tqdm=False)[0].outputs[0].token_ids
    s1 = spec.stats().scheduler
    assert again == first
    accepted = s1.spec_num_accepted_tokens - s0.spec_num_accepted_tokens
    # The whole earlier answer is in the index. At most 3 of every 4 tokens after the
    # first can be accepted drafts (29 of 40); the first run found its own loops only.
    assert accepted >= 20 and accepted > 1.5 * s0.spec_num_accepted_tokens, (s0, s1)


def test_bad_speculative_config_is_a_clear_error(tiny_dir):
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(model=str(tiny_dir), speculative_config={"method": "eagle",
                                                     "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(model=str(tiny_dir), speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": -1})
    with pytest.raises(ValueError, match="unknown field"):
        LLM(model=str(tiny_dir), speculative_config={"method": "ngram",
                                                     "num_speculative_tokens": 2, "k": 1})


COPY_PROMPTS = [
    "Repeat the following text exactly.\nText: The quick brown fox jumps over the lazy dog. "
    "A journey of a thousand miles begins with a single step.\nRepeat:",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
]


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off", "on"])
def test_default_model_greedy_with_drafts_equals_without(llm_cache, mode):
    base = llm_cache(async_scheduling="off")
    spec = llm_cache(async_scheduling=mode, speculative_config=METHODS["ngram"])
    params = [SamplingParams(max_tokens=48, temperature=0.0),
              SamplingParams(max_tokens=48, temperature=0.0, stop=["mul"])]
    a = base.generate(COPY_PROMPTS, params, use_tqdm=False)
    b = spec.generate(COPY_PROMPTS, params, use_tqdm=False)
    for x, y in zip(a, b, strict=True):
        assert y.outputs[0].token_ids == x.outputs[0].token_ids
        assert y.outputs[0].text == x.outputs[0].text
        assert y.outputs[0].finish_reason == x.outputs[0].finish_reason
    assert spec.stats().scheduler.spec_num_accepted_tokens > 0
    assert_all_blocks_free(spec)


def test_the_trace_shows_accepted_drafts_per_position(tiny_dir, tmp_path):
    trace = tmp_path / "trace.json"
    llm = LLM(model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4,
              speculative_config=METHODS["ngram"], trace_file=str(trace))
    try:
        run(llm, greedy(30))
        stats = llm.stats().scheduler
    finally:
        llm.shutdown()
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e["ph"] == "C" and e["name"] == "spec_decode"]
    assert events
    for j, accepted in enumerate(stats.spec_num_accepted_tokens_per_pos):
        assert sum(e["args"].get(f"accepted@{j}", 0) for e in events) == accepted
    assert sum(e["args"].get(f"drafted@{j}", 0) for e in events
               for j in range(K)) == stats.spec_num_draft_tokens


def test_disable_by_batch_size_stops_drafting_while_the_batch_is_larger(engines):
    base = engines(async_scheduling="off")
    spec = engines(async_scheduling="on", speculative_config={
        **METHODS["ngram"], "disable_by_batch_size": 1})
    before = spec.stats().scheduler.spec_num_draft_tokens
    assert run(spec, greedy(30)) == run(base, greedy(30))  # four at once: no drafts
    assert spec.stats().scheduler.spec_num_draft_tokens == before
    alone = spec.generate([{"prompt_token_ids": PROMPTS[1]}], greedy(30), use_tqdm=False)
    assert spec.stats().scheduler.spec_num_draft_tokens > before  # one alone: drafts
    assert alone[0].outputs[0].token_ids == run(base, greedy(30))[1]
