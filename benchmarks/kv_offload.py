"""TTFT of a multi-turn agent workload with and without the offloading connector.

    python benchmarks/kv_offload.py [--model DIR] [--system-tokens 4096] [--turn-tokens 500]
        [--conversations 16] [--turns 4] [--num-blocks N] [--ram-gib 4] [--dir D]

Every conversation starts with the same system prompt and grows by ``--turn-tokens`` a
turn; turns go round-robin over more conversations than the device pool holds, one request
at a time, so each turn's prefix has usually been evicted from the device. TTFT is the
latency of a one-token request (prefill plus one sample). Three runs, side by side: no
connector; the connector (RAM + disk, starting empty); the connector again after a restart
(a new engine on the same disk folder, RAM empty). Without ``--model`` it writes a tiny
random Llama (hidden 64) and scales the workload down to its 256 positions.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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


def ttfts(model: str, prompts: list[list[int]], engine_kw: dict[str, Any]) -> list[float]:
    llm = LLM(model, **engine_kw)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    out = []
    for p in prompts:
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
        out.append(time.perf_counter() - t)
    llm.shutdown()
    return out


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model")
    ap.add_argument("--system-tokens", type=int)
    ap.add_argument("--turn-tokens", type=int)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, help="device pool (default: a quarter of the "
                    "workload's distinct blocks)")
    ap.add_argument("--ram-gib", type=float, default=4.0)
    ap.add_argument("--dir", help="the disk tier's folder (default: a temporary one)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="forerun-kvoff-"))
    model = args.model
    if model is None:
        from tests.tiny_model import write_tiny_llama
        write_tiny_llama(tmp / "tiny")
        model = str(tmp / "tiny")
        system, turn = args.system_tokens or 64, args.turn_tokens or 40
    else:
        system, turn = args.system_tokens or 4096, args.turn_tokens or 500
    prompts = workload(system, turn, args.conversations, args.turns)
    bs = args.block_size
    distinct = system // bs + args.conversations * args.turns * turn // bs
    num_blocks = args.num_blocks or max(distinct // 4, -(-len(prompts[-1]) // bs) + 2)
    base = dict(block_size=bs, num_gpu_blocks_override=num_blocks, max_num_seqs=4)
    folder = args.dir or str(tmp / "kv")
    runs = {
        "no connector": ttfts(model, prompts, base),
        "connector": ttfts(model, prompts, {**base, "kv_offloading_size": args.ram_gib,
                                            "kv_offload_dir": folder}),
        "after restart": ttfts(model, prompts, {**base, "kv_offloading_size": args.ram_gib,
                                                "kv_offload_dir": folder}),
    }
    print(f"{len(prompts)} requests, {args.conversations} conversations x {args.turns} turns, "
          f"system {system} + {turn}/turn tokens, pool {num_blocks} blocks of {bs} "
          f"({distinct} distinct blocks)")
    print(f"{'':>14} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12}")
    for name, xs in runs.items():
        print(f"{name:>14} {1e3 * pct(xs, 0.5):>12.2f} {1e3 * pct(xs, 0.99):>12.2f}")


if __name__ == "__main__":
    main()
