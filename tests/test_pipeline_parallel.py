"""Pipeline parallel over torch.distributed (gloo): the same tokens as one process.

Oracle: the single-process engine on the same weights (float32), token for token, for
greedy and seeded requests, sync (queue depth pp) and async (pp + 1), with preemption under
KV pressure and prefix-cache hits; plus the process table (no rank outlives its engine),
the error a dead stage gives, and the errors bad sizes give before any process starts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from hypothesis import HealthCheck, given, settings

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.distributed.pipeline_parallel import stage_layers
from forerun.engine.async_llm import AsyncLLM
from tests.conftest import assert_all_blocks_free
from tests.server_harness import ServerHandle, child_pids, engine_pid, pid_alive, start_server
from tests.test_scheduler_properties import assert_lossless_prefixes, workloads
from tests.test_scheduler_properties import run as run_workload
from tests.test_tensor_parallel import (
    PARAMS,
    PROMPTS,
    assert_a_killed_rank_fails_the_run_and_leaves_no_process,
    assert_default_model_split_like_one_process,
    assert_two_nodes_give,
    rank_pids,
    run,
)
from tests.tiny_model import write_tiny_llama


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_pp")
    write_tiny_llama(folder, seed=7, num_layers=4)
    return folder


def kwargs(tiny_dir: Path, mode: str) -> dict:
    return dict(model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4,
                async_scheduling=mode)


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> list[list[int]]:
    one = LLM(**kwargs(tiny_dir, "off"))
    try:
        return run(one)
    finally:
        one.shutdown()


# Two async stages alone are not here: the data-parallel, two-node and default-model tests
# below check their tokens, and every engine here costs its ranks' start-up.
@pytest.mark.parametrize("mode,pp,tp", [("off", 2, 1), ("on", 3, 1), ("on", 2, 2)])
def test_stages_give_the_tokens_of_one_process(tiny_dir, want, mode, pp, tp):
    # A small pool: requests preempt each other while others' steps are in flight; the
    # second run hits the prefix cache.
    llm = LLM(pipeline_parallel_size=pp, tensor_parallel_size=tp, num_gpu_blocks_override=14,
              **kwargs(tiny_dir, mode))
    try:
        stats = llm.stats()
        assert stats.async_scheduling == (mode == "on")
        assert stats.max_concurrent_batches == pp + (mode == "on")
        assert run(llm) == want
        assert llm.stats().scheduler.num_preemptions > 0
        hits = llm.stats().kv_cache.prefix_cache_hits
        assert run(llm) == want  # the same prompts again: their full blocks are cached
        assert llm.stats().kv_cache.prefix_cache_hits > hits
        assert_all_blocks_free(llm)
        assert len(rank_pids()) == pp * tp - 1
    finally:
        llm.shutdown()
    assert rank_pids() == []


def test_two_data_parallel_engines_of_two_stages_each_serve_the_same_tokens(tiny_dir, want):
    """DP = 2 x PP = 2 behind one AsyncLLM: two engine-core processes, each the parent of
    its last stage's process (so the cores are not daemonic); both engines get work."""

    async def serve() -> tuple[list[list[int]], list[int]]:
        engine = AsyncLLM(EngineConfig(data_parallel_size=2, pipeline_parallel_size=2,
                                       **kwargs(tiny_dir, "on")))
        try:
            async def one(i: int) -> list[int]:
                tokens: list[int] = []
                async for out in engine.generate({"prompt_token_ids": PROMPTS[i]}, PARAMS[i],
                                                 f"r{i}"):
                    tokens = out.outputs[0].token_ids
                return tokens

            got = await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
            steps = [s.scheduler.steps for s in await engine.get_engine_stats()]
            await engine.shutdown_async()
        finally:
            engine.shutdown()
        return list(got), steps

    got, steps = asyncio.run(serve())
    assert got == want
    assert len(steps) == 2 and all(n > 0 for n in steps)
    assert rank_pids() == []


def test_bfloat16_stages_with_prepacked_weights_give_the_tokens_of_one_process(
        tiny_dir, monkeypatch):
    """In bfloat16 the one-call small-batch path (which stages cannot use: it runs every
    layer) rounds differently from the per-op path, so the one-process oracle runs without
    it; the oneDNN-prepacked linears are on in both."""
    monkeypatch.setenv("FORERUN_SMALL_BATCH_TOKENS", "0")
    kw = {**kwargs(tiny_dir, "on"), "dtype": "bfloat16"}
    one = LLM(**kw)
    try:
        want = run(one)
    finally:
        one.shutdown()
    llm = LLM(pipeline_parallel_size=2, **kw)
    try:
        assert run(llm) == want
    finally:
        llm.shutdown()


def test_every_stage_is_busy_with_its_own_requests(tiny_dir):
    """With async scheduling and depth pp + 1 the scheduler alternates the requests between
    steps, so no step feeds a sample the last stage has not produced yet."""
    llm = LLM(pipeline_parallel_size=2, **kwargs(tiny_dir, "on"))
    try:
        core = llm.llm_engine.engine_core
        sched = core.scheduler
        seen: list[set[str]] = []
        schedule = sched.schedule

        def spy():
            so = schedule()
            seen.append(set(so.num_scheduled_tokens))
            return so

        sched.schedule = spy
        prompts = [{"prompt_token_ids": [i + 1, i + 2, i + 3]} for i in range(8)]
        llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                     use_tqdm=False)
    finally:
        llm.shutdown()
    nonempty = [s for s in seen if s]
    assert len(nonempty) >= 2 * 12
    assert max(len(s) for s in nonempty) <= 4  # half of the 8 requests per step
    for a, b in zip(seen, seen[1:], strict=False):
        assert not a & b  # consecutive steps never share a request


@pytest.mark.slow
def test_default_model_in_two_stages_gives_the_same_tokens(llm_cache):
    """SmolLM2 ties its output head to the embedding: the last stage keeps the rows."""
    assert_default_model_split_like_one_process(llm_cache, pipeline_parallel_size=2)


FAULT_TEST = "test_a_stage_that_dies_or_hangs_mid_stream_fails_every_client_and_every_process_exits"


@pytest.fixture(scope="module")
def fault_servers(tiny_dir: Path, request: pytest.FixtureRequest
                  ) -> Iterator[dict[str, ServerHandle]]:
    """One `forerun serve -pp 2` per selected fault case, all started when the first case
    runs: their interpreters' imports and stage starts overlap instead of queueing. Each
    case breaks its own server."""
    faults = {item.callspec.params["fault"] for item in request.session.items
              if item.module is request.module and item.originalname == FAULT_TEST}
    handles = {fault: start_server("--model", str(tiny_dir), "--max-model-len", "256",
                                   "--pipeline-parallel-size", "2", fresh=True,
                                   env={"FORERUN_COLLECTIVE_TIMEOUT_S": "3"})
               for fault in sorted(faults)}
    yield handles
    for handle in handles.values():
        handle.stop()


@pytest.mark.parametrize("fault", ["dies", "hangs"])
def test_a_stage_that_dies_or_hangs_mid_stream_fails_every_client_and_every_process_exits(
        fault_servers, fault):
    """`forerun serve -pp 2`: four clients stream; the last stage is stopped (SIGSTOP) as
    soon as the first token arrives, so no request can finish, then killed or left hung
    (the collective timeout is 3 s here). Every client gets an error, the server exits 1,
    and no process of it is left."""
    server = fault_servers[fault]
    server.wait_healthy()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                           timeout=120)
    model = client.models.list().data[0].id
    core = engine_pid(server.proc.pid)
    (stage,) = child_pids(core)
    first = threading.Event()

    def stream(i: int) -> str:
        try:
            for _ in client.completions.create(
                    model=model, prompt=f"w{5 + i}z w17z w250z", max_tokens=200, stream=True,
                    extra_body={"ignore_eos": True}):
                first.set()
            return "finished"
        except openai.APIError as exc:
            return f"error: {exc}"

    try:
        with ThreadPoolExecutor(4) as pool:
            results = [pool.submit(stream, i) for i in range(4)]
            assert first.wait(60)
            os.kill(stage, signal.SIGSTOP)
            if fault == "dies":
                os.kill(stage, signal.SIGKILL)
            outcomes = [r.result(timeout=90) for r in results]
        assert all(o.startswith("error") for o in outcomes), outcomes
        assert server.proc.wait(90) == 1, server.log()[-3000:]
        deadline = time.monotonic() + 30
        while pid_alive(core) or pid_alive(stage):
            assert time.monotonic() < deadline, server.log()[-3000:]
            time.sleep(0.1)
    finally:
        if pid_alive(stage):
            os.kill(stage, signal.SIGKILL)
        server.stop()


@pytest.mark.parametrize("sizes", [{"tensor_parallel_size": 2},
                                   {"pipeline_parallel_size": 2}])
def test_an_engine_idle_longer_than_the_collective_timeout_still_runs(tiny_dir, monkeypatch,
                                                                       sizes):
    """Ranks wait for the next call with the collective timeout; while the engine idles,
    rank 0 pings them, so an idle minute does not end them."""
    monkeypatch.setenv("FORERUN_COLLECTIVE_TIMEOUT_S", "2")
    llm = LLM(**sizes, **kwargs(tiny_dir, "on"))
    try:
        first = run(llm)
        time.sleep(3.5)  # well past the 2 s timeout
        assert run(llm) == first
    finally:
        llm.shutdown()
    assert rank_pids() == []


def test_two_nodes_on_localhost_run_one_stage_each(tiny_dir, want):
    """--nnodes 2 -pp 2: node 1 runs the last stage, this process the engine and the first."""
    assert_two_nodes_give(want, tiny_dir, pipeline_parallel_size=2, async_scheduling="on")


# (async scheduling, queue depth, pipeline stages): the defaults for pp = 2 and 3, and the
# sync queue pp deep.
PIPELINE_ENGINES = [(False, 2, 2), (True, 3, 2), (True, 4, 3)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(with_aborts=True))
def test_pipeline_schedules_keep_every_invariant_at_depth_pp_and_pp_plus_one(w):
    """The max_tokens guard, the deferred-free fence and stale output under preemption at
    queue depths 2 to 4 with the pipeline rules: the harness checks the scheduler's
    invariants after every event; outputs equal the workload's oracle (aborted ones are
    prefixes of it); every block is released."""
    for async_scheduling, depth, pp in PIPELINE_ENGINES:
        h = run_workload(w, async_scheduling, depth, pipeline_parallel_size=pp)
        assert_lossless_prefixes(h, w, (depth, pp))


def test_stage_layers_split_contiguously_with_the_longer_stages_first():
    assert [(s.start_layer, s.end_layer) for s in
            (stage_layers(30, 4, i) for i in range(4))] == [(0, 8), (8, 16), (16, 23),
                                                            (23, 30)]
    assert stage_layers(4, 4, 3).is_last and stage_layers(4, 4, 0).is_first
    stage = stage_layers(30, 4, 1)
    assert stage.local_name("model.layers.9.mlp.down_proj.weight") == \
        "model.layers.1.mlp.down_proj.weight"
    assert stage.local_name("model.layers.16.mlp.down_proj.weight") is None
    assert stage.local_name("model.norm.weight") == "model.norm.weight"


def test_bad_sizes_are_refused_before_any_process_starts(tiny_dir):
    with pytest.raises(ValueError, match="pipeline_parallel_size=5 is more stages than"):
        LLM(model=str(tiny_dir), pipeline_parallel_size=5)
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        LLM(model=str(tiny_dir), pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 does not support "
                                         "quantization"):
        EngineConfig(model=str(tiny_dir), pipeline_parallel_size=2, quantization="int8")
    with pytest.raises(ValueError, match="nnodes=2 must divide"):
        EngineConfig(pipeline_parallel_size=3, nnodes=2, master_port=1234)
    assert rank_pids() == []


def test_a_dead_stage_is_an_error_not_a_hang_and_leaves_no_process(tiny_dir):
    assert_a_killed_rank_fails_the_run_and_leaves_no_process(
        LLM(pipeline_parallel_size=2, **kwargs(tiny_dir, "on")))
