"""A node other than 0 of a multi-node engine (``--node-rank k``).

Node 0 runs the engine (scheduler, rank 0 and its local ranks); every other node only starts
its share of the ranks, which join node 0's rendezvous and then run what rank 0 sends.
"""

from __future__ import annotations

import logging

from forerun.config import EngineConfig
from forerun.model.info import num_kv_blocks, resolve_model_info
from forerun.spec_decode.config import SpeculativeConfig
from forerun.worker.multiproc_executor import RankStartupError, spawn_ranks

logger = logging.getLogger(__name__)


def run_worker_node(config: EngineConfig) -> int:
    """A node other than 0 (``--node-rank k``): run its ranks until node 0 ends the group.

    Returns the exit status: 0 if every rank ended cleanly.
    """
    info = resolve_model_info(config)
    device = config.resolve_device()
    num_blocks = num_kv_blocks(config, info, config.resolve_dtype(device), device)
    # Node 0 may lower max_model_len to fit its cache; every node computes the same.
    addr, port = config.rendezvous()
    assert port is not None  # EngineConfig requires it with nnodes > 1
    local = config.world_size // config.nnodes
    first = config.node_rank * local
    procs = spawn_ranks(config, info, num_blocks, range(first, first + local), addr, port,
                        SpeculativeConfig.from_dict(config.speculative_config),
                        list(range(local)), local)
    logger.info("worker node %d of %d: ranks %d..%d, rendezvous %s:%d", config.node_rank,
                config.nnodes, first, first + local - 1, addr, port)
    try:
        # A rank that dies or raises while starting ends the node at once (and the others
        # with it), rather than leaving them at the rendezvous for its whole timeout.
        try:
            procs.wait_ready()
        except RankStartupError as exc:
            logger.error("worker node %d: %s", config.node_rank, exc)
            procs.kill()
            return 1
        procs.join()
    except KeyboardInterrupt:
        procs.kill()
        return 130
    return int(any(p.exitcode for p in procs.procs))
