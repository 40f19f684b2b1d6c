"""What a real ``forerun serve`` does at its limits and when things break.

A "limits" server (tiny queue, short timeouts, a small body limit, the API key from the
environment) takes the admission, timeout, disconnect, HTTP-edge and frozen-engine
cases, and last its engine is killed; two more are started only to be broken: API
process killed, SIGTERM under load. Every case checks what the client receives, and that nothing is left
behind (KV blocks, requests, processes).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from typing import Any
from urllib.parse import urlparse

import httpx
import pytest

from tests.server_harness import (
    MODEL,
    ServerArgs,
    ServerHandle,
    child_pids,
    engine_pid,
    pid_alive,
    start_server,
)
from tests.test_server import wait_idle

pytestmark = pytest.mark.slow

KEY = "sk-limits"
AUTH = {"Authorization": f"Bearer {KEY}"}
# The request timeout is short (a 1900-token request runs ~10 s idle): the 504 test waits
# it out.
TIMEOUT_S = 6
LIMITS = ("--max-num-seqs", "4", "--max-waiting-requests", "4", "--request-timeout",
          str(TIMEOUT_S),
          "--engine-heartbeat-timeout", "4", "--max-request-body-bytes", str(4 << 20),
          "--disable-fastapi-docs")
LIMITS_SERVER = ServerArgs(LIMITS, (("FORERUN_API_KEY", KEY),))


@pytest.fixture(scope="module")
def servers() -> dict[str, ServerHandle]:
    # Started together: three model loads overlap instead of queueing. The last test on the
    # limits server kills its engine (a later start_server with its arguments starts anew).
    handles = {
        "limits": LIMITS_SERVER.start(),
        "api_kill": start_server("--max-num-seqs", "8", fresh=True),
        "term": start_server("--shutdown-timeout", "60", fresh=True),
    }
    for h in handles.values():
        h.wait_healthy()
    return handles


@pytest.fixture()
def limits(servers: dict[str, ServerHandle]) -> ServerHandle:
    return servers["limits"]


def _post(server: ServerHandle, body: dict[str, Any], timeout: float = 120,
          path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body},
                      headers=AUTH, timeout=timeout)


def _idle(server: ServerHandle) -> dict[str, float]:
    m = wait_idle(server)
    assert m["forerun:num_requests_running"] == 0
    assert m["forerun:num_requests_waiting"] == 0
    assert m["forerun:kv_cache_usage_perc"] == 0.0
    return m


def _error(r: httpx.Response) -> dict[str, Any]:
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


def _wait_exit(server: ServerHandle, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, f"server still up:\n{server.log()}"
        time.sleep(0.1)
    return server.proc.returncode


def _wait_gone(pid: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while pid_alive(pid):
        assert time.monotonic() < deadline, f"process {pid} outlived its server"
        time.sleep(0.1)


# ----- admission --------------------------------------------------------------------------
def test_full_server_answers_503_with_retry_after(limits: ServerHandle) -> None:
    body = {"prompt": "Count: 1, 2, 3,", "max_tokens": 8, "ignore_eos": True,
            "temperature": 0}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(headers=AUTH, timeout=120) as c:
            return await asyncio.gather(*(
                c.post(f"{limits.base_url}/v1/completions", json={"model": MODEL, **body})
                for _ in range(20)))

    responses = asyncio.run(flood())
    codes = sorted(r.status_code for r in responses)
    # 4 running + 4 waiting fit; the other 12 arrive while those are still in flight.
    assert codes.count(200) >= 8 and codes.count(503) >= 1, (codes, sorted({r.text[:120] for r in responses}))
    assert set(codes) == {200, 503}, codes
    for r in responses:
        if r.status_code == 503:
            assert int(r.headers["retry-after"]) >= 1
            assert _error(r)["code"] == "server_overloaded"
        else:
            assert r.json()["usage"]["completion_tokens"] == 8
    _idle(limits)
    assert "Traceback" not in limits.log()


def test_request_bigger_than_the_queue_is_400_naming_n(limits: ServerHandle) -> None:
    r = _post(limits, {"prompt": "hi", "max_tokens": 2, "n": 9})
    assert r.status_code == 400 and _error(r)["param"] == "n"
    r = _post(limits, {"prompt": ["a", "b", "c"], "max_tokens": 2, "n": 3})
    assert r.status_code == 400 and _error(r)["param"] == "n"
    assert _post(limits, {"prompt": "hi", "max_tokens": 2, "n": 8}).status_code == 200
    _idle(limits)


# ----- disconnects and timeouts -----------------------------------------------------------
def test_non_streaming_client_that_hangs_up_is_aborted(limits: ServerHandle) -> None:
    long = {"prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}
    for _ in range(4):
        with pytest.raises(httpx.ReadTimeout):
            _post(limits, long, timeout=1.0)
    # 1500 tokens each would take far longer than this wait if they were still running.
    _idle(limits)
    assert _post(limits, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_request_timeout_is_504_and_frees_blocks(limits: ServerHandle) -> None:
    long = {"prompt": "Once upon a time", "max_tokens": 1900, "ignore_eos": True}
    result: dict[str, Any] = {}

    def whole() -> None:
        t0 = time.monotonic()
        result["r"] = _post(limits, long)
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=whole)  # side by side with the streamed one
    t.start()
    with httpx.stream("POST", f"{limits.base_url}/v1/completions", headers=AUTH,
                      json={"model": MODEL, **long, "stream": True}, timeout=120) as s:
        events = [line[len("data: "):] for line in s.iter_lines() if line.startswith("data:")]
    t.join()
    r = result["r"]
    assert r.status_code == 504 and _error(r)["code"] == "request_timeout"
    assert TIMEOUT_S <= result["s"] < 90
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    assert len(events) > 3  # tokens streamed before the timeout
    _idle(limits)


# ----- the HTTP edge ----------------------------------------------------------------------
def _raw_request(server: ServerHandle, headers: dict[str, str], body: bytes = b"",
                 timeout_s: float = 10.0) -> bytes:
    """Send a request head (and maybe part of a body); the reply, read until the server
    closes the connection (it must: the announced body was never read)."""
    url = urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port), timeout=timeout_s) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode()
                     + body)
        reply = b""
        while chunk := sock.recv(4096):
            reply += chunk
        return reply


def test_wrong_key_is_401_before_the_body_is_sent(limits: ServerHandle) -> None:
    # 50 MB announced, none sent: the answer must not wait for it.
    reply = _raw_request(limits, {"Content-Length": str(50 << 20),
                                  "Content-Type": "application/json",
                                  "Authorization": "Bearer wrong"})
    assert reply.startswith(b"HTTP/1.1 401")
    assert b"invalid_api_key" in reply


def test_oversized_body_is_413(limits: ServerHandle) -> None:
    reply = _raw_request(limits, {"Content-Length": str(50 << 20),
                                  "Content-Type": "application/json", **AUTH})
    assert reply.startswith(b"HTTP/1.1 413") and b"request_too_large" in reply

    def chunks() -> Any:  # no Content-Length: chunked, counted as it arrives
        for _ in range(80):
            yield b" " * (64 << 10)

    r = httpx.post(f"{limits.base_url}/v1/completions", content=chunks(),
                   headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 413 and _error(r)["code"] == "request_too_large"
    assert _post(limits, {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_key_from_environment_and_docs_disabled(limits: ServerHandle) -> None:
    assert httpx.get(f"{limits.base_url}/v1/models").status_code == 401
    assert httpx.get(f"{limits.base_url}/v1/models", headers=AUTH).status_code == 200
    assert httpx.get(f"{limits.base_url}/health").status_code == 200
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{limits.base_url}{path}").status_code == 404


def test_big_body_does_not_stall_other_calls(limits: ServerHandle) -> None:
    # ~1.5 MB of text to tokenise (kept to its last 100 tokens) plus 5,000 bad words: seconds
    # of work on a 2-core CPU, long enough for /health to be asked many times meanwhile.
    body = {"prompt": "the quick brown fox jumps over the lazy dog. " * 35000,
            "truncate_prompt_tokens": 100, "max_tokens": 2,
            "bad_words": [f"w{i}" for i in range(5000)]}
    result: dict[str, Any] = {}

    def big() -> None:
        t0 = time.monotonic()
        result["r"] = _post(limits, body)
        result["s"] = time.monotonic() - t0

    t = threading.Thread(target=big)
    t.start()
    health_s = []
    while t.is_alive():
        t0 = time.monotonic()
        assert httpx.get(f"{limits.base_url}/health", timeout=30).status_code == 200
        health_s.append(time.monotonic() - t0)
        time.sleep(0.05)
    t.join()
    r = result["r"]
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    # /health kept answering while the big request was parsed and tokenised.
    assert len(health_s) >= 3, (result["s"], health_s)
    assert max(health_s) < max(1.0, result["s"] / 3), (result["s"], health_s)
    _idle(limits)


# ----- the engine frozen, then resumed --------------------------------------------------
def test_frozen_engine_turns_health_503_and_recovers(limits: ServerHandle) -> None:
    core = engine_pid(limits.proc.pid)
    os.kill(core, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 30
        while (h := httpx.get(f"{limits.base_url}/health", timeout=10)).status_code != 503:
            assert time.monotonic() < deadline, "health still 200 with the engine frozen"
            time.sleep(0.2)
        assert "not answered" in h.json()["error"]
        assert httpx.head(f"{limits.base_url}/health", timeout=10).status_code == 503
        r = _post(limits, {"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and "retry-after" in r.headers
        assert _error(r)["code"] == "engine_unresponsive"
    finally:
        os.kill(core, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while httpx.get(f"{limits.base_url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, "health did not recover after SIGCONT"
        time.sleep(0.2)
    r = _post(limits, {"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    _idle(limits)


# ----- broken on purpose ------------------------------------------------------------------
def test_engine_killed_fails_requests_and_server_exits_nonzero(limits: ServerHandle) -> None:
    server = limits  # the last test on it: the engine dies, then the server
    long = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 1500,
            "ignore_eos": True}
    result: dict[str, Any] = {}

    def whole() -> None:
        try:
            result["whole"] = httpx.post(f"{server.base_url}/v1/completions", json=long,
                                         headers=AUTH, timeout=120)
        except httpx.HTTPError as exc:
            result["whole"] = exc

    t = threading.Thread(target=whole)
    t.start()
    with httpx.stream("POST", f"{server.base_url}/v1/completions", headers=AUTH,
                      json={**long, "stream": True}, timeout=120) as s:
        lines = s.iter_lines()
        for line in lines:
            if line.startswith("data:"):
                break  # the stream is running
        core = engine_pid(server.proc.pid)
        os.kill(core, signal.SIGKILL)
        rest = [line[len("data: "):] for line in lines if line.startswith("data:")]
    t.join(60)
    assert rest[-1] == "[DONE]" and json.loads(rest[-2])["error"]["code"] == "engine_dead"
    whole_r = result["whole"]
    assert isinstance(whole_r, httpx.Response) and whole_r.status_code == 503
    assert _wait_exit(server, 30) == 1
    _wait_gone(core, 5)
    assert child_pids(server.proc.pid) == []


def test_api_process_killed_takes_the_engine_with_it(servers: dict[str, ServerHandle]) -> None:
    server = servers["api_kill"]
    core = engine_pid(server.proc.pid)
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    _wait_gone(core, 15)


def test_sigterm_drains_in_flight_requests_then_exits(
        servers: dict[str, ServerHandle]) -> None:
    server = servers["term"]
    core = engine_pid(server.proc.pid)
    body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 64,
            "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[Any], Any]:
        async with httpx.AsyncClient(timeout=120) as c:
            async def one(stream: bool) -> Any:
                r = await c.post(f"{server.base_url}/v1/completions",
                                 json={**body, "stream": stream})
                return r.status_code, r.text

            tasks = [asyncio.create_task(one(i % 2 == 0)) for i in range(4)]
            await asyncio.sleep(1.0)
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            try:
                late: Any = await c.post(f"{server.base_url}/v1/completions", json=body)
            except httpx.ConnectError as exc:
                late = exc
            return [await t for t in tasks], late

    done, late = asyncio.run(run())
    for i, (status, text) in enumerate(done):
        assert status == 200, text
        if i % 2:
            assert json.loads(text)["usage"]["completion_tokens"] == 64
        else:
            chunks = [json.loads(line[6:]) for line in text.splitlines()
                      if line.startswith("data: {")]
            assert "error" not in chunks[-1]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # After SIGTERM the port is closed (or, in the instant before, a 503).
    assert isinstance(late, httpx.ConnectError) or late.status_code == 503
    assert _wait_exit(server, 60) in (0, -signal.SIGTERM)
    _wait_gone(core, 5)
