"""vLLM's logprobs and token-id extras, and streaming usage, through the real server.

Oracles: the offline engine (``forerun.LLM``, float32 like the server) for prompt
logprobs; the tokenizer for token ids, ``token_id:<id>`` and token counts. One server
serves the module, a second (small) one checks ``--enable-force-include-usage``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import openai
import pytest

from forerun import SamplingParams
from tests.server_harness import DEFAULT, ServerArgs, ServerHandle

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
TOL = 2e-3
# The second server; test_max_logprobs.py shares it (the whole vocabulary there).
FORCED_ARGS = ("--enable-force-include-usage", "--no-engine-process", "--max-model-len", "256",
               "--max-logprobs", "-1", "--return-tokens-as-token-ids")  # float32 on both sides; batches differ, so summation order may too
FORCED = ServerArgs(FORCED_ARGS)


@pytest.fixture(scope="module")
def env(llm_cache: Any) -> dict[str, Any]:
    main = DEFAULT.start()
    forced = FORCED.start()
    llm = llm_cache()
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    ref = llm.generate([PROMPT], params, use_tqdm=False)[0]
    ref_chat = llm.chat(CHAT, params, use_tqdm=False)[0]
    main.wait_healthy()
    forced.wait_healthy()
    return {"main": main, "forced": forced, "tok": llm.get_tokenizer(), "ref": ref,
            "ref_chat": ref_chat}


@pytest.fixture(scope="module")
def http(env: dict[str, Any]) -> httpx.Client:
    server: ServerHandle = env["main"]
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.fixture()
def client(env: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env['main'].base_url}/v1", api_key="x", max_retries=0)


def _post(http: httpx.Client, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def _chat_ids(tok: Any) -> list[int]:
    """The chat prompt's ids as transformers renders the template, then tokenises it."""
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return list(tok.encode(text, add_special_tokens=False))


def _assert_matches_offline(got: list[Any], ref: list[Any], tok: Any, k: int) -> None:
    """Server prompt_logprobs (JSON) against the offline engine's, position by position."""
    assert len(got) == len(ref)
    assert got[0] is None and ref[0] is None
    for g, r in zip(got[1:], ref[1:], strict=True):
        ranked = {t: lp for t, lp in r.items() if lp.rank is not None and lp.rank <= k}
        want = {str(t) for t in ranked} | {str(next(iter(r)))}  # the prompt's token too
        assert set(g) == want
        for t, entry in g.items():
            assert math.isclose(entry["logprob"], r[int(t)].logprob, abs_tol=TOL)
            assert entry["rank"] == r[int(t)].rank
            assert entry["decoded_token"] == tok.decode([int(t)])


def test_completion_prompt_logprobs_match_the_offline_engine(http: httpx.Client,
                                                             env: dict[str, Any]) -> None:
    resp = _post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1,
                                           "temperature": 0, "prompt_logprobs": 1})
    (choice,) = resp["choices"]
    assert len(choice["prompt_logprobs"]) == resp["usage"]["prompt_tokens"]
    _assert_matches_offline(choice["prompt_logprobs"], env["ref"].prompt_logprobs,
                            env["tok"], 1)


def test_chat_prompt_logprobs_are_on_the_response(http: httpx.Client,
                                                  env: dict[str, Any]) -> None:
    resp = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                "temperature": 0, "prompt_logprobs": 2})
    assert "prompt_logprobs" not in resp["choices"][0]  # on the response, as in vLLM
    _assert_matches_offline(resp["prompt_logprobs"], env["ref_chat"].prompt_logprobs,
                            env["tok"], 2)


@pytest.mark.parametrize("path, field", [
    ("/v1/completions", "logprobs"), ("/v1/completions", "prompt_logprobs"),
    ("/v1/chat/completions", "top_logprobs"), ("/v1/chat/completions", "prompt_logprobs")])
def test_whole_vocabulary_logprobs_are_refused_past_max_logprobs(
        http: httpx.Client, path: str, field: str) -> None:
    # vLLM's rule with its default --max-logprobs 20: -1 is the vocabulary, over the cap.
    body: dict[str, Any] = {"max_tokens": 1, field: -1}
    body.update({"prompt": PROMPT} if "chat" not in path else
                {"messages": CHAT, "logprobs": True})
    r = http.post(path, json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == field and "max allowed: 20" in err["message"]


def test_logprobs_zero_lists_the_sampled_token(http: httpx.Client, env: dict[str, Any]
                                               ) -> None:
    resp = _post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4,
                                           "temperature": 0.8, "seed": 3, "logprobs": 0,
                                           "return_token_ids": True})
    (choice,) = resp["choices"]
    lps = choice["logprobs"]
    assert lps["tokens"] == [env["tok"].decode([t]) for t in choice["token_ids"]]
    for token, lp, top in zip(lps["tokens"], lps["token_logprobs"], lps["top_logprobs"],
                              strict=True):
        assert top == {token: lp}


def test_echo_with_logprobs_starts_with_the_prompts_entries(
        http: httpx.Client, env: dict[str, Any]) -> None:
    resp = _post(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                           "temperature": 0, "echo": True, "logprobs": 1})
    (choice,) = resp["choices"]
    lps, ref = choice["logprobs"], env["ref"]
    n_prompt = len(ref.prompt_token_ids)
    assert len(lps["tokens"]) == n_prompt + resp["usage"]["completion_tokens"]
    assert lps["tokens"][:n_prompt] == [env["tok"].decode([t]) for t in ref.prompt_token_ids]
    assert lps["token_logprobs"][0] is None and lps["top_logprobs"][0] is None
    for i in range(1, n_prompt):
        want = ref.prompt_logprobs[i][ref.prompt_token_ids[i]].logprob
        assert math.isclose(lps["token_logprobs"][i], want, abs_tol=TOL)
    assert choice["text"].startswith(PROMPT)
    assert lps["text_offset"][n_prompt] == len(PROMPT)

    # A stream shows the same entries, the prompt's in its first chunk.
    events = _events(http, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3,
                                                "temperature": 0, "echo": True,
                                                "logprobs": 1, "stream": True})
    streamed = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lps["tokens"]
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]


def test_return_token_ids_are_the_tokenizers(client: openai.OpenAI, http: httpx.Client,
                                             env: dict[str, Any]) -> None:
    tok = env["tok"]
    c = client.completions.create(model=None, prompt=PROMPT, max_tokens=5, temperature=0,
                                  extra_body={"return_token_ids": True})
    choice = c.choices[0].model_dump()
    assert choice["prompt_token_ids"] == tok.encode(PROMPT)
    assert tok.decode(choice["token_ids"]) == c.choices[0].text

    chat = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 5,
                                                "temperature": 0, "return_token_ids": True})
    assert chat["prompt_token_ids"] == _chat_ids(tok)
    ids = chat["choices"][0]["token_ids"]
    assert tok.decode(ids, skip_special_tokens=True) == chat["choices"][0]["message"]["content"]

    # Streamed: each chunk's new ids; the prompt's on the first chunk only (vLLM: the role
    # chunk for chat, each choice's first chunk for completions, null on the others).
    events = _events(http, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 5, "temperature": 0, "return_token_ids": True,
        "stream": True})
    assert events[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in events[1:])
    assert [t for e in events for t in e["choices"][0].get("token_ids", [])] == ids
    events = _events(http, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "return_token_ids": True,
        "stream": True})
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == choice["token_ids"]
    assert [e["choices"][0]["prompt_token_ids"] for e in events] == \
        [choice["prompt_token_ids"]] + [None] * (len(events) - 1)


def test_vllm_extras_are_null_unless_asked_for(client: openai.OpenAI) -> None:
    # Clients read these attributes unconditionally (vLLM's tests do): null, not absent.
    c = client.completions.create(model=None, prompt=[PROMPT, "Hi"], n=2, max_tokens=2,
                                  temperature=0)
    assert len(c.choices) == 4
    for choice in c.choices:
        assert choice.prompt_logprobs is None and choice.token_ids is None
        assert choice.prompt_token_ids is None and choice.stop_reason is None
    chat = client.chat.completions.create(model=None, messages=CHAT, max_tokens=2)
    assert chat.prompt_logprobs is None and chat.prompt_token_ids is None
    assert chat.choices[0].token_ids is None and chat.choices[0].stop_reason is None
    # A stop string is the choice's stop_reason, as in vLLM.
    text = client.completions.create(model=None, prompt=PROMPT, max_tokens=8,
                                     temperature=0).choices[0].text
    word = text.split()[0]
    c = client.completions.create(model=None, prompt=PROMPT, max_tokens=8, temperature=0,
                                  stop=[word])
    assert c.choices[0].stop_reason == word and c.choices[0].finish_reason == "stop"


def test_token_ids_agree_with_prompt_logprobs_and_logprobs(client: openai.OpenAI,
                                                           env: dict[str, Any]) -> None:
    # vLLM's consistency test: echo + logprobs + prompt_logprobs + both id extras.
    tok = env["tok"]
    c = client.completions.create(model=None, prompt=PROMPT, max_tokens=4, temperature=0,
                                  echo=True, logprobs=1, extra_body={
                                      "return_token_ids": True, "prompt_logprobs": 1,
                                      "return_tokens_as_token_ids": True})
    choice = c.choices[0]
    assert choice.prompt_token_ids == tok.encode(PROMPT)
    ids = [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]
    assert ids == choice.prompt_token_ids + choice.token_ids
    assert tok.decode(ids) == choice.text
    assert [next(iter(top)) for top in choice.logprobs.top_logprobs[1:]] == \
        choice.logprobs.tokens[1:]
    # prompt_logprobs: one entry per prompt position, keyed by id, the prompt's own token
    # at each; decoded_token stays text (as in vLLM).
    assert len(choice.prompt_logprobs) == len(choice.prompt_token_ids)
    assert choice.prompt_logprobs[0] is None
    for pos, tid in zip(choice.prompt_logprobs[1:], choice.prompt_token_ids[1:], strict=True):
        assert str(tid) in pos and pos[str(tid)]["decoded_token"] == tok.decode([tid])
        assert len(pos) <= 2
    # An echo with logprobs alone shows the prompt's logprobs too, with that count.
    c = client.completions.create(model=None, prompt=PROMPT, max_tokens=1, echo=True,
                                  logprobs=2)
    _assert_matches_offline(c.choices[0].prompt_logprobs, env["ref"].prompt_logprobs,
                            tok, 2)


EMOJI_CHAT = [{"role": "system", "content": "You like to respond in only emojis, like 🎉"},
              {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}]


def test_tokens_as_ids_and_characters_split_across_tokens(http: httpx.Client,
                                                          env: dict[str, Any]) -> None:
    tok = env["tok"]
    body = {"messages": EMOJI_CHAT, "max_tokens": 8, "temperature": 0, "logprobs": True,
            "top_logprobs": 1, "return_token_ids": True, "return_tokens_as_token_ids": True}
    resp = _post(http, "/v1/chat/completions", body)
    (choice,) = resp["choices"]
    ids, content = choice["token_ids"], choice["message"]["content"]
    decoded = tok.decode(ids, skip_special_tokens=True)
    # The case this test is about: the last emoji's bytes are cut by max_tokens.
    assert decoded.endswith("\ufffd"), decoded
    # The text holds only whole characters: the incomplete one is held back to the end.
    assert "\ufffd" not in content and content == decoded.rstrip("\ufffd")
    entries = choice["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in ids]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
    assert all(t["token"].startswith("token_id:") for e in entries for t in e["top_logprobs"])
    # Streamed, the deltas add up to the same text and never carry a replacement character.
    events = _events(http, "/v1/chat/completions", {**body, "stream": True})
    deltas = [e["choices"][0]["delta"].get("content", "") for e in events]
    assert "".join(deltas) == content and not any("\ufffd" in d for d in deltas)
    assert [x["token"] for e in events if e["choices"][0]["logprobs"]
            for x in e["choices"][0]["logprobs"]["content"]] == [e["token"] for e in entries]


def test_return_tokens_as_token_ids_server_flag(env: dict[str, Any]) -> None:
    # --return-tokens-as-token-ids (the second server): the default, a request's false wins.
    url = f"{env['forced'].base_url}/v1/completions"
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "logprobs": 1,
            "return_token_ids": True}
    choice = httpx.post(url, json=body, timeout=60).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    choice = httpx.post(url, json={**body, "return_tokens_as_token_ids": False},
                        timeout=60).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [env["tok"].decode([t]) for t in choice["token_ids"]]


def test_chat_echo_shows_prompt_logprobs_and_logprobs_is_lax(http: httpx.Client,
                                                            env: dict[str, Any]) -> None:
    # vLLM: an echo computes the prompt's logprobs with top_logprobs' count; its protocol
    # reads logprobs as a lax boolean ("true" is true).
    resp = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                "temperature": 0, "echo": True,
                                                "logprobs": "true", "top_logprobs": 2})
    _assert_matches_offline(resp["prompt_logprobs"], env["ref_chat"].prompt_logprobs,
                            env["tok"], 2)
    (entry,) = resp["choices"][0]["logprobs"]["content"]
    assert len(entry["top_logprobs"]) == 2
    resp = _post(http, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 1,
                                                "logprobs": 0})
    assert resp["choices"][0]["logprobs"] is None


def test_tokens_as_token_ids_name_each_token_by_id(http: httpx.Client) -> None:
    resp = _post(http, "/v1/completions", {
        "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 2,
        "return_tokens_as_token_ids": True, "return_token_ids": True})
    (choice,) = resp["choices"]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"]
               for k in top)
    chat = _post(http, "/v1/chat/completions", {
        "messages": CHAT, "max_tokens": 3, "temperature": 0, "logprobs": True,
        "top_logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True})
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == \
        [f"token_id:{t}" for t in chat["choices"][0]["token_ids"]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_counts_tokens_on_every_chunk(http: httpx.Client,
                                                       env: dict[str, Any], path: str) -> None:
    tok = env["tok"]
    chat = "chat" in path
    body: dict[str, Any] = {"max_tokens": 4, "temperature": 0, "stream": True,
                            "return_token_ids": True, "stream_options": {
                                "include_usage": True, "continuous_usage_stats": True}}
    body.update({"messages": CHAT} if chat else {"prompt": PROMPT})
    n_prompt = len(_chat_ids(tok) if chat else tok.encode(PROMPT))
    events = _events(http, path, body)
    generated = 0
    for e in events[:-1]:  # every chunk, the chat role chunk (0 tokens so far) included
        generated += len(e["choices"][0].get("token_ids", []))
        assert e["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": generated,
                              "total_tokens": n_prompt + generated,
                              "prompt_tokens_details": None, "completion_tokens_details": None}
    if chat:
        assert events[0]["usage"]["completion_tokens"] == 0
    assert events[-1]["choices"] == []
    assert events[-1]["usage"]["completion_tokens"] == generated == 4


def test_force_include_usage_ends_every_stream_with_usage(env: dict[str, Any]) -> None:
    tok = env["tok"]
    client = openai.OpenAI(base_url=f"{env['forced'].base_url}/v1", api_key="x",
                           max_retries=0)
    chunks = list(client.completions.create(model=None, prompt=PROMPT, max_tokens=3,
                                            temperature=0, stream=True))
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == len(tok.encode(PROMPT))
    assert chunks[-1].usage.completion_tokens == 3
    # As in vLLM, the flag also puts the running usage on every chunk.
    assert [c.usage.completion_tokens for c in chunks[:-1]] == [1, 2, 3]
    chunks = list(client.chat.completions.create(model=None, messages=CHAT, max_tokens=2,
                                                 temperature=0, stream=True))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2
    assert [c.usage.completion_tokens for c in chunks[:-1]] == [0, 1, 2]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("extra, param", [
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
    # Beam search is supported (test_beam_search.py); what it cannot honour is a 400.
    ({"use_beam_search": True, "top_p": 0.5}, "top_p"),
    ({"length_penalty": 0.5}, "length_penalty"),
    ({"priority": 1}, "priority"),
    ({"vllm_xargs": {"a": 1}}, "vllm_xargs"),
])
def test_unsupported_or_misplaced_extras_are_a_400_naming_the_field(
        http: httpx.Client, path: str, extra: dict[str, Any], param: str) -> None:
    body: dict[str, Any] = {"max_tokens": 1, **extra}
    body.update({"messages": CHAT} if "chat" in path else {"prompt": PROMPT})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_extras_holding_their_off_value_and_unknown_fields_are_accepted(
        http: httpx.Client) -> None:
    # vLLM clients send the defaults; truly unknown fields are ignored, as vLLM does.
    body = {"prompt": PROMPT, "max_tokens": 1, "use_beam_search": False,
            "length_penalty": 1.0, "priority": 0, "add_special_tokens": True,
            "some_future_field": 7}
    assert http.post("/v1/completions", json=body).status_code == 200
    r = http.post("/v1/completions", json={**body, "add_special_tokens": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_special_tokens"


def test_logit_bias_out_of_vocabulary_states_the_vocabulary_size(
        http: httpx.Client, env: dict[str, Any]) -> None:
    vocab = len(env["tok"])
    r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1,
                                           "logit_bias": {str(vocab): 1}})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "logit_bias" and f"vocabulary size is {vocab}" in err["message"]
