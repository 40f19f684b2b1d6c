"""The web page at ``/`` in a real headless Chromium, against the shared default server.

The browser is Debian's ``chromium`` driven through its ``chromium-driver`` by selenium
(``scripts/install.sh`` installs both). The page must load with no console error, stream a
typed question's answer into the chat (the same text as a direct call with the page's body),
stop a stream (the server then runs nothing and holds no KV block), and show the engine
moving under load. ``--disable-web-page`` is checked on ``build_app`` directly: no engine is
needed to see which routes exist.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from forerun.core.stats import EngineStats, KVCacheStats, RecentSpan, SchedulerStats
from forerun.server.api import build_app
from forerun.server.cli_serve import add_serve_parser, server_config_from_args
from forerun.server.config import ServerConfig
from forerun.trace import ENGINE_LANE, WORKER_LANE
from tests.server_harness import MODEL, ServerHandle, start_server
from tests.test_server import wait_idle

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
QUESTION = "What is the capital of France?"
LAST_ANSWER = ("const m = document.querySelectorAll('.msg.assistant .body');"
               "return m.length ? m[m.length - 1].textContent : '';")


# ----- routes, without a browser or an engine ------------------------------------------------
class _StatsEngine:
    """What build_app and /forerun/engine touch of an AsyncLLM: one fixed stats snapshot."""

    observer: Any = None

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self.asked: list[float] = []

    async def get_engine_stats(self, timeout_s: float = 10.0,
                               span_window_s: float = 0.0) -> list[EngineStats]:
        self.asked.append(span_window_s)
        return [self.stats]


def _stats() -> EngineStats:
    return EngineStats(
        scheduler=SchedulerStats(num_running_reqs=3, num_waiting_reqs=1),
        kv_cache=KVCacheStats(num_blocks=8, num_free_blocks=6, num_deferred_blocks=0,
                              usage=0.25, prefix_cache_queries=0, prefix_cache_hits=0,
                              prefix_cache_hit_rate=0.0),
        async_scheduling=True, max_concurrent_batches=2, device_busy_fraction=0.5,
        worker_idle_ms_per_step=0.1, num_deferred_samplings=0,
        recent_spans=[RecentSpan("schedule", ENGINE_LANE, -0.5, -0.4, 7),
                      RecentSpan("forward", WORKER_LANE, -0.45, -0.1, 7)])


def test_disable_web_page_leaves_slash_a_404_and_keeps_the_engine_view() -> None:
    serve = add_serve_parser(argparse.ArgumentParser().add_subparsers())
    args = serve.parse_args(["--disable-web-page"])
    assert server_config_from_args(args).disable_web_page is True
    engine = _StatsEngine(_stats())
    on = TestClient(build_app(engine, MODEL, ServerConfig()))  # type: ignore[arg-type]
    page = on.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'src="forerun/static/app.js"' in page.text
    for name, kind in (("app.js", "javascript"), ("style.css", "text/css")):
        asset = on.get(f"/forerun/static/{name}")
        assert asset.status_code == 200 and kind in asset.headers["content-type"]
    off = TestClient(build_app(engine, MODEL,  # type: ignore[arg-type]
                               ServerConfig(disable_web_page=True)))
    assert off.get("/").status_code == 404
    assert off.get("/forerun/static/app.js").status_code == 404
    view = off.get("/forerun/engine").json()
    assert engine.asked == [2.0]
    assert (view["model"], view["num_requests_running"], view["num_requests_waiting"],
            view["kv_cache_usage"], view["async_scheduling"]) == (MODEL, 3, 1, 0.25, True)
    assert view["lanes"] == {"engine": ENGINE_LANE, "worker": WORKER_LANE}
    assert view["spans"] == [["schedule", ENGINE_LANE, -0.5, -0.4, 7],
                             ["forward", WORKER_LANE, -0.45, -0.1, 7]]


# ----- the page in Chromium -------------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> ServerHandle:
    handle = start_server()
    handle.wait_healthy()
    return handle


def _wait_for_background_install(timeout_s: float = 600.0) -> None:
    """scripts/install.sh installs Chromium in the background (the suite runs meanwhile):
    wait for the status file it writes when done, if it started one."""
    base = os.path.join(tempfile.gettempdir(), "forerun-chromium-install")
    if not os.path.exists(f"{base}.log"):
        return
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(f"{base}.status"):
        if time.monotonic() > deadline:
            pytest.fail(f"the background Chromium install did not finish: see {base}.log")
        time.sleep(1.0)


@pytest.fixture(scope="module")
def browser(server: ServerHandle) -> Iterator[Any]:
    """Headless Chromium on the page, its console log collected."""
    _wait_for_background_install()
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.fail("Debian's chromium and chromium-driver are needed: run scripts/install.sh")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-extensions", "--no-first-run", "--window-size=1280,760"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver named by path: selenium would otherwise try to download one.
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    try:
        driver.get(f"{server.base_url}/")
        yield driver
    finally:
        driver.quit()


def _until(check: Callable[[], Any], timeout_s: float = 60.0, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, "timed out"
        time.sleep(poll_s)


def _console_errors(driver: Any) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def _type(driver: Any, element_id: str, text: str) -> None:
    from selenium.webdriver.common.by import By

    box = driver.find_element(By.ID, element_id)
    box.clear()
    box.send_keys(text)


def _chat(driver: Any) -> dict[str, Any]:
    return driver.execute_script("return window.forerun.chat")


def test_the_page_loads_live_without_console_errors(browser: Any) -> None:
    dash = _until(lambda: browser.execute_script(
        "const d = window.forerun && window.forerun.dashboard;"
        "return d && d.online && d.polls >= 2 ? d : null;"), timeout_s=20)
    assert dash["running"] == 0 and dash["kvUsage"] == 0
    assert browser.find_element("id", "model").text == MODEL
    assert _console_errors(browser) == []


def test_a_typed_question_streams_the_answer_of_a_direct_call(
        browser: Any, server: ServerHandle) -> None:
    _type(browser, "temperature", "0")
    _type(browser, "max-tokens", "12")
    _type(browser, "prompt", QUESTION + "\n")  # Enter sends
    seen: list[str] = []

    def finished() -> bool:
        # The flag first, then the text: read the other way round, the last chunk could
        # land between the two reads and the text kept would be one token short.
        streaming = _chat(browser)["streaming"]
        text = browser.execute_script(LAST_ANSWER)
        if text and (not seen or seen[-1] != text):
            seen.append(text)
        return bool(text) and not streaming

    _until(finished, timeout_s=60, poll_s=0.02)
    # The text grew on screen: at least two partial texts before the whole.
    assert len(seen) >= 2 and all(seen[-1].startswith(s) for s in seen)
    direct = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0, "max_tokens": 12}).json()
    assert seen[-1] == direct["choices"][0]["message"]["content"]
    chat = _chat(browser)
    assert chat["tokens"] == direct["usage"]["completion_tokens"] and chat["tokensPerS"] > 0
    assert "tokens/s" in browser.find_element("id", "chat-stats").text
    assert _console_errors(browser) == []


def test_stop_aborts_the_stream_and_the_server_frees_everything(
        browser: Any, server: ServerHandle) -> None:
    browser.find_element("id", "clear").click()
    _type(browser, "temperature", "0")  # greedy: the same long story every run
    _type(browser, "max-tokens", "1500")
    _type(browser, "prompt", "Write a very long story about a lighthouse keeper.\n")
    _until(lambda: browser.execute_script(LAST_ANSWER), timeout_s=60)  # the stream is on
    browser.find_element("id", "stop").click()
    chat = _until(lambda: (c := _chat(browser)) and not c["streaming"] and c, timeout_s=10)
    assert chat["stopped"] and chat["finishReason"] is None
    text = browser.execute_script(LAST_ANSWER)
    m = wait_idle(server, timeout_s=20)
    assert m["forerun:num_requests_running"] == 0 and m["forerun:kv_cache_usage_perc"] == 0.0
    assert browser.execute_script(LAST_ANSWER) == text  # nothing arrived after Stop
    assert _console_errors(browser) == []


def test_the_dashboard_moves_while_a_load_runs(browser: Any, server: ServerHandle) -> None:
    done = threading.Event()

    def one(i: int) -> None:
        # Streams, so that closing it once the page has seen the load aborts the request.
        body = {"model": MODEL, "prompt": f"Story {i}: once upon a time", "max_tokens": 400,
                "ignore_eos": True, "temperature": 0.8, "seed": i, "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          timeout=120) as r:
            for _ in r.iter_lines():
                if done.is_set():
                    break

    load = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in load:
        t.start()
    try:
        # The numbers and what the page shows of them, read at one moment.
        seen = _until(lambda: browser.execute_script(
            "const d = window.forerun.dashboard, t = (id) => document.getElementById(id);"
            "return d.running > 0 && d.genTps > 0 && d.kvUsage > 0 && d.spansDrawn.engine > 0"
            " && d.spansDrawn.worker > 0 && d.workerBusy > 0 ? {...d, shown: {"
            "running: t('running').textContent, gen: t('gen-tps').textContent,"
            "worker: t('timeline').dataset.workerSpans}} : null;"), timeout_s=60)

        def both_lanes() -> dict[str, Any] | None:
            got = httpx.get(f"{server.base_url}/forerun/engine", timeout=30).json()
            lanes = {s[1] for s in got["spans"]}
            return got if {ENGINE_LANE, WORKER_LANE} <= lanes else None

        view = _until(both_lanes, timeout_s=30, poll_s=0.2)
    finally:
        done.set()
        for t in load:
            t.join()
    assert wait_idle(server, timeout_s=20)["forerun:num_requests_running"] == 0
    assert seen["shown"] == {"running": str(seen["running"]),
                             "gen": f"{seen['genTps']:.1f}",
                             "worker": str(seen["spansDrawn"]["worker"])}
    names = {(s[0], s[1]) for s in view["spans"]}
    assert names <= {("schedule", ENGINE_LANE), ("update", ENGINE_LANE),
                     ("deferred_sample_wait", ENGINE_LANE), ("prepare", WORKER_LANE),
                     ("forward", WORKER_LANE), ("sample", WORKER_LANE)}
    assert all(-view["window_s"] - 1 <= s[2] <= s[3] <= 0 for s in view["spans"])
    assert _console_errors(browser) == []


def test_a_refused_request_shows_the_api_error_naming_the_field(browser: Any) -> None:
    browser.find_element("id", "clear").click()
    _type(browser, "max-tokens", "0")
    _type(browser, "prompt", QUESTION + "\n")
    shown = _until(lambda: browser.execute_script(
        "const m = document.querySelector('.msg.error'); return m && m.textContent;"),
        timeout_s=30)
    assert "max_tokens" in shown
    assert not _chat(browser)["streaming"]
    # The browser reports the 400 itself; nothing else went wrong.
    errors = _console_errors(browser)
    assert len(errors) == 1 and "status of 400" in errors[0]["message"], errors
    _type(browser, "max-tokens", "16")
