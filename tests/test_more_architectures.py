"""Phi-3/4, Granite 3, OLMo 2 and SmolLM3, and every rope scaling type, against transformers.

Tiny random models (hidden 64, 2 layers, weights scaled so greedy is decisive) from each
family's transformers config: greedy tokens equal transformers' float32 ones on every CPU
path that applies, in one prefill or in chunks, through the engine (prefix-cache hit, async
and sync alike), and from GGUF files laid out as llama.cpp's converter writes them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    DynamicCache,
    GraniteConfig,
    LlamaConfig,
    Olmo2Config,
    Phi3Config,
    SmolLM3Config,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from forerun import LLM, SamplingParams
from forerun.model import cpu_kernels
from forerun.model.config import ModelConfig
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.rotary import RotaryEmbedding, compute_inv_freq
from tests.conftest import assert_all_blocks_free
from tests.paged_driver import PagedDriver
from tests.tiny_model import write_word_tokenizer

CPU = torch.device("cpu")
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=320, max_position_embeddings=128, rms_norm_eps=1e-6,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
ORIGINAL = 32  # longrope's original context in these configs


def _longrope(pairs: int) -> dict[str, Any]:
    return {"rope_type": "longrope", "rope_theta": 10000.0,
            "short_factor": [1.0 + 0.3 * i for i in range(pairs)],
            "long_factor": [1.0 + 2.0 * i for i in range(pairs)]}


VARIANTS: dict[str, Any] = {
    # Phi-3.5-mini-like: LongRoPE over the whole head (the small-batch C path applies).
    "phi3": lambda: Phi3Config(**COMMON, original_max_position_embeddings=ORIGINAL,
                               rope_parameters=_longrope(8), tie_word_embeddings=False),
    # Phi-4-mini-like: LongRoPE over 3/4 of each head, tied head.
    "phi4_partial": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.75,
                                       original_max_position_embeddings=ORIGINAL,
                                       rope_parameters=_longrope(6), tie_word_embeddings=True),
    # Phi-3-mini-4k-like: every layer over a sliding window (2047 there), shorter than PROMPT.
    "phi3_window": lambda: Phi3Config(**COMMON, sliding_window=4, tie_word_embeddings=False),
    "granite": lambda: GraniteConfig(**COMMON, embedding_multiplier=3.0, residual_multiplier=0.5,
                                     attention_multiplier=0.2, logits_scaling=4.0,
                                     tie_word_embeddings=True),
    # No residual multiplier: the C path runs it (attention scale passed, the rest in Python).
    "granite_c_path": lambda: GraniteConfig(**COMMON, embedding_multiplier=2.0,
                                            residual_multiplier=1.0, attention_multiplier=0.3,
                                            logits_scaling=2.0, tie_word_embeddings=False),
    "olmo2": lambda: Olmo2Config(**COMMON, tie_word_embeddings=False),
    # Every second layer without rotary.
    "smollm3": lambda: SmolLM3Config(**COMMON, no_rope_layer_interval=2,
                                     tie_word_embeddings=True),
}
C_PATH_VARIANTS = {"phi3", "phi3_window", "granite_c_path"}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1]


def _tiny_hf(cfg: Any, seed: int = 1234) -> Any:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    return hf.eval()


def _load(folder: Path, max_model_len: int | None = None) -> Any:
    source = resolve_model(str(folder))
    config = load_model_config(source)
    config.max_model_len = max_model_len
    return load_model(source, config, torch.float32, CPU)


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(variant, HF model, folder with a word tokenizer)."""
    hf = _tiny_hf(VARIANTS[request.param]())
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, COMMON["vocab_size"], COMMON["eos_token_id"])
    return request.param, hf, folder


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """Full recompute per token: transformers picks its rope frequencies from the whole
    sequence's length each time."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def _hf_greedy_cached(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers with its KV cache: each token rotated by the frequencies of the length
    the sequence had when it was computed (dynamic NTK's meaning in an engine)."""
    cache, out = DynamicCache(config=hf.config), []
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        for _ in range(n):
            logits = hf(ids, cache=cache, use_cache=True).logits[0, -1]
            out.append(int(logits.argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


@pytest.fixture(params=["op-by-op", "torch-path", "small-batch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "torch-path":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    elif cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS",
                       "1000" if request.param == "small-batch" else "0")
    return request.param


def test_greedy_matches_transformers_in_one_prefill_and_in_chunks(
        tiny, cpu_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    name, hf, folder = tiny
    takes_c_path = name in C_PATH_VARIANTS
    if cpu_path == "small-batch" and not takes_c_path:
        pytest.skip("the small-batch C stack refuses this variant (tested below)")
    calls: list[torch.dtype] = []
    real = cpu_kernels.decoder_stack
    monkeypatch.setattr(cpu_kernels, "decoder_stack",
                        lambda dtype: calls.append(dtype) or real(dtype))
    # Within longrope's original context, so that its short factors apply (as they do in
    # transformers for sequences that short).
    ours = _load(folder, max_model_len=ORIGINAL)
    want = _hf_greedy(hf, PROMPT, 12)
    with torch.inference_mode():
        assert PagedDriver(ours).greedy("a", PROMPT, 12) == want
        driver = PagedDriver(ours, seed=3)
        for start in range(0, len(PROMPT) - 1, 4):
            driver.step([("c", PROMPT[start:min(start + 4, len(PROMPT) - 1)])])
        assert driver.greedy("c", PROMPT[-1:], 12) == want
    assert bool(calls) == (cpu_path == "small-batch")


def test_small_batch_stack_refuses_what_it_does_not_compute(tiny) -> None:
    name, _, folder = tiny
    refusal = _load(folder).small_batch.refusal
    expected = {"phi4_partial": "partial rotary", "granite": "a residual multiplier",
                "olmo2": "norms after the attention and MLP blocks (post-norm layers), "
                         "q/k norm over the whole projection",
                "smollm3": "layers without rotary (NoPE)"}
    assert refusal == expected.get(name)


def test_engine_tokens_match_transformers_with_chunks_prefix_hit_async_and_sync(
        tiny) -> None:
    name, hf, folder = tiny
    if name in ("granite_c_path", "phi4_partial"):
        pytest.skip("the same code as another variant through the engine")
    prompts = [PROMPT + [33, 44], PROMPT + [8]]  # the first block (4 tokens) shared
    want = [_hf_greedy(hf, p, 8) for p in prompts]
    got = {}
    for mode in ("on", "off"):
        llm = LLM(str(folder), dtype="float32", max_model_len=ORIGINAL, block_size=4,
                  enable_prefix_caching=True, max_num_batched_tokens=8,
                  async_scheduling=mode)
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            got[mode] = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)]
            got[mode] += [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": prompts[1]}], params, use_tqdm=False)]
            assert llm.stats().kv_cache.prefix_cache_hit_rate > 0
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert got["on"] == got["off"] == want


def test_longrope_long_factors_above_the_original_context(tiny) -> None:
    """A context longer than the original one rotates by the long factors from position 0
    (vLLM's rule, by max_model_len); transformers uses them for a sequence that long."""
    name, hf, folder = tiny
    if not name.startswith("phi"):
        pytest.skip("longrope variants only")
    ours = _load(folder)  # max_model_len: the model's 128 > 32
    prompt = (PROMPT * 4)[:ORIGINAL + 4]
    with torch.inference_mode():
        assert PagedDriver(ours).greedy("a", prompt, 6) == _hf_greedy(hf, prompt, 6)


# --- rope scaling types against transformers' own init functions ------------------------

ROPES: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 3.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn_mscale_untruncated": {"rope_type": "yarn", "factor": 8.0, "beta_fast": 16,
                                "beta_slow": 2, "mscale": 0.8, "mscale_all_dim": 0.5,
                                "truncate": False, "original_max_position_embeddings": 16},
    "yarn_attention_factor": {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3,
                              "original_max_position_embeddings": 32},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "longrope": {**_longrope(8), "original_max_position_embeddings": 32},
    "longrope_factor": {**_longrope(8), "factor": 6.0, "original_max_position_embeddings": 32},
}


def _rope_llama_config(rope: dict[str, Any], max_pos: int = 128) -> LlamaConfig:
    return LlamaConfig(**{**COMMON, "max_position_embeddings": max_pos},
                       rope_parameters={"rope_theta": 10000.0, **rope},
                       architectures=["LlamaForCausalLM"])


def _ours(cfg: LlamaConfig, max_model_len: int | None = None) -> ModelConfig:
    config = ModelConfig.from_hf_dict(cfg.to_dict())
    config.max_model_len = max_model_len
    return config


@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_inverse_frequencies_and_attention_factor_match_transformers(rope: str) -> None:
    cfg = _rope_llama_config(ROPES[rope])
    init = ROPE_INIT_FUNCTIONS[ROPES[rope]["rope_type"]]
    mc = _ours(cfg)
    emb = RotaryEmbedding(mc.head_dim, mc.rope_theta, mc.rope_scaling, mc.rope_dim,
                          mc.max_position_embeddings, bool(mc.uses_long_rope_factors()))
    # longrope: transformers' long set for a sequence past the original context, the one
    # forerun uses with max_model_len 128 > 32.
    want, factor = init(cfg, "cpu", seq_len=ORIGINAL + 1)
    torch.testing.assert_close(emb._inv_freq_cpu, want, rtol=1e-6, atol=0)
    assert emb.attention_factor == pytest.approx(factor, rel=1e-12)
    pos = torch.arange(0, 100, 7)
    tables = emb.tables(pos)
    if rope != "dynamic":
        angles = pos.float()[:, None] * want[None, :]
        torch.testing.assert_close(tables.cos_half, angles.cos() * factor)
        torch.testing.assert_close(tables.sin_half, angles.sin() * factor)
    if rope.startswith("longrope"):
        short = _ours(cfg, max_model_len=32).rope_scaling
        torch.testing.assert_close(compute_inv_freq(16, 10000.0, short, long_factors=False),
                                   init(cfg, "cpu", seq_len=ORIGINAL)[0], rtol=1e-6, atol=0)


def test_dynamic_ntk_rotates_each_position_by_its_own_lengths_frequencies() -> None:
    cfg = _rope_llama_config(ROPES["dynamic"], max_pos=16)
    mc = _ours(cfg)
    emb = RotaryEmbedding(mc.head_dim, mc.rope_theta, mc.rope_scaling, mc.rope_dim,
                          mc.max_position_embeddings)
    init = ROPE_INIT_FUNCTIONS["dynamic"]
    for p in (0, 9, 15, 16, 40, 127):
        want = init(cfg, "cpu", seq_len=torch.tensor(p + 1))[0]
        got = emb.tables(torch.tensor([p]))
        angles = float(p) * want
        torch.testing.assert_close(got.cos_half[0], angles.cos(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got.sin_half[0], angles.sin(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rope", ["linear", "dynamic", "yarn_mscale_untruncated", "llama3"])
def test_rope_type_end_to_end_matches_transformers(rope: str, tmp_path: Path) -> None:
    """One tiny Llama per type (longrope: the Phi variants above); dynamic NTK decodes past
    its original context (16) against transformers with its KV cache."""
    max_pos = 16 if rope == "dynamic" else 128
    hf = _tiny_hf(_rope_llama_config(ROPES[rope], max_pos=max_pos), seed=7)
    hf.save_pretrained(tmp_path)
    ours = _load(tmp_path)
    with torch.inference_mode():
        got = PagedDriver(ours).greedy("a", PROMPT, 14)
    want = (_hf_greedy_cached if rope == "dynamic" else _hf_greedy)(hf, PROMPT, 14)
    assert got == want


# --- GGUF files laid out as llama.cpp's converter writes them ----------------------------

_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# OLMo 2's post-block norms; every other family's post_attention_layernorm is ffn_norm.
_OLMO2_NORMS = {"post_attention_layernorm": "post_attention_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}
_GGUF_ARCH = {"phi3": "phi3", "granite": "granite", "olmo2": "olmo2", "smollm3": "smollm3",
              "llama": "llama"}
_PERMUTED = ("granite", "smollm3", "llama")


def _gguf_name(hf_name: str, arch: str) -> str:
    parts = hf_name.split(".")
    if parts[0] == "lm_head":
        return f"output.{parts[-1]}"
    if parts[1] == "embed_tokens":
        return f"token_embd.{parts[-1]}"
    if parts[1] == "norm":
        return f"output_norm.{parts[-1]}"
    module = ".".join(parts[3:-1])
    names = {**_TO_GGUF, **(_OLMO2_NORMS if arch == "olmo2"
                            else {"post_attention_layernorm": "ffn_norm"})}
    return f"blk.{parts[2]}.{names[module]}.{parts[-1]}"


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write_gguf(hf: Any, path: Path, tokens: list[str]) -> None:
    import gguf

    cfg = hf.config
    arch = _GGUF_ARCH[cfg.model_type]
    w = gguf.GGUFWriter(path, arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    rope = cfg.rope_parameters
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t.startswith("<|") else gguf.TokenType.NORMAL
                       for t in tokens])
    w.add_eos_token_id(2)
    if arch == "phi3":  # as Phi3MiniModel writes it: no scaling type, the factors as tensors
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_sliding_window(0)
        scale = cfg.max_position_embeddings / rope["original_max_position_embeddings"]
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(
            rope["original_max_position_embeddings"])))
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))
    if rope.get("rope_type") in ("linear", "yarn"):  # as the converter's base class writes
        w.add_rope_scaling_type(gguf.RopeScalingType(rope["rope_type"]))
        w.add_rope_scaling_factor(rope["factor"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        arr = t.detach().float().numpy()
        if arch in _PERMUTED and ".q_proj." in name:
            arr = _llamacpp_permute(arr, heads)
        elif arch in _PERMUTED and ".k_proj." in name:
            arr = _llamacpp_permute(arr, kv_heads)
        w.add_tensor(_gguf_name(name, arch), arr.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.usefixtures("private_model_cache")
def test_gguf_loads_equal_to_the_hf_folder(tiny, tmp_path: Path) -> None:
    name, hf, _ = tiny
    if name in ("granite_c_path", "phi4_partial", "phi3_window"):
        # The window's GGUF key is read as the Gemma/Mistral files' (test_sliding_window_models).
        pytest.skip("the same GGUF layout as another variant")
    if name == "smollm3":
        # llama.cpp's smollm3 has its NoPE layers at a fixed interval of 4 (no metadata).
        hf = _tiny_hf(SmolLM3Config(**{**COMMON, "num_hidden_layers": 4},
                                    no_rope_layer_interval=4, tie_word_embeddings=True))
    tokens = [f"t{i}" for i in range(COMMON["vocab_size"])]
    tokens[7], tokens[9] = "<|end|>", "<|im_end|>"
    path = tmp_path / f"{name}.gguf"
    _write_gguf(hf, path, tokens)
    source = resolve_model(str(path))
    config = load_model_config(source)
    assert config.architecture == type(hf).__name__
    assert config.eos_token_ids == {"phi3": [2, 7], "smollm3": [2, 9]}.get(name, [2])
    if name == "phi3":
        assert config.rope_scaling is not None
        assert config.rope_scaling["rope_type"] == "longrope"
    if name == "smollm3":
        assert config.nope_layers == [3]
    config.max_model_len = ORIGINAL
    ours = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("private_model_cache")
@pytest.mark.parametrize("rope", ["linear", "yarn"])
def test_gguf_rope_scaling_metadata_loads_equal(rope: str, tmp_path: Path) -> None:
    params = {**ROPES[rope], "beta_fast": 24, "beta_slow": 2} if rope == "yarn" else ROPES[rope]
    hf = _tiny_hf(_rope_llama_config(params), seed=5)
    path = tmp_path / f"{rope}.gguf"
    _write_gguf(hf, path, [f"t{i}" for i in range(COMMON["vocab_size"])])
    source = resolve_model(str(path))
    config = load_model_config(source)
    assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == rope
    ours = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        want = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_phi3_sliding_window_applies_to_every_layer() -> None:
    cfg = Phi3Config(**COMMON, sliding_window=64, architectures=["Phi3ForCausalLM"]).to_dict()
    config = ModelConfig.from_hf_dict(cfg)
    assert config.layer_types == ["sliding_attention"] * 2 and config.sliding_window == 64
    # A window no position can reach past is full attention.
    wide = ModelConfig.from_hf_dict({**cfg, "sliding_window": 128})
    assert wide.layer_types == [] and wide.sliding_window is None


def test_generation_config_stop_list_wins_for_phi() -> None:
    cfg = Phi3Config(**COMMON, architectures=["Phi3ForCausalLM"]).to_dict()
    config = ModelConfig.from_hf_dict(cfg, {"eos_token_id": [2, 7, 9]})
    assert config.eos_token_ids == [2, 7, 9]
