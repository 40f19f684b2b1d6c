"""Multi-process execution: rank 0 on the engine's worker thread, one process per other rank.

``tensor_parallel_size * pipeline_parallel_size`` ranks; rank ``stage * tp + tp_rank``.
Every call the engine makes (``execute_model``, ``sample_tokens``) is broadcast to all ranks
before rank 0 runs it, so every rank runs the same steps in the same order; the model's
all-reduces meet inside the forward, and pipeline stages pass hidden states on
(forerun/worker/pipeline.py). With tensor parallel alone every rank samples (same seeds,
same keys), so each holds the sampled ids its next step's input needs, and rank 0's output
goes back to the scheduler; with pipeline stages the last stage samples and sends its
output to the first, and the broadcast runs on a thread of its own so that the first stage
never waits for a later one to take the next step. A rank that dies makes the next
collective fail within the collective timeout, which fails the step and stops the engine;
ranks exit when their parent goes.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from forerun import envs
from forerun.config import EngineConfig
from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.distributed.parallel_state import (
    destroy_model_parallel,
    free_port,
    init_model_parallel,
)
from forerun.distributed.pipeline_parallel import stage_layers
from forerun.model.loader import load_model
from forerun.spec_decode.config import SpeculativeConfig
from forerun.trace import Tracer
from forerun.worker.cpu_threads import CallerThreadsGuard, take_cpu_share
from forerun.worker.executor import _ResolvedFuture, worker_thread
from forerun.worker.model_runner import ModelRunner
from forerun.worker.pipeline import PipelineComm

logger = logging.getLogger(__name__)

_SHUTDOWN = "shutdown"
# Sent while the engine idles, so that a rank waiting for the next call never waits longer
# than the collective timeout (which would end it), and a hung rank is found while idle too.
_PING = "ping"


def _build_runner(config: EngineConfig, info: Any, num_blocks: int, rank: int, addr: str,
                  port: int, tracer: Tracer | None, spec_config: SpeculativeConfig | None
                  ) -> tuple[ModelRunner, dist.ProcessGroup | None]:
    """Join the engine's ranks, load this rank's share of the model, build its runner;
    returns it and the group the engine's calls arrive on."""
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    mc = info.model_config
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    tp_group, pp_group = init_model_parallel(rank, tp, pp, addr, port, device)
    stage = stage_layers(mc.num_hidden_layers, pp, pp_group.stage) if pp > 1 else None
    model = load_model(info.source, mc, dtype, device, config.quantization, tp_group, stage)
    pipeline = PipelineComm(pp_group, mc.hidden_size, dtype, device) if pp > 1 else None
    runner = ModelRunner(model, num_blocks, config.block_size, mc.num_key_value_heads // tp,
                       mc.head_dim,
                       stage.num_stage_layers if stage is not None else mc.num_hidden_layers,
                       dtype, device, config.max_num_seqs, tracer, vocab_size=mc.vocab_size,
                       speculative_config=spec_config, pipeline=pipeline)
    return runner, pp_group.control_group


def _send_call(payload: bytes, group: dist.ProcessGroup | None) -> None:
    """Rank 0: one call to every rank (``group`` None: the default group)."""
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    dist.broadcast(torch.tensor([len(payload)], dtype=torch.long), src=0, group=group)
    dist.broadcast(data, src=0, group=group)


def _recv_call(group: dist.ProcessGroup | None) -> tuple[str, tuple]:
    size = torch.zeros(1, dtype=torch.long)
    dist.broadcast(size, src=0, group=group)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, src=0, group=group)
    return pickle.loads(data.numpy().tobytes())


def _watch_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(1)
        time.sleep(0.5)


def _rank_main(config: EngineConfig, info: Any, num_blocks: int, rank: int,
               addr: str, port: int, parent_pid: int,
               spec_config: SpeculativeConfig | None, cpu_share: tuple[int, int]) -> None:
    """A rank other than 0: join the group, load its shard, then run what rank 0 sends."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank-{rank}] %(name)s: "
                               "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    take_cpu_share(*cpu_share)
    torch.manual_seed(config.seed)  # the same unseeded keys as rank 0
    runner, group = _build_runner(config, info, num_blocks, rank, addr, port, None,
                                  spec_config)
    try:
        while True:
            method, args = _recv_call(group)
            if method == _SHUTDOWN:
                return
            if method == _PING:
                continue
            with torch.inference_mode():
                getattr(runner, method)(*args)
    finally:
        if runner.pipeline is not None:
            runner.pipeline.close()
        destroy_model_parallel()


def spawn_ranks(config: EngineConfig, info: Any, num_blocks: int, ranks: range,
                addr: str, port: int, spec_config: SpeculativeConfig | None,
                share_indices: list[int], num_shares: int) -> list[Any]:
    """Start one process per rank in ``ranks`` (children of this process)."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, name=f"forerun-rank-{r}", daemon=True,
                         args=(config, info, num_blocks, r, addr, port, os.getpid(),
                               spec_config, (share, num_shares)))
             for r, share in zip(ranks, share_indices, strict=True)]
    for p in procs:
        p.start()
    return procs


class MultiprocExecutor:
    """The :class:`forerun.worker.executor.Executor` interface over the engine's ranks (see
    the module docstring)."""

    def __init__(self, config: EngineConfig, info: Any, num_blocks: int, tracer: Tracer,
                 spec_config: SpeculativeConfig | None) -> None:
        size = config.world_size
        self._threads_guard = CallerThreadsGuard()
        self._pool = worker_thread()
        self._closed = False
        addr, port = config.rendezvous()
        if port is None:
            port = free_port()
        # This node's ranks: 0 here, 1 .. local - 1 as processes; other nodes run the rest.
        local = size // config.nnodes
        shares = config.data_parallel_size * local
        self._procs = spawn_ranks(config, info, num_blocks, range(1, local), addr, port,
                                  spec_config, [config.data_parallel_rank * local + r
                                                for r in range(1, local)], shares)

        def init_rank0() -> tuple[ModelRunner, dist.ProcessGroup | None]:
            # The worker thread runs every collective of this process. It is shared by every
            # engine in the process: its CPUs and thread count go back at shutdown.
            self._saved_cpus = os.sched_getaffinity(0)
            self._saved_threads = torch.get_num_threads()
            take_cpu_share(config.data_parallel_rank * local, shares)
            return _build_runner(config, info, num_blocks, 0, addr, port, tracer, spec_config)

        try:
            self.runner, self._control = self._pool.submit(init_rank0).result()
        except BaseException:
            self._kill_ranks()
            raise
        # With pipeline stages the calls go out from a thread of their own, in order.
        self._sender = (ThreadPoolExecutor(1, thread_name_prefix="forerun-pp-control")
                        if self.runner.pipeline is not None else None)
        self._sent: Future[None] | None = None
        self._last_call = time.monotonic()
        self._ping_interval_s = envs.collective_timeout_s() / 4
        self._ping: Future[None] | None = None
        threading.Thread(target=self._keep_alive, name="forerun-rank-ping",
                         daemon=True).start()
        logger.info("%d ranks (tensor parallel %d, pipeline parallel %d; pids %s)", size,
                    config.tensor_parallel_size, config.pipeline_parallel_size,
                    [os.getpid(), *(p.pid for p in self._procs)])

    def _keep_alive(self) -> None:
        while not self._closed:
            time.sleep(self._ping_interval_s / 2)
            idle = time.monotonic() - self._last_call > self._ping_interval_s
            if idle and not self._closed and (self._ping is None or self._ping.done()):
                self._last_call = time.monotonic()
                self._ping = self._pool.submit(self._send_ping)

    def _send_ping(self) -> None:
        if self._closed:
            return
        try:
            self._broadcast(_PING, ())
        except Exception as exc:  # the next step fails on it too, and stops the engine
            logger.warning("a rank did not answer while the engine was idle: %s", exc)

    def _broadcast(self, method: str, args: tuple) -> None:
        self._last_call = time.monotonic()
        payload = pickle.dumps((method, args))
        if self._sender is None:
            _send_call(payload, self._control)
            return
        if self._sent is not None and self._sent.done():
            self._sent.result()  # a failed broadcast (a dead rank) fails this call
        self._sent = self._sender.submit(_send_call, payload, self._control)

    def _call(self, method: str, *args: Any) -> Any:
        self._broadcast(method, args)
        return getattr(self.runner, method)(*args)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Future[None]:
        return self._pool.submit(self._call, "execute_model", scheduler_output)

    def sample_tokens(self, grammar_bitmask: Any = None) -> Future[ModelRunnerOutput]:
        return _ResolvedFuture(self._pool.submit(self._call, "sample_tokens", grammar_bitmask))

    def shutdown(self) -> None:
        """Stop every rank (politely, then by force); no process outlives this."""
        if self._closed:
            return
        self._closed = True

        def stop() -> None:
            try:
                # Ranks on other nodes are not ours to watch; a dead one fails this too.
                if all(p.is_alive() for p in self._procs):
                    self._broadcast(_SHUTDOWN, ())
                    if self._sent is not None:
                        self._sent.result(timeout=30)
            finally:
                if self.runner.pipeline is not None:
                    self.runner.pipeline.close()
                if self._sender is not None:
                    self._sender.shutdown(wait=False, cancel_futures=True)
                destroy_model_parallel()
                os.sched_setaffinity(0, self._saved_cpus)
                torch.set_num_threads(self._saved_threads)
        grace_s = 10.0
        try:
            self._pool.submit(stop).result(timeout=30)
        except Exception as exc:
            # The ranks did not all get the shutdown (one is dead or hung): no waiting.
            logger.warning("multi-process shutdown: %s", exc)
            grace_s = 0.0
        self._kill_ranks(grace_s)
        self._threads_guard.restore()

    def _kill_ranks(self, grace_s: float = 10.0) -> None:
        for p in self._procs:
            p.join(grace_s)
            if p.is_alive():
                p.kill()
                p.join(5)
