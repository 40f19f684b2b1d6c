"""A tiny random Llama with a word-level tokenizer ("w0z".."w{V-1}z"), written as an HF folder."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast


def write_tiny_llama(folder: Path, vocab: int = 320, eos: int = 2, seed: int = 4321,
                     num_layers: int = 2) -> Any:
    """Write the model and tokenizer to ``folder``; return transformers' model (eval mode).

    Weights are larger than the default init, so that greedy choices are decisive.
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                      max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1,
                      eos_token_id=eos, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    hf.eval()
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, vocab, eos)
    return hf


def write_word_tokenizer(folder: Path, vocab: int, eos: int) -> None:
    """A word-level tokenizer "w0z".."w{vocab-1}z" (bos w1z, eos w{eos}z) into ``folder``."""
    tk = Tokenizer(models.WordLevel({f"w{i}z": i for i in range(vocab)}, unk_token="w0z"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="w0z", bos_token="w1z",
                            eos_token=f"w{eos}z").save_pretrained(folder)
    # Otherwise AutoTokenizer picks the Llama tokenizer class, which re-normalises words.
    cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(tok_cfg))


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """``n`` greedy tokens from a transformers model, recomputing the whole sequence each
    step (no cache: the oracle stays as plain as it can be)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]
