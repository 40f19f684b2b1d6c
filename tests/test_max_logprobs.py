"""``--max-logprobs`` (EngineConfig.max_logprobs): vLLM's limit on logprobs per position.

The processor refuses ``logprobs`` / ``prompt_logprobs`` above the limit, naming the field
and the limit; ``-1`` is the whole vocabulary, allowed only when the limit is -1 too.
Oracles: the limit arithmetic (unit tests on the processor), and through a server started
with ``--max-logprobs -1``: the whole distribution (its probabilities sum to 1, every
vocabulary id once) and transformers' float32 logits for the first generated position.
"""

from __future__ import annotations

import math
from typing import Any

import httpx
import pytest

from forerun.engine.processor import Processor
from forerun.sampling_params import SamplingParams
from tests.server_harness import DEFAULT
from tests.test_server_logprobs import FORCED

VOCAB = 1000


@pytest.mark.parametrize("limit, kw, ok", [
    (20, dict(logprobs=20), True), (20, dict(logprobs=21), False),
    (20, dict(prompt_logprobs=21), False), (20, dict(logprobs=-1), False),
    (5, dict(prompt_logprobs=6), False), (0, dict(logprobs=0), True),
    (0, dict(logprobs=1), False), (-1, dict(logprobs=-1), True),
    (-1, dict(prompt_logprobs=VOCAB), True), (-1, dict(logprobs=VOCAB + 1), False),
])
def test_processor_checks_the_engine_limit(limit: int, kw: dict[str, int], ok: bool) -> None:
    proc = Processor(None, 100, VOCAB, [0], max_logprobs=limit)
    (name, value), = kw.items()
    if ok:
        got = getattr(proc.process_params(SamplingParams(**kw)), name)
        assert got == (VOCAB if value == -1 else value)  # -1: the vocabulary's size
        return
    with pytest.raises(ValueError) as e:
        proc.process_params(SamplingParams(**kw))
    shown = VOCAB if limit == -1 else limit
    assert str(e.value).startswith(f"{name}: ")
    assert f"max allowed: {shown}" in str(e.value)


def test_processor_refuses_a_bad_limit() -> None:
    with pytest.raises(ValueError, match="max_logprobs"):
        Processor(None, 100, VOCAB, [0], max_logprobs=-2)


@pytest.mark.slow
@pytest.mark.parametrize("path, field", [("/v1/completions", "logprobs"),
                                         ("/v1/chat/completions", "top_logprobs"),
                                         ("/v1/completions", "prompt_logprobs")])
def test_default_server_refuses_above_20(path: str, field: str) -> None:
    server = DEFAULT.start()
    server.wait_healthy()
    body: dict[str, Any] = {"max_tokens": 1, field: 21}
    body.update({"messages": [{"role": "user", "content": "Hi"}], "logprobs": True}
                if "chat" in path else {"prompt": "Hi"})
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and "max allowed: 20" in err["message"], err


@pytest.mark.slow
def test_whole_vocabulary_with_max_logprobs_minus_one(hf_smollm2: tuple[Any, Any]) -> None:
    import torch

    server = FORCED.start()
    server.wait_healthy()
    model, tok = hf_smollm2
    messages = [{"role": "user", "content": "Name a colour."}]
    r = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=120, json={
        "messages": messages, "max_tokens": 1, "temperature": 0, "logprobs": True,
        "top_logprobs": -1, "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    (pos,) = r.json()["choices"][0]["logprobs"]["content"]
    top = pos["top_logprobs"]
    vocab = model.config.vocab_size
    assert len(top) == vocab
    assert len({t["token"] for t in top}) == vocab  # token_id:<id>, each id once
    assert math.isclose(sum(math.exp(t["logprob"]) for t in top), 1.0, abs_tol=1e-3)
    # The oracle: transformers' log-softmax at the prompt's last position.
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    got = torch.full((vocab,), float("nan"))
    for t in top:
        got[int(t["token"].split(":")[1])] = t["logprob"]
    assert torch.allclose(got, ref, atol=2e-3)
    # A count above 20 is fine here too, and so is -1 for the prompt's positions.
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=120, json={
        "prompt": "Hi there", "max_tokens": 1, "logprobs": 25, "prompt_logprobs": -1})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert len(choice["logprobs"]["top_logprobs"][0]) >= 25
    assert all(p is None or len(p) == vocab for p in choice["prompt_logprobs"])


def test_offline_llm_takes_max_logprobs(llm_cache: Any) -> None:
    # The offline engine builds its processor from the same EngineConfig field.
    llm = llm_cache(max_logprobs=3)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate(["Hi"], SamplingParams(max_tokens=1, logprobs=4), use_tqdm=False)
    out = llm.generate(["Hi"], SamplingParams(max_tokens=1, logprobs=3), use_tqdm=False)
    assert len(out[0].outputs[0].logprobs[0]) >= 3
