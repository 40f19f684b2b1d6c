"""Mixture-of-experts models (Qwen3-MoE, Mixtral) and the fused MoE layer, against
transformers on the same tiny random weights and a float64 per-token reference."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GT
from gguf.quants import quantize
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from forerun import LLM, SamplingParams
from forerun.model import cpu_kernels
from forerun.model.loader import ModelLoadError, load_model, load_model_config, resolve_model
from forerun.model.moe import fused_experts, select_experts
from forerun.model.quant.gguf_linear import GGUFLinear
from forerun.model.quant.int8_linear import Int8Linear
from tests.conftest import assert_all_blocks_free, tokens_sync_and_async
from tests.kquant_pack import BLOCK_BYTES, pack_kquant
from tests.paged_driver import PagedDriver
from tests.tiny_model import hf_greedy, write_word_tokenizer

CPU = torch.device("cpu")
COMMON: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=320, max_position_embeddings=256, rms_norm_eps=1e-6,
    eos_token_id=2, bos_token_id=1)
VARIANTS: dict[str, Any] = {
    # Layer 1 dense (mlp_only_layers), the others sparse; 8 experts, top-2, renormalised.
    "qwen3moe": lambda: Qwen3MoeConfig(**COMMON, head_dim=32, num_experts=8,
                                       num_experts_per_tok=2, moe_intermediate_size=48,
                                       norm_topk_prob=True, mlp_only_layers=[1]),
    # Mixtral: 4 experts of intermediate_size, top-2 of the softmax over all.
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2),
}
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1]


# --- the layer ----------------------------------------------------------------------------
def _reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
               ids: torch.Tensor) -> torch.Tensor:
    """Token by token in float64: sum_j weights[t, j] * expert_ids[t, j](x[t])."""
    x, w13, w2, weights = (v.double() for v in (x, w13, w2, weights))
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (w13[e] @ x[t]).split(i)
            out[t] += weights[t, j] * (w2[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize("routing", ["random", "one-expert", "some-idle"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_fused_experts_match_a_float64_per_token_reference(top_k: int, routing: str) -> None:
    torch.manual_seed(top_k)
    e, t, h, i = 10, 13, 32, 24  # 10 experts: a partial block of the router kernel
    x, w13, w2 = torch.randn(t, h), 0.3 * torch.randn(e, 2 * i, h), 0.3 * torch.randn(e, h, i)
    logits = torch.randn(t, e)
    if routing == "one-expert" and top_k == 1:
        logits[:, 5] += 100.0  # every token on expert 5
    elif routing == "some-idle":
        logits[:, [0, 3, 6]] -= 100.0  # experts 0, 3 and 6 get no token (if top_k < 6)
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    if routing == "one-expert" and top_k == 1:
        assert set(ids.flatten().tolist()) == {5}
    if routing == "some-idle" and top_k < 6:
        assert not {0, 3, 6} & set(ids.flatten().tolist())
    got = fused_experts(x, w13, w2, weights, ids)
    torch.testing.assert_close(got.double(), _reference(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("routing", ["random", "one-expert", "some-idle"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_the_layer_in_one_c_call_matches_a_float64_per_token_reference(
        top_k: int, routing: str) -> None:
    """FusedMoE.forward where the C kernels run: routing, grouping and every expert in
    csrc/moe_block.c (one call for the layer), against the float64 reference routed by the
    float64 router logits; experts without tokens, all tokens on one, k = 1, 2, 8."""
    from forerun.model.moe import FusedMoE

    if not cpu_kernels.supports(torch.float32, CPU):
        pytest.skip("no C kernels")
    torch.manual_seed(10 + top_k)
    e, t, h, i = 8, 13, 32, 24
    moe = FusedMoE(h, i, e, top_k, renormalize=top_k > 1)
    x = torch.randn(t, h)
    x[:, 0] = 1.0  # a constant feature: the router's column 0 is then a per-expert offset
    with torch.no_grad():
        moe.w13.copy_(0.3 * torch.randn(e, 2 * i, h))
        moe.w2.copy_(0.3 * torch.randn(e, h, i))
        moe.gate.weight.copy_(torch.randn(e, h))
        if routing == "one-expert" and top_k == 1:
            moe.gate.weight[5, 0] += 100.0  # every token on expert 5
        elif routing == "some-idle":
            moe.gate.weight[[0, 3, 6], 0] -= 100.0  # no token for experts 0, 3 and 6
    assert moe._c_block(x) is not None
    logits = x.double() @ moe.gate.weight.double().T
    weights, ids = select_experts(logits, top_k, renormalize=top_k > 1)
    if routing == "one-expert" and top_k == 1:
        assert set(ids.flatten().tolist()) == {5}
    if routing == "some-idle" and top_k < 6:
        assert not {0, 3, 6} & set(ids.flatten().tolist())
    with torch.inference_mode():
        got = moe(x)
    torch.testing.assert_close(got.double(), _reference(x, moe.w13, moe.w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 45), (4, 13, 64), (5, 4, 2048), (6, 1, 31),
                                         (3, 9, 33), (40, 37, 64), (17, 50, 96), (33, 16, 32)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("amx", [True, False])
def test_row_major_bfloat16_matmul_is_float64_within_one_rounding(m: int, n: int, k: int,
                                                                   bias: bool, amx: bool) -> None:
    """csrc/rowmajor_bf16.c (plain bfloat16 experts as stored): every output within half a
    bfloat16 step of the float64 product plus float32 summation error; odd k (masked
    tails), a last partial group of weight rows, 1-40 rows of x (partial tiles of x for the
    AMX body, which takes k a multiple of 32 where the CPU has AMX), each body."""
    if not cpu_kernels.supports(torch.bfloat16, CPU):
        pytest.skip("no C kernels")
    torch.manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
    b = torch.randn(n).bfloat16() if bias else None
    prev = cpu_kernels.set_rowmajor_amx(amx)
    try:
        got = cpu_kernels.rowmajor_matmul(x, w, b).double()
    finally:
        cpu_kernels.set_rowmajor_amx(prev)
    want = x.double() @ w.double().T + (0 if b is None else b.double())
    slack = 2.0 ** -8 * want.abs() + 1e-6 * (x.double().abs() @ w.double().abs().T + 1)
    assert ((got - want).abs() <= slack).all()


@pytest.mark.parametrize("t", [13, 65])
def test_plain_bfloat16_experts_take_the_c_block_within_bf16_rounding(t: int) -> None:
    """A bfloat16 layer of plain experts in one C call (their rows as stored): the float64
    reference of its bf16 weights within bf16's rounding of the intermediates, and far from
    it with two experts swapped. Past 16 rows an expert (65 tokens) the block runs them on
    AMX tiles where the CPU has them, and leaves the layer to torch where not."""
    from forerun.model.moe import FusedMoE

    if not cpu_kernels.supports(torch.bfloat16, CPU):
        pytest.skip("no C kernels")
    torch.manual_seed(11)
    e, h, i = 8, 64, 48
    moe = FusedMoE(h, i, e, 2, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    moe = moe.to(torch.bfloat16)
    x = torch.randn(t, h).bfloat16()
    in_c = t * 2 <= 16 * e or cpu_kernels.small_matmul_has_amx()
    assert (moe._c_block(x) is not None) == in_c
    logits = x.double() @ moe.gate.weight.double().T
    weights, ids = select_experts(logits, 2, renormalize=True)
    want = _reference(x, moe.w13, moe.w2, weights, ids)
    with torch.inference_mode():
        got = moe(x).double()
        with torch.no_grad():
            moe.w13[[0, 1]] = moe.w13[[1, 0]].clone()
        swapped = moe(x).double()
    scale = want.abs().max()
    assert (got - want).abs().max() < 0.02 * scale
    assert (swapped - want).abs().max() > 0.1 * scale


@pytest.mark.parametrize("kind", ["int8", "gguf"])
def test_quantized_experts_in_bfloat16_take_the_c_block_within_bf16_rounding(kind: str) -> None:
    """int8 and GGUF-block experts with bfloat16 activations: the layer in one C call
    (float32 accumulation, one rounding) within bf16's rounding of the torch path (which
    rounds every intermediate), and far from it with two experts swapped."""
    from forerun.model.moe import FusedMoE
    from forerun.model.quant.int8_linear import int8_experts

    if not cpu_kernels.supports(torch.bfloat16, CPU):
        pytest.skip("no C kernels")
    torch.manual_seed(7)
    moe = FusedMoE(64, 64, 8, 2, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    if kind == "int8":
        experts = int8_experts(moe)
    else:
        def blocks(w: torch.Tensor) -> tuple[int, torch.Tensor]:
            return int(GT.Q8_0), torch.from_numpy(quantize(w.detach().numpy(), GT.Q8_0))

        experts = [(GGUFLinear([blocks(moe.w13[e, :64]), blocks(moe.w13[e, 64:])], 64),
                    GGUFLinear([blocks(moe.w2[e])], 64)) for e in range(8)]
    moe.use_quantized_experts(experts)
    moe = moe.to(torch.bfloat16)
    x = torch.randn(5, 64).to(torch.bfloat16)
    assert moe._c_block(x) is not None
    with torch.inference_mode():
        got = moe(x).float()
        moe._c_block = lambda x: None  # the torch path
        ref = moe(x).float()
        pairs = list(moe.quant_experts)
        moe.quant_experts = torch.nn.ModuleList([pairs[1], pairs[0], *pairs[2:]])
        del moe._c_block
        swapped = moe(x).float()
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 0.02 * scale  # measured 0.4-0.8%
    assert (swapped - ref).abs().max() > 0.1 * scale


@pytest.mark.parametrize("renormalize", [False, True])
def test_router_weights_are_the_softmaxs_top_k(renormalize: bool) -> None:
    logits = torch.randn(6, 8, dtype=torch.float64)
    weights, ids = select_experts(logits.float(), 3, renormalize)
    probs = torch.softmax(logits, dim=-1)
    exp_w, exp_ids = torch.topk(probs, 3, dim=-1)
    if renormalize:
        exp_w = exp_w / exp_w.sum(dim=-1, keepdim=True)
    assert torch.equal(ids, exp_ids)
    torch.testing.assert_close(weights.double(), exp_w, atol=1e-6, rtol=1e-6)


def test_a_step_without_tokens_returns_nothing() -> None:
    out = fused_experts(torch.zeros(0, 4), torch.zeros(2, 6, 4), torch.zeros(2, 4, 3),
                        torch.zeros(0, 1), torch.zeros(0, 1, dtype=torch.long))
    assert out.shape == (0, 4)


# --- the models ---------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_moe(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """(transformers' model, forerun's float32 model, folder) for one architecture."""
    torch.manual_seed(99)
    hf = AutoModelForCausalLM.from_config(VARIANTS[request.param]())
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    hf.eval()
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    write_word_tokenizer(folder, COMMON["vocab_size"], COMMON["eos_token_id"])
    source = resolve_model(str(folder))
    return hf, load_model(source, load_model_config(source), torch.float32, CPU), folder


@pytest.fixture(params=["small-batch", "op-by-op", "torch-path"])
def moe_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Every step as one C call for the whole stack (its MoE block included), the C kernels
    op by op, and the pure torch path."""
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
    calls: list[torch.dtype] = []
    for entry in ("decoder_stack", "decoder_stack_quantized"):
        real = getattr(cpu_kernels, entry)
        monkeypatch.setattr(cpu_kernels, entry,
                            lambda dtype, real=real: calls.append(dtype) or real(dtype))
    yield request.param
    assert calls, "the small-batch path was never taken"


def test_prefill_logits_and_greedy_tokens_match_transformers(tiny_moe, moe_path: str) -> None:
    hf, ours, _ = tiny_moe
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        tokens = PagedDriver(ours, seed=7).greedy("a", PROMPT, 16)
    assert tokens == hf_greedy(hf, PROMPT, 16)


def test_bfloat16_moe_decodes_in_the_stack_as_op_by_op_with_torch_experts(
        tiny_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain bfloat16 experts in the one-call stack (the MoE block over their rows as
    stored) against op by op with the experts in torch (oneDNN, one call per expert): a
    6-stream decode step gives the same logits within bf16 rounding. Not against
    transformers: in bfloat16 this tiny model's routing flips on some prompts in either
    engine (both paths there are 10-66% off on one prompt of six)."""
    from forerun.model.moe import FusedMoE

    if cpu_kernels.kernel_library() is None:
        pytest.skip("no C compiler: the kernels cannot be built")
    if not cpu_kernels.small_matmul_is_fast(torch.bfloat16):
        pytest.skip("no AVX512-BF16: plain bfloat16 steps run op by op on this CPU")
    _, _, folder = tiny_moe
    source = resolve_model(str(folder))
    prompts = [[(t + 13 * i) % 200 + 3 for t in PROMPT[:5 + i % 3]] for i in range(6)]
    calls: list[torch.dtype] = []
    real = cpu_kernels.decoder_stack
    monkeypatch.setattr(cpu_kernels, "decoder_stack",
                        lambda dtype: calls.append(dtype) or real(dtype))
    logits = {}
    for tokens in ("1000", "0"):
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", tokens)
        if tokens == "0":
            monkeypatch.setattr(FusedMoE, "_c_block", lambda self, x: None)
        ours = load_model(source, load_model_config(source), torch.bfloat16, CPU)
        driver = PagedDriver(ours, num_blocks=256)
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                driver.step([(i, p[:-1])])
            logits[tokens] = driver.step([(i, p[-1:]) for i, p in enumerate(prompts)])
        if tokens == "1000":
            assert calls, "the stack did not run the step"
            calls.clear()
    assert not calls
    for got, ref in zip(logits["1000"], logits["0"], strict=True):
        assert (got - ref).abs().max() < 0.05 * ref.abs().max() + 0.05


ENGINE_CONFIGS: dict[str, dict[str, Any]] = {
    "chunked-prefix": {"enable_prefix_caching": True, "max_num_batched_tokens": 8},
    "preemption": {"num_gpu_blocks_override": 10, "block_size": 4,
                   "max_num_batched_tokens": 64},
    "ngram-spec": {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                          "prompt_lookup_max": 3, "prompt_lookup_min": 1}},
}


@pytest.mark.parametrize("config", list(ENGINE_CONFIGS))
def test_async_and_sync_engines_give_identical_tokens(tiny_moe, config: str) -> None:
    _, _, folder = tiny_moe
    # Repeats, so that the n-gram proposer finds matches; a shared prefix for the cache.
    prompts = [" ".join(f"w{t}z" for t in (PROMPT * 2)[:n]) for n in (5, 14, 22)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=9, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=11, ignore_eos=True)]
    outs, preempted, proposed = {}, 0, 0
    for mode in ("on", "off"):
        llm = LLM(str(folder), dtype="float32", max_model_len=128, async_scheduling=mode,
                  **ENGINE_CONFIGS[config])
        try:
            outs[mode] = [o.outputs[0].token_ids for o in
                          llm.generate(prompts, params, use_tqdm=False)]
            preempted += llm.stats().scheduler.num_preemptions
            proposed += llm.stats().scheduler.spec_num_draft_tokens
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    assert outs["on"] == outs["off"]
    assert all(len(t) == p.max_tokens for t, p in zip(outs["on"], params, strict=True))
    if config == "preemption":
        assert preempted > 0, "the tiny pool should force preemption"
    if config == "ngram-spec":
        assert proposed > 0, "the prompts' repeats should give the n-gram proposer drafts"


def test_stacked_expert_checkpoints_load_the_same(tiny_moe, tmp_path: Path) -> None:
    """A checkpoint with the experts already stacked (experts.gate_up_proj / down_proj)."""
    hf, ours, folder = tiny_moe
    if isinstance(hf.config, MixtralConfig):
        pytest.skip("the stacked names are Qwen3-MoE's")
    dst = tmp_path / "stacked"
    shutil.copytree(folder, dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    stacked = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(COMMON["num_hidden_layers"]):
        pre = f"model.layers.{layer}.mlp.experts"
        if f"{pre}.0.gate_proj.weight" not in tensors:
            continue
        n = hf.config.num_experts
        stacked[f"{pre}.gate_up_proj"] = torch.stack([torch.cat(
            [tensors[f"{pre}.{e}.gate_proj.weight"], tensors[f"{pre}.{e}.up_proj.weight"]])
            for e in range(n)])
        stacked[f"{pre}.down_proj"] = torch.stack(
            [tensors[f"{pre}.{e}.down_proj.weight"] for e in range(n)])
    save_file(stacked, path, metadata={"format": "pt"})
    source = resolve_model(str(dst))
    again = load_model(source, load_model_config(source), torch.float32, CPU)
    for (name, a), (_, b) in zip(ours.named_parameters(), again.named_parameters(),
                                 strict=True):
        assert torch.equal(a, b), name


def test_a_missing_expert_is_named(tiny_moe, tmp_path: Path) -> None:
    hf, _, folder = tiny_moe
    dst = tmp_path / "broken"
    shutil.copytree(folder, dst)
    (path,) = dst.glob("*.safetensors")
    tensors = load_file(path)
    name = next(k for k in sorted(tensors) if ".experts.1." in k)
    del tensors[name]
    save_file(tensors, path, metadata={"format": "pt"})
    source = resolve_model(str(dst))
    with pytest.raises(ModelLoadError, match=name.replace(".", r"\.")):
        load_model(source, load_model_config(source), torch.float32, CPU)


def _int8_rows(v: torch.Tensor) -> torch.Tensor:
    """float64 rows rounded as Int8Linear rounds its activations: per row, symmetric."""
    s = v.abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(v / torch.where(s > 0, s, torch.ones_like(s))) * s


def _int8_reference(moe: Any, x: torch.Tensor) -> torch.Tensor:
    """A MoE layer with int8 experts, token by token in float64 from its own int8 rows and
    scales dequantized (the router run as the layer runs it: its choice is not what is
    checked here)."""
    weights, ids = select_experts(moe.gate(x), moe.top_k, moe.renormalize)
    x = x.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate_up, down = moe.quant_experts[int(ids[t, j])]
            w13 = gate_up.weight_rows().double() * gate_up.weight_scale.double()[:, None]
            w2 = down.weight_rows().double() * down.weight_scale.double()[:, None]
            g, u = (w13 @ _int8_rows(x[t])).split(w2.shape[1])
            h = torch.nn.functional.silu(g) * u
            out[t] += weights[t, j].double() * (w2 @ _int8_rows(h))
    return out


@pytest.mark.parametrize("path", ["kernels", "torch-path"])
def test_int8_experts_match_the_float64_oracle_of_their_int8_rows(
        tiny_moe, path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """quantization="int8" on a MoE model: every expert's gate/up and down become int8 per
    output channel (the router stays float), and the layer equals a float64 per-token
    reference over the same int8 rows; with two experts' rows swapped it does not."""
    if path == "torch-path":
        monkeypatch.setattr(cpu_kernels, "supports", lambda dtype, device: False)
    _, _, folder = tiny_moe
    source = resolve_model(str(folder))
    model = load_model(source, load_model_config(source), torch.float32, CPU,
                       quantization="int8")
    moe = next(layer.mlp for layer in model.model.layers if layer.mlp.quant_experts)
    assert moe.w13 is None and isinstance(moe.gate, torch.nn.Linear)
    assert isinstance(moe.quant_experts[0][0], Int8Linear)
    torch.manual_seed(3)
    x = torch.randn(24, COMMON["hidden_size"])
    with torch.inference_mode():
        got = moe(x).double()
        ref = _int8_reference(moe, x)
        scale = ref.abs().max()
        err = (got - ref).abs().max() / scale
        assert err < 2e-5, f"max error {err:.2e} of the largest output"
        pairs = list(moe.quant_experts)
        moe.quant_experts = torch.nn.ModuleList([pairs[1], pairs[0], *pairs[2:]])
        wrong = (moe(x).double() - ref).abs().max() / scale
    assert wrong > 1e-2, float(wrong)


def test_int8_moe_engine_is_close_to_the_exact_one_and_async_equals_sync(
        tiny_moe, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model with int8 experts: the prompt's logits within a few percent of the
    float32 engine's, the one-call decoder stack (its MoE block over the int8 experts) the
    op-by-op path's function, and the async and sync engines give the same tokens."""
    _, exact, folder = tiny_moe
    source = resolve_model(str(folder))
    quant = load_model(source, load_model_config(source), torch.float32, CPU,
                       quantization="int8")
    with torch.inference_mode():
        ref = PagedDriver(exact).step([("a", PROMPT)])[0]
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
        got = PagedDriver(quant).step([("a", PROMPT)])[0]
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
        stacked = PagedDriver(quant).step([("a", PROMPT)])[0]
        assert quant.small_batch.mode == "mixed" and quant.small_batch.applies(
            torch.zeros(len(PROMPT), COMMON["hidden_size"]))
        # The same int8 rows and row quantization; only the order of the weighted sums
        # differs.
        torch.testing.assert_close(stacked, got, atol=1e-4, rtol=1e-4)
        monkeypatch.delenv("FORERUN_SMALL_BATCH_TOKENS")
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 0.08, f"max logit error {err:.4f} of the largest logit"
    prompts = [" ".join(f"w{t}z" for t in PROMPT[:n]) for n in (4, 11)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    outs = tokens_sync_and_async(str(folder), prompts, params, quantization="int8")
    assert outs["on"] == outs["off"]
    assert all(len(t) == 10 for t in outs["on"])


def test_bad_expert_counts_are_refused(tmp_path: Path) -> None:
    cfg = Qwen3MoeConfig(**COMMON, num_experts=4, num_experts_per_tok=5,
                         moe_intermediate_size=16, architectures=["Qwen3MoeForCausalLM"])
    cfg.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        load_model_config(resolve_model(str(tmp_path)))


# --- GGUF files ---------------------------------------------------------------------------
_GGUF_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
               "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
               "block_sparse_moe.gate": "ffn_gate_inp"}


def _blocks(arr: np.ndarray, qtype: GT) -> np.ndarray:
    """``arr`` [..., k] as ``qtype``'s bytes [..., row bytes] (K-quants: our packer)."""
    flat = arr.reshape(-1, arr.shape[-1])
    raw = pack_kquant(flat, qtype) if qtype in BLOCK_BYTES else quantize(flat, qtype)
    return raw.reshape(*arr.shape[:-1], -1)


def _write_moe_gguf(hf: torch.nn.Module, path: Path, types: dict[str, GT] | None = None
                    ) -> None:
    """The layout llama.cpp's converter writes: qwen3moe, or Mixtral as llama with experts
    (its Q/K rows interleaved for llama.cpp's rotary), each layer's experts stacked; the
    tensors whose GGUF name ends in a key of ``types`` in that block type, the rest float32."""
    import gguf

    def add(name: str, arr: np.ndarray) -> None:
        qtype = next((q for k, q in (types or {}).items() if name.endswith(k)), None)
        if qtype is None:
            w.add_tensor(name, arr.copy())
        else:
            raw = _blocks(arr, qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)

    cfg = hf.config
    mixtral = isinstance(cfg, MixtralConfig)
    arch = "llama" if mixtral else "qwen3moe"
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if not mixtral:
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    w.add_eos_token_id(2)
    experts: dict[tuple[str, str], dict[int, Any]] = {}
    for name, t in hf.state_dict().items():
        arr = t.detach().float().numpy()
        parts = name.split(".")
        if parts[0] == "lm_head":
            add("output.weight", arr)
            continue
        if parts[1] in ("embed_tokens", "norm"):
            add(("token_embd" if parts[1] == "embed_tokens" else "output_norm") + ".weight",
                arr)
            continue
        layer, rest = parts[2], ".".join(parts[3:-1])
        if name.endswith(".experts.gate_up_proj"):  # transformers' own stacked [E, 2I, H]
            gate, up = np.split(arr, 2, axis=1)
            experts[(layer, "ffn_gate_exps")] = dict(enumerate(gate))
            experts[(layer, "ffn_up_exps")] = dict(enumerate(up))
            continue
        if name.endswith(".experts.down_proj"):
            experts[(layer, "ffn_down_exps")] = dict(enumerate(arr))
            continue
        if mixtral and rest in ("self_attn.q_proj", "self_attn.k_proj"):
            heads = cfg.num_attention_heads if "q_proj" in rest else cfg.num_key_value_heads
            arr = arr.reshape(heads, 2, arr.shape[0] // heads // 2, arr.shape[1]).swapaxes(
                1, 2).reshape(arr.shape)
        add(f"blk.{layer}.{_GGUF_BLOCK[rest]}.weight", arr)
    for (layer, kind), per in experts.items():
        add(f"blk.{layer}.{kind}.weight", np.stack([per[e] for e in sorted(per)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.usefixtures("private_model_cache")
def test_gguf_files_load_the_same_model(tiny_moe, tmp_path: Path) -> None:
    hf, _, _ = tiny_moe
    path = tmp_path / "moe.gguf"
    _write_moe_gguf(hf, path)
    source = resolve_model(str(path))
    config = load_model_config(source)
    assert config.architecture == hf.config.architectures[0]
    assert (config.num_experts, config.num_experts_per_tok) == (
        hf.config.num_local_experts, hf.config.num_experts_per_tok)
    ours = load_model(source, config, torch.float32, CPU)
    with torch.inference_mode():
        got = PagedDriver(ours).step([("a", PROMPT)])[0]
        ref = hf(torch.tensor([PROMPT])).logits[0].float()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.usefixtures("private_model_cache")
def test_gguf_experts_run_in_their_blocks_close_to_the_exact_engine(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts in Q8_0 (gate), Q4_K (up) and Q6_K (down), attention in Q8_0: quantization=
    "gguf" against the same file dequantized (the same weights, so what differs is the
    activations' int8 quantization per 32 only)."""
    torch.manual_seed(5)
    cfg = Qwen3MoeConfig(**{**COMMON, "hidden_size": 256, "num_attention_heads": 4,
                            "num_hidden_layers": 2}, head_dim=64, num_experts=4,
                         num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
    hf = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.08 * torch.randn_like(p))
        # Router logits far apart next to rounding: the stack and the op-by-op path round
        # differently (by ~1e-6), and a near tie in top-k would flip an expert between them.
        for layer in hf.model.layers:
            layer.mlp.gate.weight.mul_(8.0)
    path = tmp_path / "q.gguf"
    _write_moe_gguf(hf, path, {"ffn_gate_exps.weight": GT.Q8_0, "ffn_up_exps.weight": GT.Q4_K,
                               "ffn_down_exps.weight": GT.Q6_K, "attn_q.weight": GT.Q8_0,
                               "attn_k.weight": GT.Q8_0, "attn_v.weight": GT.Q8_0,
                               "attn_output.weight": GT.Q8_0})
    source = resolve_model(str(path))
    config = load_model_config(source)
    exact = load_model(source, config, torch.float32, CPU)
    quant = load_model(source, config, torch.float32, CPU, quantization="gguf")
    for layer in quant.model.layers:
        moe = layer.mlp
        assert moe.w13 is None and len(moe.quant_experts) == 4
        gate_up, down = moe.quant_experts[3]
        assert isinstance(gate_up, GGUFLinear) and isinstance(down, GGUFLinear)
        assert [t for t, _, _ in gate_up.tiles] == [int(GT.Q8_0), int(GT.Q4_K)]
        assert [t for t, _, _ in down.tiles] == [int(GT.Q6_K)]
    with torch.inference_mode():
        ref = PagedDriver(exact).step([("a", PROMPT)])[0]
        # The same blocks op by op and through the one-call stack (its MoE block).
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
        got = PagedDriver(quant).step([("a", PROMPT)])[0]
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
        stacked = PagedDriver(quant).step([("a", PROMPT)])[0]
        assert quant.small_batch.mode == "gguf"
        torch.testing.assert_close(stacked, got, atol=1e-4, rtol=1e-4)
        # The stack holds the experts' addresses from its first step: the swap below is
        # checked op by op.
        monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 0.08, f"max logit error {err:.4f} of the largest logit"
    # Against a wrong expert (expert 0's and 1's blocks swapped) the same check fails.
    moe = quant.model.layers[0].mlp
    pairs = list(moe.quant_experts)
    moe.quant_experts = torch.nn.ModuleList([pairs[1], pairs[0], *pairs[2:]])
    with torch.inference_mode():
        swapped = PagedDriver(quant).step([("a", PROMPT)])[0]
    wrong = (swapped - ref).abs().max() / ref.abs().max()
    assert wrong > 3 * err, (float(wrong), float(err))


class _SumOverRanks:
    """A stand-in tensor-parallel group: all_reduce keeps each rank's partial output, so the
    test can add them as the collective would."""

    def __init__(self, rank: int, size: int, seen: list[torch.Tensor]) -> None:
        self.rank, self.size, self.seen = rank, size, seen

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.clone())
        return t


@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "experts"])
def test_the_ranks_shares_of_a_moe_layer_sum_to_the_whole(expert_parallel: bool,
                                                         int8: bool) -> None:
    """Each rank's share of a layer, summed as the all-reduce sums them: the whole layer.
    With int8 experts (quantized after the split, as the loader does): whole experts are
    the one-process int8 experts, so the sum is that layer's output; a width split gives
    each rank int8 rows of its own columns, so the sum is checked against the float64
    oracle of those rows, rank by rank."""
    import copy

    from forerun.distributed.tensor_parallel import shard_moe
    from forerun.model.moe import FusedMoE
    from forerun.model.quant.int8_linear import int8_experts

    torch.manual_seed(2)
    moe = FusedMoE(32, 24, 8, 3, renormalize=True)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    x = torch.randn(9, 32)
    whole = copy.deepcopy(moe)
    if int8:
        whole.use_quantized_experts(int8_experts(whole))
    want = whole(x).double()
    seen: list[torch.Tensor] = []
    oracle = torch.zeros_like(want)
    for rank in range(2):
        part = copy.deepcopy(moe)
        shard_moe(part, _SumOverRanks(rank, 2, seen), expert_parallel)
        held = part.w13.shape[0] if expert_parallel else part.w13.shape[1]
        assert held == (4 if expert_parallel else 24)  # half the experts, or half the width
        if int8:
            part.use_quantized_experts(int8_experts(part))
            assert len(part.quant_experts) == (4 if expert_parallel else 8)
            if not expert_parallel:
                oracle += _int8_reference(part, x)
        part(x)
    got = (seen[0] + seen[1]).double()
    if int8:
        # And int8 is near the float layer (a bound that a wrong split would not meet).
        exact = moe(x).double()
        assert (got - exact).abs().max() / exact.abs().max() < 0.03
    if int8 and not expert_parallel:
        assert (got - oracle).abs().max() / oracle.abs().max() < 2e-5
        want = oracle
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["width", "experts"])
def test_the_ranks_shares_of_gguf_experts_sum_to_the_whole_layer(expert_parallel: bool) -> None:
    """Block-backed experts (Q8_0 gate/up, Q4_0 down) split over two ranks in their blocks:
    whole experts, or each expert's gate/up rows and down input columns (cut between
    blocks, so every block's integer dot product is the whole layer's). Summed as the
    all-reduce sums them, the ranks give the one-process quantized layer up to the order of
    the float sums."""
    from forerun.distributed.tensor_parallel import shard_moe
    from forerun.model.moe import FusedMoE

    torch.manual_seed(4)
    router = torch.randn(4, 64)
    weights = [(0.3 * torch.randn(128, 64), 0.3 * torch.randn(64, 64)) for _ in range(4)]

    def blocks(w: torch.Tensor, qtype: GT) -> tuple[int, torch.Tensor]:
        return int(qtype), torch.from_numpy(quantize(w.numpy(), qtype))

    def layer() -> FusedMoE:  # built afresh (a GGUF linear holds C pointers: no deepcopy)
        moe = FusedMoE(64, 64, 4, 2, renormalize=True)
        with torch.no_grad():
            moe.gate.weight.copy_(router)
        moe.use_quantized_experts([
            (GGUFLinear([blocks(w13[:64], GT.Q8_0), blocks(w13[64:], GT.Q8_0)], 64),
             GGUFLinear([blocks(w2, GT.Q4_0)], 64)) for w13, w2 in weights])
        return moe

    x = torch.randn(9, 64)
    want = layer()(x).double()
    seen: list[torch.Tensor] = []
    for rank in range(2):
        part = layer()
        shard_moe(part, _SumOverRanks(rank, 2, seen), expert_parallel)
        assert part.w13 is None and len(part.quant_experts) == (2 if expert_parallel else 4)
        gate_up, down = part.quant_experts[0]
        assert isinstance(gate_up, GGUFLinear) and isinstance(down, GGUFLinear)
        assert (gate_up.out_features, down.in_features) == (
            (128, 64) if expert_parallel else (64, 32))
        part(x)
    got = (seen[0] + seen[1]).double()
    assert want.abs().max() > 0.5
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_two_ranks_give_the_tokens_of_one_process(tiny_moe) -> None:
    """TP=2 with expert parallelism (whole experts per rank; the width split is checked
    above) against the one-process engine: real ranks, real all-reduces."""
    hf, _, folder = tiny_moe
    if isinstance(hf.config, MixtralConfig):
        pytest.skip("one architecture is enough for the ranks' arithmetic (and time)")
    prompts = [{"prompt_token_ids": PROMPT[:n]} for n in (4, 11)]
    params = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.9, seed=3, ignore_eos=True)]
    kw: dict[str, Any] = dict(model=str(folder), dtype="float32", max_model_len=128)
    one = LLM(**kw)
    try:
        want = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
    finally:
        one.shutdown()
    two = LLM(tensor_parallel_size=2, enable_expert_parallel=True, **kw)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        assert_all_blocks_free(two)
    finally:
        two.shutdown()
    assert got == want


def test_expert_parallel_sizes_must_divide_the_experts() -> None:
    from dataclasses import replace

    from forerun.distributed.tensor_parallel import check_tensor_parallel
    from forerun.model.config import ModelConfig

    cfg = ModelConfig.from_hf_dict({**VARIANTS["qwen3moe"]().to_dict(),
                                    "architectures": ["Qwen3MoeForCausalLM"]})
    cfg = replace(cfg, num_attention_heads=6, num_key_value_heads=3, intermediate_size=96,
                  moe_intermediate_size=50)  # 3 divides the heads, not 8 experts nor 50
    with pytest.raises(ValueError, match="does not divide the model's num_experts"):
        check_tensor_parallel(cfg, 3, expert_parallel=True)
    with pytest.raises(ValueError, match="does not divide the model's moe_intermediate_size"):
        check_tensor_parallel(cfg, 3)
    # 2 divides all of them (heads 6 and 6, experts 8, widths 96 and 50).
    check_tensor_parallel(replace(cfg, num_key_value_heads=6), 2, expert_parallel=True)
    check_tensor_parallel(replace(cfg, num_key_value_heads=6), 2)


def test_prepacking_leaves_the_router_to_the_c_block() -> None:
    """oneDNN's reordered linears replace every plain linear except a MoE layer's router,
    whose rows the C block reads: with it packed, every step past the small-batch path went
    to the per-expert loop."""
    from forerun.model.moe import FusedMoE
    from forerun.model.packed_linear import PackedLinear, prepack_linears, prepack_supported

    if not (prepack_supported(torch.bfloat16, CPU) and cpu_kernels.supports(torch.bfloat16, CPU)):
        pytest.skip("no pre-reordered linears or C kernels here")
    torch.manual_seed(5)
    block = nn.ModuleDict({"proj": nn.Linear(64, 64), "mlp": FusedMoE(64, 48, 8, 2, True)})
    block = block.to(torch.bfloat16)
    assert prepack_linears(block) == 1
    assert isinstance(block["proj"], PackedLinear)
    assert type(block["mlp"].gate) is nn.Linear
    assert block["mlp"]._c_block(torch.randn(3, 64).bfloat16()) is not None
