"""The process groups of this process and the collectives the model needs.

One engine's model runs on ``tensor_parallel_size * pipeline_parallel_size`` ranks: rank
``stage * tp + tp_rank``. Each pipeline stage is one tensor-parallel group; hidden states go
from a stage's rank to the next stage's rank of the same ``tp_rank``. Ranks find each other
over TCP at ``master_addr:master_port`` (a ``torch.distributed`` TCP store that rank 0
serves), so the same code runs ranks as local processes or on several machines.

The rendezvous is in two steps. First every rank checks in at the store and waits, polling,
until all have: that is the wait that may be long (processes still importing, other machines
still starting; up to ``RENDEZVOUS_TIMEOUT``), and because it polls, the process that runs
rank 0 can end it at once (``abort``) when one of its rank processes dies meanwhile, instead
of sitting in ``init_process_group`` for the whole timeout. Only then are the groups built,
among ranks known to be alive, under the collective timeout.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from forerun import envs

logger = logging.getLogger(__name__)

# How long ranks wait for each other to join the group.
RENDEZVOUS_TIMEOUT = timedelta(minutes=10)
# How often a rank waiting at the rendezvous looks at the store (and at ``abort``).
_POLL_S = 0.05
_JOINED = "forerun/rendezvous/joined"


class RendezvousAborted(RuntimeError):
    """The rendezvous was ended from outside (another rank of this process tree died)."""


@dataclass(slots=True)
class TensorParallelGroup:
    """This process's place in its tensor-parallel group (one pipeline stage's ranks)."""

    rank: int
    size: int
    # None: the default group (every rank of the engine is in this group).
    group: dist.ProcessGroup | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, parts: list[torch.Tensor], x: torch.Tensor) -> None:
        dist.all_gather(parts, x, group=self.group)


@dataclass(slots=True)
class PipelineParallelGroup:
    """This process's pipeline stage and the ranks it talks to.

    ``group`` is every rank's data plane (the hidden-state sends; the calls too without
    pipeline stages). With stages, two more communicators over every rank, each used from a
    thread of its own on the first rank, so that neither makes the first stage wait for a
    later one: ``control_group`` carries each call the engine makes to every rank (a gloo
    broadcast returns only once every rank has received it), ``output_group`` the sampled
    output from the last stage back to the first. All three time out after the collective
    timeout; only the rendezvous may take longer.
    """

    stage: int
    size: int
    tp_rank: int
    tp_size: int
    group: dist.ProcessGroup | None = None
    control_group: dist.ProcessGroup | None = None
    output_group: dist.ProcessGroup | None = None

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.size - 1

    def global_rank(self, stage: int) -> int:
        """The rank of ``stage`` that holds this rank's ``tp_rank``."""
        return stage * self.tp_size + self.tp_rank


def init_model_parallel(rank: int, tp_size: int, pp_size: int, master_addr: str,
                        master_port: int, device: torch.device,
                        abort: threading.Event | None = None,
                        ) -> tuple[TensorParallelGroup, PipelineParallelGroup]:
    """Join the engine's ranks (blocks until every rank has); gloo on CPU, NCCL on CUDA.

    ``abort``: set from another thread to end the wait at the rendezvous with
    :class:`RendezvousAborted` (the executor does when a rank process dies).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    world = tp_size * pp_size
    # A rank that stops answering turns into an error after this long, not a hang.
    timeout = timedelta(seconds=envs.collective_timeout_s())
    store = _rendezvous(rank, world, master_addr, master_port, abort)
    # Every rank has checked in, so building the groups only waits for live processes:
    # the collective timeout bounds it (a rank dying in this short window fails it then).
    store.set_timeout(timeout)
    # The default group's keys apart from ours, as init_process_group does with its own store.
    dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank,
                            world_size=world, timeout=timeout)
    stage, tp_rank = divmod(rank, tp_size)
    everyone = list(range(world))
    # Every rank creates every group, in the same order (torch.distributed's rule).
    group = tp_group = dist.new_group(everyone, timeout=timeout)
    control_group = output_group = None
    if pp_size > 1:
        for s in range(pp_size):
            g = dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)),
                               timeout=timeout)
            if s == stage:
                tp_group = g
        control_group = dist.new_group(everyone, timeout=timeout)
        output_group = dist.new_group(everyone, timeout=timeout)
    logger.info("rank %d of %d: pipeline stage %d of %d, tensor-parallel rank %d of %d "
                "(%s, %s:%d)", rank, world, stage, pp_size, tp_rank, tp_size, backend,
                master_addr, master_port)
    return (TensorParallelGroup(tp_rank, tp_size, tp_group),
            PipelineParallelGroup(stage, pp_size, tp_rank, tp_size, group,
                                  control_group or group, output_group))


def _rendezvous(rank: int, world: int, master_addr: str, master_port: int,
                abort: threading.Event | None) -> dist.Store:
    """Connect to the store (rank 0 serves it), check in, and wait until all ``world``
    ranks have; returns the store."""
    wait = RENDEZVOUS_TIMEOUT
    if envs.elastic_agent_store():
        # Under torchrun the agent serves the store at MASTER_ADDR:MASTER_PORT already.
        store: dist.Store = dist.TCPStore(envs.master_addr() or master_addr,
                                          envs.master_port() or master_port,
                                          is_master=False, timeout=wait)
    else:
        # Not waiting for the workers in the constructor (torch's default): that wait
        # cannot be ended early; the polling below can.
        store = dist.TCPStore(master_addr, master_port, world_size=world,
                              is_master=rank == 0, timeout=wait, wait_for_workers=False,
                              multi_tenant=True)
    store.add(_JOINED, 1)
    deadline = time.monotonic() + wait.total_seconds()
    next_note = time.monotonic() + 30
    while (joined := store.add(_JOINED, 0)) < world:
        if abort is not None and abort.wait(_POLL_S):
            raise RendezvousAborted(f"rank {rank}: rendezvous ended (another rank failed)")
        if abort is None:
            time.sleep(_POLL_S)
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"rank {rank}: only {joined} of {world} ranks reached the "
                               f"rendezvous at {master_addr}:{master_port} within "
                               f"{wait.total_seconds():.0f} s")
        if now > next_note:
            next_note = now + 30
            logger.info("rank %d: %d of %d ranks at the rendezvous %s:%d, waiting", rank,
                        joined, world, master_addr, master_port)
    return store


def destroy_model_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    """A TCP port free on this machine now (for a local rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
