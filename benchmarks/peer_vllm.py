"""The throughput workload on vLLM's CPU build, run with the python of a venv that has it.

    /path/to/vllm-venv/bin/python benchmarks/peer_vllm.py --model HF_DIR [--json OUT]

``benchmarks/throughput.py --vllm-python ... --vllm-model ...`` runs this for its vLLM row.
The settings follow ../shared/reference/peer-baselines.md: the model on both cores
(``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), 2 GiB of KV cache; vLLM's CPU platform turns async
scheduling off by itself, so this is vLLM's synchronous engine; ``--async-scheduling``
wraps that platform hook to turn it back on afterwards (how peer-baselines.md measured its
"async forced on" row).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def force_async_scheduling() -> None:
    """Re-enable async scheduling after vLLM's CPU platform hook switches it off."""
    from vllm.platforms.cpu import CpuPlatform

    original = CpuPlatform.check_and_update_config.__func__

    def patched(cls, vllm_config):  # noqa: ANN001, ANN202 - vLLM's own signature
        original(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    CpuPlatform.check_and_update_config = classmethod(patched)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF folder (vLLM does not read our GGUF)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--warmup-output-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--async-scheduling", action="store_true",
                    help="force vLLM's async scheduling on (its CPU platform turns it off)")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams  # only in the vLLM venv

    if args.async_scheduling:
        force_async_scheduling()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=1024, seed=args.seed,
              **({"async_scheduling": True} if args.async_scheduling else {}))
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(args.seed)

    def prompts() -> list[dict[str, list[int]]]:
        return [{"prompt_token_ids": [rng.randrange(100, vocab) for _ in range(args.input_len)]}
                for _ in range(args.num_prompts)]

    def run(n_out: int) -> float:
        sp = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate(prompts(), sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.num_prompts * n_out
        return wall

    run(args.warmup_output_len)
    walls = [run(args.output_len) for _ in range(args.repeats)]
    toks = [args.num_prompts * args.output_len / w for w in walls]
    name = "vLLM CPU (async forced)" if args.async_scheduling else "vLLM CPU (sync)"
    # What the engine was configured with after the platform hook ran.
    effective = llm.llm_engine.vllm_config.scheduler_config.async_scheduling
    result = {"engine": name, "async_scheduling": effective, "tok_s_all": toks,
              "tok_s": sorted(toks)[(len(toks) - 1) // 2], "wall_s": walls}
    text = json.dumps(result)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
