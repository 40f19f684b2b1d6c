"""Gemma 2, Gemma 3 (text) and Mistral: tiny random models against transformers in float32.

Each model has sliding and global layers with an 8-token window, and every prompt here is
longer than the window, so the window's edge (transformers: position p sees p-W+1 .. p)
is crossed in prefill, chunked prefill and decode, over 4-token KV blocks.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    Qwen2Config,
)

from forerun.model import attention, cpu_kernels
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.small_batch import unsupported_features
from tests.paged_driver import PagedDriver
from tests.tiny_model import write_word_tokenizer

CPU = torch.device("cpu")
WINDOW = 8
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
    sliding_window=WINDOW, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VARIANTS: dict[str, Any] = {
    # Soft caps small enough to bite on these weights; an attention scale not head_dim's.
    "gemma2": lambda: Gemma2Config(**COMMON, num_hidden_layers=2, query_pre_attn_scalar=24,
                                   attn_logit_softcapping=3.0, final_logit_softcapping=8.0),
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON, num_hidden_layers=3, query_pre_attn_scalar=16,  # head_dim: as in a GGUF
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                            "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
    "mistral": lambda: MistralConfig(**COMMON, num_hidden_layers=2, tie_word_embeddings=False),
    # Layers from max_window_layers on slide.
    "qwen2": lambda: Qwen2Config(**COMMON, num_hidden_layers=2, use_sliding_window=True,
                                 max_window_layers=1, tie_word_embeddings=True),
}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1, 77, 123, 8, 19, 240, 31, 56, 201, 9, 4]


def _randomise(model: torch.nn.Module) -> None:
    """Larger-than-default weights so greedy choices are decisive; norms away from their
    identity (Gemma's weights are offsets from 1, the others' the scale itself). Gemma's
    embeddings are scaled by sqrt(hidden) = 8: smaller ones keep the current token's from
    swamping the layers (with the tied head, greedy would repeat the last token)."""
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_((0.0 if gemma else 1.0) + 0.2 * torch.randn_like(p))
            elif gemma and "embed_tokens" in name:
                p.copy_(0.01 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, forerun model fp32, folder) for one architecture."""
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(VARIANTS[request.param]())
    _randomise(hf)
    hf.eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, hf.config.vocab_size, eos=2)
    source = resolve_model(str(folder))
    ours = load_model(source, load_model_config(source), torch.float32, CPU)
    return hf, ours, folder


@pytest.fixture(params=["c-kernels", "torch-path"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """The C kernels (Mistral, Qwen2: the one-call small-batch stack, which has the window;
    the Gemmas: op by op, the stack refusing them) and the pure-torch path."""
    calls: list[torch.dtype] = []
    if request.param == "torch-path":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    elif cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    else:
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
        real = cpu_kernels.decoder_stack
        monkeypatch.setattr(cpu_kernels, "decoder_stack",
                            lambda dtype: calls.append(dtype) or real(dtype))
    yield request.param, calls


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


# Per model object, weakly: keyed by id(), a model of the next architecture could reuse a
# freed model's id and get its tokens (it did, in the full suite).
_Runs = dict[tuple[tuple[int, ...], int], list[int]]  # (prompt, n) -> tokens
_GREEDY: weakref.WeakKeyDictionary[torch.nn.Module, _Runs] = weakref.WeakKeyDictionary()


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens by full recompute (once per model, prompt and length:
    several tests ask)."""
    cache = _GREEDY.setdefault(hf, {})
    key = (tuple(prompt), n)
    if key not in cache:
        ids = list(prompt)
        for _ in range(n):
            ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
        cache[key] = ids[len(prompt):]
    return cache[key]


def test_config_marks_sliding_layers(tiny) -> None:
    hf, ours, _ = tiny
    cfg = ours.config
    want = getattr(hf.config, "layer_types", None) or ["sliding_attention"] * 2
    assert cfg.layer_types == want and cfg.sliding_window == WINDOW
    assert [layer.self_attn.window for layer in ours.model.layers] == [
        WINDOW if t == "sliding_attention" else None for t in want]


def test_small_batch_stack_takes_mistral_and_refuses_gemma(tiny) -> None:
    hf, ours, _ = tiny
    missing = unsupported_features(ours)
    if not hf.config.model_type.startswith("gemma"):
        assert missing == [] and ours.small_batch.available
    else:
        assert "Gemma norms" in missing and not ours.small_batch.available


def test_prefill_logits_and_greedy_match_transformers(tiny, cpu_path) -> None:
    hf, ours, _ = tiny
    path, stack_calls = cpu_path
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        tokens = PagedDriver(ours, seed=7).greedy("a", PROMPT, 12)
    torch.testing.assert_close(got, _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)
    assert tokens == _hf_greedy(hf, PROMPT, 12)
    # Mistral and Qwen2 ran in the one-call stack, window and all; the Gemmas never.
    assert bool(stack_calls) == (path == "c-kernels" and ours.small_batch.available)


def test_prompt_attending_in_window_query_blocks_matches_transformers(
        tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh prompt of 21 tokens over a window of 8 in SDPA calls of 4 query rows (the
    last of one) over their windows' keys, as prompts longer than 128 tokens run."""
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    hf, ours, _ = tiny
    monkeypatch.setattr(attention, "WINDOW_QUERY_BLOCK", 4)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
    torch.testing.assert_close(got, _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_mixed_batch_match_transformers(tiny, cpu_path) -> None:
    """Chunks of 5 (each past the first has context, some of it out of the window) next to
    a decode and a fresh prompt longer than the window in one step."""
    hf, ours, _ = tiny
    other = PROMPT[::-1]
    driver = PagedDriver(ours, seed=3)
    with torch.inference_mode():
        driver.step([("b", other[:-1])])
        chunks = []
        for i in range(0, len(PROMPT), 5):
            batch = [("a", PROMPT[i:i + 5])]
            if i == 5:
                batch += [("b", other[-1:]), ("c", other[:12])]
            out = driver.step(batch)
            chunks.append(out[0])
            if i == 5:
                lb, lc = out[1], out[2]
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat(chunks), _hf_logits(hf, PROMPT), **close)
    torch.testing.assert_close(lb[0], _hf_logits(hf, other)[-1], **close)
    torch.testing.assert_close(lc, _hf_logits(hf, other[:12]), **close)


def _engine(folder: Path, **kw: Any) -> Any:
    from forerun import LLM

    return LLM(str(folder), dtype="float32", max_model_len=64, block_size=4,
               kv_cache_memory_bytes=4 << 20, **kw)


def test_engine_chunked_prefill_prefix_hit_and_async_match_transformers(tiny) -> None:
    """The offline engine: a prompt in 8-token chunks, then the same prompt again (its
    full blocks from the prefix cache), with async scheduling on and off."""
    from forerun import SamplingParams
    from tests.conftest import assert_all_blocks_free

    hf, _, folder = tiny
    prompt = {"prompt_token_ids": PROMPT}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = {}
    for mode in ("off", "on"):
        llm = _engine(folder, max_num_batched_tokens=8, async_scheduling=mode)
        try:
            outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2)]
            assert outs[1].num_cached_tokens > 0
            got[mode] = [o.outputs[0].token_ids for o in outs]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    want = _hf_greedy(hf, PROMPT, 8)
    assert got["off"] == got["on"] == [want, want]


def _permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF reordering of llama-arch Q/K rows (Mistral)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


def _write_gguf(hf: torch.nn.Module, path: Path) -> None:
    """What llama.cpp's converter writes (conversion/gemma.py, llama.py): tensors named by
    gguf-py's map (Gemma's sandwich norms post_attention_norm / ffn_norm / post_ffw_norm),
    Gemma norms with the 1 already added, no separate output for tied embeddings, Mistral
    as llama with its Q/K rows permuted; the window, soft caps and (Gemma 3) the layer
    pattern as metadata."""
    import gguf

    cfg = hf.config
    arch = {"gemma2": "gemma2", "gemma3_text": "gemma3", "mistral": "llama"}[cfg.model_type]
    gemma = arch != "llama"
    # gguf-py's own table of Hugging Face -> GGUF tensor names, as the converter uses it.
    names = gguf.get_tensor_name_map(
        {"gemma2": gguf.MODEL_ARCH.GEMMA2, "gemma3": gguf.MODEL_ARCH.GEMMA3,
         "llama": gguf.MODEL_ARCH.LLAMA}[arch], cfg.num_hidden_layers)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    else:
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    tokens, types = [f"t{i}" for i in range(cfg.vocab_size)], [1] * cfg.vocab_size
    if gemma:  # Gemma's end of turn, a control token (llama.cpp's type 3)
        tokens[106], types[106] = "<end_of_turn>", 3
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_eos_token_id(2)
    for name, t in hf.state_dict().items():
        arr = t.detach().float().numpy()
        if gemma and name.endswith("norm.weight"):
            arr = arr + 1
        if not gemma and ".q_proj." in name:
            arr = _permute_qk(arr, cfg.num_attention_heads)
        elif not gemma and ".k_proj." in name:
            arr = _permute_qk(arr, cfg.num_key_value_heads)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gname is not None, name
        w.add_tensor(gname, arr.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.usefixtures("private_model_cache")
def test_gguf_loading_matches_transformers(tiny, tmp_path: Path) -> None:
    hf, ours, _ = tiny
    if hf.config.model_type == "qwen2":
        pytest.skip("llama.cpp's qwen2 has no sliding window (its converter writes none)")
    if hf.config.model_type == "gemma2":
        pytest.skip("a GGUF has no query_pre_attn_scalar (llama.cpp takes head_dim), and this "
                    "Gemma 2's differs; the Gemma 3 file covers the Gemma names and norms")
    path = tmp_path / "tiny.gguf"
    _write_gguf(hf, path)
    source = resolve_model(str(path))
    config = load_model_config(source)
    for key in ("architecture", "layer_types", "sliding_window", "query_pre_attn_scalar",
                "attn_logit_softcapping", "final_logit_softcapping", "rope_local_theta",
                "rope_scaling", "tie_word_embeddings", "hidden_act"):
        assert getattr(config, key) == getattr(ours.config, key), key
    assert config.eos_token_ids == ([2, 106] if hf.config.model_type == "gemma3_text" else [2])
    from_gguf = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(from_gguf).step([("a", PROMPT)])[0]
    torch.testing.assert_close(got, _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def _config(arch: str, **kw: Any) -> dict[str, Any]:
    return {"architectures": [arch], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 6, "num_attention_heads": 4, "vocab_size": 320, **kw}


def test_layer_types_without_a_layer_types_key_follow_each_familys_pattern() -> None:
    """transformers 4 configs: Gemma 2 slides on even layers, Gemma 3 makes every sixth
    global (sliding_window_pattern) and rotates its sliding layers by
    rope_local_base_freq, Qwen2 slides from max_window_layers on when use_sliding_window,
    Mixtral everywhere."""
    from forerun.model.config import ModelConfig

    s, f = "sliding_attention", "full_attention"
    g2 = ModelConfig.from_hf_dict(_config("Gemma2ForCausalLM", sliding_window=16,
                                          head_dim=16))
    assert g2.layer_types == [s, f] * 3 and g2.query_pre_attn_scalar == 16
    g3 = ModelConfig.from_hf_dict(_config(
        "Gemma3ForCausalLM", sliding_window=16, sliding_window_pattern=3, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}))
    assert g3.layer_types == [s, s, f] * 2 and g3.layer_window(0) == 16
    assert g3.layer_window(2) is None
    assert (g3.rope_theta, g3.rope_local_theta) == (1e6, 1e4)
    assert g3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    q2 = ModelConfig.from_hf_dict(_config("Qwen2ForCausalLM", sliding_window=32,
                                          use_sliding_window=True, max_window_layers=4))
    assert q2.layer_types == [f] * 4 + [s] * 2
    assert ModelConfig.from_hf_dict(_config("Qwen2ForCausalLM", sliding_window=32)
                                    ).layer_types == []
    mx = ModelConfig.from_hf_dict(_config("MixtralForCausalLM", sliding_window=32,
                                          num_local_experts=4, num_experts_per_tok=2))
    assert mx.layer_types == [s] * 6 and mx.sliding_window == 32


def test_gemma_stops_on_end_of_turn_from_generation_config() -> None:
    from forerun.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict(_config("Gemma3ForCausalLM", eos_token_id=1),
                                   {"eos_token_id": [1, 106]})
    assert cfg.eos_token_ids == [1, 106]


@pytest.mark.parametrize(("extra", "named"), [
    ({"layer_types": ["sliding_attention"] * 5}, "layer_types"),
    ({"layer_types": ["chunked_attention"] * 6}, "layer_types"),
    ({"sliding_window": 0}, "sliding_window"),
    ({"hidden_activation": "relu"}, "relu"),
])
def test_bad_sliding_or_activation_settings_are_refused_by_name(
        extra: dict[str, Any], named: str) -> None:
    from forerun.model.config import ModelConfig
    from forerun.model.errors import ModelLoadError

    d = _config("Gemma2ForCausalLM", **{"sliding_window": 16, **extra})
    with pytest.raises(ModelLoadError, match=named):
        ModelConfig.from_hf_dict(d)
