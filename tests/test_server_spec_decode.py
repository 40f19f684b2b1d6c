"""``forerun serve --speculative-config``: the same greedy text through the OpenAI API,
streamed or not, and vLLM's spec-decode counters on /metrics (and, on the same server,
vLLM's waiting-by-reason gauge).

Oracles: the offline engine without drafts (float32, like the server) for the text; the
Prometheus text parser for the counters, which must grow with each request.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forerun import SamplingParams
from tests.server_harness import ServerArgs

pytestmark = pytest.mark.slow

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
SPEC_SERVER = ServerArgs(("--speculative-config", SPEC, "--max-model-len", "512",
                          "--no-engine-process"))
PROMPT = ("Repeat the list exactly.\nList: red, green, blue, yellow, orange, purple, pink.\n"
          "Repeat: red, green,")


@pytest.fixture(scope="module")
def server() -> Any:
    handle = SPEC_SERVER.start()
    handle.wait_healthy()
    return handle


def spec_counters(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics").text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if "spec_decode" in s.name and s.name.endswith("_total"):
                key = s.name + ("" if "position" not in s.labels else f"@{s.labels['position']}")
                out[key] = s.value
    return out


def test_completions_with_drafts_equal_the_offline_text(server, llm_cache):
    want = llm_cache().generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0),
                                use_tqdm=False)[0].outputs[0].text
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x")
    before = spec_counters(server.base_url)
    got = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                    max_tokens=24, temperature=0.0)
    assert got.choices[0].text == want
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT,
                                       max_tokens=24, temperature=0.0, stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    after = spec_counters(server.base_url)
    for name in ("vllm:spec_decode_num_drafts_total",
                 "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total",
                 "forerun:spec_decode_num_drafts_total",
                 "forerun:spec_decode_num_draft_tokens_total",
                 "forerun:spec_decode_num_accepted_tokens_total"):
        assert after[name] > before.get(name, 0.0), (name, before, after)
    accepted = after["forerun:spec_decode_num_accepted_tokens_total"]
    per_pos = sum(v for k, v in after.items()
                  if k.startswith("forerun:spec_decode_num_accepted_tokens_per_pos_total@"))
    assert per_pos == accepted


def test_waiting_requests_by_reason_are_exported(server):
    text = httpx.get(f"{server.base_url}/metrics").text
    reasons = {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text)
               for s in fam.samples if s.name == "vllm:num_requests_waiting_by_reason"}
    assert reasons == {"capacity": 0.0, "deferred": 0.0, "remote_kvs": 0.0}
