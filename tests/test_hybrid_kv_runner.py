"""The hybrid KV cache manager in the engine: sliding layers keep only their window's blocks.

Tiny random Gemma 3 (sliding and full layers) and Qwen2 (``use_sliding_window`` from
``max_window_layers`` on: the one-call C stack with a table per group) with an 8-token window
over 4-token blocks, so every group has its own block table: greedy against transformers in
float32 over prompts longer than the window, in chunks, under preemption, with prefix-cache
hits, async and sync. Then the KV memory of a long prompt on a Gemma-3-shaped model (5
sliding : 1 full layers) against the window's bound, computed from the config alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Qwen2Config

from forerun import LLM, SamplingParams
from forerun.core.hybrid_kv_cache_manager import HybridKVCacheManager
from forerun.core.kv_cache_spec import kv_bytes_per_block
from forerun.model import cpu_kernels
from tests.conftest import assert_all_blocks_free
from tests.tiny_model import hf_greedy, write_word_tokenizer

WINDOW, BLOCK = 8, 4
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
    sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
MODELS: dict[str, Any] = {
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen2": lambda: Qwen2Config(**COMMON, num_hidden_layers=3, use_sliding_window=True,
                                 max_window_layers=1, tie_word_embeddings=True),
}
PROMPTS = [[(7 * i + 13 * j) % 300 + 10 for i in range(n)] for j, n in enumerate((23, 19, 26))]


def _write(folder: Path, config: Any, seed: int = 5) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config)
    gemma = config.model_type.startswith("gemma")
    with torch.no_grad():  # decisive greedy choices (see test_sliding_window_models.py)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif gemma and "embed_tokens" in name:
                p.copy_(0.01 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    hf.eval()
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size, eos=2)
    return hf


@pytest.fixture(scope="module", params=list(MODELS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(f"hybrid-{request.param}")
    hf = _write(folder, MODELS[request.param]())
    return hf, folder


def _engine_tokens(folder: Path) -> dict[str, list[list[int]]]:
    """Three prompts longer than the window, in 8-token chunks, over a pool too small for
    all of them (preemptions), then the first prompt twice (prefix-cache hits), with async
    scheduling off and on; every block free afterwards. Greedy tokens per mode."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        llm = LLM(str(folder), dtype="float32", max_model_len=48, block_size=BLOCK,
                  max_num_batched_tokens=8, num_gpu_blocks_override=29,
                  async_scheduling=mode)
        try:
            kv = llm.llm_engine.scheduler.kv_cache_manager
            assert isinstance(kv, HybridKVCacheManager) and kv.num_groups == 3
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params,
                                use_tqdm=False)
            assert llm.stats().scheduler.num_preemptions > 0
            # The tiny pool's churn evicted the first prompt's blocks; run it once more, then
            # again: that one hits every group's blocks (the sliding ones: its window's).
            again = [llm.generate([{"prompt_token_ids": PROMPTS[0]}], params,
                                  use_tqdm=False)[0]]
            hits_before = llm.stats().kv_cache.prefix_cache_hits
            again += llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)
            assert again[1].num_cached_tokens > 0
            assert llm.stats().kv_cache.prefix_cache_hits > hits_before
            got[mode] = [o.outputs[0].token_ids for o in outs + again]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    return got


def test_hybrid_engine_matches_transformers_chunked_preempted_and_prefix_cached(
        tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """See _engine_tokens: async and sync give transformers' greedy tokens. Qwen2's steps
    run in the one-call C stack, each layer on its group's table."""
    hf, folder = tiny
    stack_calls: list[torch.dtype] = []
    real_stack = cpu_kernels.decoder_stack
    monkeypatch.setattr(cpu_kernels, "decoder_stack",
                        lambda dtype: stack_calls.append(dtype) or real_stack(dtype))
    want = [hf_greedy(hf, p, 16) for p in PROMPTS]
    got = _engine_tokens(folder)
    assert got["off"] == got["on"] == want + want[:1] * 2
    takes_stack = hf.config.model_type == "qwen2" and cpu_kernels.kernel_library() is not None
    assert bool(stack_calls) == takes_stack


def test_hybrid_engine_on_the_torch_path_matches_transformers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same on the pure-torch attention (what CUDA runs): each group's window view
    gathers from its own table, never a null entry."""
    monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    hf = _write(tmp_path, MODELS["gemma3"]())
    want = [hf_greedy(hf, p, 16) for p in PROMPTS]
    got = _engine_tokens(tmp_path)
    assert got["off"] == got["on"] == want + want[:1] * 2


def test_a_long_prompts_kv_bytes_stay_at_the_window_bound(tmp_path: Path) -> None:
    """A Gemma-3-shaped model (5 sliding : 1 full layers, window 16): while a 200-token
    prompt runs, the request's live blocks never exceed the full layer's whole sequence plus
    each sliding layer's window and one step's chunk, far below every layer keeping all."""
    window, chunk, prompt_len, new = 16, 16, 200, 4
    config = Gemma3TextConfig(**{**COMMON, "sliding_window": window}, num_hidden_layers=6,
                              query_pre_attn_scalar=16)
    assert config.layer_types.count("sliding_attention") == 5
    _write(tmp_path, config)
    llm = LLM(str(tmp_path), dtype="float32", max_model_len=256, block_size=BLOCK,
              max_num_batched_tokens=chunk, enable_prefix_caching=False)
    try:
        engine = llm.llm_engine
        kv = engine.scheduler.kv_cache_manager
        assert isinstance(kv, HybridKVCacheManager)
        # From the config alone: one layer per group (group size = the full layers' count),
        # a block is one layer's K and V of BLOCK positions.
        block_bytes = 2 * BLOCK * config.num_key_value_heads * config.head_dim * 4
        assert kv_bytes_per_block(kv.kv_cache_groups, BLOCK, config.num_key_value_heads,
                                  config.head_dim, 4) == block_bytes
        prompt = [(5 * i) % 300 + 10 for i in range(prompt_len)]
        engine.add_request("long", {"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=new, temperature=0, ignore_eos=True))
        peak = steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            if "long" in kv.group_req_to_blocks:
                peak = max(peak, kv.num_live_blocks("long"))
                steps += 1
        total = prompt_len + new
        full_blocks = -(-total // BLOCK)
        # A step at C of n tokens reads [C - W + 1, C + n): at most W - 1 + n positions, over
        # one block more than they fill when they start late in a block.
        window_blocks = -(-(window - 1 + chunk) // BLOCK) + 1
        bound = (full_blocks + 5 * window_blocks) * block_bytes
        all_full = 6 * full_blocks * block_bytes
        measured = peak * block_bytes
        assert steps > prompt_len // chunk
        assert full_blocks * block_bytes < measured <= bound
        assert measured < 0.4 * all_full, (measured, all_full)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()
