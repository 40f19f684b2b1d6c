"""Engine command-line flags shared by ``forerun serve``, ``generate`` and ``chat``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from forerun import envs
from forerun.config import EngineConfig


def add_engine_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EngineConfig flags (vLLM's spellings) to ``parser``."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local GGUF file or HF-style folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto",
                   help="auto, float32, bfloat16 or float16 (CUDA only)")
    g.add_argument("--device", default="auto", help="auto, cpu or cuda")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_true", default=True)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching",
                   action="store_false")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-gpu-blocks-override", type=int, default=None)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--async-scheduling", choices=["auto", "on", "off"], default="auto")
    g.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_const",
                   const="off")
    g.add_argument("--max-concurrent-batches", type=int, default=None)
    g.add_argument("--trace-file", default=None,
                   help="write a Chrome trace of engine and worker activity here")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="the most logprobs a request may ask for; -1 for the whole vocabulary")
    g.add_argument("--quantization", "-q", default=None,
                   help="gguf (compute with a GGUF's quantized blocks) or int8")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split each engine's model over this many processes (torch.distributed)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                   help="split each engine's layers into this many stages, one process "
                        "group each (torch.distributed)")
    g.add_argument("--nnodes", type=int, default=1,
                   help="machines the engine's ranks spread over")
    g.add_argument("--node-rank", type=int, default=0,
                   help="this machine's index; nodes other than 0 run ranks only")
    g.add_argument("--master-addr", default=None,
                   help="rendezvous host (default: MASTER_ADDR, else 127.0.0.1)")
    g.add_argument("--master-port", type=int, default=None,
                   help="rendezvous port (default: MASTER_PORT; needed with --nnodes > 1)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine cores behind one server, each on its own share of the CPUs")
    g.add_argument("--simulated-device", default=None,
                   help="DEVICE[/MODEL], e.g. h100/llama-3-8b: the forward only sleeps for "
                        "its modelled step time (to measure the host side)")
    g.add_argument("--speculative-config", type=_json_dict, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'')
    return parser


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    """Build an EngineConfig from parsed ``add_engine_args`` flags; ValueError if invalid.

    Under a launcher that starts one process per rank (``torchrun``: RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT) with tensor x pipeline parallel size equal to WORLD_SIZE and no
    ``--nnodes``, each process is one "node" of one rank: RANK 0 runs the engine.
    """
    launched = envs.launcher_rank()
    if (launched is not None and launched[1] > 1 and args.nnodes == 1
            and args.tensor_parallel_size * args.pipeline_parallel_size == launched[1]):
        args.node_rank, args.nnodes = launched
    return EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        seed=args.seed,
        async_scheduling=args.async_scheduling,
        max_concurrent_batches=args.max_concurrent_batches,
        trace_file=args.trace_file,
        max_logprobs=args.max_logprobs,
        quantization=args.quantization,
        speculative_config=args.speculative_config,
        simulated_device=args.simulated_device,
        data_parallel_size=args.data_parallel_size,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
    )


def _json_dict(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value
