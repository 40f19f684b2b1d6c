"""Soak ``forerun serve``: many concurrent clients with mixed parameters, random
disconnects and aborts, for minutes; then count what was lost and what leaked.

    python benchmarks/soak.py                       # 256 clients, 10 minutes
    python benchmarks/soak.py --clients 32 --duration 60 --warmup 15   # a smoke run

Every response is checked: a whole one must parse, have the choices asked for and usage
that adds up; a stream must be well-formed SSE ending in ``[DONE]`` with a finish reason
for every choice. A deliberately bad request must get a 400 naming a field. A 503 with
``Retry-After`` (server full) is counted as rejected, not lost. Anything else is *failed*:
a 5xx, a malformed body, a dropped connection we did not cause. At the end the server
must be idle with every KV block free; RSS of the API and engine processes is sampled
every 30 s, and growth is the median of the last three samples under load over the median
of the first three after the warm-up. Targets (issue 11): 0 failed, 0 leaked blocks, RSS
growth under 5 % after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
from common import markdown_table, write_json
from serve import MODEL_NAME, free_port

from forerun.bench.serve import wait_until_healthy

PROMPTS = ["Hello, my name is", "The capital of France is", "Write a haiku about rain.",
           "List three prime numbers:", "Once upon a time", "def fibonacci(n):",
           "Explain what a KV cache is in one sentence."]
# Requests that must be refused with 400, and the field the error must name.
BAD = [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
       ({"max_tokens": 0}, "max_tokens"), ({"top_k": 2 ** 63}, "top_k"),
       ({"n": 0}, "n"), ({"logprobs": 99}, "logprobs"), ({"stop_token_ids": [-1]}, None)]


@dataclass(slots=True)
class Tally:
    """What happened to every request the soak sent."""

    counts: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def fail(self, why: str) -> None:
        self.counts["failed"] += 1
        if len(self.failures) < 20:
            self.failures.append(why)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        m = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    return int(m.group(1)) / 1024 if m else 0.0


def engine_pid(server_pid: int) -> int:
    out = subprocess.run(["pgrep", "-P", str(server_pid), "-f", "spawn_main"],
                         capture_output=True, text=True, check=False).stdout.split()
    if not out:
        raise RuntimeError("no engine core process under the server")
    return int(out[0])


def random_body(rng: random.Random) -> tuple[str, dict[str, Any], str | None]:
    """(path, body, the field a 400 must name or "" for any 400, None when valid)."""
    chat = rng.random() < 0.4
    n = rng.choice([1, 1, 1, 2, 3])
    body: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": rng.randint(1, 48),
                            "n": n, "stream": rng.random() < 0.5}
    r = rng.random()
    if r < 0.3:
        body["temperature"] = 0
    elif r < 0.9:
        body.update(temperature=rng.uniform(0.3, 1.5), top_p=rng.choice([1.0, 0.9, 0.5]),
                    top_k=rng.choice([-1, 5, 50]), min_p=rng.choice([0.0, 0.05]))
    if rng.random() < 0.3:
        body["seed"] = rng.randint(0, 2 ** 32)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice([".", "\n", " the"])]
    if rng.random() < 0.1:
        body["ignore_eos"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": rng.choice(PROMPTS)}]
        if rng.random() < 0.2:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
    else:
        body["prompt"] = rng.choice(PROMPTS)
        if rng.random() < 0.2:
            body["logprobs"] = rng.randint(0, 5)
    expect: str | None = None
    if rng.random() < 0.05:
        bad, name = rng.choice(BAD)
        if chat and "logprobs" in bad:
            bad, name = {"top_logprobs": 99, "logprobs": True}, "top_logprobs"
        body.update(bad)
        expect = name or ""
    return ("/v1/chat/completions" if chat else "/v1/completions"), body, expect


def check_whole(body: dict[str, Any], data: dict[str, Any]) -> str | None:
    want = body["n"]
    if len(data.get("choices", [])) != want:
        return f"{len(data.get('choices', []))} choices for n={want}"
    usage = data["usage"]
    if usage["completion_tokens"] > want * body["max_tokens"]:
        return "more tokens than max_tokens"
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return "usage does not add up"
    if any(c["finish_reason"] not in ("stop", "length") for c in data["choices"]):
        return "a choice without a finish reason"
    return None


def check_stream(body: dict[str, Any], events: list[str]) -> str | None:
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    finished: set[int] = set()
    for e in events[:-1]:
        data = json.loads(e)
        if "error" in data:
            return f"error event: {data['error'].get('message')}"
        for c in data.get("choices", []):
            if c.get("finish_reason") is not None:
                finished.add(c["index"])
    if finished != set(range(body["n"])):
        return f"finish reasons for {sorted(finished)} of n={body['n']}"
    return None


async def one_request(client: httpx.AsyncClient, url: str, rng: random.Random,
                      tally: Tally) -> None:
    path, body, expect = random_body(rng)
    tally.counts["sent"] += 1
    # 10 %: the client hangs up after a random moment; streams may also stop reading.
    hang_up = rng.random() < 0.1
    try:
        if body["stream"]:
            await asyncio.wait_for(_stream(client, url + path, body, expect, rng, hang_up,
                                           tally), None if not hang_up else rng.uniform(0, 1))
        else:
            coro = client.post(url + path, json=body)
            r = await (asyncio.wait_for(coro, rng.uniform(0, 1)) if hang_up else coro)
            _judge_whole(r, body, expect, tally)
    except TimeoutError:
        tally.counts["disconnected"] += 1
    except httpx.HTTPError as exc:
        tally.fail(f"{type(exc).__name__}: {exc}")
    except (ValueError, KeyError) as exc:
        tally.fail(f"malformed: {exc!r}")


def _judge_whole(r: httpx.Response, body: dict[str, Any], expect: str | None,
                 tally: Tally) -> None:
    if r.status_code == 503 and "retry-after" in r.headers:
        tally.counts["rejected_503"] += 1
    elif expect is not None:
        err = r.json().get("error", {})
        if r.status_code != 400 or (expect and err.get("param") != expect):
            tally.fail(f"bad input {body} got {r.status_code} {r.text[:200]}")
        else:
            tally.counts["bad_input_400"] += 1
    elif r.status_code != 200:
        tally.fail(f"{r.status_code} {r.text[:200]}")
    else:
        why = check_whole(body, r.json())
        if why:
            tally.fail(why)
        else:
            tally.counts["completed"] += 1


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                  expect: str | None, rng: random.Random, hang_up: bool,
                  tally: Tally) -> None:
    abort_after = rng.randint(1, 5) if rng.random() < 0.1 else None
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            _judge_whole(r, body, expect, tally)
            return
        if expect is not None:
            tally.fail(f"bad input {body} streamed 200")
            return
        events: list[str] = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if abort_after is not None and len(events) >= abort_after:
                    tally.counts["aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
    why = check_stream(body, events)
    if why:
        tally.fail(why)
    else:
        tally.counts["completed"] += 1


async def soak(url: str, clients: int, duration: float, warmup: float, server_pid: int,
               seed: int) -> dict[str, Any]:
    tally = Tally()
    core = engine_pid(server_pid)
    t0 = time.monotonic()
    stop_at = t0 + duration
    rss: dict[str, float] = {}

    async def worker(i: int) -> None:
        rng = random.Random(seed * 100003 + i)
        limits = httpx.Limits(max_connections=4)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            while time.monotonic() < stop_at:
                await one_request(client, url, rng, tally)

    series: list[tuple[float, float, float]] = []

    async def sampler() -> None:
        # Every 30 s: a leak climbs steadily, a cache filling up levels off.
        while time.monotonic() < stop_at:
            series.append((round(time.monotonic() - t0), rss_mib(server_pid), rss_mib(core)))
            await asyncio.sleep(min(30.0, warmup))

    await asyncio.gather(sampler(), *(worker(i) for i in range(clients)))
    elapsed = time.monotonic() - t0
    async with httpx.AsyncClient(timeout=30) as c:
        idle = await _wait_idle(c, url)
    rss.update(_rss_levels(series, warmup))
    rss["api_after_mib"], rss["engine_after_mib"] = rss_mib(server_pid), rss_mib(core)
    return {"elapsed_s": elapsed, "counts": dict(tally.counts), "failures": tally.failures,
            "rss_series_s_api_engine_mib": series, **rss, **idle}


def _rss_levels(series: list[tuple[float, float, float]], warmup: float) -> dict[str, float]:
    """RSS levels under load: the median of the first three samples after the warm-up and
    of the last three. Medians, because a single sample can land on a step's transient
    buffers (a large batch's activations), which come and go and are not growth."""
    after = [s for s in series if s[0] >= warmup]
    if len(after) < 6:
        return {}
    out = {}
    for i, name in ((1, "api"), (2, "engine")):
        out[f"{name}_warm_mib"] = statistics.median(s[i] for s in after[:3])
        out[f"{name}_end_mib"] = statistics.median(s[i] for s in after[-3:])
    return out


async def _wait_idle(c: httpx.AsyncClient, url: str, timeout_s: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        text = (await c.get(url + "/metrics")).text
        vals = {k: float(v) for k, v in re.findall(
            r"^forerun:(num_requests_running|num_requests_waiting|kv_cache_usage_perc)"
            r"\{[^}]*\} (\S+)$", text, re.M)}
        idle = (vals.get("num_requests_running") == 0 and vals.get("num_requests_waiting") == 0
                and vals.get("kv_cache_usage_perc") == 0.0)
        if idle or time.monotonic() > deadline:
            return {"idle_at_end": idle, **{f"end_{k}": v for k, v in vals.items()}}
        await asyncio.sleep(0.5)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=256)
    p.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    p.add_argument("--warmup", type=float, default=60.0,
                   help="seconds before the first RSS sample")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="",
                   help="extra forerun serve flags, e.g. '--dtype bfloat16'")
    p.add_argument("--out", default="benchmarks/results/soak.json")
    args = p.parse_args()
    port = free_port()
    cmd = [sys.executable, "-m", "forerun.cli", "serve", "--port", str(port),
           "--served-model-name", MODEL_NAME, *args.server_args.split()]
    log = open("/tmp/forerun-soak-server.log", "wb")  # noqa: SIM115 - the server writes it
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(url, proc.poll, timeout_s=300.0, poll_s=1.0)
        res = asyncio.run(soak(url, args.clients, args.duration, args.warmup, proc.pid,
                               args.seed))
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
    with open("/tmp/forerun-soak-server.log", encoding="utf-8", errors="replace") as f:
        res["server_tracebacks"] = f.read().count("Traceback")
    growth = {k: 100 * (res[f"{k}_end_mib"] / res[f"{k}_warm_mib"] - 1)
              for k in ("api", "engine") if res.get(f"{k}_warm_mib")}
    if not growth:
        print("too few RSS samples after the warm-up: run longer")
    c = res["counts"]
    rows = [{"clients": args.clients, "seconds": round(res["elapsed_s"]),
             **{k: c.get(k, 0) for k in ("sent", "completed", "failed", "aborted",
                                         "disconnected", "rejected_503", "bad_input_400")},
             "idle_kv_free_at_end": res["idle_at_end"],
             "api_rss_mib": f"{res.get('api_warm_mib', 0):.0f} -> {res.get('api_end_mib', 0):.0f}"
                            f" ({growth.get('api', 0):+.1f}%)",
             "engine_rss_mib": f"{res.get('engine_warm_mib', 0):.0f} -> "
                               f"{res.get('engine_end_mib', 0):.0f} ({growth.get('engine', 0):+.1f}%)",
             "tracebacks": res["server_tracebacks"]}]
    print(markdown_table(rows, list(rows[0])))
    print("RSS (s, API MiB, engine MiB):",
          " ".join(f"{t}:{a:.0f}/{e:.0f}" for t, a, e in res["rss_series_s_api_engine_mib"]))
    for why in res["failures"]:
        print("  failure:", why)
    ok = (c.get("failed", 0) == 0 and res["idle_at_end"] and bool(growth)
          and all(g < 5.0 for g in growth.values()))
    print("targets met" if ok else "TARGETS NOT MET")
    write_json(args.out, {"args": vars(args), "rss_growth_pct": growth, **res, "ok": ok})
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
