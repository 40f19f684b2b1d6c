"""The GGUF parse cache and the on-disk model cache, on a tiny GGUF written here."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file

import forerun.model.gguf_file as gguf_file
import forerun.model.loader as loader
from forerun.model.cache import CACHE_ENV, GGUFCacheEntry, cache_root
from forerun.model.loader import load_model, load_model_config, load_tokenizer, resolve_model
from tests.paged_driver import PagedDriver

CPU = torch.device("cpu")
HIDDEN, FFN, LAYERS, HEADS, KV_HEADS = 32, 64, 2, 4, 2
PROMPT = [2, 9, 30, 4, 17, 11, 28]
CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"


def _vocab() -> tuple[list[str], list[str]]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + ["\u0120"]  # Ġ = space
    merges = ["h e", "l l", "he ll", "hell o", "\u0120 w"]
    return ["<s>", "</s>", *letters, "he", "ll", "hell", "hello", "\u0120w"], merges


def _write_tiny_gguf(path: Path, seed: int = 0) -> None:
    """A 2-layer llama GGUF with random float32 weights and a small BPE vocabulary."""
    import gguf

    tokens, merges = _vocab()
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(128)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template(CHAT_TEMPLATE)
    head_dim = HIDDEN // HEADS

    def rand(*shape: int) -> np.ndarray:
        return (0.2 * rng.standard_normal(shape)).astype(np.float32)

    w.add_tensor("token_embd.weight", rand(len(tokens), HIDDEN))
    w.add_tensor("output_norm.weight", 1 + rand(HIDDEN))
    w.add_tensor("output.weight", rand(len(tokens), HIDDEN))
    for i in range(LAYERS):
        b = f"blk.{i}"
        w.add_tensor(f"{b}.attn_norm.weight", 1 + rand(HIDDEN))
        w.add_tensor(f"{b}.ffn_norm.weight", 1 + rand(HIDDEN))
        w.add_tensor(f"{b}.attn_q.weight", rand(HIDDEN, HIDDEN))
        w.add_tensor(f"{b}.attn_k.weight", rand(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(f"{b}.attn_v.weight", rand(KV_HEADS * head_dim, HIDDEN))
        w.add_tensor(f"{b}.attn_output.weight", rand(HIDDEN, HIDDEN))
        w.add_tensor(f"{b}.ffn_gate.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"{b}.ffn_up.weight", rand(FFN, HIDDEN))
        w.add_tensor(f"{b}.ffn_down.weight", rand(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def gguf_path(tmp_path: Path) -> Path:
    path = tmp_path / "model" / "tiny.gguf"
    path.parent.mkdir()
    _write_tiny_gguf(path)
    return path


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(folder))
    return folder


def _load_all(path: Path, dtype: torch.dtype) -> dict[str, Any]:
    source = resolve_model(str(path))
    config = load_model_config(source)
    model = load_model(source, config, dtype, CPU)
    tok = load_tokenizer(source)
    with torch.inference_mode():
        logits = PagedDriver(model).step([("a", PROMPT)])[0]
    return {
        "config": config,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "logits": logits,
        "ids": tok("hello world hell")["input_ids"],
        "chat": tok.apply_chat_template(
            [{"role": "user", "content": "hello"}], tokenize=False),
        "special": (tok.bos_token, tok.eos_token),
    }


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["config"] == b["config"]
    assert a["params"].keys() == b["params"].keys()
    for name, t in a["params"].items():
        assert torch.equal(t, b["params"][name]), name
    assert torch.equal(a["logits"], b["logits"])
    assert a["ids"] == b["ids"]
    assert a["chat"] == b["chat"]
    assert a["special"] == b["special"]


def _forbid_gguf(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any read of the GGUF itself fail, so a test proves the cache served everything."""
    def boom(*_: Any, **__: Any) -> Any:
        raise AssertionError("the GGUF file was read despite a warm cache")

    monkeypatch.setattr(gguf_file, "GGUFReader", boom)
    monkeypatch.setattr(loader, "open_gguf", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        _only_folder(transformers.AutoTokenizer.from_pretrained))


def _only_folder(real: Any) -> Any:
    def from_pretrained(*args: Any, **kwargs: Any) -> Any:
        if "gguf_file" in kwargs:
            raise AssertionError("the tokenizer was converted from the GGUF again")
        return real(*args, **kwargs)
    return from_pretrained


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cached_load_is_identical(gguf_path: Path, cache_dir: Path, dtype: torch.dtype,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    uncached = _load_all(gguf_path, dtype)
    monkeypatch.setenv(CACHE_ENV, str(cache_dir))
    cold = _load_all(gguf_path, dtype)
    entry = GGUFCacheEntry.for_source(resolve_model(str(gguf_path)))
    assert entry is not None
    assert entry.config_path.is_file() and entry.tokenizer_dir.is_dir()
    stored = load_file(entry.weights_path(dtype))
    assert {t.dtype for t in stored.values()} == {dtype}
    _assert_same(uncached, cold)
    with monkeypatch.context() as m:
        _forbid_gguf(m)
        warm = _load_all(gguf_path, dtype)
    _assert_same(uncached, warm)


def test_corrupt_entry_is_ignored_and_rebuilt(gguf_path: Path, cache_dir: Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture) -> None:
    reference = _load_all(gguf_path, torch.float32)
    entry = GGUFCacheEntry.for_source(resolve_model(str(gguf_path)))
    assert entry is not None
    weights = entry.weights_path(torch.float32)
    good_size = weights.stat().st_size
    # Truncated weights, garbage config, garbage tokenizer.
    with weights.open("r+b") as f:
        f.truncate(good_size // 2)
    entry.config_path.write_text("{not json")
    (entry.tokenizer_dir / "tokenizer.json").write_text("\x00garbage")
    with caplog.at_level(logging.INFO, logger="forerun.model.cache"):
        again = _load_all(gguf_path, torch.float32)
    _assert_same(reference, again)
    ignored = [r for r in caplog.records if "ignoring unreadable cached" in r.message]
    assert {r.levelno for r in ignored} == {logging.INFO}
    assert len(ignored) == 3
    # Rebuilt: the next load is served from the cache alone.
    assert weights.stat().st_size == good_size
    with monkeypatch.context() as m:
        _forbid_gguf(m)
        _assert_same(reference, _load_all(gguf_path, torch.float32))


def test_weights_of_another_shape_are_ignored(gguf_path: Path, cache_dir: Path) -> None:
    reference = _load_all(gguf_path, torch.float32)
    entry = GGUFCacheEntry.for_source(resolve_model(str(gguf_path)))
    assert entry is not None
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.ones(3)}, entry.weights_path(torch.float32))
    _assert_same(reference, _load_all(gguf_path, torch.float32))
    assert "model.embed_tokens.weight" in load_file(entry.weights_path(torch.float32))


@pytest.mark.parametrize("value", ["", "off", "OFF"])
def test_disabling(gguf_path: Path, tmp_path: Path, value: str,
                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv(CACHE_ENV, value)
    assert cache_root() is None
    assert GGUFCacheEntry.for_source(resolve_model(str(gguf_path))) is None
    _load_all(gguf_path, torch.float32)
    assert not (tmp_path / "home").exists()


def test_default_location(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "forerun"


def test_unwritable_cache_still_loads(gguf_path: Path, tmp_path: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))  # a folder under a file
    result = _load_all(gguf_path, torch.float32)
    assert result["ids"]


def test_changed_file_gets_a_new_entry_and_a_new_parse(gguf_path: Path, cache_dir: Path) -> None:
    first = _load_all(gguf_path, torch.float32)
    source = resolve_model(str(gguf_path))
    entry = GGUFCacheEntry.for_source(source)
    assert gguf_file.open_gguf(gguf_path) is gguf_file.open_gguf(gguf_path)
    reader = gguf_file.open_gguf(gguf_path)
    st = gguf_path.stat()
    _write_tiny_gguf(gguf_path, seed=1)
    os.utime(gguf_path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second_entry = GGUFCacheEntry.for_source(source)
    assert entry is not None and second_entry is not None
    assert second_entry.folder != entry.folder
    assert gguf_file.open_gguf(gguf_path) is not reader
    second = _load_all(gguf_path, torch.float32)
    assert not torch.equal(first["logits"], second["logits"])


def test_config_and_weights_parse_the_gguf_once(gguf_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, "off")
    with gguf_file._READERS_LOCK:  # forget every parsed file: the next open parses again
        gguf_file._READERS.clear()
    real = gguf_file.GGUFReader
    calls: list[Path] = []

    def counting(path: Path) -> Any:
        calls.append(path)
        return real(path)

    monkeypatch.setattr(gguf_file, "GGUFReader", counting)
    source = resolve_model(str(gguf_path))
    load_model(source, load_model_config(source), torch.float32, CPU)
    assert len(calls) == 1
