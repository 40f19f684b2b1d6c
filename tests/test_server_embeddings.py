"""``/v1/embeddings``, ``/score`` and ``/rerank`` on the session's shared default server (a
generating engine: pooling requests run on it through the same path). Oracles: the offline
engine's ``LLM.embed`` on the same model and dtype, and cosine similarity computed here."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import torch

from tests.server_harness import MODEL, ServerHandle, start_server
from tests.test_server_validation import assert_all_blocks_free

pytestmark = pytest.mark.slow


TEXTS = ["The capital of France is Paris.", "Paris is in France.", "Bananas are yellow."]


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server()
    handle.wait_healthy()
    return handle


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> Any:
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client


@pytest.fixture(scope="module")
def offline(llm_cache: Any) -> torch.Tensor:
    """The offline engine's embeddings of TEXTS (the server's model, float32)."""
    outs = llm_cache().embed(TEXTS, use_tqdm=False)
    return torch.tensor([o.outputs.embedding for o in outs])


def test_openai_client_embeddings_float_and_base64_match_the_offline_engine(
        server: ServerHandle, offline: torch.Tensor) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    # Without encoding_format the client asks for base64 and decodes it itself.
    for fmt in ("float", None):
        kw = {"encoding_format": fmt} if fmt else {}
        r = client.embeddings.create(model=MODEL, input=TEXTS, **kw)
        got = torch.tensor([d.embedding for d in r.data])
        assert [d.index for d in r.data] == [0, 1, 2]
        assert torch.nn.functional.cosine_similarity(got, offline, dim=1).min() >= 0.9999
        assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    short = client.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=32)
    want = torch.nn.functional.normalize(offline[0], dim=0)  # unit length already
    vec = torch.tensor(short.data[0].embedding)
    assert vec.shape == (32,) and abs(float(vec.norm()) - 1.0) < 1e-5
    # Matryoshka: the first 32 values, renormalised on their own.
    assert torch.nn.functional.cosine_similarity(vec, want[:32], dim=0) >= 0.9999


def test_ollama_embed_is_normalized_and_legacy_embeddings_is_not(
        server: ServerHandle, offline: torch.Tensor, llm_cache: Any) -> None:
    """Ollama's two routes through the ``ollama`` client: ``/api/embed`` normalises (the
    offline engine's default), ``/api/embeddings`` gives the raw pooled state."""
    import ollama

    from forerun import PoolingParams

    client = ollama.Client(host=server.base_url, timeout=60)
    r = client.embed(model=MODEL, input=TEXTS)
    got = torch.tensor(r.embeddings)
    assert torch.nn.functional.cosine_similarity(got, offline).min() >= 0.9999
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)
    assert r.prompt_eval_count == sum(len(o.prompt_token_ids) for o in
                                      llm_cache().embed(TEXTS, use_tqdm=False))
    short = torch.tensor(client.embed(model=MODEL, input=TEXTS[0], dimensions=16).embeddings)
    want = torch.nn.functional.normalize(offline[0, :16], dim=0)
    assert short.shape == (1, 16) and torch.allclose(short[0], want, atol=1e-4)
    raw = llm_cache().embed(TEXTS[:1], PoolingParams(normalize=False), use_tqdm=False)
    legacy = torch.tensor(client.embeddings(model=MODEL, prompt=TEXTS[0]).embedding)
    assert torch.allclose(legacy, torch.tensor(raw[0].outputs.embedding), rtol=1e-4,
                          atol=1e-4)
    assert legacy.norm() > 1.5  # not normalised: the check above could not pass by chance


def test_token_id_inputs_embed_like_their_text(http: httpx.Client, llm_cache: Any,
                                               offline: torch.Tensor) -> None:
    ids = llm_cache().get_tokenizer().encode(TEXTS[1])
    for body in ({"input": ids}, {"input": [ids, ids]}):
        r = http.post("/v1/embeddings", json=body)
        assert r.status_code == 200, r.text
        for d in r.json()["data"]:
            cos = torch.nn.functional.cosine_similarity(torch.tensor(d["embedding"]),
                                                        offline[1], dim=0)
            assert cos >= 0.9999


def test_score_and_rerank_are_cosines_sorted_for_rerank(http: httpx.Client,
                                                        offline: torch.Tensor) -> None:
    want = (offline[1:] @ offline[0]).tolist()
    for path in ("/score", "/v1/score"):
        r = http.post(path, json={"model": MODEL, "text_1": TEXTS[0], "text_2": TEXTS[1:]})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1]
        assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-4)
    r = http.post("/rerank", json={"query": TEXTS[0], "documents": TEXTS[:0:-1], "top_n": 1})
    assert r.status_code == 200, r.text
    (top,) = r.json()["results"]
    # Documents reversed: "Paris is in France." is index 1 there, and the best match.
    assert top["index"] == 1 and top["document"] == {"text": TEXTS[1]}
    assert top["relevance_score"] == pytest.approx(max(want), abs=1e-4)
    r = http.post("/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:],
                                      "return_documents": False})
    results = r.json()["results"]
    assert [x["index"] for x in results] == [0, 1] and "document" not in results[0]
    assert results[0]["relevance_score"] >= results[1]["relevance_score"]


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/embeddings", {"input": []}, "input"),
    ("/v1/embeddings", {"input": ["ok", ""]}, "input"),
    ("/v1/embeddings", {"input": [[1, 10 ** 9]]}, "input"),
    ("/v1/embeddings", {"input": [True]}, "input"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "x", "dimensions": 0}, "dimensions"),
    ("/v1/embeddings", {"input": "x", "dimensions": 100000}, "dimensions"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    ("/score", {"text_1": "a"}, "text_2"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
])
def test_bad_input_is_a_400_naming_the_field(http: httpx.Client, path: str,
                                             body: dict[str, Any], param: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_unknown_model_is_a_404_and_every_block_is_free_after(http: httpx.Client) -> None:
    r = http.post("/v1/embeddings", json={"model": "nope", "input": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert_all_blocks_free(http)

