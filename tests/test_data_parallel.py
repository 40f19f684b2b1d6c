"""``forerun serve --data-parallel-size 2``: two engine cores behind one API server.

Oracles: the offline engine (float32, like the servers) for every completion; the
per-engine series of /metrics (Prometheus text parser) for where the work went; the process
table for a clean exit when one engine dies.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from forerun import LLM, SamplingParams
from tests.server_harness import pid_alive, start_server, started_pids

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def add(a, b):",
           "Three fruits: apple,", "Water boils at", "The largest planet is"]


def engine_pids(server_pid: int) -> list[int]:
    return started_pids(server_pid)


def per_engine(text: str, name: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["engine"]] = s.value
    return out


def test_two_engines_share_the_requests_answer_like_one_and_stop_together(llm_cache):
    server = start_server("--data-parallel-size", "2", fresh=True)
    server.wait_healthy()
    try:
        want = [o.outputs[0].text for o in llm_cache().generate(
            PROMPTS, SamplingParams(max_tokens=12, temperature=0.0), use_tqdm=False)]

        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", timeout=120,
                               max_retries=0)

        def complete(prompt: str) -> str:
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                          temperature=0)
            return r.choices[0].text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(complete, PROMPTS))
        assert got == want
        # n > 1: the children go to one engine together (they share the prompt's blocks).
        r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, n=3,
                                      temperature=0)
        assert [c.text for c in r.choices] == [want[0][: len(c.text)] for c in r.choices]
        text = httpx.get(f"{server.base_url}/metrics").text
        queries = per_engine(text, "vllm:prefix_cache_queries_total")
        assert set(queries) == {"0", "1"} and all(v > 0 for v in queries.values()), queries
        assert set(per_engine(text, "vllm:num_requests_running")) == {"0", "1"}
        # Each engine pins itself to its own share of the CPUs.
        pids = engine_pids(server.proc.pid)
        cpus = [os.sched_getaffinity(pid) for pid in pids]
        assert len(cpus) == 2
        if len(os.sched_getaffinity(0)) >= 2:
            assert not cpus[0] & cpus[1], cpus
        # One engine dying stops the server (exit 1) and the other engine.
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while server.proc.poll() is None:
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.1)
        assert server.proc.returncode == 1
        deadline = time.monotonic() + 15
        while pid_alive(pids[0]):
            assert time.monotonic() < deadline, "engine 0 outlived its server"
            time.sleep(0.1)
    finally:
        server.stop()


def test_bad_data_parallel_size_is_a_clear_error():
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(data_parallel_size=0)
    with pytest.raises(ValueError, match="data_parallel_size.*forerun serve"):
        LLM(data_parallel_size=2)


def test_a_shared_prefix_goes_where_its_blocks_are_unless_that_engine_is_much_busier():
    from forerun.engine.dp_router import PrefixAwareRouter

    router = PrefixAwareRouter(num_engines=2, block_size=4, max_imbalance=2)
    system = list(range(100, 112))  # three full blocks
    load = [0, 0]

    def route(prompt: list[int]) -> int:
        i = router.choose(prompt, load)
        load[i] += 1
        return i

    assert route(system + [1, 2]) == 0  # nothing cached anywhere: the least loaded
    assert route([7] * 14) == 1
    assert route([8] * 14) == 0
    # Loads are 2 and 1: by load this would go to engine 1; its prefix is on engine 0.
    assert route(system + [3, 4, 5]) == 0
    assert route(system[:8] + [9] * 6) == 0  # two leading blocks match there
    assert route(system[:3]) == 1  # shorter than a block: by load
    # Engine 0 now runs 4, engine 1 runs 2: within the allowed imbalance of 2...
    assert route(system + [6]) == 0
    # ...and now beyond it: the least loaded engine takes the request (and its blocks).
    assert load == [5, 2]
    assert route(system + [6]) == 1
    assert route(system + [10]) == 1  # both hold it now; the less loaded one wins
