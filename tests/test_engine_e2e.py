"""End to end on the real default model (SmolLM2-135M-Instruct, float32).

Oracles: transformers' greedy generation on the same GGUF, and the synchronous engine
(async scheduling must produce identical tokens in every configuration).
"""

from __future__ import annotations

import pytest
import torch

from forerun import SamplingParams
from tests.conftest import assert_all_blocks_free

pytestmark = pytest.mark.slow

PROMPTS = [
    "Once upon a time, there was a little",
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "A list of three fruits: apple, banana,",
    "In the beginning the Universe was created. This has made a lot of people very angry "
    "and been widely regarded as a bad move. Many were increasingly of the opinion that",
    "Q: What is two plus two?\nA:",
]


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def mixed_params() -> list[SamplingParams]:
    """Greedy and seeded sampling, various lengths and stop conditions, one per prompt."""
    return [
        greedy(16),
        greedy(10, stop=["\n"]),
        SamplingParams(max_tokens=14, temperature=0.8, seed=7),
        SamplingParams(max_tokens=9, temperature=1.0, top_p=0.9, top_k=40, seed=3),
        greedy(20, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, seed=11, stop=["."]),
    ]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_sync_engine_greedy_equals_transformers_token_for_token(llm_cache, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    llm = llm_cache(async_scheduling="off")
    outs = llm.generate(PROMPTS, greedy(12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        ids = hf_tok(prompt, return_tensors="pt").input_ids
        assert out.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = hf_model.generate(ids, max_new_tokens=12, do_sample=False,
                                    eos_token_id=None, pad_token_id=2)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist(), prompt
    assert_all_blocks_free(llm)


CONFIGS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    "no_prefix_caching": {"enable_prefix_caching": False},
    "preemption": {"num_gpu_blocks_override": 16, "block_size": 4, "max_num_batched_tokens": 64},
    "one_seq": {"max_num_seqs": 1},
}


@pytest.fixture(scope="module")
def sync_baseline(llm_cache):
    llm = llm_cache(async_scheduling="off")
    return tokens(llm.generate(PROMPTS, mixed_params(), use_tqdm=False))


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("mode", ["off", "on"])
def test_async_and_sync_give_identical_tokens_in_every_configuration(
        llm_cache, sync_baseline, name, mode):
    llm = llm_cache(async_scheduling=mode, **CONFIGS[name])
    before = llm.stats().scheduler.num_preemptions
    outs = llm.generate(PROMPTS, mixed_params(), use_tqdm=False)
    assert tokens(outs) == sync_baseline
    if name == "preemption":
        assert llm.stats().scheduler.num_preemptions > before, \
            "the tiny pool should force preemption"
    assert_all_blocks_free(llm)


def test_async_is_on_by_default_and_reports_wasted_tokens_for_stop_finishes(llm_cache):
    llm = llm_cache()
    assert llm.stats().async_scheduling is True
    before = llm.stats().scheduler.wasted_tokens
    # A greedy request that ends on EOS before max_tokens: with one step in flight behind
    # it, exactly one token of work is thrown away.
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   greedy(32), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop"
    assert llm.stats().scheduler.wasted_tokens - before == 1
    # A length finish never wastes a step.
    before = llm.stats().scheduler.wasted_tokens
    llm.generate(PROMPTS[:2], greedy(8, ignore_eos=True), use_tqdm=False)
    assert llm.stats().scheduler.wasted_tokens == before
    assert_all_blocks_free(llm)


def test_chat_reply_equals_transformers_on_the_chat_template(llm_cache, hf_smollm2):
    hf_model, hf_tok = hf_smollm2
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    llm = llm_cache()
    out = llm.chat(messages, greedy(24), use_tqdm=False)[0]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True,
                                     return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        ref = hf_model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=2)
    ref_ids = ref[0, ids.shape[1]:].tolist()
    assert out.prompt_token_ids == ids[0].tolist()
    # transformers keeps the EOS it stopped on; so do we (finish_reason "stop").
    assert out.outputs[0].token_ids == ref_ids[: len(out.outputs[0].token_ids)]
    assert out.outputs[0].token_ids[-1] == 2 and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == hf_tok.decode(ref_ids, skip_special_tokens=True)


def test_prefix_cache_hits_on_shared_prefixes_without_changing_tokens(llm_cache):
    shared = PROMPTS[4] + " the answer is"
    prompts = [shared + " forty", shared + " a towel", shared + " unknown"]
    cached = llm_cache()
    uncached = llm_cache(enable_prefix_caching=False)
    rate0 = cached.stats().kv_cache.prefix_cache_hits
    a = cached.generate(prompts, greedy(8), use_tqdm=False)
    b = uncached.generate(prompts, greedy(8), use_tqdm=False)
    assert tokens(a) == tokens(b)
    assert cached.stats().kv_cache.prefix_cache_hits > rate0
    assert cached.stats().kv_cache.prefix_cache_hit_rate > 0
    assert uncached.stats().kv_cache.prefix_cache_hits == 0


SEEDED = {
    "temperature": dict(temperature=1.0),
    "top_p": dict(temperature=0.8, top_p=0.9),
    "top_k + min_p": dict(temperature=1.2, top_k=20, min_p=0.02),
}


@pytest.mark.parametrize("async_scheduling", ["on", "off"])
def test_seeded_request_gets_the_same_tokens_whatever_else_is_in_the_batch(
        llm_cache, async_scheduling: str):
    """Every setting of :data:`SEEDED` at once: each seeded request alone, then all of them
    in one batch with unseeded and differently seeded requests, then again in other rows."""
    llm = llm_cache(async_scheduling=async_scheduling)
    seeded = [SamplingParams(max_tokens=12, seed=1234, **s) for s in SEEDED.values()]
    alone = [llm.generate([PROMPTS[0]], p, use_tqdm=False)[0].outputs[0].token_ids
             for p in seeded]
    others = [SamplingParams(max_tokens=5, temperature=0.9),
              SamplingParams(max_tokens=9, temperature=0.0),
              SamplingParams(max_tokens=13, temperature=0.7, top_p=0.5, seed=99)]
    batch = llm.generate([PROMPTS[0]] * len(seeded) + PROMPTS[1:4], [*seeded, *others],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batch[:len(seeded)]] == alone
    # Other rows, behind an unseeded request and in reverse order.
    again = llm.generate([PROMPTS[2]] + [PROMPTS[0]] * len(seeded),
                         [others[0], *reversed(seeded)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again[1:]] == alone[::-1]
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(max_tokens=12, temperature=1.0),
                            use_tqdm=False)
    for want in alone:
        assert unseeded[0].outputs[0].token_ids != want or \
            unseeded[1].outputs[0].token_ids != want
    assert_all_blocks_free(llm)


def test_seeded_tokens_are_the_same_sync_and_async(llm_cache):
    params = [SamplingParams(max_tokens=10, seed=7 + i, **s) for i, s in enumerate(SEEDED.values())]
    outs = [llm_cache(async_scheduling=mode).generate(PROMPTS[:3], params, use_tqdm=False)
            for mode in ("on", "off")]
    assert [o.outputs[0].token_ids for o in outs[0]] == [o.outputs[0].token_ids for o in outs[1]]


def test_stop_string_truncates_text_and_stop_token_ids_end_generation(llm_cache):
    llm = llm_cache()
    free = llm.generate([PROMPTS[0]], greedy(16), use_tqdm=False)[0].outputs[0]
    assert " named" in free.text
    out = llm.generate([PROMPTS[0]], greedy(16, stop=[" named"]), use_tqdm=False)[0].outputs[0]
    assert out.text == free.text[: free.text.index(" named")]
    assert out.finish_reason == "stop" and out.stop_reason == " named"
    keep = llm.generate([PROMPTS[0]], greedy(16, stop=[" named"], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert keep.text == free.text[: free.text.index(" named") + len(" named")]
    third = free.token_ids[2]
    out = llm.generate([PROMPTS[0]], greedy(16, stop_token_ids=[third]), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == free.token_ids[:3]
    assert out.outputs[0].stop_reason == third
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("bad,field", [
    (lambda: SamplingParams(max_tokens=0), "max_tokens"),
    (lambda: SamplingParams(temperature=-0.5), "temperature"),
    (lambda: SamplingParams(top_p=0.0), "top_p"),
    (lambda: SamplingParams(top_p=1.5), "top_p"),
    (lambda: SamplingParams(top_k=-2), "top_k"),
    (lambda: SamplingParams(top_k=0), "top_k"),
])
def test_invalid_sampling_params_raise_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        bad()


def test_bad_prompt_in_a_batch_fails_before_any_work_and_leaks_nothing(llm_cache):
    llm = llm_cache()
    steps = llm.stats().scheduler.steps
    too_long = {"prompt_token_ids": [5] * 2048}
    with pytest.raises(ValueError, match="^prompt.*2048"):
        llm.generate([PROMPTS[0], too_long], greedy(4), use_tqdm=False)
    assert llm.stats().scheduler.steps == steps
    assert_all_blocks_free(llm)
    # The engine is unaffected: the good prompt still runs.
    out = llm.generate([PROMPTS[0]], greedy(4), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 4


def test_missing_model_path_is_a_clear_error(tmp_path):
    from forerun import LLM
    from forerun.model.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=str(tmp_path / "nope")):
        LLM(model=str(tmp_path / "nope"))
