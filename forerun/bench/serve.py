"""Load-test an OpenAI-compatible server over streaming ``/v1/completions``.

Reports request and token throughput and TTFT / TPOT / ITL / E2E latency; every failed
request is counted and its first errors are shown, never silently dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from forerun.bench.datasets import SampleRequest, random_requests, sharegpt_requests

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class RequestResult:
    """What one benchmark request measured."""

    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    generated_text: str = ""
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def wait_until_healthy(base_url: str, exit_code: Callable[[], int | None], timeout_s: float,
                       poll_s: float = 0.5) -> None:
    """Poll ``base_url/health`` until it answers 200; RuntimeError if the server process
    exits first (``exit_code`` returns its code, None while it runs), TimeoutError after
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = exit_code()
        if code is not None:
            raise RuntimeError(f"server exited with {code}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll_s)
    raise TimeoutError(f"{base_url} not healthy after {timeout_s:g} s")


def add_serve_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", default=None, help="model name to send (default: the server's)")
    p.add_argument("--tokenizer", default=None,
                   help="local model path for the tokenizer (default: the default model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--dataset", "--dataset-name", dest="dataset", default="random",
                   choices=["random", "sharegpt"])
    p.add_argument("--dataset-path", default=None)
    p.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=128)
    p.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   default=128)
    p.add_argument("--random-prompt-format", choices=["ids", "text"], default="ids",
                   help="send random prompts as token ids (exact length) or decoded text")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (Poisson arrivals); inf sends all at once")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-file", default=None)
    p.add_argument("--disable-tqdm", action="store_true")
    p.add_argument("--request-timeout", type=float, default=600.0)


def _load_tokenizer(path: str | None) -> Any:
    from forerun.model.loader import load_tokenizer
    from forerun.model.source import resolve_model

    return load_tokenizer(resolve_model(path))


def _sse_payloads(line: str) -> str | None:
    if not line.startswith("data:"):
        return None
    return line[5:].strip()


async def send_request(client: httpx.AsyncClient, url: str, model: str, req: SampleRequest,
                       ignore_eos: bool, headers: dict[str, str]) -> RequestResult:
    """Stream one completion and time its chunks."""
    res = RequestResult(prompt_len=req.prompt_len)
    payload = {"model": model, "prompt": req.prompt, "max_tokens": req.expected_output_len,
               "temperature": 0.0, "stream": True, "ignore_eos": ignore_eos,
               "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    texts: list[str] = []
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return res
            async for line in resp.aiter_lines():
                data = _sse_payloads(line)
                if not data:
                    continue
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = str(chunk["error"].get("message"))
                    return res
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
                for choice in chunk.get("choices", []):
                    if not texts:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    texts.append(choice.get("text", ""))
        res.latency = time.perf_counter() - start
        res.generated_text = "".join(texts)
        res.success = bool(texts)
        if not res.success:
            res.error = "the stream carried no tokens"
    except Exception as exc:  # a failed request is a result, not a crash of the benchmark
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def _arrivals(n: int, rate: float, seed: int) -> Any:
    rng = np.random.default_rng(seed)
    for i in range(n):
        yield i
        if rate != float("inf") and i < n - 1:
            await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def run_benchmark(base_url: str, model: str | None, requests: list[SampleRequest],
                        max_concurrency: int | None, request_rate: float, ignore_eos: bool,
                        seed: int = 0, api_key: str | None = None,
                        endpoint: str = "/v1/completions", disable_tqdm: bool = False,
                        timeout_s: float = 600.0) -> dict[str, Any]:
    """Send ``requests`` and return the result dict (also what ``--save-result`` writes)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=max_concurrency or len(requests) or 1)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout_s, limits=limits) as client:
        if model is None:
            r = await client.get("/v1/models", headers=headers)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="requests")

        async def one(req: SampleRequest) -> RequestResult:
            if sem is None:
                res = await send_request(client, endpoint, model, req, ignore_eos, headers)
            else:
                async with sem:
                    res = await send_request(client, endpoint, model, req, ignore_eos, headers)
            bar.update(1)
            return res

        start = time.perf_counter()
        tasks = []
        async for i in _arrivals(len(requests), request_rate, seed):
            tasks.append(asyncio.create_task(one(requests[i])))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    out = summarize(results, duration)
    out.update(model=model, base_url=base_url, num_prompts=len(requests),
               max_concurrency=max_concurrency,
               request_rate="inf" if request_rate == float("inf") else request_rate)
    return out


def _stats(name: str, values: list[float], into: dict[str, Any]) -> None:
    ms = np.asarray(values, dtype=float) * 1000.0 if values else np.zeros(1)
    into[f"mean_{name}_ms"] = float(ms.mean())
    into[f"median_{name}_ms"] = float(np.median(ms))
    into[f"p99_{name}_ms"] = float(np.percentile(ms, 99))


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    d: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(failed),
        "errors": [r.error for r in failed][:20],
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
    }
    _stats("ttft", [r.ttft for r in ok], d)
    _stats("tpot", tpots, d)
    _stats("itl", [x for r in ok for x in r.itl], d)
    _stats("e2el", [r.latency for r in ok], d)
    return d


def format_table(d: dict[str, Any]) -> str:
    rows = [("Successful requests", d["completed"]), ("Failed requests", d["failed"]),
            ("Benchmark duration (s)", f"{d['duration']:.2f}"),
            ("Total input tokens", d["total_input_tokens"]),
            ("Total generated tokens", d["total_output_tokens"]),
            ("Request throughput (req/s)", f"{d['request_throughput']:.2f}"),
            ("Output token throughput (tok/s)", f"{d['output_throughput']:.2f}"),
            ("Total token throughput (tok/s)", f"{d['total_token_throughput']:.2f}")]
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        rows.append((f"-- {title} --", ""))
        for stat in ("mean", "median", "p99"):
            rows.append((f"{stat.capitalize()} {key.upper()} (ms)",
                         f"{d[f'{stat}_{key}_ms']:.2f}"))
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * (width + 14), " Serving Benchmark Result ".center(width + 14, "="),
             *[f"{k:<{width}}{v!s:>14}" for k, v in rows], "=" * (width + 14)]
    if d["failed"]:
        lines.append("First errors:")
        lines.extend(f"  {e}" for e in d["errors"][:5])
    return "\n".join(lines)


def run_serve_bench(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    random.seed(args.seed)
    tokenizer = _load_tokenizer(args.tokenizer)
    if args.dataset == "sharegpt":
        if not args.dataset_path:
            logger.error("--dataset sharegpt needs --dataset-path")
            return 2
        reqs = sharegpt_requests(tokenizer, args.dataset_path, args.num_prompts, args.seed,
                                 output_len=args.output_len)
    else:
        reqs = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               args.seed, as_token_ids=args.random_prompt_format == "ids")
    result = asyncio.run(run_benchmark(
        args.base_url, args.model, reqs, args.max_concurrency, args.request_rate,
        args.ignore_eos, args.seed, args.api_key, args.endpoint, args.disable_tqdm,
        args.request_timeout))
    print(format_table(result))  # the table is the command's output, not a log line
    if args.save_result or args.result_file:
        path = args.result_file or f"bench-serve-{int(time.time())}.json"
        with open(path, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
        logger.info("result written to %s", path)
    return 0 if result["failed"] == 0 else 1
