"""vLLM's extra endpoints, server options and metric names, through one real server.

The server listens on a unix socket under a root path, with two served names, request-id
headers, load tracking, the tokenizer-info endpoint and an API key: every test reaches it
through that socket, so ``--uds`` and ``--root-path`` are exercised by all of them.
Oracles: transformers' tokenizer, the server's own ``/v1`` routes (greedy, so the same
request gives the same text), the usage the responses report, and prometheus_client's
text parser.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forerun import SamplingParams, StructuredOutputsParams
from tests.server_harness import ServerArgs, ServerHandle

pytestmark = pytest.mark.slow

KEY = "sk-endpoints"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAMES = ("smol", "smol-alias")
ROOT = "/api"
SOCK = os.path.join(tempfile.gettempdir(), f"forerun-endpoints-{os.getpid()}.sock")
# Long enough that the stream is still running when the test looks (a token takes ~5 ms).
LONG = 1900
CHAT = [{"role": "user", "content": "Name a colour."}]
ENDPOINTS_SERVER = ServerArgs(
    ("--uds", SOCK, "--root-path", ROOT, "--served-model-name", *NAMES,
     "--enable-request-id-headers", "--enable-server-load-tracking",
     "--enable-tokenizer-info-endpoint",
     "--structured-outputs-config", '{"disable_any_whitespace": false}'),
    (("FORERUN_API_KEY", KEY),))


@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = ENDPOINTS_SERVER.start()
    deadline = time.monotonic() + 240
    while True:
        if handle.proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{handle.log()}")
        try:
            with _http() as h:
                if h.get("/health").status_code == 200:
                    return handle
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"server not healthy:\n{handle.log()}")
        time.sleep(0.3)


def _http() -> httpx.Client:
    """A client for the server's socket; paths are under the root path."""
    return httpx.Client(transport=httpx.HTTPTransport(uds=SOCK),
                        base_url=f"http://forerun{ROOT}", timeout=60)


@pytest.fixture()
def http(server: ServerHandle) -> Iterator[httpx.Client]:
    with _http() as h:
        yield h


@pytest.fixture()
def client(http: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://forerun{ROOT}/v1", api_key=KEY, max_retries=0,
                         http_client=http)


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer: Any) -> Any:
    return smollm2_tokenizer  # the session's (conftest)


# ----- /tokenize, /detokenize, /tokenizer_info ------------------------------------------------
def test_tokenize_prompt_matches_the_tokenizer(http: httpx.Client, tok: Any) -> None:
    text = "Hello, my name is Ada."
    r = http.post("/tokenize", json={"prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    want = tok.encode(text, add_special_tokens=True)
    assert body["tokens"] == want
    assert body["count"] == len(want)
    assert body["max_model_len"] == 2048
    assert body["token_strs"] == tok.convert_ids_to_tokens(want)
    plain = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert plain["tokens"] == tok.encode(text, add_special_tokens=False)
    assert plain["token_strs"] is None


def test_tokenize_messages_matches_the_chat_template(http: httpx.Client, tok: Any) -> None:
    r = http.post("/tokenize", json={"model": NAMES[1], "messages": CHAT})
    assert r.status_code == 200, r.text
    text = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert r.json()["tokens"] == tok.encode(text, add_special_tokens=False)
    bare = http.post("/tokenize", json={"messages": CHAT, "add_generation_prompt": False})
    text = tok.apply_chat_template(CHAT, add_generation_prompt=False, tokenize=False)
    assert bare.json()["tokens"] == tok.encode(text, add_special_tokens=False)


def test_detokenize_inverts_tokenize_and_refuses_unknown_ids(http: httpx.Client,
                                                            tok: Any) -> None:
    ids = tok.encode("The quick brown fox", add_special_tokens=False)
    r = http.post("/detokenize", json={"tokens": ids})
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": tok.decode(ids)}
    bad = http.post("/detokenize", json={"tokens": [1, len(tok) + 10_000]})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "tokens"
    assert http.post("/detokenize", json={"model": "nope", "tokens": ids}).status_code == 404


def test_tokenizer_info_reports_the_tokenizer(http: httpx.Client, tok: Any) -> None:
    r = http.get("/tokenizer_info")
    assert r.status_code == 200, r.text
    info = r.json()
    assert info["tokenizer_class"] == type(tok).__name__
    assert info["chat_template"] == tok.chat_template


# ----- /invocations ---------------------------------------------------------------------------
def test_invocations_routes_by_body_shape(http: httpx.Client) -> None:
    chat = {"messages": CHAT, "max_tokens": 6, "temperature": 0}
    r = http.post("/invocations", json=chat)
    assert r.status_code == 200, r.text
    direct = http.post("/v1/chat/completions", json=chat, headers=AUTH).json()
    assert r.json()["object"] == "chat.completion"
    assert (r.json()["choices"][0]["message"]["content"]
            == direct["choices"][0]["message"]["content"])
    comp = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0}
    r = http.post("/invocations", json=comp)
    assert r.status_code == 200, r.text
    direct = http.post("/v1/completions", json=comp, headers=AUTH).json()
    assert r.json()["object"] == "text_completion"
    assert r.json()["choices"][0]["text"] == direct["choices"][0]["text"]
    assert http.post("/invocations", json={"input": "x"}).status_code == 400


def test_invocations_answers_with_the_keys_a_client_parses(http: httpx.Client) -> None:
    # vLLM's test: the openai client's parsed chat completion and /invocations' raw JSON
    # have the same keys and choices (so every field the client declares is in the JSON).
    import openai

    transport = httpx.HTTPTransport(uds=SOCK)
    client = openai.OpenAI(base_url=f"http://forerun{ROOT}/v1", api_key=KEY, max_retries=0,
                           http_client=httpx.Client(transport=transport))
    args = {"messages": CHAT, "max_completion_tokens": 4, "temperature": 0.0,
            "logprobs": False}
    parsed = client.chat.completions.create(model=NAMES[0], **args).model_dump()
    raw = http.post("/invocations", json=args).json()
    assert parsed.keys() == raw.keys()
    assert parsed["choices"] == raw["choices"]
    comp = {"prompt": "Once upon a time", "max_tokens": 4, "temperature": 0.0}
    parsed = client.completions.create(model=NAMES[0], **comp).model_dump()
    raw = http.post("/invocations", json=comp).json()
    assert parsed.keys() == raw.keys() and parsed["choices"] == raw["choices"]


# ----- options --------------------------------------------------------------------------------
def test_api_key_guards_v1_under_the_root_path_only(http: httpx.Client) -> None:
    assert http.get("/v1/models").status_code == 401
    assert http.get("/v1/models", headers=AUTH).status_code == 200
    assert http.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    # Behind a proxy that strips the prefix the same routes answer, guarded the same.
    with httpx.Client(transport=httpx.HTTPTransport(uds=SOCK), base_url="http://forerun",
                      timeout=60) as stripped:
        assert stripped.get("/v1/models").status_code == 401
        assert stripped.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == NAMES[0]


def test_request_id_header_is_echoed_or_made(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": "hi"}, headers={"X-Request-Id": "abc-123"})
    assert r.headers["x-request-id"] == "abc-123"
    made = http.get("/health").headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f]{32}", made)
    assert made != http.get("/health").headers["x-request-id"]
    # Refusals carry it too.
    refused = http.get("/v1/models", headers={"X-Request-Id": "denied-1"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "denied-1"
    # As in vLLM, the client's id also names the response (cmpl-<id>, chatcmpl-<id>).
    r = http.post("/v1/completions", headers={"X-Request-Id": "abc-9", **AUTH},
                  json={"prompt": "hi", "max_tokens": 1})
    assert r.headers["x-request-id"] == "abc-9" and r.json()["id"] == "cmpl-abc-9"


def test_every_served_name_is_listed_and_accepted(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == list(NAMES)
    for name in NAMES:
        out = client.completions.create(model=name, prompt="Hi", max_tokens=2)
        assert out.model == NAMES[0]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)


def test_requests_are_logged_one_line_each(server: ServerHandle,
                                           client: openai.OpenAI) -> None:
    out = client.completions.create(model=NAMES[0], prompt="Log me", max_tokens=2)
    deadline = time.monotonic() + 10
    while f"Received request {out.id}" not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)
    assert server.log().count(f"Received request {out.id}:") == 1


def test_load_counts_an_in_flight_stream(http: httpx.Client) -> None:
    assert http.get("/load").json() == {"server_load": 0}
    body = {"prompt": "Count slowly:", "max_tokens": LONG, "stream": True,
            "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # held: a dropped iterator closes the response
        next(lines)
        assert http.get("/load").json() == {"server_load": 1}
    deadline = time.monotonic() + 10
    while http.get("/load").json()["server_load"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)


# ----- metrics --------------------------------------------------------------------------------
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _scrape(http: httpx.Client) -> tuple[Samples, dict[str, str]]:
    """Every sample by (name, labels), and every family's type."""
    samples: Samples = {}
    types: dict[str, str] = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def _value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(v for (n, lab), v in samples.items()
               if n == name and set(labels.items()) <= set(lab))


def _wait_idle(http: httpx.Client) -> Samples:
    deadline = time.monotonic() + 30
    while True:
        samples, _ = _scrape(http)
        if (_value(samples, "vllm:num_requests_running") == 0
                and _value(samples, "vllm:num_requests_waiting") == 0) \
                or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_metrics_count_what_was_sent(http: httpx.Client, client: openai.OpenAI) -> None:
    before = _wait_idle(http)
    a = client.completions.create(model=NAMES[0], prompt="One two three", max_tokens=5,
                                  temperature=0)
    b = client.completions.create(model=NAMES[1], prompt="Red green", max_tokens=7, n=2,
                                  temperature=1.0, seed=3)
    c = client.chat.completions.create(model=NAMES[0], messages=CHAT, max_tokens=3)  # type: ignore[arg-type]
    after = _wait_idle(http)

    def delta(name: str, **labels: str) -> float:
        return _value(after, "vllm:" + name, **labels) - _value(before, "vllm:" + name,
                                                               **labels)

    # Sequences: a, both choices of b, c. Each choice prefills the prompt for itself.
    prompt = (a.usage.prompt_tokens + 2 * b.usage.prompt_tokens  # type: ignore[union-attr]
              + c.usage.prompt_tokens)  # type: ignore[union-attr]
    generated = sum(r.usage.completion_tokens for r in (a, b, c))  # type: ignore[union-attr]
    assert delta("prompt_tokens_total") == prompt
    assert delta("generation_tokens_total") == generated
    assert delta("request_prompt_tokens_sum") == prompt
    assert delta("request_prompt_tokens_count") == 4
    assert delta("request_generation_tokens_sum") == generated
    assert delta("iteration_tokens_total_sum") == prompt + generated
    finished = sum(delta("request_success_total", finished_reason=r)
                   for r in ("stop", "length"))
    assert finished == 4
    # n: 1, 2, 1 (one per request); max_tokens: 5, 7, 7, 3 (one per sequence).
    assert delta("request_params_n_bucket", le="1.0") == 2
    assert delta("request_params_n_bucket", le="2.0") == 3
    assert delta("request_params_n_count") == 3
    assert delta("request_params_max_tokens_bucket", le="2.0") == 0
    assert delta("request_params_max_tokens_bucket", le="5.0") == 2
    assert delta("request_params_max_tokens_bucket", le="10.0") == 4
    assert delta("request_params_max_tokens_sum") == 5 + 7 + 7 + 3
    for name in ("request_inference_time_seconds", "request_prefill_time_seconds",
                 "request_decode_time_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "time_to_first_token_seconds"):
        assert delta(name + "_count") == 4, name


def test_iteration_tokens_follow_vllms_per_step_definition(http: httpx.Client,
                                                          client: openai.OpenAI,
                                                          tok: Any) -> None:
    # vLLM's definition (V1 IterationStats, observed once per engine step that has
    # outputs): the prompt tokens of each request whose first token that step sampled
    # (its whole prompt, prefix-cache hits included) plus every token the step sampled.
    # vLLM's own test_metrics_counts shape: identical prompts one after another (so the
    # later ones hit the prefix cache), a fixed length each (ignore_eos), one step per
    # token: sum = N * (P + max_tokens), count = N * max_tokens.
    prompt_ids = tok.encode("Hello my name is Robert and I love magic")
    n, max_tokens = 3, 10
    before = _wait_idle(http)
    for _ in range(n):
        r = client.completions.create(model=NAMES[0], prompt=prompt_ids, max_tokens=max_tokens,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == max_tokens  # type: ignore[union-attr]
    after = _wait_idle(http)

    def delta(name: str) -> float:
        return _value(after, "vllm:" + name) - _value(before, "vllm:" + name)

    assert delta("iteration_tokens_total_sum") == n * (len(prompt_ids) + max_tokens)
    assert delta("iteration_tokens_total_count") == n * max_tokens


def test_metrics_have_vllm_and_forerun_names_alike(http: httpx.Client) -> None:
    samples, types = _scrape(http)
    vllm = {(n.removeprefix("vllm:"), lab): v for (n, lab), v in samples.items()
            if n.startswith("vllm:") and not n.endswith("_created")}
    ours = {(n.removeprefix("forerun:"), lab): v for (n, lab), v in samples.items()
            if n.startswith("forerun:") and not n.endswith("_created")}
    assert vllm == ours
    assert types["vllm:iteration_tokens_total"] == "histogram"
    assert types["vllm:request_success"] == "counter"
    assert types["vllm:num_requests_running"] == "gauge"
    assert types["vllm:cache_config_info"] == "gauge"
    running = [lab for (n, lab) in samples if n == "vllm:num_requests_running"]
    assert running == [(("engine", "0"), ("model_name", NAMES[0]))]
    # Every finish reason has a series from the start (no request here ended in error).
    reasons = {dict(lab)["finished_reason"] for (n, lab) in samples
               if n == "vllm:request_success_total"}
    assert reasons == {"stop", "length", "abort", "error"}
    (info,) = [dict(lab) for (n, lab) in samples if n == "vllm:cache_config_info"]
    assert info["block_size"] == "16"
    assert int(info["num_gpu_blocks"]) > 0


def test_aborted_requests_are_counted(http: httpx.Client) -> None:
    before = _wait_idle(http)
    body = {"prompt": "Abort me", "max_tokens": LONG, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=body, headers=AUTH) as r:
        lines = r.iter_lines()
        next(lines)
    deadline = time.monotonic() + 10
    while True:
        after = _wait_idle(http)
        got = (_value(after, "vllm:request_success_total", finished_reason="abort")
               - _value(before, "vllm:request_success_total", finished_reason="abort"))
        if got or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert got == 1


@pytest.mark.slow
def test_structured_outputs_config_sets_the_server_wide_whitespace_mode(
        client: openai.OpenAI, llm_cache: Any) -> None:
    # This server runs with --structured-outputs-config '{"disable_any_whitespace": false}'
    # (vLLM's flag): a JSON constraint that does not choose allows any whitespace. Oracle:
    # the offline engine with each mode set on the request (greedy, float32 both sides).
    # A request's own choice still wins: the same code path as without the flag
    # (test_structured_whitespace.py).
    from tests.test_structured_whitespace import TAGS

    ask = [{"role": "user", "content": "Tags for a post about colours, as JSON."}]
    llm = llm_cache()

    def offline(disable: bool) -> str:
        so = StructuredOutputsParams(json=TAGS, disable_any_whitespace=disable)
        p = SamplingParams(max_tokens=6, temperature=0.0, structured_outputs=so)
        return llm.chat(ask, p, use_tqdm=False)[0].outputs[0].text

    any_ws, compact = offline(False), offline(True)
    assert any_ws != compact  # the prompt tells the two modes apart
    rf = {"type": "json_schema", "json_schema": {"name": "tags", "schema": TAGS}}
    r = client.chat.completions.create(model=NAMES[0], messages=ask, max_tokens=6,
                                       temperature=0, response_format=rf)
    assert r.choices[0].message.content == any_ws

