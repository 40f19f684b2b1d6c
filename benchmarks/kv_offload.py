"""TTFT of a multi-turn agent workload with and without the offloading connector.

    python benchmarks/kv_offload.py                 # the default model (SmolLM2-135M): 4096-token
                                                    # system prompt, +500 tokens a turn
    python benchmarks/kv_offload.py --tiny          # smoke: a tiny random Llama, scaled down
    python benchmarks/kv_offload.py [--model M] [--system-tokens N] [--turn-tokens N]
        [--conversations 8] [--turns 3] [--num-blocks N] [--ram-gib 4] [--dir D]

Every conversation starts with the same system prompt and grows by ``--turn-tokens`` a
turn; turns go round-robin over more conversations than the device pool holds, one request
at a time, so each turn's history has been evicted from the device by the time the
conversation comes back (the system prompt, used by every request, stays). The pool is
sized to the longest prompt plus two blocks unless ``--num-blocks`` says otherwise (a
quarter of the workload's distinct blocks if that is more). TTFT is the latency of a
one-token request (prefill plus one sample), from the engine's timestamps (arrival to
first token); "request" is the whole ``generate`` call, which with the connector also waits
for the request's save to reach RAM. Three runs, side by side: no connector; the
connector (RAM + disk, starting empty); the connector again after a restart (a new engine on
the same disk folder, RAM empty). Per run also the share of prompt tokens that were not
computed (device prefix-cache hits, connector loads included once they land on the device)
and the run's wall time.

Wall time: the no-connector run recomputes each returning conversation's whole history
(``turn * turn_tokens`` tokens over the system prompt's context), the connector run only
the new turn, the restarted run almost nothing; the first request of the first two runs
prefills the system prompt. At the default size (8 conversations x 3 turns, 24 requests,
prompts of 4596 to 5596 tokens, a pool of 352 blocks) that is about 3.5 minutes on one
quiet core (estimated from a 3 x 2 run, docs/kv_connector.md), about 11 on a core that
other jobs hold two thirds of.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import write_json  # noqa: E402

from forerun import LLM, SamplingParams  # noqa: E402


def workload(system: int, turn: int, conversations: int, turns: int) -> list[list[int]]:
    """Prompts in arrival order: turn by turn, conversation by conversation."""
    sys_prompt = [1] + [(13 * j) % 250 + 3 for j in range(system - 1)]
    prompts = []
    for t in range(1, turns + 1):
        for c in range(conversations):
            history = [(31 * c + 7 * j) % 250 + 3 for j in range(t * turn)]
            prompts.append(sys_prompt + history)
    return prompts


def run(model: str | None, prompts: list[list[int]], engine_kw: dict[str, Any]
        ) -> dict[str, Any]:
    """One engine over the workload: each request's TTFT and cached prompt tokens."""
    start = time.perf_counter()
    llm = LLM(model, **engine_kw)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    ttft, latency, cached = [], [], []
    for p in prompts:
        t = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        # generate() returns once the connector's save of the request's blocks has
        # reported (the blocks are held until then): the TTFT is the engine's own.
        latency.append(time.perf_counter() - t)
        m = out.metrics
        assert m is not None and m.first_token_time is not None
        ttft.append(m.first_token_time - m.arrival_time)
        cached.append(out.num_cached_tokens)
    llm.shutdown()
    return {"ttft_s": ttft, "latency_s": latency, "cached_tokens": cached,
            "wall_s": time.perf_counter() - start}


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="default: the engine's default model (SmolLM2-135M)")
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random Llama (hidden 64) and a workload scaled to its 256 "
                    "positions: a smoke test of the path, not a measurement")
    ap.add_argument("--system-tokens", type=int)
    ap.add_argument("--turn-tokens", type=int)
    ap.add_argument("--conversations", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, help="device pool (default: the longest prompt "
                    "plus two blocks, or a quarter of the workload's distinct blocks if more)")
    ap.add_argument("--ram-gib", type=float, default=4.0)
    ap.add_argument("--dir", help="the disk tier's folder (default: a temporary one)")
    ap.add_argument("--json", default=None, help="where to write (default results/kv_offload.json)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="forerun-kvoff-"))
    model = args.model
    if args.tiny:
        from tests.tiny_model import write_tiny_llama
        write_tiny_llama(tmp / "tiny")
        model = str(tmp / "tiny")
        system, turn = args.system_tokens or 64, args.turn_tokens or 40
        conversations, turns = args.conversations or 16, args.turns or 4
    else:
        system, turn = args.system_tokens or 4096, args.turn_tokens or 500
        conversations, turns = args.conversations or 8, args.turns or 3
    prompts = workload(system, turn, conversations, turns)
    bs = args.block_size
    distinct = system // bs + conversations * turns * turn // bs
    num_blocks = args.num_blocks or max(distinct // 4, -(-len(prompts[-1]) // bs) + 2)
    # Conversations whose last turn fits beside the system prompt: fewer than there are.
    holds = max(0, num_blocks - system // bs) // max(1, -(-turns * turn // bs))
    if holds >= conversations:
        print(f"warning: the pool holds {holds} of {conversations} conversations' "
              "histories; returning turns may hit on the device", file=sys.stderr)
    base = dict(block_size=bs, num_gpu_blocks_override=num_blocks, max_num_seqs=4,
                max_model_len=len(prompts[-1]) + 16)
    folder = args.dir or str(tmp / "kv")
    offload = {**base, "kv_offloading_size": args.ram_gib, "kv_offload_dir": folder}
    runs: dict[str, dict[str, Any]] = {}
    for name, kw in (("no connector", base), ("connector", offload),
                     ("after restart", offload)):
        runs[name] = run(model, prompts, kw)
        print(f"{name}: {runs[name]['wall_s']:.0f} s", flush=True)
    prompt_tokens = sum(len(p) for p in prompts)
    print(f"{len(prompts)} requests, {conversations} conversations x {turns} turns, "
          f"system {system} + {turn}/turn tokens, pool {num_blocks} blocks of {bs} "
          f"(the system prompt and {holds} conversations' last turns; {distinct} distinct "
          f"blocks), model {model or 'default'}")
    # With a few dozen requests p99 is the slowest one: in the first two runs the first
    # request, which prefills the system prompt; the next column leaves it out.
    print("| run | TTFT p50 ms | TTFT p99 ms | p99 after the first ms | TTFT mean ms "
          "| request mean ms | prompt tokens cached | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        xs, lat = r["ttft_s"], r["latency_s"]
        print(f"| {name} | {1e3 * pct(xs, 0.5):.1f} | {1e3 * pct(xs, 0.99):.1f} | "
              f"{1e3 * pct(xs[1:] or xs, 0.99):.1f} | "
              f"{1e3 * sum(xs) / len(xs):.1f} | {1e3 * sum(lat) / len(lat):.1f} | "
              f"{sum(r['cached_tokens']) / prompt_tokens:.1%} | {r['wall_s']:.0f} |")
    path = write_json("kv_offload.json", {
        "args": vars(args), "model": model, "system_tokens": system, "turn_tokens": turn,
        "conversations": conversations, "turns": turns, "num_blocks": num_blocks,
        "prompt_lens": [len(p) for p in prompts], "runs": runs}, args.json)
    print(f"wrote {path}")
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
