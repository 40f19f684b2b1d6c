"""Bad request bodies against a real ``forerun serve``: a 400 naming the field, never a 5xx.

Raw httpx, so that bodies no client library would build get through (NaN, lone surrogates,
bools for numbers). One server for the module (the same one test_server.py uses); a normal
request must still work after each bad one, and at the end every KV block is free.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import MODEL, ServerHandle, start_server

pytestmark = pytest.mark.slow


CHAT = [{"role": "user", "content": "Say hi."}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server()
    handle.wait_healthy()
    return handle


@pytest.fixture(scope="module")
def http(server: ServerHandle) -> Any:
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        yield client


def post_raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    """POST a body as given: Python's json.dumps would refuse a lone surrogate (it escapes
    it, which is what we want) but writes NaN bare, which is what a sloppy client sends."""
    return http.post(path, content=body.encode("utf-8"),
                     headers={"content-type": "application/json"})


def assert_normal_request_works(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 2,
                                           "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def metrics(http: httpx.Client) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


def assert_all_blocks_free(http: httpx.Client, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(http)
        idle = (m.get("forerun:num_requests_running") == 0
                and m.get("forerun:num_requests_waiting") == 0
                and m.get("forerun:kv_cache_usage_perc") == 0.0)
        if idle:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.2)


# (endpoint, raw JSON body, the field the error must name)
BAD: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 2.0}', "max_tokens"),
    ("/v1/completions", '{"prompt": [true, false]}', "prompt"),
    ("/v1/completions", '{"prompt": [[1, true]]}', "prompt"),
    ("/v1/completions", '{"prompt": [1, 99999999]}', "prompt"),
    ("/v1/completions", '{"prompt": [-1]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "bad_words": "word"}', "bad_words"),
    ("/v1/completions", '{"prompt": "hi", "seed": 9223372036854775808}', "seed"),
    ("/v1/completions", '{"prompt": "hi", "seed": -9223372036854775809}', "seed"),
    ("/v1/completions", '{"prompt": "hi", "top_k": 9223372036854775808}', "top_k"),
    ("/v1/completions", '{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": "x"}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "temperature": 1e308}', "temperature"),
    ("/v1/completions", '{"prompt": "hi", "top_p": Infinity}', "top_p"),
    ("/v1/completions", '{"prompt": "hi", "presence_penalty": -Infinity}', "presence_penalty"),
    ("/v1/completions", '{"prompt": "hi", "repetition_penalty": NaN}', "repetition_penalty"),
    ("/v1/completions", '{"prompt": "hi", "min_p": NaN}', "min_p"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"5": NaN}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "logit_bias": {"x": 1}}', "logit_bias"),
    ("/v1/completions", '{"prompt": "hi", "stop": 123}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": "x"}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "stop_token_ids": [true]}', "stop_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "allowed_token_ids": [99999999]}', "allowed_token_ids"),
    ("/v1/completions", '{"prompt": "hi", "n": true}', "n"),
    ("/v1/completions", '{"prompt": "hi", "stream": "yes"}', "stream"),
    ("/v1/completions", '{"prompt": "hi", "logprobs": true}', "logprobs"),
    ("/v1/completions", '{"prompt": "hi", "echo": 1}', "echo"),
    ("/v1/completions", '{"prompt": "hi", "truncate_prompt_tokens": 1.5}', "truncate_prompt_tokens"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"max_completion_tokens": true}', "max_completion_tokens"),
    # vLLM reads chat's logprobs as a lax boolean (1 and "true" are true); not "maybe".
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"logprobs": "maybe"}', "logprobs"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"temperature": -Infinity}', "temperature"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
     '"stream_options": {"include_usage": "yes"}}', "stream_options"),
]


# Lone surrogate escapes. pydantic's JSON parser refuses them as invalid JSON, before any
# field is known (param null); a body validated from Python objects names the field.
SURROGATES: list[tuple[str, str, str]] = [
    ("/v1/completions", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "a\\udfffb"]}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "bad_words": ["\\ud800"]}', "bad_words"),
    ("/v1/completions", '{"prompt": "hi", "stop": "\\udc00"}', "stop"),
    ("/v1/completions", '{"prompt": "hi", "model": "\\ud800"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "guided_regex": "\\ud800x"}', "guided_regex"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
]


@pytest.mark.parametrize("path, body, param", SURROGATES, ids=[b[1] for b in SURROGATES])
def test_lone_surrogate_is_a_400_not_a_500(http: httpx.Client, path: str, body: str,
                                           param: str) -> None:
    r = post_raw(http, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    assert err["param"] in (None, param) and "surrogate" in err["message"], err
    assert_normal_request_works(http)


@pytest.mark.parametrize("path, body, param", BAD, ids=[b[1][:60] for b in BAD])
def test_bad_body_is_a_400_naming_the_field(http: httpx.Client, path: str, body: str,
                                            param: str) -> None:
    r = post_raw(http, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS, err
    assert err["param"] == param, err
    assert err["message"].startswith(param), err
    assert_normal_request_works(http)


# (field, value, pydantic's error type): vLLM bounds these in its request schema, and its
# 400 message carries the type, which clients match on.
OUT_OF_RANGE = [("seed", 2**63, "less_than_equal"), ("seed", -(2**63) - 1, "greater_than_equal"),
                ("truncate_prompt_tokens", -2, "greater_than_equal")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field, value, kind", OUT_OF_RANGE)
def test_out_of_range_message_carries_the_pydantic_error_type(
        http: httpx.Client, path: str, field: str, value: int, kind: str) -> None:
    body: dict[str, Any] = {"max_tokens": 1, field: value}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path
                else {"prompt": "hi"})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and kind in err["message"], err


def test_extreme_seeds_are_accepted_with_parallel_sampling(http: httpx.Client) -> None:
    # vLLM's schema takes seeds in the signed 64-bit range; the children of n > 1 get
    # seed + i modulo 2**64, so both ends still work.
    for seed in (2**63 - 1, -(2**63)):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hello", "n": 2,
                                               "max_tokens": 2, "seed": seed})
        assert r.status_code == 200, r.text
        assert [c["index"] for c in r.json()["choices"]] == [0, 1]


# ----- random bodies ------------------------------------------------------------------------
def _rarely(common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any],
            in_ten: int) -> st.SearchStrategy[Any]:
    """``rare`` about ``in_ten`` times in ten (one_of's own choice is far from even)."""
    return st.integers(0, 9).flatmap(lambda i: rare if i >= 10 - in_ten else common)


_SURROGATES = st.sampled_from(["\ud800", "a\udfffb", "\udc00x"])
_TEXT = _rarely(st.text(max_size=8), _SURROGATES, 2)
# Numbers valid, invalid and absurd; never a valid large count (n = 5000 would be slow).
_NUMBER = st.one_of(
    st.integers(-3, 5), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**63, 2**64, -(2**63) - 1, 10**30, 1e308, -1e308]))
_JUNK = st.one_of(st.none(), st.booleans(), _NUMBER, _TEXT,
                  st.lists(st.one_of(st.booleans(), _NUMBER, _TEXT), max_size=3),
                  st.dictionaries(_TEXT, _NUMBER, max_size=2))


def _mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Valid about eight times in ten, so that many bodies reach the engine."""
    return _rarely(valid, _JUNK, 2)


_WORD = st.text(alphabet="abc xyz.!", min_size=1, max_size=5)
_IDS = st.lists(st.integers(0, 49151), min_size=1, max_size=4)
_PROMPT = _mostly(st.one_of(_WORD, st.lists(_WORD, min_size=1, max_size=2), _IDS,
                            st.lists(_IDS, min_size=1, max_size=2),
                            st.lists(st.one_of(st.integers(-2, 60000), _JUNK), max_size=3)))
_MESSAGES = _mostly(st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                           "content": _mostly(_WORD)}), min_size=1, max_size=2))
_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _mostly(st.floats(0, 2)), "top_p": _mostly(st.floats(0.01, 1)),
    "top_k": _mostly(st.sampled_from([-1, 1, 5, 2**63 - 1])),
    "seed": _mostly(st.integers(-(2**63), 2**63 - 1)),
    "stop": _mostly(st.one_of(_WORD, st.lists(_WORD, max_size=2))),
    "stop_token_ids": _mostly(st.lists(st.integers(0, 49151), max_size=2)),
    "ignore_eos": _mostly(st.booleans()), "min_tokens": _mostly(st.integers(0, 2)),
    "n": _mostly(st.integers(1, 2)),
    "presence_penalty": _mostly(st.floats(-2, 2)), "frequency_penalty": _mostly(st.floats(-2, 2)),
    "repetition_penalty": _mostly(st.floats(0.5, 2)), "min_p": _mostly(st.floats(0, 1)),
    "logit_bias": _mostly(st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                          max_size=2)),
    "allowed_token_ids": _mostly(st.lists(st.integers(0, 49151), min_size=1, max_size=3)),
    "bad_words": _mostly(st.lists(_WORD.filter(str.strip), max_size=2)),
    "prompt_logprobs": _mostly(st.integers(0, 3)),
    "truncate_prompt_tokens": _mostly(st.sampled_from([-1, 1, 3])),
    "stream": _mostly(st.booleans()), "skip_special_tokens": _mostly(st.booleans()),
    "include_stop_str_in_output": _mostly(st.booleans()), "model": _mostly(st.just(MODEL)),
    "stream_options": _mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "response_format": _mostly(st.sampled_from([{"type": "text"}, {"type": "json_object"}])),
    "guided_regex": _mostly(st.just("[a-z]{1,3}")),
    "guided_choice": _mostly(st.just(["yes", "no"])),
    "user": _mostly(_WORD), "logprobs": _mostly(st.one_of(st.booleans(), st.integers(0, 3))),
    "echo": _mostly(st.booleans()), "top_logprobs": _mostly(st.integers(0, 3)),
}


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, str]:
    """An endpoint and a JSON body: a few random fields, each valid or not."""
    chat = draw(st.booleans())
    body: dict[str, Any] = {"messages": draw(_MESSAGES)} if chat else {"prompt": draw(_PROMPT)}
    # Never null: a request without max_tokens may generate up to the whole context.
    body["max_tokens"] = draw(_rarely(st.integers(1, 3), _JUNK.filter(lambda v: v is not None),
                                      2))
    for name in draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=4, unique=True)):
        body[name] = draw(_FIELDS[name])
    # ensure_ascii escapes lone surrogates as \\udXXX, the way they arrive over the wire;
    # allow_nan writes NaN and Infinity bare, which a sloppy client sends.
    text = json.dumps(body, ensure_ascii=True, allow_nan=True)
    return ("/v1/chat/completions" if chat else "/v1/completions"), text


STATUSES: list[int] = []


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(case=bodies())
def test_random_bodies_never_get_a_5xx(http: httpx.Client, case: tuple[str, str]) -> None:
    path, body = case
    r = post_raw(http, path, body)
    STATUSES.append(r.status_code)
    assert r.status_code < 500, (r.status_code, body, r.text[:500])
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text
    assert http.get("/health").status_code == 200


def test_random_bodies_reached_the_engine_too(http: httpx.Client) -> None:
    # Not only 400s: a fair share of the random bodies was valid and generated (a test of
    # the strategy, so that "never a 5xx" covers the engine path as well).
    if STATUSES:
        assert STATUSES.count(200) >= len(STATUSES) // 5, sorted(STATUSES)


def test_every_block_is_free_after_the_bad_requests(http: httpx.Client) -> None:
    assert_normal_request_works(http)
    assert_all_blocks_free(http)
