"""The simulated device: its roofline by hand, and the real engine around it.

Oracles: the step times written out from the datasheet figures here; the synchronous
engine (async gives the same tokens); the token function itself (every delivered id is the
one the simulated sampler gives for that request and position).
"""

from __future__ import annotations

import pytest

from forerun import LLM, SamplingParams
from forerun.worker.simulated import (
    DEVICES,
    MODELS,
    parse_simulated_device,
    simulated_token,
    step_time_s,
)
from tests.conftest import assert_all_blocks_free


def test_a_decode_step_is_bound_by_reading_the_weights_and_kv():
    h100, llama = DEVICES["h100"], MODELS["llama-3-8b"]
    kv_per_token = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads of 128, bf16
    want = (8.03e9 * 2 + 4 * 1000 * kv_per_token) / 3.35e12 + 0.3e-3
    assert step_time_s(h100, llama, 4, [1000] * 4) == pytest.approx(want, rel=1e-12)
    assert 4.5e-3 < want < 6e-3  # the regime the seed describes: a few ms per step


def test_a_long_prefill_is_bound_by_flops():
    h100, llama = DEVICES["h100"], MODELS["llama-3-8b"]
    tokens = 8192
    attn = 4 * tokens * tokens * 4096 * 32
    want = (2 * 8.03e9 * tokens + attn) / 989e12 + 0.3e-3
    assert step_time_s(h100, llama, tokens, [tokens]) == pytest.approx(want, rel=1e-12)


def test_bad_simulated_device_names_the_field_and_the_choices():
    for bad in ("tpu", "h100/gpt-5", ""):
        with pytest.raises(ValueError, match="simulated_device.*h100.*llama-3-8b"):
            parse_simulated_device(bad)
    with pytest.raises(ValueError, match="simulated_device"):
        LLM(simulated_device="h100", speculative_config={"method": "ngram",
                                                         "num_speculative_tokens": 2})


def test_sync_and_async_engines_give_the_simulated_tokens():
    prompts = [{"prompt_token_ids": list(range(2000, 2000 + n))} for n in (5, 40, 77)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    results = {}
    for mode in ("off", "on"):
        llm = LLM(simulated_device="h100/llama-3-8b", async_scheduling=mode,
                  max_num_batched_tokens=32, kv_cache_memory_bytes=64 << 20,
                  max_model_len=512)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
        vocab = llm.llm_engine.model_info.vocab_size
        for p, o in zip(prompts, outs, strict=True):
            n = len(p["prompt_token_ids"])
            assert o.outputs[0].token_ids == [
                simulated_token(o.request_id, n + i, vocab) for i in range(12)]
        results[mode] = [o.outputs[0].token_ids for o in outs]
    assert results["on"] == results["off"]
