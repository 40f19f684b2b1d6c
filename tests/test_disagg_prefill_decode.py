"""Prefill/decode disaggregation: a producer server, a consumer server and the proxy.

The oracle is one ordinary server (the session's shared default one): the same greedy text,
streamed or not. That the KV really crossed is read from the consumer's prefix-cache hits
(a prompt it never saw hits exactly the producer's full blocks before the last token).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
import uvicorn

from forerun.kv_connector.tcp_transport import KVBlockServer, TransferError, pull_blocks
from forerun.server.disagg_proxy import ProxyConfig, build_proxy_app, prefill_body
from tests.server_harness import MODEL, ServerHandle, free_port, start_server
from tests.test_server import scrape, wait_idle

BLOCK = 16  # the servers' default block size


def _tcp(role: str) -> tuple[str, str]:
    return "--kv-transfer-config", json.dumps({"kv_connector": "TCPConnector",
                                               "kv_role": role})


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[ServerHandle, ServerHandle, ServerHandle, str]]:
    """(producer, consumer, one ordinary server, proxy URL); the last test kills the
    producer."""
    producer = start_server(*_tcp("kv_producer"), fresh=True)
    consumer = start_server(*_tcp("kv_consumer"), fresh=True)
    one = start_server()
    for s in (producer, consumer, one):
        s.wait_healthy()
    port = free_port()
    app = build_proxy_app(ProxyConfig([producer.base_url], [consumer.base_url], 60.0))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the proxy did not start"
        time.sleep(0.05)
    yield producer, consumer, one, url
    server.should_exit = True
    thread.join(10)
    producer.stop()
    consumer.stop()


def _hits(server: ServerHandle) -> float:
    return scrape(server)["forerun:prefix_cache_hits_total"]


def _completion(url: str, prompt: str, **extra: object) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _full_blocks_before_last(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_prefill_decode_gives_the_greedy_text_of_one_server(pd) -> None:
    producer, consumer, one, proxy = pd
    prompt = "A short history of the printing press, from Gutenberg onwards: " * 5
    want = _completion(one.base_url, prompt)
    before = _hits(consumer)
    got = _completion(proxy, prompt)
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    n_prompt = got["usage"]["prompt_tokens"]
    assert n_prompt > 2 * BLOCK
    # The consumer never saw this prompt: every hit is a block pulled from the producer.
    assert _hits(consumer) - before == _full_blocks_before_last(n_prompt)
    # The producer frees its blocks once they are read; both end with every block free.
    for s in (producer, consumer):
        assert wait_idle(s)["forerun:kv_cache_usage_perc"] == 0.0


def test_prefill_decode_streams_chat_like_one_server(pd) -> None:
    producer, consumer, one, proxy = pd
    messages = [{"role": "user", "content": "List five rivers of Europe and one fact "
                                            "about each of them, briefly. " * 3}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 24, "temperature": 0}
    want = httpx.post(one.base_url + "/v1/chat/completions", json=body, timeout=120).json()
    before = _hits(consumer)
    text = []
    with httpx.stream("POST", proxy + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text.append(choice["delta"].get("content") or "")
    assert "".join(text) == want["choices"][0]["message"]["content"]
    n_prompt = want["usage"]["prompt_tokens"]
    assert _hits(consumer) - before == _full_blocks_before_last(n_prompt)
    for s in (producer, consumer):
        assert wait_idle(s)["forerun:kv_cache_usage_perc"] == 0.0


def test_a_bad_request_reads_as_from_one_server(pd) -> None:
    _, _, one, proxy = pd
    body = {"model": MODEL, "prompt": "hi", "temperature": -1}
    direct = httpx.post(one.base_url + "/v1/completions", json=body, timeout=30)
    via = httpx.post(proxy + "/v1/completions", json=body, timeout=30)
    assert via.status_code == direct.status_code == 400
    assert via.json()["error"]["param"] == direct.json()["error"]["param"] == "temperature"
    r = httpx.post(proxy + "/v1/completions", json={**body, "temperature": 0, "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_a_dead_prefill_instance_fails_cleanly_and_decode_keeps_serving(pd) -> None:
    producer, consumer, one, proxy = pd
    prompt = "Notes on the migration of arctic terns across the oceans of the world. " * 4
    want = _completion(one.base_url, prompt)["choices"][0]["text"]
    # The producer answers where its KV is, then dies before the consumer reads it.
    first = httpx.post(producer.base_url + "/v1/completions",
                       json=prefill_body({"model": MODEL, "prompt": prompt,
                                          "temperature": 0}), timeout=120).json()
    params = first["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    producer.stop()
    before = _hits(consumer)
    got = _completion(consumer.base_url, prompt, kv_transfer_params=params)
    assert got["choices"][0]["text"] == want  # the prompt was recomputed
    assert _hits(consumer) == before
    r = httpx.post(proxy + "/v1/completions",
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 4}, timeout=60)
    assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
    again = _completion(consumer.base_url, "The capital of France is")
    assert again["choices"][0]["text"] == _completion(
        one.base_url, "The capital of France is")["choices"][0]["text"]
    assert wait_idle(consumer)["forerun:kv_cache_usage_perc"] == 0.0


def _caches(n_blocks: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n_blocks, 2, 4, 8, generator=g).to(torch.bfloat16),
             torch.randn(n_blocks, 2, 8, 4, generator=g).to(torch.bfloat16))
            for _ in range(3)]


def test_a_pull_copies_the_offered_blocks_and_frees_them_once_acknowledged() -> None:
    src, dst = _caches(6, 0), _caches(5, 1)
    server = KVBlockServer("127.0.0.1", 0, "fp", offer_timeout_s=60)
    try:
        server.register_kv_caches(src)
        server.offer("r1", [4, 1, 3])
        with pytest.raises(TransferError, match="layout differs"):
            pull_blocks("127.0.0.1", server.port, "r1", "other", 0, [0], dst, 10)
        with pytest.raises(TransferError, match="no KV is offered"):
            pull_blocks("127.0.0.1", server.port, "r2", "fp", 0, [0], dst, 10)
        with pytest.raises(TransferError, match="out of the 3 offered"):
            pull_blocks("127.0.0.1", server.port, "r1", "fp", 2, [0, 1], dst, 10)
        assert server.take_done() == set()
        pull_blocks("127.0.0.1", server.port, "r1", "fp", 1, [2, 0], dst, 10)
        for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
            assert torch.equal(dk[2], sk[1]) and torch.equal(dk[0], sk[3])
            assert torch.equal(dv[2], sv[1]) and torch.equal(dv[0], sv[3])
        assert server.take_done() == {"r1"}
        server.offer("r3", [0])
        server.offer_timeout_s = 0.0
        server.offer("r4", [0])
        assert server.take_done() == {"r4"}  # expired, unread: freed anyway
    finally:
        server.close()
