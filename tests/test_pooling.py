"""The pooling runner on tiny random models: embeddings against transformers' final-normed
hidden states of the same weights, pooled the same way; chunked prefill, prefix-cache hits,
pooling mixed with generation, the async engine, and validation."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from forerun import LLM, SamplingParams
from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM
from forerun.outputs import PoolingRequestOutput, RequestOutput
from forerun.pooling_params import PoolerConfig, PoolingParams
from forerun.server.embeddings import embed_texts
from tests.conftest import assert_all_blocks_free
from tests.tiny_model import write_tiny_llama, write_word_tokenizer

VOCAB = 320
ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 8 << 20, "max_model_len": 256}
# Mixed lengths; the last two share their first 32 tokens (two full blocks of 16).
PROMPTS = [
    [1, 17, 42, 5],
    [1, *range(100, 137)],
    [1, *range(200, 231), 7, 8, 9, 10, 11],
    [1, *range(200, 231), 60, 61, 62],
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    folder = tmp_path_factory.mktemp("tiny-llama-pool")
    return str(folder), write_tiny_llama(folder, VOCAB)


@pytest.fixture(scope="module")
def engines(tiny: tuple[str, Any]) -> Any:
    """The reference (whole prompts, no prefix cache) and a chunked, caching engine."""
    folder, _ = tiny
    made = {
        "ref": LLM(folder, runner="pooling", enable_prefix_caching=False, **ENGINE),
        "chunked": LLM(folder, runner="pooling", max_num_batched_tokens=8, **ENGINE),
        "gen": LLM(folder, max_num_batched_tokens=16, **ENGINE),
    }
    yield made
    for llm in made.values():
        llm.shutdown()


def _hf_pooled(hf: Any, ids: list[int], kind: str, dims: int | None,
               normalize: bool) -> torch.Tensor:
    with torch.no_grad():
        # The last entry is after the final norm: what forerun's model returns, and what
        # vLLM pools.
        h = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0].float()
    vec = {"LAST": h[-1], "MEAN": h.mean(0), "CLS": h[0]}[kind]
    if dims is not None:
        vec = vec[:dims]
    return F.normalize(vec, dim=0) if normalize else vec


def _vectors(outs: list[Any]) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.mark.parametrize(("kind", "dims", "normalize"), [
    ("LAST", None, True), ("MEAN", None, True), ("CLS", None, True), ("LAST", None, False),
    ("MEAN", 16, True), ("LAST", 24, False)])
def test_embeddings_match_transformers_hidden_states_pooled_the_same_way(
        tiny: tuple[str, Any], engines: Any, kind: str, dims: int | None,
        normalize: bool) -> None:
    _, hf = tiny
    llm = engines["chunked"]  # prompts of up to 37 tokens in chunks of 8
    params = PoolingParams(dimensions=dims, normalize=normalize, pooling_type=kind)
    outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for p, out in zip(PROMPTS, outs, strict=True):
        want = _hf_pooled(hf, p, kind, dims, normalize)
        got = torch.tensor(out.outputs.embedding)
        assert out.prompt_token_ids == p and got.shape == want.shape
        assert F.cosine_similarity(got, want, dim=0) >= 0.9999
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # the length too
    assert_all_blocks_free(llm)


def test_chunked_batch_with_prefix_hits_gives_the_vectors_of_one_at_a_time(
        engines: Any) -> None:
    ref, llm = engines["ref"], engines["chunked"]
    for kind in ("LAST", "MEAN"):
        params = PoolingParams(pooling_type=kind)
        alone = torch.cat([_vectors(ref.embed([{"prompt_token_ids": p}], params,
                                              use_tqdm=False)) for p in PROMPTS])
        hits_before = llm.stats().kv_cache.prefix_cache_hits
        batch = [{"prompt_token_ids": p} for p in PROMPTS]
        first = _vectors(llm.embed(batch, params, use_tqdm=False))
        again = _vectors(llm.embed(batch, params, use_tqdm=False))  # every prompt cached
        hits = llm.stats().kv_cache.prefix_cache_hits - hits_before
        torch.testing.assert_close(first, alone, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(again, alone, rtol=1e-5, atol=1e-5)
        # LAST uses cached blocks; MEAN must compute every position, so it never looks.
        assert (hits > 0) == (kind == "LAST"), (kind, hits)
    assert_all_blocks_free(llm)


def test_pooling_mixed_with_generation_leaves_both_unchanged(engines: Any) -> None:
    gen, ref = engines["gen"], engines["ref"]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    gen_prompts = [[1, 9, 8, 7], [1, *range(50, 70)]]
    alone = [o.outputs[0].token_ids for o in gen.generate(
        [{"prompt_token_ids": p} for p in gen_prompts], sp, use_tqdm=False)]
    want = _vectors(ref.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False))
    engine = gen.llm_engine
    for i, p in enumerate(gen_prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": p}, sp)
    for i, p in enumerate(PROMPTS):  # queued behind the generations: they share steps
        engine.add_pooling_request(f"p{i}", {"prompt_token_ids": p}, PoolingParams())
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(2)] == alone
    assert all(isinstance(done[f"g{i}"], RequestOutput) for i in range(2))
    pooled = [done[f"p{i}"] for i in range(len(PROMPTS))]
    assert all(isinstance(o, PoolingRequestOutput) and o.finish_reason == "stop"
               for o in pooled)
    got = torch.tensor([o.outputs.data for o in pooled])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Aborted halfway through its chunked prompt: its blocks come back all the same.
    engine.add_pooling_request("cut", {"prompt_token_ids": PROMPTS[1]},
                               PoolingParams(pooling_type="MEAN"))
    engine.step()
    engine.abort_request(["cut"])
    while engine.engine_core.has_work():
        engine.step()
    assert_all_blocks_free(gen)


def test_a_preempted_pooling_request_is_recomputed_to_the_same_vector(
        tiny: tuple[str, Any], engines: Any) -> None:
    # Five blocks: the generation's third block can only come from the pooling request
    # admitted beside it, which is preempted halfway through its chunked MEAN prompt.
    llm = LLM(tiny[0], num_gpu_blocks_override=5, max_num_batched_tokens=4,
              **{**ENGINE, "max_model_len": 80})
    try:
        sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        gen_prompt = {"prompt_token_ids": list(range(1, 31))}
        alone = llm.generate([gen_prompt], sp, use_tqdm=False)[0].outputs[0].token_ids
        mean = PoolingParams(pooling_type="MEAN")
        want = _vectors(engines["ref"].embed([{"prompt_token_ids": PROMPTS[1]}], mean,
                                             use_tqdm=False))
        engine = llm.llm_engine
        engine.add_request("g", gen_prompt, sp)
        engine.add_pooling_request("p", {"prompt_token_ids": PROMPTS[1]}, mean)
        done: dict[str, Any] = {}
        preempted = False
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            req = engine.scheduler.requests.get("p")
            preempted |= req is not None and req.num_preemptions > 0
        assert preempted
        assert done["g"].outputs[0].token_ids == alone
        torch.testing.assert_close(torch.tensor([done["p"].outputs.data]), want,
                                   rtol=1e-5, atol=1e-5)
        assert_all_blocks_free(llm)
    finally:
        llm.shutdown()


def test_generation_on_a_pooling_engine_is_refused_naming_the_runner(engines: Any) -> None:
    with pytest.raises(ValueError, match=r"^model: .*--runner pooling"):
        engines["ref"].generate("w5z w6z", SamplingParams(max_tokens=2), use_tqdm=False)
    assert_all_blocks_free(engines["ref"])


def test_score_is_the_cosine_of_the_embeddings(engines: Any) -> None:
    llm = engines["ref"]
    texts = ["w5z w6z w7z", "w5z w6z w8z", "w90z w91z"]
    vecs = _vectors(llm.embed(texts, use_tqdm=False))
    scores = llm.score(texts[0], texts, use_tqdm=False)
    want = (vecs @ vecs[0]).tolist()
    assert [s.outputs.score for s in scores] == pytest.approx(want, abs=1e-6)
    assert scores[0].outputs.score == pytest.approx(1.0, abs=1e-6)
    pairwise = llm.score(texts[:2], texts[1:], use_tqdm=False)
    assert pairwise[1].outputs.score == pytest.approx(float(vecs[1] @ vecs[2]), abs=1e-6)
    with pytest.raises(ValueError, match="^text_2"):
        llm.score(texts[:2], texts, use_tqdm=False)


def test_async_encode_matches_the_sync_engine(tiny: tuple[str, Any], engines: Any) -> None:
    folder, _ = tiny
    want = _vectors(engines["ref"].embed([{"prompt_token_ids": p} for p in PROMPTS],
                                         PoolingParams(pooling_type="MEAN"), use_tqdm=False))

    async def run() -> tuple[list[Any], list[list[float]], Any]:
        engine = AsyncLLM(EngineConfig(model=folder, runner="pooling",
                                       max_num_batched_tokens=8, **ENGINE),
                          engine_process=False)
        try:
            async def one(i: int, p: list[int]) -> Any:
                outs = [o async for o in engine.encode(
                    {"prompt_token_ids": p}, PoolingParams(pooling_type="MEAN"), f"a{i}")]
                assert len(outs) == 1 and outs[0].finished
                return outs[0]
            got = await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
            # The helper other protocols' routes (Ollama's /api/embed) call.
            plain = await embed_texts(engine, [PROMPTS[1], "w5z w6z"], dimensions=8)
            return got, plain, (await engine.get_engine_stats())[0]
        finally:
            await engine.shutdown_async()

    got, plain, stats = asyncio.run(run())
    torch.testing.assert_close(torch.tensor([o.outputs.data for o in got]), want,
                               rtol=1e-5, atol=1e-5)
    ref = engines["ref"].embed([{"prompt_token_ids": PROMPTS[1]}, "w5z w6z"],
                               PoolingParams(dimensions=8), use_tqdm=False)
    torch.testing.assert_close(torch.tensor(plain), _vectors(ref), rtol=1e-5, atol=1e-5)
    assert stats.kv_cache.num_free_blocks == stats.kv_cache.num_blocks


def test_qwen3_mean_embeddings_match_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(5)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      vocab_size=VOCAB, max_position_embeddings=256, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    hf.save_pretrained(tmp_path)
    write_word_tokenizer(tmp_path, VOCAB, 2)
    llm = LLM(str(tmp_path), runner="pooling", max_num_batched_tokens=8,
              pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    try:
        outs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS[:2]], use_tqdm=False)
        for p, out in zip(PROMPTS[:2], outs, strict=True):
            want = _hf_pooled(hf, p, "MEAN", None, True)
            assert F.cosine_similarity(torch.tensor(out.outputs.embedding), want, dim=0) \
                >= 0.9999
    finally:
        llm.shutdown()


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"dimensions": 0}, "dimensions"), ({"dimensions": 1.5}, "dimensions"),
    ({"normalize": 1}, "normalize"), ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"pooling_type": "MAX"}, "pooling_type")])
def test_bad_pooling_params_are_refused_naming_the_field(kwargs: dict[str, Any],
                                                         field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}"):
        PoolingParams(**kwargs)


def test_engine_refusals_name_the_field(engines: Any) -> None:
    llm = engines["ref"]
    with pytest.raises(ValueError, match="^dimensions: the model's embeddings have 64"):
        llm.embed("w5z", PoolingParams(dimensions=65), use_tqdm=False)
    with pytest.raises(ValueError, match="^prompt: the prompt is empty"):
        llm.embed(["w5z", {"prompt_token_ids": []}], use_tqdm=False)
    with pytest.raises(ValueError, match="^pooler_config: unknown key 'pooling'"):
        PoolerConfig.from_dict({"pooling": "MEAN"})
    with pytest.raises(ValueError, match="^runner"):
        EngineConfig(runner="embed")
    with pytest.raises(ValueError, match="^runner: the pooling runner does not support"):
        EngineConfig(runner="pooling", simulated_device="h100/llama-3-8b")
    out = llm.embed({"prompt_token_ids": PROMPTS[1]}, truncate_prompt_tokens=5,
                    use_tqdm=False)[0]
    assert out.prompt_token_ids == PROMPTS[1][-5:]
    assert_all_blocks_free(llm)
