"""Reading a GGUF file: hyper-parameters as a Hugging Face style config, and named weights."""

from __future__ import annotations

import logging
import mmap
import re
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from forerun.model.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",  # MixtralForCausalLM where the file has experts
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
}
# Architectures whose converter (llama.cpp's LlamaModel) interleaves Q/K rows.
_PERMUTED_ARCHS = frozenset({"llama", "granite", "smollm3"})
_GEMMA = ("gemma2", "gemma3")

_GLOBAL_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

_BLOCK_NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # Mixture of experts: the router, and every expert's projections stacked [E, out, in].
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    # Phi-3's fused q/k/v; OLMo 2's norms after the attention and MLP blocks.
    "attn_qkv": "self_attn.qkv_proj",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # gpt-oss's per-head attention sinks (the model drops the suffix llama.cpp adds).
    "attn_sinks": "self_attn.sinks",
}
# Per architecture, block tensors whose Hugging Face name differs from _BLOCK_NAMES': Phi-3's
# ffn_up holds gate and up rows (gate first), as its checkpoints' gate_up_proj.
# Gemma's sandwich norms: llama.cpp names the MLP input norm ffn_norm there too (HF
# pre_feedforward_layernorm), the attention output's post_attention_norm.
_GEMMA_NAMES = {"ffn_norm": "pre_feedforward_layernorm"}
_ARCH_BLOCK_NAMES: dict[str, dict[str, str]] = {"phi3": {"ffn_up": "mlp.gate_up_proj"},
                                                "gemma2": _GEMMA_NAMES, "gemma3": _GEMMA_NAMES}


_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

# Tensors that are hyper-parameters rather than weights: gguf_hf_config reads them.
_ROPE_FREQS = "rope_freqs.weight"
# LongRoPE's two factor sets (Phi-3 128k files).
_ROPE_LONG, _ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
_CONFIG_TENSORS = frozenset({_ROPE_FREQS, _ROPE_LONG, _ROPE_SHORT})

# The Llama 3 family's end-of-generation tokens. Its GGUFs name one of them as eos (and
# rarely an eot or eom id) while the Hugging Face folder's generation_config stops on all
# three and llama.cpp recognises them by their text; matching the text (control tokens only)
# gives a GGUF the same stops.
_LLAMA3_STOP_TEXTS = frozenset({"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"})
# The same for the other families whose chat turns end on a token other than eos: Phi-3's
# generation_config stops on <|end|> and <|endoftext|>, SmolLM3's on <|im_end|>, Gemma's on
# <end_of_turn>.
_STOP_TEXTS: dict[str, frozenset[str]] = {
    "llama": _LLAMA3_STOP_TEXTS,
    "phi3": frozenset({"<|end|>", "<|endoftext|>"}),
    "smollm3": frozenset({"<|im_end|>", "<|end_of_text|>"}),
    "gemma2": frozenset({"<end_of_turn>"}),
    "gemma3": frozenset({"<end_of_turn>"}),
    # gpt-oss (harmony): a turn ends on <|return|> (answered) or <|call|> (a tool call).
    "gpt-oss": frozenset({"<|return|>", "<|call|>", "<|endoftext|>"}),
}
# Control tokens a file may name as eos / eot that are no stop for its family: gpt-oss's
# <|end|> closes one message (the reasoning on the analysis channel) inside a turn, and
# stopping there would cut every answer off after its thinking.
_NOT_STOP_TEXTS: dict[str, frozenset[str]] = {"gpt-oss": frozenset({"<|end|>"})}
_CONTROL_TOKEN = 3  # llama.cpp's token type of special tokens


# Parsed readers by (resolved path, size, mtime): the config, the weights and the chat
# template all come from one parse per process. A reader only holds a memory map, so
# keeping a few is cheap; a changed file gets a new key and is parsed again.
_READERS: OrderedDict[tuple[str, int, int], GGUFReader] = OrderedDict()
_READERS_MAX = 4
_READERS_LOCK = threading.Lock()


def open_gguf(path: Path) -> GGUFReader:
    """Open (or reuse) a parsed GGUF file; parse failures become ``ModelLoadError``."""
    try:
        resolved = Path(path).resolve()
        st = resolved.stat()
    except OSError as exc:
        raise ModelLoadError(f"could not read GGUF file {path}: {exc}") from exc
    key = (str(resolved), st.st_size, st.st_mtime_ns)
    # Held while parsing so that two threads asking for the same file parse it once.
    with _READERS_LOCK:
        reader = _READERS.get(key)
        if reader is not None:
            _READERS.move_to_end(key)
            return reader
        try:
            reader = GGUFReader(resolved)
        except Exception as exc:  # the reader raises assorted errors on truncated/corrupt files
            raise ModelLoadError(f"could not read GGUF file {path}: {exc}") from exc
        _READERS[key] = reader
        while len(_READERS) > _READERS_MAX:
            _READERS.popitem(last=False)
        return reader


_RELEASE_WINDOW = 2 << 20  # see release_gguf_pages


def release_gguf_pages(reader: GGUFReader, start: int = 0, length: int | None = None) -> None:
    """Drop the file's pages (all, or those of bytes ``start .. start + length``) from this
    process's resident memory once its weights have been copied out: the mapping stays (the
    reader still answers), and the pages stay in the page cache, but they no longer count as
    the process's own. Without it a loaded GGUF shows twice in RSS (the blocks the model
    holds, and the mapped file)."""
    mm = getattr(reader.data, "_mmap", None)  # numpy.memmap's mapping
    if mm is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    if length is not None:
        # Out to whole 2 MiB windows: a read fault also maps the cached pages around it
        # (Linux's fault-around, and a large folio whole), which stay resident here until
        # dropped: to the nearest page, SmolLM2's 211 lookups left 11.5 of its 96 MB mapped,
        # to 64 KiB 7.6, to 2 MiB 0.06. A neighbour's page dropped too is read again if
        # needed.
        end = -(-(start + length) // _RELEASE_WINDOW) * _RELEASE_WINDOW
        start -= start % _RELEASE_WINDOW
        length = min(end, len(mm)) - start
    try:
        if length is None:
            mm.madvise(mmap.MADV_DONTNEED)
        elif length > 0:
            mm.madvise(mmap.MADV_DONTNEED, start, length)
    except (OSError, ValueError) as exc:  # a closed mapping; nothing to drop
        logger.debug("madvise on %s: %s", reader.data.filename, exc)


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _architecture(reader: GGUFReader) -> tuple[str, str]:
    arch = _field(reader, "general.architecture")
    hf_arch = GGUF_ARCHITECTURES.get(arch)
    if hf_arch is None:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; supported: "
            + ", ".join(f"{k} ({v})" for k, v in GGUF_ARCHITECTURES.items())
        )
    if arch == "llama" and int(_field(reader, "llama.expert_count", 0) or 0) > 0:
        hf_arch = "MixtralForCausalLM"  # llama.cpp writes Mixtral as llama with experts
    elif arch == "llama" and int(_field(reader, "llama.attention.sliding_window", 0) or 0) > 0:
        hf_arch = "MistralForCausalLM"  # and Mistral as llama (with its window, if any)
    return arch, hf_arch


def _sliding_config(reader: GGUFReader, arch: str, layers: int) -> dict[str, Any]:
    """``sliding_window`` and ``layer_types`` as llama.cpp reads them: the window from
    ``{arch}.attention.sliding_window``; which layers slide from
    ``{arch}.attention.sliding_window_pattern`` (one bool per layer, or a period n: every
    n-th layer global), else the family's period (Gemma 2: 2, Gemma 3: 6, else every
    layer). Gemma 2 files without the key have llama.cpp's default window, 4096."""
    window = _field(reader, f"{arch}.attention.sliding_window")
    if window is None and arch == "gemma2":
        window = 4096
    if not window:
        return {}
    pattern = _field(reader, f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        sliding = [bool(v) for v in pattern][:layers]
    else:
        n = int(pattern) if pattern is not None else {"gemma2": 2, "gemma3": 6,
                                                       "gpt-oss": 2}.get(arch, 0)
        sliding = [n == 0 or i % n < n - 1 for i in range(layers)]
    return {"sliding_window": int(window),
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _gemma_config(reader: GGUFReader, arch: str, hidden: int, heads: int, head_dim: int,
                  layers: int) -> dict[str, Any]:
    """Gemma's attention scale, soft caps and local rope base. The files do not store
    query_pre_attn_scalar; llama.cpp (as Google's code) uses hidden / heads for the 27B
    models (46 layers: Gemma 2; 62: Gemma 3) and head_dim for the others. A Gemma 3's
    sliding layers rotate by ``rope.freq_base_swa`` (llama.cpp's default 10000), unscaled;
    a Gemma 2's share the global base."""
    if arch not in _GEMMA:
        return {}
    big = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // heads if big else head_dim,
        "attn_logit_softcapping": _field(reader, f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": _field(reader, f"{arch}.final_logit_softcapping"),
    }
    if arch == "gemma3":
        out["rope_local_base_freq"] = float(_field(reader, f"{arch}.rope.freq_base_swa",
                                                   10000.0))
    return out


def _moe_config(reader: GGUFReader, arch: str, hf_arch: str) -> dict[str, Any]:
    """The mixture-of-experts keys of the config (none for a dense file). llama.cpp
    renormalises the chosen experts' weights for both MoE architectures forerun reads;
    gpt-oss's experts are intermediate_size wide, its activation's constants llama.cpp's
    (transformers' defaults)."""
    if hf_arch == "GptOssForCausalLM":
        return {"num_local_experts": int(_field(reader, f"{arch}.expert_count")),
                "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count")),
                "intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length",
                                                _field(reader, f"{arch}.feed_forward_length")))}
    if hf_arch not in ("Qwen3MoeForCausalLM", "MixtralForCausalLM"):
        return {}
    ffn = int(_field(reader, f"{arch}.feed_forward_length"))
    names = {t.name for t in reader.tensors}
    layers = int(_field(reader, f"{arch}.block_count"))
    # A layer without a router is dense (llama.cpp's own files have none; this reads any).
    dense = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]
    return {
        "mlp_only_layers": dense,
        "num_experts": int(_field(reader, f"{arch}.expert_count", 0) or 0),
        "num_experts_per_tok": int(_field(reader, f"{arch}.expert_used_count", 0) or 0),
        "moe_intermediate_size": int(_field(reader, f"{arch}.expert_feed_forward_length", ffn)),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
    }


def _rope_freq_factors(reader: GGUFReader) -> list[float] | None:
    """The per-pair rope frequency divisors of ``rope_freqs.weight``, if the file has them.

    llama.cpp's converter writes this tensor for Llama 3.1/3.2 (``rope_type: llama3``)
    instead of the scaling parameters, and llama.cpp divides each pair's angle by it. Using
    the numbers themselves is exact for any file, whatever parameters produced them.
    """
    return _vector_tensor(reader, _ROPE_FREQS)


def _vector_tensor(reader: GGUFReader, name: str) -> list[float] | None:
    """A 1-D tensor's values as floats (None if the file lacks it)."""
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        return None
    try:
        arr = dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float32)
    except Exception as exc:
        raise ModelLoadError(f"could not read tensor {name}: {exc}") from exc
    # float32 -> Python float is exact, and so is the JSON round trip of the config cache.
    return [float(v) for v in arr]


def _stop_token_ids(reader: GGUFReader, arch: str) -> list[int]:
    """eos, then end-of-turn / end-of-message and the family's stop tokens, no repeats."""
    ids = [
        int(v) for v in (_field(reader, "tokenizer.ggml.eos_token_id"),
                         _field(reader, "tokenizer.ggml.eot_token_id"),
                         _field(reader, "tokenizer.ggml.eom_token_id")) if v is not None
    ]
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    stop_texts = _STOP_TEXTS.get(arch, _LLAMA3_STOP_TEXTS)
    not_stops = _NOT_STOP_TEXTS.get(arch, frozenset())
    if (stop_texts and tokens is not None and types is not None
            and len(types.data) == len(tokens.data)):
        kinds = np.array(types.contents())
        # Only control tokens are decoded: a few hundred strings, not the whole vocabulary.
        for i in np.flatnonzero(kinds == _CONTROL_TOKEN):
            text = bytes(tokens.parts[tokens.data[int(i)]]).decode("utf-8", errors="replace")
            if text in stop_texts:
                ids.append(int(i))
            elif text in not_stops:
                ids = [t for t in ids if t != int(i)]
    return list(dict.fromkeys(ids))


def gguf_hf_config(reader: GGUFReader) -> dict[str, Any]:
    """Translate GGUF metadata into a ``config.json``-shaped dict for ``ModelConfig``.

    A ``rope_freqs.weight`` tensor becomes ``rope_scaling["freq_factors"]`` (rotary.py).
    """
    arch, hf_arch = _architecture(reader)
    names = {t.name for t in reader.tensors}

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else key("vocab_size")
    rope_scaling = _rope_scaling(reader, arch)
    head_dim = int(key("attention.key_length", hidden // heads))
    return {
        "architectures": [hf_arch],
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rotary_dim": int(key("rope.dimension_count", head_dim)),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(key("context_length", 2048)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        # Chat models stop on end-of-turn as well as end-of-text.
        "eos_token_id": _stop_token_ids(reader, arch),
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "rope_scaling": rope_scaling,
        **_granite_config(reader, arch),
        **_moe_config(reader, arch, hf_arch),
        **_sliding_config(reader, arch, int(key("block_count"))),
        **_gemma_config(reader, arch, hidden, heads,
                        int(key("attention.key_length", hidden // heads)),
                        int(key("block_count"))),
    }


def _granite_config(reader: GGUFReader, arch: str) -> dict[str, Any]:
    """Granite's multipliers, under llama.cpp's ``*_scale`` names."""
    if arch != "granite":
        return {}
    keys = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
            "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}
    out = {}
    for name, gguf_key in keys.items():
        value = _field(reader, f"{arch}.{gguf_key}")
        if value is not None:
            out[name] = float(value)
    if not out.get("attention_multiplier"):
        # llama.cpp's reading of a missing (or zero) attention.scale: 1 / sqrt(head_dim).
        heads = int(_field(reader, f"{arch}.attention.head_count"))
        head_dim = _field(reader, f"{arch}.attention.key_length") or int(
            _field(reader, f"{arch}.embedding_length")) // heads
        out["attention_multiplier"] = float(head_dim) ** -0.5
    return out


def _rope_scaling(reader: GGUFReader, arch: str) -> dict[str, Any] | None:
    """``rope_scaling`` from the ``{arch}.rope.scaling.*`` keys and the rope tensors:
    linear and yarn from the keys; longrope from ``rope_factors_long/short`` (Phi-3's
    converter writes no type for it); ``rope_freqs`` as ``freq_factors``."""

    def key(name: str) -> Any:
        return _field(reader, f"{arch}.rope.scaling.{name}")

    scaling_type = key("type")
    rope_scaling: dict[str, Any] | None = None
    original = key("original_context_length")
    long, short = _vector_tensor(reader, _ROPE_LONG), _vector_tensor(reader, _ROPE_SHORT)
    if long is not None or short is not None:
        if long is None or short is None:
            raise ModelLoadError(f"GGUF has only one of {_ROPE_LONG} and {_ROPE_SHORT}")
        rope_scaling = {"rope_type": "longrope", "long_factor": long, "short_factor": short,
                        "original_max_position_embeddings": original}
        if key("attn_factor") is not None:
            rope_scaling["attention_factor"] = float(key("attn_factor"))
    elif scaling_type == "yarn":
        rope_scaling = {"rope_type": "yarn", "factor": key("factor"),
                        "original_max_position_embeddings": original}
        for name, gguf_name in (("attention_factor", "yarn_attn_factor"),
                                ("beta_fast", "yarn_beta_fast"),
                                ("beta_slow", "yarn_beta_slow")):
            if key(gguf_name) is not None:
                rope_scaling[name] = float(key(gguf_name))
        if arch == "gpt-oss":
            # transformers' gpt-oss ramps between the unrounded pair bounds (truncate false).
            rope_scaling["truncate"] = False
    elif scaling_type not in (None, "none"):
        rope_scaling = {"rope_type": scaling_type, "factor": key("factor")}
    factors = _rope_freq_factors(reader)
    if factors is not None:
        # With no scaling type in the metadata the factors are the llama3 rescaling itself;
        # with one (linear), llama.cpp applies both, and so does rotary.py.
        rope_scaling = {**(rope_scaling or {"rope_type": "llama3"}), "freq_factors": factors}
    return rope_scaling


def gguf_chat_template(reader: GGUFReader) -> str | None:
    """The Jinja chat template stored in the GGUF metadata, if any."""
    return _field(reader, "tokenizer.chat_template")


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    m = _BLOCK_RE.match(gguf_name)
    if m is None:
        return None
    name = _ARCH_BLOCK_NAMES.get(arch, {}).get(m.group(2)) or _BLOCK_NAMES.get(m.group(2))
    if name is None:
        return None
    return f"model.layers.{m.group(1)}.{name}.{m.group(3)}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleaving so the weights suit ``rotate_half`` rotary."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _unpermute_rows(arr: np.ndarray, name: str, arch: str, heads: int, kv_heads: int
                    ) -> np.ndarray:
    # Only llama-style conversions permute Q/K rows; qwen2/qwen3, phi3 (fused) and olmo2
    # converters keep Hugging Face order.
    if arch in _PERMUTED_ARCHS and ".q_proj." in name:
        return _unpermute(arr, heads)
    if arch in _PERMUTED_ARCHS and ".k_proj." in name:
        return _unpermute(arr, kv_heads)
    return arr


def _head_counts(reader: GGUFReader, arch: str) -> tuple[int, int]:
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    return heads, int(_field(reader, f"{arch}.attention.head_count_kv", heads))


class RawBlocks(Mapping[str, tuple[int, torch.Tensor]]):
    """``hf_name -> (ggml type id, uint8 rows [out, row_bytes] on ``device``)`` for every
    2-D weight of the file stored in one of ``types``: the file's blocks as they are (Q/K
    rows put back in Hugging Face order, whole rows of blocks moving together). A layer's
    stacked experts (3-D) come as every expert's rows one after another.

    Each lookup copies its tensor out of the memory map then and there, and drops the map's
    pages of it from this process (:func:`release_gguf_pages`, for one range): a loader that
    turns the blocks into its own form one module at a time holds about one copy of the
    weights, not the map's, the copies' and its own at once (the 12-layer Qwen3-30B-A3B
    shape in Q4_K_M, a 4.7 GB file, peaked at 14.1 GiB copying all of them first)."""

    def __init__(self, reader: GGUFReader, types: set[int],
                 device: torch.device | None = None) -> None:
        arch, _ = _architecture(reader)
        self._reader = reader
        self._device = device
        self._arch = arch
        self._heads = _head_counts(reader, arch)
        self._tensors: dict[str, Any] = {}
        for t in reader.tensors:
            name = _hf_name(t.name, arch)
            stacked = len(t.shape) == 3 and name is not None and ".experts." in name
            if name is None or int(t.tensor_type) not in types or not (
                    len(t.shape) == 2 or stacked) or not name.endswith(".weight"):
                continue
            self._tensors[name] = t

    def qtype(self, name: str) -> int:
        """The ggml type id of ``name``, without reading its blocks."""
        return int(self._tensors[name].tensor_type)

    def __getitem__(self, name: str) -> tuple[int, torch.Tensor]:
        t = self._tensors[name]
        stacked = len(t.shape) == 3
        rows = int(t.shape[1]) * (int(t.shape[2]) if stacked else 1)
        raw = np.asarray(t.data).reshape(rows, -1)
        raw = _unpermute_rows(raw, name, self._arch, *self._heads)
        out = torch.from_numpy(np.array(raw, dtype=np.uint8, copy=True))
        release_gguf_pages(self._reader, int(t.data_offset), int(t.n_bytes))
        return self.qtype(name), out if self._device is None else out.to(self._device)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def gguf_weights(reader: GGUFReader, path: Path, skip: frozenset[str] = frozenset()
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, float32 tensor)`` for every model tensor, dequantised (except the
    names in ``skip``, which the model holds in another form)."""
    arch, _ = _architecture(reader)
    heads, kv_heads = _head_counts(reader, arch)
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS:
            continue
        name = _hf_name(t.name, arch)
        if name is None:
            logger.warning("ignoring unknown GGUF tensor %s", t.name)
            continue
        if name in skip:
            continue
        try:
            arr = dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        except Exception as exc:
            raise ModelLoadError(
                f"could not read tensor {t.name} from GGUF file {path}: {exc}"
            ) from exc
        arr = _unpermute_rows(arr, name, arch, heads, kv_heads)
        if arch in _GEMMA and name.endswith("norm.weight"):
            # llama.cpp's converter stores Gemma's norms as 1 + w; yield Hugging Face's w
            # (the model adds the 1 back, in float32).
            arr = arr.astype(np.float64) - 1.0
        yield name, torch.from_numpy(np.array(arr, dtype=np.float32, copy=True))
