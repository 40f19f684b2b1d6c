"""gpt-oss (``GptOssForCausalLM``) against transformers on one tiny random model: attention
sinks, sliding-window (even) and full (odd) layers with prompts longer than the window,
YaRN rope, q/k/v/o biases, a biased router with the softmax over its top-k, and experts with
biases and the clamped SwiGLU; from the Hugging Face folder, from a GGUF written from it the
way llama.cpp's converter lays it out (experts float32, or MXFP4 from our own packer), and
from OpenAI's MXFP4 checkpoint tensors. Then the engines: async == sync, offline greedy ==
transformers, and TP=2 with and without expert parallelism == one process (the ranks'
shares of a layer in process; real ranks with FORERUN_TEST_GPT_OSS_TP=1, too slow for CI)."""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import dequantize
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from forerun import LLM, SamplingParams
from forerun.model import cpu_kernels
from forerun.model.gpt_oss import dequantize_mxfp4_checkpoint
from forerun.model.loader import (
    ModelLoadError,
    load_model,
    load_model_config,
    load_tokenizer,
    resolve_model,
)
from forerun.model.quant.gguf_linear import GGUFLinear
from tests.conftest import assert_all_blocks_free, tokens_sync_and_async
from tests.paged_driver import PagedDriver
from tests.tiny_model import hf_greedy, write_word_tokenizer

CPU = torch.device("cpu")
VOCAB, EOS, WINDOW = 320, 2, 6
# 13 tokens: past the sliding window of 6, so the even layers' windows slide in prefill too.
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1, 33, 80]
MX = int(GT.MXFP4)


def _config() -> GptOssConfig:
    # max_position_embeddings at YaRN's pre-scaling context x factor (transformers warns
    # otherwise); layer_types and rope_parameters from GptOssConfig's own defaults.
    return GptOssConfig(
        hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, max_position_embeddings=131072,
        sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5,
        eos_token_id=EOS, bos_token_id=1, pad_token_id=0, architectures=["GptOssForCausalLM"])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """(transformers' float32 model, its folder with a word tokenizer)."""
    torch.manual_seed(31)
    hf = AutoModelForCausalLM.from_config(_config(), attn_implementation="eager")
    with torch.no_grad():
        for name, p in hf.named_parameters():
            # Sinks and biases large enough to matter; the gate values reach the clamp.
            scale = 0.5 if ("sinks" in name or "bias" in name) else 0.15
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else scale * torch.randn_like(p))
        hf.model.layers[0].mlp.experts.gate_up_proj.mul_(8.0)  # some |gate|, |up| > 7
    hf.eval()
    folder = tmp_path_factory.mktemp("gpt-oss")
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, VOCAB, EOS)
    return hf, folder


def _load(path: Path, quantization: str | None = None) -> Any:
    source = resolve_model(str(path))
    return load_model(source, load_model_config(source), torch.float32, CPU,
                      quantization=quantization)


@pytest.fixture(params=["one-call-stack", "op-by-op", "torch-path"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The one-call C stack for every step (sinks in its attention, gpt-oss's MoE options
    in its MoE block), the C kernels op by op, and pure torch."""
    if request.param == "torch-path":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    elif cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS",
                       "1000" if request.param == "one-call-stack" else "0")
    return request.param


def test_config_reads_the_layer_types_window_rope_and_experts(tiny) -> None:
    _, folder = tiny
    cfg = load_model_config(resolve_model(str(folder)))
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert (cfg.layer_window(0), cfg.layer_window(1)) == (WINDOW, None)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["truncate"] is False
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (4, 2, 32)
    assert cfg.attention_sinks and (cfg.swiglu_alpha, cfg.swiglu_limit) == (1.702, 7.0)


def test_prefill_logits_and_greedy_tokens_match_transformers(tiny, path: str) -> None:
    hf, folder = tiny
    ours = _load(folder)
    assert ours.small_batch.refusal is None
    calls = []
    stack_forward = ours.small_batch.forward
    ours.small_batch.forward = lambda *a, **k: calls.append(1) or stack_forward(*a, **k)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        tokens = PagedDriver(ours, seed=3).greedy("a", PROMPT, 12)
    assert tokens == hf_greedy(hf, PROMPT, 12)
    assert (len(calls) == 13) == (path == "one-call-stack")  # the prompt and every decode


def test_openai_mxfp4_checkpoint_tensors_dequantize_as_transformers_does() -> None:
    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(118, 134, (3, 8, 2), dtype=torch.uint8, generator=gen)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize_mxfp4_checkpoint(blocks, scales).transpose(1, 2), want)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.experts.down_proj_bias",
                                  "model.layers.0.self_attn.sinks",
                                  "model.layers.0.mlp.router.bias"])
def test_a_missing_tensor_is_named_as_the_checkpoint_names_it(tiny, tmp_path: Path,
                                                               name: str) -> None:
    _, folder = tiny
    dst = tmp_path / "broken"
    shutil.copytree(folder, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        _load(dst)


# --- GGUF ---------------------------------------------------------------------------------
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pack_mxfp4(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's MXFP4 blocks of ``x`` ``[..., k]`` (per 32 values: an E8M0 exponent byte so
    that the largest magnitude fits level 6, then 16 bytes: value j in byte j's low nibble,
    value j + 16 in its high one, sign in each nibble's bit 3), and the values they hold."""
    b = x.reshape(-1, 32).astype(np.float64)
    amax = np.abs(b).max(axis=1)
    e = np.where(amax > 0, np.ceil(np.log2(np.maximum(amax, 1e-30) / 6.0)), 0).astype(int)
    scaled = b / np.exp2(e)[:, None]
    idx = np.abs(np.abs(scaled)[..., None] - _FP4).argmin(axis=-1)
    nib = idx | np.where(scaled < 0, 8, 0)
    qs = (nib[:, :16] | (nib[:, 16:] << 4)).astype(np.uint8)
    raw = np.concatenate([(e + 127).astype(np.uint8)[:, None], qs], axis=1)
    values = np.sign(scaled) * _FP4[idx] * np.exp2(e)[:, None]
    return raw.reshape(*x.shape[:-1], -1), values.reshape(x.shape).astype(np.float32)


_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "mlp.router": "ffn_gate_inp"}


def _write_gguf(hf: torch.nn.Module, path: Path, mxfp4: bool) -> dict[str, np.ndarray]:
    """llama.cpp's gpt-oss layout: experts split into ffn_{gate,up,down}_exps [E, out, in]
    (gate and up de-interleaved) with their biases, attn_sinks.weight; with ``mxfp4`` the
    expert weights in MXFP4. Returns the expert weights the file holds (as values)."""
    import gguf

    cfg = hf.config
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_sliding_window(cfg.sliding_window)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(EOS)
    held: dict[str, np.ndarray] = {}

    def experts(name: str, arr: np.ndarray) -> None:
        if not mxfp4:
            w.add_tensor(name, np.ascontiguousarray(arr))
            held[name] = arr
            return
        raw, values = pack_mxfp4(arr)
        # Our packer's blocks are what gguf's own decoder reads.
        assert np.array_equal(dequantize(raw, GT.MXFP4).reshape(arr.shape), values)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GT.MXFP4)
        held[name] = values

    for name, t in hf.state_dict().items():
        arr = t.detach().float().numpy()
        parts = name.split(".")
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            w.add_tensor({"embed_tokens": "token_embd", "norm": "output_norm"}.get(
                parts[1], "output") + ".weight", arr)
            continue
        blk, rest = f"blk.{parts[2]}", ".".join(parts[3:])
        if rest == "self_attn.sinks":
            w.add_tensor(f"{blk}.attn_sinks.weight", arr)
        elif rest == "mlp.experts.gate_up_proj":  # [E, H, 2I] -> [E, 2I, H], de-interleaved
            out_in = arr.transpose(0, 2, 1)
            experts(f"{blk}.ffn_gate_exps.weight", out_in[:, 0::2])
            experts(f"{blk}.ffn_up_exps.weight", out_in[:, 1::2])
        elif rest == "mlp.experts.gate_up_proj_bias":
            w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(arr[:, 0::2]))
            w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(arr[:, 1::2]))
        elif rest == "mlp.experts.down_proj":
            experts(f"{blk}.ffn_down_exps.weight", arr.transpose(0, 2, 1))
        elif rest == "mlp.experts.down_proj_bias":
            w.add_tensor(f"{blk}.ffn_down_exps.bias", arr)
        else:
            module, _, kind = rest.rpartition(".")
            w.add_tensor(f"{blk}.{_NAMES[module]}.{kind}", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return held


def _with_experts(hf: torch.nn.Module, held: dict[str, np.ndarray]) -> torch.nn.Module:
    """A copy of ``hf`` whose expert weights are the file's (MXFP4-rounded) values."""
    out = copy.deepcopy(hf)
    with torch.no_grad():
        for i, layer in enumerate(out.model.layers):
            ex = layer.mlp.experts
            gate, up, down = (torch.from_numpy(held[f"blk.{i}.ffn_{p}_exps.weight"])
                              for p in ("gate", "up", "down"))
            gu = torch.empty(gate.shape[0], 2 * gate.shape[1], gate.shape[2])
            gu[:, 0::2], gu[:, 1::2] = gate, up
            ex.gate_up_proj.copy_(gu.transpose(1, 2))
            ex.down_proj.copy_(down.transpose(1, 2))
    return out


@pytest.mark.usefixtures("private_model_cache")
def test_a_gguf_with_float_experts_loads_the_same_model(tiny, tmp_path: Path) -> None:
    hf, _ = tiny
    file = tmp_path / "gpt-oss-f32.gguf"
    _write_gguf(hf, file, mxfp4=False)
    cfg = load_model_config(resolve_model(str(file)))
    assert cfg.architecture == "GptOssForCausalLM"
    assert cfg.layer_types == ["sliding_attention", "full_attention"]
    assert cfg.sliding_window == WINDOW and cfg.rope_scaling["truncate"] is False
    ours = _load(file)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert PagedDriver(ours).greedy("a", PROMPT, 8) == hf_greedy(hf, PROMPT, 8)


@pytest.mark.usefixtures("private_model_cache")
def test_a_gguf_with_mxfp4_experts_matches_transformers_on_its_values(
        tiny, tmp_path: Path) -> None:
    """Dequantized (quantization=None): transformers on the file's MXFP4 values, token for
    token. In their blocks (quantization="gguf"): within the activations' int8 rounding."""
    hf, _ = tiny
    file = tmp_path / "gpt-oss-mxfp4.gguf"
    hf_mx = _with_experts(hf, _write_gguf(hf, file, mxfp4=True))
    exact, quant = _load(file), _load(file, "gguf")
    for layer in quant.model.layers:
        moe = layer.mlp
        assert moe.w13 is None and len(moe.quant_experts) == 4 and moe.b13 is not None
        gate_up, down = moe.quant_experts[1]
        assert isinstance(gate_up, GGUFLinear) and isinstance(down, GGUFLinear)
        assert [t for t, _, _ in gate_up.tiles] == [MX, MX]
        assert [t for t, _, _ in down.tiles] == [MX]
    with torch.inference_mode():
        ref = hf_mx(torch.tensor([PROMPT])).logits[0].float()
        want = PagedDriver(exact).step([("a", PROMPT)])[0]
        torch.testing.assert_close(want, ref, atol=1e-4, rtol=1e-4)
        assert PagedDriver(exact).greedy("a", PROMPT, 8) == hf_greedy(hf_mx, PROMPT, 8)
        got = PagedDriver(quant).step([("a", PROMPT)])[0]
    err = (got - want).abs().max() / want.abs().max()
    assert err < 0.05, f"max logit error {err:.4f} of the largest logit"


@pytest.mark.usefixtures("private_model_cache")
def test_mxfp4_experts_beside_float_attention_run_in_the_one_call_stack(
        tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As llama.cpp's converter writes gpt-oss (MXFP4 experts, the rest float), a layer holds
    GGUF experts beside plain attention linears: the stack takes them as mixed linears and
    gives the op-by-op path's logits and tokens, every step in one call."""
    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    hf, _ = tiny
    file = tmp_path / "gpt-oss-mxfp4.gguf"
    _write_gguf(hf, file, mxfp4=True)
    runs = {}
    for tokens_env in ("0", "1000"):  # op by op, then the one-call stack
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", tokens_env)
        model = _load(file, "gguf")
        calls: list[int] = []
        stack_forward = model.small_batch.forward
        model.small_batch.forward = (lambda *a, f=stack_forward, c=calls, **k:
                                     c.append(1) or f(*a, **k))
        with torch.inference_mode():
            logits = PagedDriver(model).step([("a", PROMPT)])[0]
            tokens = PagedDriver(model, seed=3).greedy("a", PROMPT, 12)
        runs[tokens_env] = (logits, tokens, len(calls), model.small_batch.mode)
    (want, want_tokens, op_calls, _), (got, tokens, calls, mode) = runs["0"], runs["1000"]
    assert mode == "mixed" and op_calls == 0 and calls == 13  # the prompt and every decode
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert tokens == want_tokens


def test_openai_mxfp4_checkpoints_load_like_their_floats(tiny, tmp_path: Path) -> None:
    """The folder with each layer's experts as ``*_blocks`` / ``*_scales`` (OpenAI's
    checkpoint layout) loads the weights the dequantized folder holds."""
    hf, folder = tiny
    dst = tmp_path / "mxfp4-folder"
    shutil.copytree(folder, dst)
    (file,) = dst.glob("*.safetensors")
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj",
                                                    "experts.down_proj"))]:
        out_in = tensors.pop(name).transpose(1, 2).numpy()  # [E, out, in]
        raw, values = pack_mxfp4(out_in)
        raw = raw.reshape(*out_in.shape[:2], -1, 17)
        lo, hi = raw[..., 1:] & 0x0F, raw[..., 1:] >> 4
        vals = np.concatenate([lo, hi], axis=-1)  # ggml order: value j, then j + 16
        blocks = (vals[..., 0::2] | (vals[..., 1::2] << 4)).astype(np.uint8)  # OpenAI's
        tensors[f"{name}_blocks"] = torch.from_numpy(blocks)
        tensors[f"{name}_scales"] = torch.from_numpy(np.ascontiguousarray(raw[..., 0]))
        tensors[name] = torch.from_numpy(values).transpose(1, 2).contiguous()  # the floats
    floats = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    save_file({n: t for n, t in tensors.items() if n not in floats or "experts." not in n
               or n.endswith("_bias")}, file, metadata={"format": "pt"})
    packed = _load(dst)
    save_file(floats, file, metadata={"format": "pt"})
    plain = _load(dst)
    for (name, a), (_, b) in zip(packed.named_parameters(), plain.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


# --- the engines ----------------------------------------------------------------------------
def test_async_and_sync_engines_give_identical_tokens_and_transformers_greedy(tiny) -> None:
    hf, folder = tiny
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:9] + [7, 8]},
               {"prompt_token_ids": PROMPT[:4]}]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=11, ignore_eos=True)]
    # Chunked prefill (8-token steps) and the prefix cache (the shared first 9 tokens).
    outs = tokens_sync_and_async(str(folder), prompts, params, enable_prefix_caching=True,
                                 max_num_batched_tokens=8, block_size=4)
    assert outs["on"] == outs["off"]
    assert outs["on"][0] == hf_greedy(hf, PROMPT, 10)


@pytest.mark.parametrize("top_k", [1, 3, 8])
def test_the_gpt_oss_layer_in_one_c_call_matches_its_torch_path_in_float64(top_k: int) -> None:
    """gpt-oss's MoE layer (router bias, softmax over the top k, expert biases, clamped
    SwiGLU) in csrc/moe_block.c against the layer's torch path in float64 (the path the
    transformers comparisons pin), its gate clamp, up clamp and both biases in play; and
    each addition matters (dropping one moves the output 100x past the bound; the softmax
    over the top k equals the renormalised top k of the softmax, so it cannot)."""
    from forerun.model.moe import FusedMoE

    if not cpu_kernels.supports(torch.float32, torch.device("cpu")):
        pytest.skip("no C kernels")
    torch.manual_seed(20 + top_k)
    moe = FusedMoE(32, 24, 8, top_k, True, router_bias=True, softmax_over_top_k=True,
                   expert_bias=True, swiglu=(1.702, 7.0))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p))
        moe.gate.bias.mul_(8.0)  # as large as the logits: it moves the routing
    x = 2.0 * torch.randn(11, 32)
    assert moe._c_block(x) is not None
    with torch.inference_mode():
        got = moe(x).double()
        ref64 = copy.deepcopy(moe).double()
        ref64._c_block = lambda x: None
        gate_up = x.double() @ ref64.w13[0].T + ref64.b13[0]
        assert (gate_up[:, :24] > 7.0).any() and (gate_up[:, 24:].abs() > 7.0).any()
        want = ref64(x.double())
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    for name in ("gate.bias", "b13", "b2"):
        other = copy.deepcopy(ref64)
        with torch.no_grad():
            other.get_parameter(name).zero_()
        with torch.inference_mode():
            assert (other(x.double()) - want).abs().max() > 1e-3 * scale, name
    other = copy.deepcopy(ref64)
    other.swiglu = None  # SiLU-and-multiply
    with torch.inference_mode():
        assert (other(x.double()) - want).abs().max() > 1e-3 * scale


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "experts"])
def test_the_ranks_shares_of_a_gpt_oss_moe_layer_sum_to_the_whole(expert_parallel: bool
                                                                  ) -> None:
    """Expert biases split with their experts (or their width; the down bias joins once),
    the router with its bias on every rank."""
    from forerun.distributed.tensor_parallel import shard_moe
    from forerun.model.moe import FusedMoE
    from tests.test_moe import _SumOverRanks

    torch.manual_seed(2)
    moe = FusedMoE(32, 24, 8, 3, True, router_bias=True, softmax_over_top_k=True,
                   expert_bias=True, swiglu=(1.702, 7.0))
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn_like(p))
    x = torch.randn(9, 32)
    want = moe(x)
    seen: list[torch.Tensor] = []
    for rank in range(2):
        part = copy.deepcopy(moe)
        shard_moe(part, _SumOverRanks(rank, 2, seen), expert_parallel)
        part(x)
    # The whole layer runs in one C call, a rank's share of whole experts in torch (float32
    # sums in another order): the bound is on the output's scale (a wrong split is off by
    # whole percents of it).
    scale = want.abs().max().item()
    assert scale > 1.0
    torch.testing.assert_close(seen[0] + seen[1], want, atol=1e-6 * scale, rtol=1e-5)


@pytest.mark.skipif(not os.environ.get("FORERUN_TEST_GPT_OSS_TP"),
                    reason="real ranks: about 75 s on one busy core; FORERUN_TEST_GPT_OSS_TP=1")
def test_two_ranks_with_and_without_expert_parallelism_give_one_process_tokens(tiny) -> None:
    """Real ranks and all-reduces (the attention sinks split with their heads)."""
    _, folder = tiny
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:5]}]
    params = [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.9, seed=3, ignore_eos=True)]
    kw: dict[str, Any] = dict(model=str(folder), dtype="float32", max_model_len=64)
    runs = {}
    for name, extra in (("one", {}), ("tp", {"tensor_parallel_size": 2}),
                        ("ep", {"tensor_parallel_size": 2, "enable_expert_parallel": True})):
        llm = LLM(**kw, **extra)
        try:
            runs[name] = [o.outputs[0].token_ids
                          for o in llm.generate(prompts, params, use_tqdm=False)]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert runs["tp"] == runs["one"] and runs["ep"] == runs["one"]


@pytest.mark.usefixtures("private_model_cache")
def test_the_tokenizer_of_a_gguf_with_yarn_rope_keys_loads(tmp_path: Path) -> None:
    """llama.cpp's converter writes gpt-oss's YaRN numbers as rope.scaling.* keys, which
    transformers' GGUF config reader stumbles on; the vocabulary itself is all a tokenizer
    needs: byte-level BPE with its merges, the special tokens whole."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n", "Ġa n", "Ġan d"]
    specials = ["<|start|>", "<|end|>"]
    tokens = ([bytes_to_unicode()[b] for b in range(256)]
              + ["".join(m.split(" ")) for m in merges] + specials)
    path = tmp_path / "gpt-oss-vocab.gguf"
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(1)
    w.add_context_length(131072)
    w.add_rope_freq_base(150000.0)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(32.0)
    w.add_rope_scaling_orig_ctx_len(4096)
    w.add_rope_scaling_yarn_beta_fast(32.0)
    w.add_rope_scaling_yarn_beta_slow(1.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(specials)) + [3] * len(specials))
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|start|>"))
    w.add_eos_token_id(tokens.index("<|end|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tok = load_tokenizer(resolve_model(str(path)))
    ids = tok.encode("<|start|>the and<|end|>", add_special_tokens=False)
    assert ids == [tokens.index(t) for t in ("<|start|>", "t", "he", "Ġand", "<|end|>")]
    assert tok.eos_token_id == tokens.index("<|end|>")
    assert tok.decode(tok.encode("in the and!", add_special_tokens=False)) == "in the and!"
