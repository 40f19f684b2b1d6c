"""The process group of this process and the collectives the model needs.

One tensor-parallel group per engine. Ranks find each other over TCP at
``master_addr:master_port`` (the standard ``torch.distributed`` rendezvous), so the same
code runs ranks as local processes or on several machines.
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from forerun import envs

logger = logging.getLogger(__name__)

# A rank that stops answering turns into an error after this long, not a hang.
COLLECTIVE_TIMEOUT = timedelta(seconds=60)


@dataclass(slots=True)
class TensorParallelGroup:
    """This process's place in its tensor-parallel group."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x)
        return x


_group: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, size: int, master_addr: str, master_port: int,
                         device: torch.device) -> TensorParallelGroup:
    """Join the group (blocks until every rank has); gloo on CPU, NCCL on CUDA."""
    global _group
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Under torchrun the agent serves the store at MASTER_ADDR:MASTER_PORT already.
    init = "env://" if envs.elastic_agent_store() else f"tcp://{master_addr}:{master_port}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=size,
                            timeout=COLLECTIVE_TIMEOUT)
    _group = TensorParallelGroup(rank, size)
    logger.info("tensor-parallel rank %d of %d (%s, %s:%d)", rank, size, backend,
                master_addr, master_port)
    return _group


def destroy_tensor_parallel() -> None:
    global _group
    if dist.is_initialized():
        dist.destroy_process_group()
    _group = None


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
