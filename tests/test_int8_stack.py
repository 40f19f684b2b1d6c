"""quantization="int8" through the one-call small-batch stack (decoder_stack.c's mixed
stack): the same tokens and logits as the int8 linears op by op, and the stack is taken."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from forerun.model import cpu_kernels
from forerun.model.loader import load_model, load_model_config, resolve_model
from forerun.model.quant.int8_linear import Int8Linear
from tests.paged_driver import PagedDriver

pytestmark = pytest.mark.skipif(cpu_kernels.kernel_library() is None,
                                reason="no C kernels here")
CPU = torch.device("cpu")
PROMPT = [5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with odd sizes: 90 wide (a weight block of 2 rows after 22 of 4 in the
    o and down projections, 26 values past the last 64 in every row of them), 150 inner."""
    torch.manual_seed(7)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(
        hidden_size=90, intermediate_size=150, num_hidden_layers=3, num_attention_heads=3,
        num_key_value_heads=1, vocab_size=320, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=False))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in name
                    else 0.15 * torch.randn_like(p))
    out = tmp_path_factory.mktemp("int8-stack")
    hf.save_pretrained(out)
    return out


def _load(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    source = resolve_model(str(folder))
    return load_model(source, load_model_config(source), dtype, CPU, quantization="int8")


def _run(model: torch.nn.Module, n: int) -> tuple[list[int], list[torch.Tensor], list[int]]:
    """Greedy ``n`` tokens after PROMPT for one sequence, then one decode step of three
    sequences (3 rows per linear): the tokens, every step's logits, the batch's argmax."""
    driver = PagedDriver(model)
    logits = [driver.step([("a", PROMPT)])[0][-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(n - 1):
        logits.append(driver.step([("a", [tokens[-1]])])[0][-1])
        tokens.append(int(logits[-1].argmax()))
    driver.step([("b", PROMPT[:5]), ("c", PROMPT[3:])])
    batch = driver.step([("a", [7]), ("b", [9]), ("c", [11])])
    logits += [row[-1] for row in batch]
    return tokens, logits, [int(row[-1].argmax()) for row in batch]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_through_the_stack_equals_op_by_op(folder: Path, dtype: torch.dtype,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    if dtype == torch.bfloat16 and not cpu_kernels.small_matmul_is_fast(dtype):
        pytest.skip("no AVX512-BF16 small matmul: bfloat16 int8 models decode op by op")
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    op_model = _load(folder, dtype)
    assert isinstance(op_model.model.layers[0].mlp.down_proj, Int8Linear)
    with torch.inference_mode():
        ref_tokens, ref_logits, ref_batch = _run(op_model, 12)
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
    calls: list[torch.dtype] = []
    real = cpu_kernels.decoder_stack_mixed
    monkeypatch.setattr(cpu_kernels, "decoder_stack_mixed",
                        lambda dt: calls.append(dt) or real(dt))
    model = _load(folder, dtype)
    with torch.inference_mode():
        tokens, logits, batch = _run(model, 12)
    assert model.small_batch.mode == "mixed"
    assert len(calls) == 12 + 2, "the stack was not taken for every step"
    assert tokens == ref_tokens
    assert batch == ref_batch
    # Same int8 kernels and rescale; only the float q/k/v matmul rounds differently (and
    # the int8 activation rows move by a level where that crosses a rounding boundary).
    tol = 2e-3 if dtype == torch.float32 else 6e-2
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, atol=tol * float(want.abs().max()), rtol=0)


def test_int8_stack_is_the_layers_own_int8_linears(folder: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 linears' own rows feed the stack: perturbing one of them moves its logits
    (no stale copy), and the bytes a step streams count them at one byte a weight (their
    tiles' padding too)."""
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "1000")
    model = _load(folder, torch.float32)
    with torch.inference_mode():
        before = PagedDriver(model).step([("a", PROMPT)])[0][-1]
        down = model.model.layers[1].mlp.down_proj
        down.weight_q.neg_()
        down.weight_sum.neg_()
        after = PagedDriver(model).step([("a", PROMPT)])[0][-1]
    assert not torch.allclose(before, after, atol=1e-3)
    cfg = model.config
    h, i, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    qkv = h * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim
    def tiled(n: int, k: int) -> int:  # int8 tiles: rows to whole 16s, k to whole 4s
        return -(-n // 16) * 16 * (-(-k // 4) * 4)
    int8 = tiled(h, h) + tiled(2 * i, h) + tiled(h, i)
    expected = layers * (4 * qkv + int8 + 4 * (h + 2 * i + h)) + 4 * cfg.vocab_size * h
    assert model.small_batch.streamed_bytes() == expected


def test_int8_engine_async_equals_sync_on_the_stack(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine with quantization="int8" decodes through the stack by default, and the
    asynchronous scheduler gives the synchronous one's tokens."""
    from forerun import LLM, SamplingParams
    from forerun.model.small_batch import SmallBatchStack
    from tests.tiny_model import write_tiny_llama

    write_tiny_llama(tmp_path, num_layers=3)
    steps: list[tuple[str | None, int]] = []
    forward = SmallBatchStack.forward

    def counted(self: SmallBatchStack, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        steps.append((self.mode, x.shape[0]))
        return forward(self, x, *args, **kwargs)

    monkeypatch.setattr(SmallBatchStack, "forward", counted)
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["w5z w17z w250z w3z", "w99z w42z", "w7z w300z w12z w64z w1z w8z"]
    out = {}
    for mode in ("off", "on"):
        steps.clear()
        llm = LLM(str(tmp_path), quantization="int8", async_scheduling=mode,
                  kv_cache_memory_bytes=16 << 20, max_model_len=128)
        try:
            out[mode] = [o.outputs[0].token_ids
                         for o in llm.generate(prompts, sp, use_tqdm=False)]
        finally:
            llm.shutdown()
        assert len(steps) >= 15 and all(m == "mixed" for m, _ in steps), steps
    assert out["on"] == out["off"]


def test_bfloat16_int8_stack_takes_decode_steps_of_up_to_32_rows_without_amx(
        folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the int8 VNNI body, the bfloat16 register tiles and no AMX under oneDNN, a
    32-sequence decode step runs in one call (faster there than op by op), with
    the op-by-op path's greedy tokens; elsewhere the stack keeps to 8 rows."""
    monkeypatch.delenv("FORERUN_SMALL_BATCH_TOKENS", raising=False)
    model = _load(folder, torch.bfloat16)
    fast = (cpu_kernels.small_matmul_is_fast(torch.bfloat16)
            and cpu_kernels.int8_matmul_isa() == "avx512vnni"
            and "AMX" not in torch.backends.cpu.get_cpu_capability())
    with torch.inference_mode():
        PagedDriver(model).step([("a", PROMPT)])  # settles the stack's mode
    assert model.small_batch.max_tokens(torch.bfloat16) == (32 if fast else 8)
    if not fast:
        pytest.skip("no AVX512-VNNI int8 body or bf16 tiles, or oneDNN has AMX here")
    seqs = [(s, [(7 * s + j) % 300 + 3 for j in range(6)]) for s in range(32)]

    def decode(model: torch.nn.Module) -> list[int]:
        driver = PagedDriver(model)
        for s, prompt in seqs:
            driver.step([(s, prompt)])
        rows = driver.step([(s, [prompt[-1]]) for s, prompt in seqs])
        return [int(r[-1].argmax()) for r in rows]

    calls: list[torch.dtype] = []
    real = cpu_kernels.decoder_stack_mixed
    monkeypatch.setattr(cpu_kernels, "decoder_stack_mixed",
                        lambda dt: calls.append(dt) or real(dt))
    with torch.inference_mode():
        got = decode(model)
    assert len(calls) == 33, "the 32-row step did not take the stack"
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    with torch.inference_mode():
        want = decode(_load(folder, torch.bfloat16))
    assert sum(a == b for a, b in zip(got, want, strict=True)) >= 30  # bf16 q/k/v rounding
