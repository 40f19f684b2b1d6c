"""Beam search: ``LLM.beam_search`` offline and ``use_beam_search`` on the server.

Oracle: an independent brute-force beam search over transformers' float32 model on the
same weights (every beam scored by its own full forward pass, no KV cache, no forerun
code), token for token, with vLLM's ranking (cumulative logprob, then the
length-penalised score at the end).
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch

from forerun.beam_search import BeamSearchParams
from tests.conftest import assert_all_blocks_free
from tests.server_harness import MODEL, start_server

PROMPTS = ["The capital of France is", "Once upon a time, a small robot"]


def hf_beam_search(model: Any, prompt: list[int], width: int, max_tokens: int,
                   eos: set[int], ignore_eos: bool, length_penalty: float
                   ) -> list[tuple[list[int], float]]:
    """The best ``width`` (tokens with the prompt, cumulative logprob), best first."""
    live: list[tuple[list[int], float]] = [(list(prompt), 0.0)]
    finished: list[tuple[list[int], float]] = []
    for _ in range(max_tokens):
        if not live:
            break
        cands: list[tuple[list[int], float]] = []
        for toks, cum in live:
            with torch.no_grad():
                lp = model(torch.tensor([toks])).logits[0, -1].double().log_softmax(-1)
            # Only a beam's best width + |eos| tokens can make the next round's width.
            vals, ids = lp.topk(width + len(eos))
            for v, t in zip(vals.tolist(), ids.tolist(), strict=True):
                seq = (toks + [t], cum + v)
                (finished if t in eos and not ignore_eos else cands).append(seq)
        cands.sort(key=lambda c: (-c[1], c[0][-1]))
        live = cands[:width]

    def score(seq: tuple[list[int], float], done: bool) -> float:
        n = len(seq[0]) - (1 if done else 0)
        return seq[1] / n ** length_penalty

    pool = [(s, score(s, True)) for s in finished] + [(s, score(s, False)) for s in live]
    pool.sort(key=lambda e: -e[1])
    return [s for s, _ in pool[:width]]


@pytest.mark.slow
@pytest.mark.parametrize("prompts, width, max_tokens, ignore_eos, length_penalty",
                         [(PROMPTS, 3, 4, False, 1.0), (PROMPTS[1:], 2, 3, True, 0.5)])
def test_llm_beam_search_matches_brute_force(llm_cache: Any, hf_smollm2: tuple[Any, Any],
                                             prompts: list[str], width: int, max_tokens: int,
                                             ignore_eos: bool, length_penalty: float) -> None:
    llm = llm_cache()
    model, tok = hf_smollm2
    eos = set(llm.llm_engine.processor.eos_token_ids)
    params = BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                              ignore_eos=ignore_eos, length_penalty=length_penalty)
    outs = llm.beam_search([{"prompt": p} for p in prompts], params)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        ref = hf_beam_search(model, ids, width, max_tokens, eos, ignore_eos, length_penalty)
        assert [s.tokens for s in out.sequences] == [r[0] for r in ref]
        for s, (_, cum) in zip(out.sequences, ref, strict=True):
            assert abs(s.cum_logprob - cum) < 2e-3 * max_tokens
            assert s.text == tok.decode(s.tokens)  # vLLM: the whole sequence, decoded
    assert_all_blocks_free(llm)


def test_beam_width_over_max_logprobs_is_refused(llm_cache: Any) -> None:
    llm = llm_cache()
    with pytest.raises(ValueError, match="max allowed: 20"):
        llm.beam_search(["Hi"], BeamSearchParams(beam_width=11, max_tokens=2))


@pytest.mark.slow
def test_server_use_beam_search_is_the_offline_search(llm_cache: Any,
                                                      hf_smollm2: tuple[Any, Any]) -> None:
    server = start_server()  # the session's shared default server
    llm = llm_cache()
    tok = hf_smollm2[1]
    server.wait_healthy()
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)
    prompt = PROMPTS[0]
    ref = llm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=3))[0]
    r = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=3,
                                  temperature=0, extra_body={"use_beam_search": True})
    n_prompt = len(tok.encode(prompt))
    assert [c.text for c in r.choices] == [
        tok.decode(s.tokens[n_prompt:], skip_special_tokens=True) for s in ref.sequences]
    assert r.usage.completion_tokens == sum(len(s.tokens) - n_prompt for s in ref.sequences)
    # Chat, streamed: the conversation through the template, as an offline search of its
    # ids; the n beams arrive as the n choices.
    messages = [{"role": "user", "content": "Name a colour."}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    ref = llm.beam_search([{"prompt_token_ids": ids}],
                          BeamSearchParams(beam_width=2, max_tokens=3))[0]
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=3, temperature=0, stream=True,
        extra_body={"use_beam_search": True})
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts == [tok.decode(s.tokens[len(ids):], skip_special_tokens=True)
                     for s in ref.sequences]
    from tests.test_server import wait_idle

    m = wait_idle(server)  # every round's requests are done: no KV block held
    assert m["forerun:kv_cache_usage_perc"] == 0.0 and m["forerun:num_requests_running"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("extra, param", [
    ({"n": 11}, "n"), ({"logprobs": 2}, "logprobs"), ({"top_p": 0.5}, "top_p"),
    ({"stop": ["x"]}, "stop"), ({"length_penalty": 0.5, "use_beam_search": False},
                                "length_penalty")])
def test_server_beam_search_refuses_what_it_would_ignore(extra: dict[str, Any],
                                                        param: str) -> None:
    server = start_server()
    server.wait_healthy()
    body = {"prompt": "Hi", "max_tokens": 2, "n": 2, "use_beam_search": True, **extra}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
