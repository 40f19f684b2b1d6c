"""End-to-end tests of ``forerun serve`` through the official ``openai`` client.

One server (engine in its own process) serves the whole module; a second, small one checks
``--api-key``. Faults (a killed or frozen engine, SIGTERM) are in test_server_faults.py.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forerun import SamplingParams
from tests.server_harness import DEFAULT, MODEL, ServerArgs, ServerHandle

pytestmark = pytest.mark.slow

API_KEY = "sk-forerun-test"
KEYED = ServerArgs(("--api-key", API_KEY, "--max-model-len", "512"))
PROMPT = "Hello, my name is"
CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def env(llm_cache: Any) -> dict[str, Any]:
    # Boot both servers while the offline reference engine runs in this process.
    main = DEFAULT.start()
    keyed = KEYED.start()
    llm = llm_cache()
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    ref_completion = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0]
    ref_chat = llm.chat(CHAT, greedy, use_tqdm=False)[0].outputs[0]
    main.wait_healthy()
    keyed.wait_healthy()
    return {"main": main, "keyed": keyed, "ref_completion": ref_completion,
            "ref_chat": ref_chat}


@pytest.fixture(scope="module")
def server(env: dict[str, Any]) -> ServerHandle:
    return env["main"]


@pytest.fixture()
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def scrape(server: ServerHandle) -> dict[str, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def wait_idle(server: ServerHandle, timeout_s: float = 60.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(server)
        idle = (m["forerun:num_requests_running"] == 0
                and m["forerun:num_requests_waiting"] == 0
                and m["forerun:kv_cache_usage_perc"] == 0.0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


# ----- basics -------------------------------------------------------------------------------
def test_health_version_models(server: ServerHandle, client: openai.OpenAI) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_head_health_answers_as_get_does(server: ServerHandle) -> None:
    # What load balancers send: the status of GET, and no body.
    r = httpx.head(f"{server.base_url}/health")
    assert r.status_code == 200 and r.content == b""


def test_completion_matches_offline(env: dict[str, Any], client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == env["ref_completion"].text
    assert r.choices[0].finish_reason == env["ref_completion"].finish_reason
    assert r.usage.completion_tokens == len(env["ref_completion"].token_ids)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_matches_offline(env: dict[str, Any], client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                       temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == env["ref_chat"].text
    assert r.usage.completion_tokens == len(env["ref_chat"].token_ids)
    # max_completion_tokens is the newer name of max_tokens.
    r2 = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=4,
                                        temperature=0)
    assert r2.usage.completion_tokens == 4 and r2.choices[0].finish_reason == "length"


def test_completion_token_prompts_and_echo(env: dict[str, Any], client: openai.OpenAI) -> None:
    ids = env["ref_completion"]  # reuse: prompt as token ids must give the same text
    r = client.completions.create(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=16,
                                  temperature=0, echo=True)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == PROMPT + ids.text for c in r.choices)


# ----- streaming ----------------------------------------------------------------------------
def test_streaming_completion_equals_whole(env: dict[str, Any], client: openai.OpenAI) -> None:
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == env["ref_completion"].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_chat_equals_whole(env: dict[str, Any], client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == env["ref_chat"].text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(env["ref_chat"].token_ids)


def test_stop_strings(env: dict[str, Any], client: openai.OpenAI) -> None:
    full = env["ref_completion"].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    expected = full[:full.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop])
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16,
                                         temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                  stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert r.choices[0].text == expected + stop


# ----- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"extra_body": {"top_k": -5}}, "top_k"),
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
    ({"extra_body": {"min_p": 2}}, "min_p"),
    ({"extra_body": {"truncate_prompt_tokens": 0}}, "truncate_prompt_tokens"),
])
def test_bad_completion_params(client: openai.OpenAI, kwargs: dict[str, Any],
                               param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
    assert e.value.status_code == 400
    err = e.value.body
    assert err["param"] == param and param in err["message"]


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    # Unknown roles reach the template, as in vLLM (tests/test_tool_calling.py); a role
    # that is not a string is refused.
    ([{"role": 7, "content": "hi"}], "messages[0].role"),
    ("hello", "messages"),
    ([], "messages"),
])
def test_bad_chat_messages(client: openai.OpenAI, messages: Any, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=messages)
    assert e.value.body["param"] == param and param in e.value.body["message"]


def test_completion_logprobs_and_penalties(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
        presence_penalty=0.5, frequency_penalty=0.5, logit_bias={"42": -100}, seed=1,
        extra_body={"repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2,
                    "bad_words": ["Paris"], "allowed_token_ids": None})
    r = client.completions.create(**kw)
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.tokens) == len(lp.token_logprobs) == 5
    assert len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert all(len(t) == 3 for t in lp.top_logprobs) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == r.choices[0].text
    assert all(x <= 0 for x in lp.token_logprobs)
    # Streamed: the same logprobs, chunk by chunk.
    toks: list[str] = []
    for chunk in client.completions.create(stream=True, **kw):
        if chunk.choices and chunk.choices[0].logprobs:
            toks += chunk.choices[0].logprobs.tokens
    assert toks == lp.tokens


def test_chat_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert content[0].bytes == list(content[0].token.encode())
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-6
    n = 0
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4,
                                                temperature=0, logprobs=True, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            n += len(chunk.choices[0].logprobs.content)
    assert n == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, logprobs=True,
                                       top_logprobs=30)
    assert e.value.body["param"] == "top_logprobs"


def test_parallel_sampling_n(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = dict(model=MODEL, max_tokens=6, temperature=1.0, seed=5, n=2,
                              extra_body={"ignore_eos": True})
    r = client.completions.create(prompt=PROMPT, **kw)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 12
    # Streamed: chunks per choice, the same texts (seeded), usage over both.
    texts = ["", ""]
    chunks = list(client.completions.create(prompt=PROMPT, stream=True,
                                            stream_options={"include_usage": True}, **kw))
    for chunk in chunks:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in r.choices]
    assert chunks[-1].usage.completion_tokens == 12
    # Two prompts: choices 0, 1 for the first, 2, 3 for the second.
    r2 = client.completions.create(prompt=[PROMPT, PROMPT], **kw)
    assert sorted(c.index for c in r2.choices) == [0, 1, 2, 3]
    assert [c.text for c in r2.choices] == [c.text for c in r.choices] * 2
    chat = client.chat.completions.create(messages=CHAT, **kw)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens == 12
    deltas = ["", ""]
    roles = set()
    for chunk in client.chat.completions.create(messages=CHAT, stream=True, **kw):
        for c in chunk.choices:
            deltas[c.index] += c.delta.content or ""
            if c.delta.role:
                roles.add(c.index)
    assert roles == {0, 1}
    assert deltas == [c.message.content for c in chat.choices]


def test_harmless_defaults_accepted(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                  logprobs=None, presence_penalty=0, frequency_penalty=0.0,
                                  logit_bias=None, user="someone")
    assert r.usage.completion_tokens == 2


def test_non_json_body_is_400(server: ServerHandle) -> None:
    r = httpx.post(f"{server.base_url}/v1/completions", content=b"{nope",
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"]


def test_unknown_model_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found"


def test_prompt_too_long_400(env: dict[str, Any]) -> None:
    keyed = env["keyed"]  # max_model_len 512
    c = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=4)
    assert e.value.body["param"] == "prompt" and "512" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=600)
    assert e.value.body["param"] == "max_tokens"


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: openai.OpenAI) -> None:
    ids = [504, 3458, 282, 4649, 314, 1345, 28, 253]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 5, "temperature": 0.0}
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 3}, **kw)
    tail = client.completions.create(prompt=ids[-3:], **kw)
    assert cut.usage.prompt_tokens == 3
    assert cut.choices[0].text == tail.choices[0].text


def test_truncate_prompt_tokens_admits_an_over_long_prompt(env: dict[str, Any]) -> None:
    keyed = env["keyed"]  # max_model_len 512
    c = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=API_KEY, max_retries=0)
    out = c.completions.create(model=MODEL, prompt="hello " * 600, max_tokens=2,
                               extra_body={"truncate_prompt_tokens": 100})
    assert out.usage.prompt_tokens == 100 and out.usage.completion_tokens == 2


def test_api_key(env: dict[str, Any]) -> None:
    keyed = env["keyed"]
    bad = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        bad.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert e.value.status_code == 401
    assert httpx.get(f"{keyed.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{keyed.base_url}/health").status_code == 200  # health is open
    good = openai.OpenAI(base_url=f"{keyed.base_url}/v1", api_key=API_KEY, max_retries=0)
    r = good.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


# ----- concurrency, disconnects, metrics ----------------------------------------------------
def test_32_concurrent_streams(server: ServerHandle) -> None:
    prompts = [f"Story {i}: once upon a time" for i in range(32)]

    async def run() -> tuple[list[str], list[str]]:
        c = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0)

        async def whole(p: str) -> str:
            r = await c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0)
            return r.choices[0].text

        async def streamed(p: str) -> str:
            s = await c.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0,
                                           stream=True)
            return "".join([ch.choices[0].text async for ch in s])

        a = await asyncio.gather(*(whole(p) for p in prompts))
        b = await asyncio.gather(*(streamed(p) for p in prompts))
        await c.close()
        return a, b

    whole_texts, streamed_texts = asyncio.run(run())
    assert streamed_texts == whole_texts
    assert all(t for t in whole_texts)


def test_disconnect_frees_blocks(server: ServerHandle, client: openai.OpenAI) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                      timeout=60) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data:")
            if seen == 3:
                # Scrape while still reading: leaving iter_lines closes the connection.
                busy = scrape(server)
                assert busy["forerun:num_requests_running"] == 1
                assert busy["forerun:kv_cache_usage_perc"] > 0
                break
    # The connection is closed mid-stream, 997 tokens early.
    m = wait_idle(server)
    assert m["forerun:num_requests_running"] == 0
    assert m["forerun:kv_cache_usage_perc"] == 0.0
    r2 = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert r2.usage.completion_tokens == 2


def test_metrics_move(server: ServerHandle, client: openai.OpenAI) -> None:
    before = scrape(server)
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
    after = wait_idle(server)
    for name in ("forerun:prompt_tokens_total", "forerun:generation_tokens_total",
                 "forerun:time_to_first_token_seconds_count",
                 "forerun:e2e_request_latency_seconds_count",
                 "forerun:request_queue_time_seconds_count",
                 "forerun:inter_token_latency_seconds_count",
                 "forerun:prefix_cache_queries_total"):
        assert after[name] > before.get(name, 0.0), name
    assert after["forerun:generation_tokens_total"] - before[
        "forerun:generation_tokens_total"] == 5
    for name in ("forerun:num_preemptions_total", "forerun:prefix_cache_hits_total",
                 "forerun:wasted_tokens_total"):
        assert name in after
