"""Parallel sampling (``SamplingParams.n > 1``) on the real default model, float32.

A request with n=k is fanned out into k children that share the prompt's KV blocks
through the prefix cache; the parent's RequestOutput carries k completions.
"""

from __future__ import annotations

import pytest

from forerun import SamplingParams
from tests.conftest import assert_all_blocks_free

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived an old fisherman who"
# Longer than two 16-token blocks, and used by no other test, so its blocks start uncached.
LONG_PROMPT = (
    "The lighthouse keeper wrote in his logbook every evening, noting the weather, the "
    "ships that passed, the birds that rested on the railing and the colour of the sky at "
    "dusk. One night, after a long storm, he found a strange message that read:"
)


def texts(out) -> list[str]:
    return [c.text for c in out.outputs]


def test_seeded_n4_gives_four_different_reproducible_completions(llm_cache):
    llm = llm_cache()
    params = SamplingParams(n=4, max_tokens=10, temperature=1.0, seed=100)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert out.finished and [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) > 0 and c.finish_reason for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    (again,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert texts(again) == texts(out)
    # Child i is the request with seed + i.
    singles = llm.generate([PROMPT] * 4,
                           [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i)
                            for i in range(4)], use_tqdm=False)
    assert [s.outputs[0].token_ids for s in singles] == [c.token_ids for c in out.outputs]
    assert_all_blocks_free(llm)


def test_children_share_the_prompt_blocks_and_greedy_matches_n1(llm_cache):
    llm = llm_cache()
    block_size = llm.llm_engine.config.block_size
    before = llm.stats().kv_cache.prefix_cache_hits
    (out,) = llm.generate([LONG_PROMPT], SamplingParams(n=4, max_tokens=8, temperature=0.0),
                          use_tqdm=False)
    # The last prompt token is always recomputed, so it never counts as a hit.
    full_blocks = (len(out.prompt_token_ids) - 1) // block_size
    assert full_blocks > 2
    # The first child computes the prompt; the other three hit all its full blocks.
    assert llm.stats().kv_cache.prefix_cache_hits - before == 3 * full_blocks * block_size
    # Reading blocks another child writes in the same step gives the same tokens.
    (ref,) = llm.generate([LONG_PROMPT], SamplingParams(max_tokens=8, temperature=0.0),
                          use_tqdm=False)
    assert all(c.token_ids == ref.outputs[0].token_ids for c in out.outputs)
    assert all(c.text == ref.outputs[0].text for c in out.outputs)
    assert_all_blocks_free(llm)


def test_n1_unchanged_and_mixed_batch(llm_cache):
    llm = llm_cache()
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    (alone,) = llm.generate([PROMPT], seeded, use_tqdm=False)
    assert len(alone.outputs) == 1 and alone.outputs[0].index == 0
    outs = llm.generate([PROMPT, PROMPT],
                        [seeded, SamplingParams(n=3, max_tokens=8, temperature=0.8, seed=1)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert outs[0].request_id != outs[1].request_id
    assert len(outs[0].outputs) == 1 and len(outs[1].outputs) == 3
    assert outs[1].prompt_token_ids == alone.prompt_token_ids
    assert_all_blocks_free(llm)


def test_aborting_the_parent_aborts_every_child(llm_cache):
    llm = llm_cache()
    engine = llm.llm_engine
    engine.add_request("parent", PROMPT,
                       SamplingParams(n=3, max_tokens=50, temperature=1.0, ignore_eos=True))
    outs = []
    while not outs:
        outs = engine.step()
    assert [o.request_id for o in outs] == ["parent"] and not outs[0].finished
    engine.abort_request(["parent"])
    while engine.engine_core.has_work():
        assert engine.step() == []
    assert not engine.has_unfinished_requests()
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("n", [0, -1])
def test_invalid_n_raises_naming_n(n):
    with pytest.raises(ValueError, match="^n must"):
        SamplingParams(n=n)


def test_child_params_get_n1_and_consecutive_seeds():
    from forerun.engine.parallel_sampling import child_params, child_request_id

    seeded = SamplingParams(n=3, seed=10, temperature=0.5, stop=["x"])
    kids = [child_params(seeded, i) for i in range(3)]
    assert [k.n for k in kids] == [1, 1, 1] and [k.seed for k in kids] == [10, 11, 12]
    assert all(k.stop == ["x"] and k.temperature == 0.5 for k in kids)
    assert seeded.n == 3 and seeded.seed == 10  # the parent's params are untouched
    assert child_params(SamplingParams(n=2), 1).seed is None
    assert child_request_id("req", 2) == "req_2"
