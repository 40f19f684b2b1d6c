"""quantization="gguf" and "int8" end to end: the engine on tiny random GGUFs (each block
type, every CPU path) and on SmolLM2, where the teacher-forced negative log-likelihood of a
fixed public-domain text (via prompt_logprobs) must stay near the exact engine's, and the
async engine must produce the synchronous one's tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf import GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

from forerun import LLM, SamplingParams
from forerun.model import cpu_kernels
from forerun.model.errors import ModelLoadError
from forerun.model.gguf_file import RawBlocks, open_gguf, release_gguf_pages
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.quant.gguf_linear import KQUANT_TYPES, SUPPORTED_TYPES, GGUFEmbedding, GGUFLinear
from forerun.model.quant.int8_linear import Int8Linear
from tests.conftest import SMOLLM2_GGUF, mapped_rss_kib, smollm2_dir
from tests.kquant_pack import pack_blocks, pack_kquant
from tests.paged_driver import PagedDriver

CPU = torch.device("cpu")
# Lincoln's Gettysburg Address (1863), public domain.
TEXT = (
    "Four score and seven years ago our fathers brought forth on this continent, a new "
    "nation, conceived in Liberty, and dedicated to the proposition that all men are created "
    "equal. Now we are engaged in a great civil war, testing whether that nation, or any "
    "nation so conceived and so dedicated, can long endure. We are met on a great "
    "battle-field of that war. We have come to dedicate a portion of that field, as a final "
    "resting place for those who here gave their lives that that nation might live. It is "
    "altogether fitting and proper that we should do this. But, in a larger sense, we can "
    "not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave "
    "men, living and dead, who struggled here, have consecrated it, far above our poor power "
    "to add or detract."
)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a small"]


def requantize_gguf(src: Path, dst: Path, qtype: GT) -> Path:
    """A copy of ``src`` with every quantized tensor re-quantized to ``qtype`` (from its
    dequantized values) and all metadata kept."""
    reader = open_gguf(src)  # parsed once per process: the 49k-token vocabulary takes seconds
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        if t.tensor_type in (GT.F32, GT.F16):
            writer.add_tensor(t.name, np.asarray(t.data).reshape(shape).copy())
            continue
        arr = dequantize(t.data, t.tensor_type).reshape(shape)
        q = quantize(arr, qtype)
        writer.add_tensor(t.name, q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


WIDE = 768  # SmolLM2's hidden size 576 padded to whole K-quant super-blocks


def widen_smollm2(src: Path, dst: Path, qtype_of: dict[str, GT], default: GT) -> Path:
    """SmolLM2 with its hidden size padded from 576 to 768 so that every weight row is whole
    256-value super-blocks, written in K-quants (``qtype_of[suffix]``, else ``default``):
    the same function, since the padding is zeros that stay zero.

    The residual stream gets 192 zero columns (embedding, o_proj/down_proj rows), the
    attention 3 zero query heads and 1 zero KV head (12 and 4: head h still reads KV head
    h // 3), whose outputs are zero; RMSNorm then averages over 768 values of which 192 are
    zero, so its weights are scaled by sqrt(576/768) and its eps by 576/768 to compute the
    same values."""
    reader = open_gguf(src)
    old, heads, kv, hd = 576, 12, 4, 64
    ratio = old / WIDE
    override = {"llama.embedding_length": WIDE, "llama.attention.head_count": heads,
                "llama.attention.head_count_kv": kv}
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        value = override.get(field.name, field.contents())
        if field.name == "llama.attention.layer_norm_rms_epsilon":
            value = value * ratio
        writer.add_key_value(field.name, value, vtype, sub_type=sub)
    for t in reader.tensors:
        shape = tuple(reversed(t.shape.tolist()))
        arr = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
        if arr.ndim == 1:  # a norm over the hidden size
            out = np.zeros(WIDE, np.float32)
            out[:old] = arr * np.float32(np.sqrt(ratio))
            writer.add_tensor(t.name, out)
            continue
        rows = {"attn_q.weight": heads * hd, "attn_k.weight": kv * hd, "attn_v.weight": kv * hd,
                "attn_output.weight": WIDE, "ffn_down.weight": WIDE}
        n = next((r for suffix, r in rows.items() if t.name.endswith(suffix)), shape[0])
        k = shape[1] if shape[1] == 1536 else WIDE  # every input but down_proj's is hidden
        out = np.zeros((n, k), np.float32)
        out[:shape[0], :shape[1]] = arr  # whole heads appended: the Q/K row order holds
        qtype = next((q for suffix, q in qtype_of.items() if t.name.endswith(suffix)), default)
        raw = pack_kquant(out, qtype)
        writer.add_tensor(t.name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


# ---- tiny random models -------------------------------------------------------------------
def _write_tiny_gguf(path: Path, qtype: GT, tied: bool, seed: int, hidden: int = 64,
                     inter: int = 96, types: dict[str, GT] | None = None,
                     std: float = 0.15) -> None:
    """A random llama with hidden 64 (or ``hidden``) written with its 2-D weights (normal,
    ``std``) in ``qtype``, or in ``types[suffix]`` for tensor names ending in a suffix given
    there."""
    rng = np.random.default_rng(seed)
    layers, heads, kv, vocab = 2, 4, 2, 256
    w = GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list([f"t{i}" for i in range(vocab)])
    w.add_eos_token_id(3)

    def mat(name: str, n: int, k: int) -> None:
        arr = (std * rng.standard_normal((n, k))).astype(np.float32)
        t = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), qtype)
        if t == GT.F32:
            w.add_tensor(name, arr)
            return
        q = pack_blocks(arr, t)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.2 * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    if not tied:
        mat("output.weight", vocab, hidden)
    hd = hidden // heads
    for i in range(layers):
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
        mat(f"blk.{i}.attn_q.weight", heads * hd, hidden)
        mat(f"blk.{i}.attn_k.weight", kv * hd, hidden)
        mat(f"blk.{i}.attn_v.weight", kv * hd, hidden)
        mat(f"blk.{i}.attn_output.weight", hidden, heads * hd)
        mat(f"blk.{i}.ffn_gate.weight", inter, hidden)
        mat(f"blk.{i}.ffn_up.weight", inter, hidden)
        mat(f"blk.{i}.ffn_down.weight", hidden, inter)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.usefixtures("private_model_cache")
@pytest.mark.parametrize("qtype", [GT.Q8_0, GT.Q4_0, GT.Q4_1, GT.Q5_0, GT.Q5_1, GT.IQ4_NL],
                         ids=lambda t: t.name)
@pytest.mark.parametrize("path", ["small-batch", "op-by-op", "torch"])
def test_tiny_gguf_model_computes_with_its_blocks(tmp_path: Path, monkeypatch, qtype: GT,
                                                  path: str) -> None:
    file = tmp_path / "tiny.gguf"
    # Q5_1's own id, 7, as seed puts one activation of the last decode step on an 8-bit
    # rounding boundary: C and torch differ by 4.4e-3 of the logits there, 1e-7 on every
    # other row (and on every row of seeds 5-11 but 7).
    seed = 8 if qtype == GT.Q5_1 else int(qtype)
    _write_tiny_gguf(file, qtype, tied=qtype != GT.Q4_0, seed=seed)
    source = resolve_model(str(file))
    config = load_model_config(source)
    exact = load_model(source, config, torch.float32, CPU)
    if path == "op-by-op":
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    ours = load_model(source, config, torch.float32, CPU, quantization="gguf")
    layer = ours.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, GGUFLinear)
    assert isinstance(layer.mlp.down_proj, GGUFLinear)
    assert isinstance(ours.model.embed_tokens, GGUFEmbedding)
    assert ours.quant_head is not None
    # The blocks are held once, never dequantized: far below the float32 model.
    assert ours.resident_weight_bytes < exact.resident_weight_bytes / 3
    def logits(model: torch.nn.Module) -> torch.Tensor:
        prompt = [5, 17, 250, 3, 99, 42, 7, 200, 12, 64, 1]
        with torch.inference_mode():
            d = PagedDriver(model)
            out = [d.step([("a", prompt)])[0]]
            # Then single-token decode steps (the small-batch path when it is on).
            out += [d.step([("a", [tok])])[0] for tok in (9, 31, 77)]
        return torch.cat(out)

    want = logits(exact)
    with monkeypatch.context() as mp:  # the pure-torch function, as reference
        mp.setattr(cpu_kernels, "supports", lambda *a: False)
        ref = logits(ours)
    got = ref if path == "torch" else logits(ours)
    scale = want.abs().max()
    # Same weights; only the 8-bit activation blocks differ from the exact path...
    assert (got - want).abs().max() < 0.05 * scale
    # ...and every path computes the same function as the torch one, up to one activation
    # rounded to the next 8-bit level: the element-wise ops' 1e-7 differences can carry a
    # value across a rounding boundary (an AMX Xeon, Q8_0: layer 1's down_proj input on the
    # first prompt row, 2.6e-3 of the logits; every other row 1e-6).
    assert (got - ref).abs().max() < 4e-3 * scale


def _paged_logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits of a prefill and three single-token decode steps."""
    prompt = [5, 17, 250, 3, 99, 42, 7, 200, 12, 64, 1]
    with torch.inference_mode():
        d = PagedDriver(model)
        out = [d.step([("a", prompt)])[0]]
        out += [d.step([("a", [tok])])[0] for tok in (9, 31, 77)]
    return torch.cat(out)


# Q4_K_M's recipe in small: attention values and MLP down projections in Q6_K, the rest Q4_K.
_Q4_K_M = {"attn_v.weight": GT.Q6_K, "ffn_down.weight": GT.Q6_K}


@pytest.mark.usefixtures("private_model_cache")
@pytest.mark.parametrize("mix", ["Q4_K", "Q6_K", "Q5_K", "Q3_K", "Q2_K", "IQ4_XS", "Q4_K_M",
                                 "Q4_K+Q8_0"])
@pytest.mark.parametrize("path", ["kernels", "torch"])
def test_tiny_kquant_model_computes_with_its_blocks(tmp_path: Path, monkeypatch, mix: str,
                                                    path: str) -> None:
    """Hidden 256 (whole super-blocks), every 2-D weight in K-quants (or mixed with Q8_0 in
    the same fused projections): all held in their blocks, logits those of the exact path
    up to the activation quantization, and every path the torch function."""
    types = {"Q4_K_M": _Q4_K_M, "Q4_K+Q8_0": {"attn_k.weight": GT.Q8_0,
                                              "ffn_up.weight": GT.Q8_0}}.get(mix, {})
    base = GT.Q4_K if mix in ("Q4_K_M", "Q4_K+Q8_0") else GT[mix]
    file = tmp_path / "tiny-k.gguf"
    # std 0.075: a gain per matmul (std * sqrt(256)) of 1.2, as the hidden-64 model's; a
    # random model of larger gain amplifies any rounding layer by layer.
    _write_tiny_gguf(file, base, tied=mix != "Q6_K", seed=len(mix), hidden=256, inter=512,
                     types=types, std=0.075)
    source = resolve_model(str(file))
    config = load_model_config(source)
    exact = load_model(source, config, torch.float32, CPU)
    ours = load_model(source, config, torch.float32, CPU, quantization="gguf")
    for layer in ours.model.layers:
        for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                    layer.mlp.down_proj):
            assert isinstance(lin, GGUFLinear)
            assert any(t in KQUANT_TYPES for t, _, _ in lin.tiles)
    assert isinstance(ours.model.embed_tokens, GGUFEmbedding)
    assert ours.quant_head is not None
    assert ours.resident_weight_bytes < exact.resident_weight_bytes / 3
    # Decode steps run in the one-call decoder stack, with the same GGUF matmul.
    assert ours.small_batch.can_run(torch.float32)
    want = _paged_logits(exact)
    scale = want.abs().max()
    if path == "torch":  # everything in torch
        with monkeypatch.context() as mp:
            mp.setattr(cpu_kernels, "supports", lambda *a: False)
            got = _paged_logits(ours)
        assert (got - want).abs().max() < 0.05 * scale
        return
    got = _paged_logits(ours)
    assert (got - want).abs().max() < 0.05 * scale
    # The reference: the same model with only the quantized linears in torch (so op by op:
    # the decoder stack runs the C kernels). Per linear the
    # kernels match torch to float rounding (tests/test_kquant_kernels.py, 2e-4 of the scale
    # at most); through the model a last-bit difference now and then moves an activation
    # across an 8-bit rounding boundary, and the step it takes grows layer by layer and,
    # through the KV cache, token by token (measured: up to 1.2% of the scale where one did,
    # against 4-6% for the activation quantization itself).
    with monkeypatch.context() as mp:
        mp.setattr(GGUFLinear, "forward", GGUFLinear.forward_torch)
        mp.setattr(ours.small_batch, "available", False)
        ref = _paged_logits(ours)
    assert (got - ref).abs().max() < 0.02 * scale


@pytest.mark.usefixtures("private_model_cache")
def test_types_not_run_natively_load_dequantized_and_are_logged(tmp_path: Path, caplog
                                                                 ) -> None:
    """A TQ2_0 up projection (no kernel here) takes its fused gate/up partner (Q4_K) with it
    into the dequantized path; the log names both types."""
    file = tmp_path / "tiny-tq20.gguf"
    _write_tiny_gguf(file, GT.Q4_K, tied=True, seed=3, hidden=256, inter=512,
                     types={"ffn_up.weight": GT.TQ2_0})
    source = resolve_model(str(file))
    with caplog.at_level(logging.INFO, logger="forerun.model.loader"):
        model = load_model(source, load_model_config(source), torch.float32, CPU,
                           quantization="gguf")
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, GGUFLinear)
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, torch.nn.Linear)
    lines = [r.message for r in caplog.records if "loaded dequantized" in r.message]
    assert lines and "Q4_K x 2" in lines[0] and "TQ2_0 x 2" in lines[0], lines


@pytest.mark.usefixtures("private_model_cache")
def test_blocks_are_copied_out_of_the_mapping_one_lookup_at_a_time() -> None:
    """quantization="gguf" reads the file through RawBlocks: a lookup copies that tensor's
    blocks out of the mapping and drops the mapping's pages of it then, so a loader that
    turns blocks into its own form one module at a time never holds the mapped file and
    every copy at once (measured on this reader's mapping: other tests' readers map the same
    file). The copies are the file's bytes."""
    path = smollm2_dir() / SMOLLM2_GGUF
    reader = open_gguf(path)
    blocks = RawBlocks(reader, set(SUPPORTED_TYPES))
    assert "model.layers.0.mlp.down_proj.weight" in blocks
    assert "model.norm.weight" not in blocks  # float32, and 1-D
    release_gguf_pages(reader)
    copies = {name: blocks[name] for name in blocks}
    looked_up = sum(raw.numel() for _, raw in copies.values())
    assert looked_up > 0.5 * path.stat().st_size  # every linear and the embedding
    mapping = (reader.data.ctypes.data, reader.data.ctypes.data + reader.data.nbytes)
    assert mapped_rss_kib(path, mapping) * 1024 < 0.05 * looked_up
    by_name = {t.name: t for t in reader.tensors}
    for gguf_name, name in (("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                            ("token_embd.weight", "model.embed_tokens.weight")):
        t = by_name[gguf_name]
        qtype, raw = copies[name]
        assert qtype == int(t.tensor_type)
        assert np.array_equal(raw.numpy(), np.asarray(t.data).reshape(raw.shape))


def test_gguf_quantization_needs_quantized_linears(tmp_path: Path) -> None:
    file = tmp_path / "f32.gguf"
    _write_tiny_gguf(file, GT.F32, tied=True, seed=1)
    source = resolve_model(str(file))
    with pytest.raises(ModelLoadError,
                       match="quantization='gguf'.*Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL or MXFP4"):
        load_model(source, load_model_config(source), torch.float32, CPU,
                   quantization="gguf")


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    hf = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128))
    hf.save_pretrained(tmp_path)
    source = resolve_model(str(tmp_path))
    config = load_model_config(source)
    with pytest.raises(ModelLoadError, match="quantization='gguf'"):
        load_model(source, config, torch.float32, CPU, quantization="gguf")
    with pytest.raises(ValueError, match="quantization"):
        load_model(source, config, torch.float32, CPU, quantization="awq")
    # int8 works from a Hugging Face folder as well.
    model = load_model(source, config, torch.float32, CPU, quantization="int8")
    assert isinstance(model.model.layers[0].mlp.gate_up_proj, Int8Linear)
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, torch.nn.Linear)


# ---- SmolLM2 ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_files(tmp_path_factory: pytest.TempPathFactory):
    """The shipped Q4_1 file and Q8_0 and Q5_0 re-quantizations of it; the model cache is off
    meanwhile, so the throw-away files leave nothing in ~/.cache/forerun."""
    src = smollm2_dir() / SMOLLM2_GGUF
    out = tmp_path_factory.mktemp("requantized")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORERUN_CACHE_DIR", "off")
        yield {"Q4_1": src,
               "Q8_0": requantize_gguf(src, out / "smollm2.Q8_0.gguf", GT.Q8_0),
               "Q5_0": requantize_gguf(src, out / "smollm2.Q5_0.gguf", GT.Q5_0)}


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(smollm2_tokenizer, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model's tokenizer as a folder: every file below has SmolLM2's vocabulary,
    and converting it from each GGUF again (``tokenizer=`` spares it) costs ~10 s a file."""
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    smollm2_tokenizer.save_pretrained(folder)
    return folder


_TOKENIZER: dict[str, str] = {}  # set by the fixture below for the SmolLM2 engines


@pytest.fixture(autouse=True)
def _smollm2_tokenizer(request: pytest.FixtureRequest) -> None:
    if "smollm2_files" in request.fixturenames or "widened_smollm2" in request.fixturenames:
        _TOKENIZER["tokenizer"] = str(request.getfixturevalue("smollm2_tokenizer_dir"))
    else:
        _TOKENIZER.clear()


def _engine(file: Path, **kwargs) -> LLM:
    return LLM(str(file), kv_cache_memory_bytes=64 << 20, max_model_len=1024,
               **_TOKENIZER, **kwargs)


def _nll(llm: LLM) -> float:
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (out,) = llm.generate([TEXT], sp, use_tqdm=False)
    ids, plp = out.prompt_token_ids, out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) > 100
    return -float(np.mean([plp[j][ids[j]].logprob for j in range(1, len(ids))]))


def _greedy(llm: LLM) -> list[list[int]]:
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]


_EXACT_NLL: dict[str, float] = {}  # per file, across the cases below


@pytest.mark.parametrize(("mode", "file", "tolerance"), [
    ("int8", "Q4_1", 0.01),
    ("gguf", "Q8_0", 0.01),
    ("gguf", "Q4_1", 0.05),  # the shipped file
    # What SmolLM2's own K-quant files hold: its 576-value rows are not whole super-blocks,
    # so llama.cpp writes Q5_0 for Q4_K there.
    ("gguf", "Q5_0", 0.03),
    # Q4_0 (13 s with its re-quantization) is checked on the tiny models and per kernel.
])
def test_smollm2_nll_near_exact_and_async_equals_sync(smollm2_files, mode: str, file: str,
                                                      tolerance: float) -> None:
    """The exact engine reads the same file (dequantized), so the NLLs compare the
    computation, not the file's own quantization."""
    path = smollm2_files[file]
    if file not in _EXACT_NLL:
        exact = _engine(path, async_scheduling="off")
        try:
            _EXACT_NLL[file] = _nll(exact)
        finally:
            exact.shutdown()
    exact_nll = _EXACT_NLL[file]
    llms = {m: _engine(path, quantization=mode, async_scheduling=m) for m in ("off", "on")}
    try:
        weight_bytes = llms["off"].stats().weight_bytes
        assert weight_bytes > 0
        if mode == "gguf":  # the blocks, about the size of the file, and nothing else
            assert weight_bytes < 1.05 * path.stat().st_size
        nll = _nll(llms["off"])
        assert abs(nll - exact_nll) <= tolerance * exact_nll, (nll, exact_nll)
        assert _greedy(llms["on"]) == _greedy(llms["off"])
    finally:
        for llm in llms.values():
            llm.shutdown()


@pytest.fixture(scope="module")
def widened_smollm2(tmp_path_factory: pytest.TempPathFactory):
    """``mix -> path``: SmolLM2 widened to whole super-blocks (:func:`widen_smollm2`) in that
    K-quant mix, written on first use; the model cache is off meanwhile."""
    src = smollm2_dir() / SMOLLM2_GGUF
    out = tmp_path_factory.mktemp("widened")
    files: dict[str, Path] = {}

    def get(mix: str) -> Path:
        if mix not in files:
            types, default = (_Q4_K_M, GT.Q4_K) if mix == "Q4_K_M" else ({}, GT[mix])
            files[mix] = widen_smollm2(src, out / f"smollm2-wide.{mix}.gguf", types, default)
        return files[mix]

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FORERUN_CACHE_DIR", "off")
        yield get


@pytest.mark.parametrize(("mix", "tolerance"), [
    ("Q4_K_M", 0.05),  # Q4_K, with Q6_K attention values and MLP down projections
    # Whole Q6_K at the 1%: its activation format is the one a faster body is
    # tempted to coarsen (one scale per 256 values scored 2.45% here, per 32 0.47%).
    ("Q6_K", 0.01),
    # Whole-Q5_K (23 s), Q3_K (29 s) and IQ4_XS (47 s) files are checked on the tiny models
    # and against gguf per kernel body: the suite's time limit leaves room for two mixes.
])
def test_smollm2_kquants_nll_near_exact_and_async_equals_sync(widened_smollm2, mix: str,
                                                              tolerance: float) -> None:
    """Every weight of a real model in K-quants: the exact engine reads the same file
    (dequantized), so the NLLs compare the computation, not the file's own quantization."""
    path = widened_smollm2(mix)
    exact = _engine(path, async_scheduling="off")
    try:
        exact_nll = _nll(exact)
    finally:
        exact.shutdown()
    llms = {m: _engine(path, quantization="gguf", async_scheduling=m) for m in ("off", "on")}
    try:
        weight_bytes = llms["off"].stats().weight_bytes
        assert 0 < weight_bytes < 1.05 * path.stat().st_size  # the blocks, nothing else
        nll = _nll(llms["off"])
        assert abs(nll - exact_nll) <= tolerance * exact_nll, (nll, exact_nll)
        assert _greedy(llms["on"]) == _greedy(llms["off"])
    finally:
        for llm in llms.values():
            llm.shutdown()
