"""Tensor parallel over torch.distributed (gloo): the same tokens as one process.

Oracle: the single-process engine on the same weights (float32), token for token, for
greedy and seeded requests, sync and async, with preemption under KV pressure; plus the
process table (no rank outlives its engine) and the error a bad size gives.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.distributed.parallel_state import free_port
from forerun.worker.executor import run_on_worker_thread
from tests.conftest import assert_all_blocks_free
from tests.server_harness import pid_alive, started_pids
from tests.tiny_model import write_tiny_llama, write_word_tokenizer

PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 300, 12, 64, 1], [9, 8, 7, 6, 5, 9, 8],
           [100, 200, 300, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11], [44, 45, 46]]
PARAMS = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.9, seed=5, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=9, ignore_eos=True)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_tp")
    write_tiny_llama(folder, seed=7)  # 4 heads, 2 KV heads, intermediate 128
    return folder


def run(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def rank_pids() -> list[int]:
    """This process's live rank (and engine-core) processes."""
    return started_pids(os.getpid())


def worker_thread_setup() -> tuple[set[int], int]:
    """The CPUs and torch thread count of the process's shared worker thread."""
    return run_on_worker_thread(lambda: (os.sched_getaffinity(0), torch.get_num_threads()))


@pytest.mark.parametrize("mode", ["off", "on"])
def test_two_ranks_give_the_tokens_of_one_process(tiny_dir, mode):
    kw = dict(model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4,
              async_scheduling=mode)
    one = LLM(**kw)
    want = run(one)
    one.shutdown()
    before = worker_thread_setup()
    # A small pool: requests preempt each other, so resumed rows are rebuilt on every rank.
    two = LLM(tensor_parallel_size=2, num_gpu_blocks_override=14, **kw)
    try:
        assert run(two) == want
        assert two.stats().scheduler.num_preemptions > 0
        assert_all_blocks_free(two)
        assert len(rank_pids()) == 1
    finally:
        two.shutdown()
    assert rank_pids() == []
    # The process's shared worker thread has its CPUs and threads back for later engines.
    assert worker_thread_setup() == before


def prompt_logprobs(llm: LLM) -> torch.Tensor:
    """The log-probability of each prompt token after the first, all prompts in a row."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return torch.tensor([pos[t].logprob for o, p in zip(outs, PROMPTS, strict=True)
                         for pos, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)])


def test_int8_weights_split_over_two_ranks_stay_near_one_process(tiny_dir):
    """quantization="int8" with TP=2: each rank quantizes its own share after the split
    (the row-parallel o and down projections per output channel over its input columns,
    so not bit for bit the one-process int8 rows). The prompts' teacher-forced
    log-probabilities stay as near the one-process int8 engine's as int8 is to the exact
    engine, and the ranks' engine generates and frees every block."""
    kw = dict(model=str(tiny_dir), dtype="float32", max_model_len=128)
    engines = {"exact": {}, "int8": {"quantization": "int8"},
               "int8-tp2": {"quantization": "int8", "tensor_parallel_size": 2}}
    got = {}
    for name, extra in engines.items():
        llm = LLM(**kw, **extra)
        try:
            got[name] = prompt_logprobs(llm)
            if name == "int8-tp2":
                tokens = run(llm)
                assert all(len(t) == 20 for t in tokens)
                assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    quant_err = (got["int8"] - got["exact"]).abs().max()
    split_err = (got["int8-tp2"] - got["int8"]).abs().max()
    assert 0 < quant_err < 0.2, float(quant_err)
    assert split_err <= 2 * quant_err, (float(split_err), float(quant_err))
    assert rank_pids() == []


GGUF_PROMPTS = [[5, 17, 250, 3, 99, 42, 7, 200, 12, 64, 1], [9, 8, 7, 6, 5, 9, 8],
                [100, 200, 30, 10, 20, 30, 40, 50, 60, 70, 80, 90, 11]]


@pytest.mark.parametrize("mix", ["Q8_0-tied", "Q4_K_M-untied"])
def test_gguf_blocks_split_over_two_ranks_give_the_logprobs_of_one_process(
        tmp_path: Path, mix: str) -> None:
    """quantization="gguf" with TP=2: each rank keeps its rows (q/k/v, gate/up, the
    vocabulary of the embedding and head) and its input columns (o, down) in their blocks.
    Every block's integer dot product is the one-process one; only the order of the float
    sums differs. So the prompts' log-probabilities are the one-process engine's to float
    rounding at almost every position (a last-bit difference now and then moves an
    activation across an 8-bit rounding step: well within the quantization's own error),
    greedy tokens are equal, and every block is freed."""
    from gguf import GGMLQuantizationType as GT

    from tests.test_quant_e2e import _Q4_K_M, _write_tiny_gguf

    file = tmp_path / f"{mix}.gguf"
    if mix == "Q8_0-tied":
        # hidden 64, MLP 128: 32 and 64 input columns a rank, whole Q8_0 blocks
        _write_tiny_gguf(file, GT.Q8_0, tied=True, seed=3, inter=128)
    else:  # 256 columns a rank: one K-quant super-block
        _write_tiny_gguf(file, GT.Q4_K, tied=False, seed=4, hidden=512, inter=512,
                         types=_Q4_K_M, std=0.05)
    write_word_tokenizer(tmp_path / "tok", vocab=256, eos=3)  # the file has no vocabulary
    kw = dict(model=str(file), tokenizer=str(tmp_path / "tok"), dtype="float32",
              max_model_len=128)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = {}
    for name, extra in {"exact": {}, "gguf": {"quantization": "gguf"},
                        "gguf-tp2": {"quantization": "gguf", "tensor_parallel_size": 2}
                        }.items():
        llm = LLM(**kw, **extra)
        try:
            lp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
            outs = llm.generate([{"prompt_token_ids": p} for p in GGUF_PROMPTS], lp,
                                use_tqdm=False)
            logprobs = torch.tensor([pos[t].logprob for o, p in zip(outs, GGUF_PROMPTS,
                                                                      strict=True)
                                     for pos, t in zip(o.prompt_logprobs[1:], p[1:],
                                                       strict=True)])
            tokens = [o.outputs[0].token_ids for o in llm.generate(
                [{"prompt_token_ids": p} for p in GGUF_PROMPTS], params, use_tqdm=False)]
            got[name] = (logprobs, tokens)
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    (exact, _), (one, one_tokens), (two, two_tokens) = got.values()
    quant_err = (one - exact).abs()
    split_err = (two - one).abs()
    assert quant_err.max() > 1e-3  # the blocks are what ran, not dequantized weights
    assert split_err.median() < 1e-5, split_err
    assert split_err.max() < quant_err.max(), (float(split_err.max()), float(quant_err.max()))
    assert two_tokens == one_tokens
    assert rank_pids() == []


def assert_default_model_split_like_one_process(llm_cache, **sizes: int) -> None:
    """SmolLM2 in float32 split by ``sizes`` gives the one-process engine's greedy tokens."""
    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time"]
    params = SamplingParams(max_tokens=16, temperature=0.0)
    want = [o.outputs[0].token_ids for o in llm_cache().generate(prompts, params,
                                                                 use_tqdm=False)]
    llm = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20, max_model_len=512, **sizes)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()
    assert got == want


@pytest.mark.slow
def test_default_model_split_three_ways_gives_the_same_tokens(llm_cache):
    assert_default_model_split_like_one_process(llm_cache, tensor_parallel_size=3)


def test_a_size_the_model_cannot_split_by_is_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(ValueError, match="tensor_parallel_size=3 does not divide"):
        LLM(model=str(tiny_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(model=str(tiny_dir), tensor_parallel_size=0)
    assert rank_pids() == []


def assert_a_killed_rank_fails_the_run_and_leaves_no_process(llm: LLM) -> None:
    """Kill ``llm``'s one rank process: the next run raises (well within the collective
    timeout), and after shutdown no rank process is left."""
    try:
        (pid,) = rank_pids()
        os.kill(pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(Exception):  # noqa: B017 - gloo's error type varies by cause
            run(llm)
        assert time.monotonic() - start < 90
    finally:
        llm.shutdown()
    deadline = time.monotonic() + 15
    while pid_alive(pid):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert rank_pids() == []


def test_a_dead_rank_is_an_error_not_a_hang_and_leaves_no_process(tiny_dir):
    assert_a_killed_rank_fails_the_run_and_leaves_no_process(LLM(
        model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4,
        tensor_parallel_size=2))


def assert_two_nodes_give(want: list[list[int]], model_dir: Path, **kw: Any) -> None:
    """Node 1 is a `forerun serve --node-rank 1` process that runs its ranks only; this
    process is node 0 (the engine and its ranks); they meet over TCP. ``kw`` are the
    engine's settings (sizes and async mode), given to both nodes."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in kw.items()]
    node1 = subprocess.Popen(
        [sys.executable, "-m", "forerun.cli", "serve", "--model", str(model_dir),
         "--dtype", "float32", "--max-model-len", "128", "--block-size", "4", *flags,
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, block_size=4,
                  nnodes=2, node_rank=0, master_port=port, **kw)
        try:
            assert run(llm) == want
            assert rank_pids() == []  # the other ranks run on the other "node"
        finally:
            llm.shutdown()
        # Node 0 ended the group: node 1's ranks and node 1 itself exit cleanly.
        code = node1.wait(60)
        assert code == 0, node1.stdout.read().decode()[-3000:] if node1.stdout else code
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)


def test_two_nodes_on_localhost_give_the_tokens_of_one_process(tiny_dir):
    one = LLM(model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4)
    want = run(one)
    one.shutdown()
    assert_two_nodes_give(want, tiny_dir, tensor_parallel_size=2)


def test_multi_node_settings_are_checked():
    with pytest.raises(ValueError, match="master_port"):
        EngineConfig(tensor_parallel_size=2, nnodes=2)
    with pytest.raises(ValueError, match="nnodes=2 must divide"):
        EngineConfig(tensor_parallel_size=3, nnodes=2, master_port=1234)
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234)


def test_torchrun_launches_one_rank_per_process(tiny_dir):
    """`torchrun --nproc-per-node 2 -m forerun.cli generate ... -tp 2`: RANK 0 runs the engine
    and prints the text, RANK 1 runs its rank; the text is the single-process one."""
    args = ["generate", "w5z w17z w250z w3z", "--model", str(tiny_dir), "--dtype", "float32",
            "--max-tokens", "8", "--max-model-len", "128"]
    one = LLM(model=str(tiny_dir), dtype="float32", max_model_len=128)
    try:
        want = one.generate(["w5z w17z w250z w3z"], SamplingParams(max_tokens=8, temperature=0),
                            use_tqdm=False)[0].outputs[0].text
    finally:
        one.shutdown()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                          "2", "--master-port", str(free_port()), "-m", "forerun.cli", *args,
                          "-tp", "2"], capture_output=True, text=True, timeout=300, env=env)
    assert two.returncode == 0, two.stderr[-3000:]
    assert two.stdout == want + "\n"


def test_vocab_parallel_embedding_rows_sum_to_the_whole_with_a_padded_vocabulary():
    from forerun.distributed.parallel_state import TensorParallelGroup
    from forerun.distributed.tensor_parallel import VocabParallelEmbedding

    class Local(TensorParallelGroup):  # one process plays every rank; the test sums
        def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
            return x

    full = torch.randn(10, 4, dtype=torch.float64)  # 10 rows over 3 ranks: 4, 4, 2 + pad
    ids = torch.tensor([0, 3, 4, 7, 8, 9])
    shards = [VocabParallelEmbedding(full, Local(r, 3)) for r in range(3)]
    assert [s.weight.shape[0] for s in shards] == [4, 4, 4]
    assert torch.equal(sum(s(ids) for s in shards), full[ids])


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "IQ4_NL", "Q3_K", "Q4_K", "Q6_K", "IQ4_XS"])
def test_gguf_rows_and_columns_of_a_rank_are_those_of_the_dequantized_matrix(qtype: str):
    """A rank's share of a block-backed linear, cut from the blocks: rows (with zero rows
    of padding, as the last rank of a vocabulary gets) and whole blocks of input columns
    dequantize (by gguf's own reader) to exactly that part of the whole matrix; a cut
    inside a block is refused with a message that names the block size."""
    import numpy as np
    from gguf import GGMLQuantizationType as GT
    from gguf.quants import dequantize

    from forerun.model.quant.gguf_linear import GGUFLinear
    from tests.kquant_pack import pack_blocks

    t = GT[qtype]
    w = np.random.default_rng(1).standard_normal((40, 512)).astype(np.float32)
    raw = pack_blocks(w, t)
    whole = dequantize(raw, t)
    lin = GGUFLinear([(int(t), torch.from_numpy(raw))], 512)

    def dense(part: GGUFLinear) -> np.ndarray:
        ((pt, rows),) = part.parts
        return dequantize(rows.numpy(), GT(pt))

    ids = torch.tensor([3, 4, 5, 17, 39])
    got = dense(lin.take_rows(ids, pad=2))
    assert np.array_equal(got[:5], whole[ids.numpy()]) and not got[5:].any()
    assert np.array_equal(dense(lin.take_columns(256, 512)), whole[:, 256:])
    block = 256 if qtype in ("Q3_K", "Q4_K", "Q6_K", "IQ4_XS") else 32
    with pytest.raises(ValueError, match=f"inside its blocks of {block}"):
        lin.take_columns(0, 128 + 16)
