"""Llama 3.x GGUF files: rope frequency factors (``rope_freqs.weight``), stop tokens, the
``llama-bpe`` tokenizer, tied and untied output, GQA, against transformers in float32.

The GGUF is written here the way llama.cpp's ``convert_hf_to_gguf.py`` writes a Llama 3.1/3.2
checkpoint, independently of forerun's reader: Q/K rows permuted for llama.cpp's interleaved
rotary, no llama3 scaling parameters in the metadata, and one F32 ``rope_freqs.weight`` of
head_dim/2 factors (each 1, ``factor``, or the smooth blend's reciprocal) that llama.cpp
divides each pair's angle by.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from forerun.model import cpu_kernels
from forerun.model.errors import ModelLoadError
from forerun.model.loader import load_model, load_model_config, load_tokenizer, resolve_model
from tests.paged_driver import PagedDriver

CPU = torch.device("cpu")
# original_max_position_embeddings well below the prompt length, so that the long
# wavelengths are stretched where the test looks, and head_dim 16 with theta 10^4 puts one
# pair below high_freq_wavelen (kept), two between (blended) and five above (divided by 8).
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
THETA = 10000.0
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d", "1 2", "12 3"]
NEW_TOKENS = 16


@pytest.fixture(scope="module", autouse=True)
def _kernels_from_the_machine_cache() -> None:
    # Load the C kernels (built once per machine) before private_model_cache points the
    # cache folder at a fresh one, where they would be compiled again on every run.
    cpu_kernels.kernel_library()


def _vocab() -> tuple[list[str], list[int]]:
    """A byte-level BPE vocabulary in llama.cpp's spelling: 256 bytes, a few merges, and the
    Llama 3 special tokens (marked control, as the converter marks added special tokens)."""
    byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
    merged = ["".join(m.split(" ")) for m in MERGES]
    tokens = byte_tokens + merged + SPECIALS
    types = [1] * (len(byte_tokens) + len(merged)) + [3] * len(SPECIALS)
    return tokens, types


TOKENS, TOKEN_TYPES = _vocab()
BOS, END_OF_TEXT, EOM, EOT = (TOKENS.index(t) for t in (
    "<|begin_of_text|>", "<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"))


def _hf_model(tied: bool) -> Any:
    torch.manual_seed(2024 + tied)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=len(TOKENS),
                      max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=THETA,
                      rope_scaling=dict(ROPE), tie_word_embeddings=tied,
                      bos_token_id=BOS, eos_token_id=EOT)
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    # Larger than the default init, so that greedy choices are decisive.
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    return hf.eval()


def _rope_factors(head_dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """llama.cpp's converter's rope_freqs: per pair, the divisor llama3 scaling applies.

    (The converter reads original_max_position_embeddings at the top level of config.json,
    default 8192; Llama 3.1/3.2 keep 8192 inside rope_scaling, so the two agree on real
    checkpoints. The tiny model uses 64, so it is passed from the rope parameters here.)
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old_ctx = rope["original_max_position_embeddings"]
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's Q/K row order: each head's two rotary halves interleaved pair by pair."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    return f"blk.{parts[2]}.{_LAYER_NAMES['.'.join(parts[3:-1])]}.{parts[-1]}"


def _write_gguf(hf: Any, path: Path, rope_freqs: np.ndarray | None = None) -> None:
    cfg = hf.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = cfg.hidden_size // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    # An instruct conversion: eos is <|eot_id|>, and no eot/eom ids are written.
    w.add_eos_token_id(EOT)
    w.add_add_bos_token(True)
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied models (Llama 3.2 1B/3B)
        arr = t.detach().float().numpy()
        if ".q_proj." in name:
            arr = _permute(arr, heads)
        elif ".k_proj." in name:
            arr = _permute(arr, kv_heads)
        w.add_tensor(_gguf_name(name), np.ascontiguousarray(arr))
    factors = _rope_factors(head_dim, THETA, ROPE) if rope_freqs is None else rope_freqs
    w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    # Full recompute each step: no cache logic between us and the oracle.
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def _prompt() -> list[int]:
    # Longer than original_max_position_embeddings (64): positions where llama3 scaling bites.
    g = torch.Generator().manual_seed(7)
    return [BOS] + torch.randint(0, len(TOKENS) - len(SPECIALS), (79,), generator=g).tolist()


@pytest.mark.usefixtures("private_model_cache")
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_llama3_gguf_greedy_matches_transformers(tied: bool, tmp_path: Path) -> None:
    hf = _hf_model(tied)
    path = tmp_path / "llama3.gguf"
    _write_gguf(hf, path)
    prompt = _prompt()

    source = resolve_model(str(path))
    config = load_model_config(source)
    assert config.architecture == "LlamaForCausalLM"
    assert config.tie_word_embeddings == tied
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.bos_token_id == BOS
    # eos first, then the other Llama 3 stops found by their text, as HF's generation_config
    # ([128001, 128008, 128009]) and llama.cpp stop on all three.
    assert config.eos_token_ids[0] == EOT
    assert sorted(config.eos_token_ids) == sorted([EOT, END_OF_TEXT, EOM])
    factors = config.rope_scaling["freq_factors"]
    assert factors == _rope_factors(16, THETA, ROPE).tolist()
    assert {1.0, 8.0} < set(factors) and len(set(factors)) == 4  # kept, blended x2, stretched

    ours = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", prompt)])[0]
        ref = _hf_logits(hf, prompt)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        expected = _hf_greedy(hf, prompt, NEW_TOKENS)
        assert PagedDriver(ours, seed=5).greedy("a", prompt, NEW_TOKENS) == expected

        # A second start reads config and weights from the cache: the same numbers.
        cached = load_model_config(source)
        assert cached == config
        again = load_model(source, cached, torch.float32, CPU)
        assert torch.equal(PagedDriver(again).step([("a", prompt)])[0], got)


def test_llama3_scaling_is_what_the_test_sees() -> None:
    """Without the factors the same weights give clearly different logits: the greedy test
    above would catch a reader that dropped or inverted them."""
    hf = _hf_model(False)
    plain = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**hf.config.to_dict(), "rope_parameters": {"rope_type": "default",
                                                                  "rope_theta": THETA}}),
        dtype=torch.float32).eval()
    plain.load_state_dict(hf.state_dict())
    prompt = _prompt()
    assert (_hf_logits(plain, prompt) - _hf_logits(hf, prompt)).abs().max() > 0.1


@pytest.mark.usefixtures("private_model_cache")
def test_llama3_gguf_tokenizer(tmp_path: Path) -> None:
    """The llama-bpe pre-tokenizer (Llama 3's split) and whole special tokens."""
    path = tmp_path / "llama3.gguf"
    _write_gguf(_hf_model(True), path)
    tok = load_tokenizer(resolve_model(str(path)))
    # Llama 3 splits digits in runs of at most three, unlike GPT-2.
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12345 and")]
    assert pieces == ["123", "45", "Ġand"]
    ids = tok.encode("<|begin_of_text|>the 123<|eot_id|>", add_special_tokens=False)
    assert ids[0] == BOS and ids[-1] == EOT
    assert TOKENS.index("Ġand") in tok.encode(" and", add_special_tokens=False)
    assert tok.decode(tok.encode("x and the 12345!", add_special_tokens=False)) == (
        "x and the 12345!")


@pytest.mark.usefixtures("private_model_cache")
def test_rope_freqs_of_the_wrong_length_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "bad.gguf"
    _write_gguf(_hf_model(True), path, rope_freqs=np.ones(5, dtype=np.float32))
    with pytest.raises(ModelLoadError, match="freq_factors has 5 entries"):
        load_model_config(resolve_model(str(path)))
