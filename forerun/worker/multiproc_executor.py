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

Start-up. Ranks are started by :func:`forerun.spawn.start_process`: a fresh interpreter
(multiprocessing's "spawn") or a fork of a fork server that imported torch once
(``FORERUN_WORKER_MULTIPROC_METHOD=forkserver``), never a fork of a process that already
runs the engine's threads, an OpenMP pool and perhaps a CUDA context (a forked child
inherits their locks in whatever state they were, and CUDA cannot be used in it at all;
vLLM switches to spawn for the same reason). A rank needs nothing from ``__main__``: its
function and arguments all come from forerun, so the parent hides its ``__main__`` while a
rank starts, and ranks start the same way from a file, ``python -``, ``python -c`` or a
notebook. (vLLM instead refuses ``python -`` with a message; working is better.)

Every rank process has a pipe back to the parent on which it reports its start-up stage,
its exception with the traceback, or that it is ready; the parent waits for that and for
rank 0 at once (:meth:`RankProcesses.wait_ready`), watching the processes too, so a rank
that dies or raises before or during the rendezvous or while loading its weights becomes,
within a fraction of a second, an error that names the rank, its pid, its exit code, the
stage and the cause. Then the other ranks are killed and reaped, and rank 0's wait at the
rendezvous is ended (:func:`forerun.distributed.parallel_state.init_model_parallel`'s
``abort``) rather than left for the rendezvous timeout. (One window remains: a rank that
dies in the moment between the last check-in and the groups being built is reported at
once all the same, but rank 0's thread, inside torch's group construction, is free again
only after the collective timeout.)
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch
import torch.distributed as dist

from forerun import envs
from forerun.config import EngineConfig
from forerun.core.output import ModelRunnerOutput, SchedulerOutput
from forerun.distributed.parallel_state import (
    RendezvousAborted,
    destroy_model_parallel,
    free_port,
    init_model_parallel,
)
from forerun.distributed.pipeline_parallel import stage_layers
from forerun.model.loader import load_model
from forerun.spawn import exit_with_parent, start_process
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
                  port: int, tracer: Tracer | None, spec_config: SpeculativeConfig | None,
                  report: Callable[[str], None] = lambda stage: None,
                  abort: threading.Event | None = None,
                  ) -> tuple[ModelRunner, dist.ProcessGroup | None]:
    """Join the engine's ranks, load this rank's share of the model, build its runner;
    returns it and the group the engine's calls arrive on. ``report`` hears each stage as it
    begins; ``abort`` (rank 0) ends the wait at the rendezvous."""
    device = config.resolve_device()
    dtype = config.resolve_dtype(device)
    mc = info.model_config
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    report("rendezvous")
    tp_group, pp_group = init_model_parallel(rank, tp, pp, addr, port, device, abort)
    report("loading weights")
    stage = stage_layers(mc.num_hidden_layers, pp, pp_group.stage) if pp > 1 else None
    if envs.rank_fault() == (rank, "load"):
        raise RuntimeError(f"rank {rank}: injected fault while loading its weights "
                           "(FORERUN_RANK_FAULT)")
    model = load_model(info.source, mc, dtype, device, config.quantization, tp_group, stage,
                       expert_parallel=config.enable_expert_parallel)
    report("building the runner")
    pipeline = PipelineComm(pp_group, mc.hidden_size, dtype, device) if pp > 1 else None
    runner = ModelRunner(model, num_blocks, config.block_size, mc.num_key_value_heads // tp,
                       mc.head_dim,
                       stage.num_stage_layers if stage is not None else mc.num_hidden_layers,
                       dtype, device, config.max_num_seqs, tracer, vocab_size=mc.vocab_size,
                       speculative_config=spec_config, pipeline=pipeline,
                       kv_cache_dtype=config.resolve_kv_cache_dtype(dtype))
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


# What a rank process reports on its pipe during start-up: (kind, text).
_STAGE, _READY, _FAILED = "stage", "ready", "failed"


def _report(conn: Connection, kind: str, text: str = "") -> None:
    try:
        conn.send((kind, text))
    except OSError:  # the parent is gone or stopped listening; exit_with_parent ends us
        pass


def _rank_main(config: EngineConfig, info: Any, num_blocks: int, rank: int,
               addr: str, port: int,
               spec_config: SpeculativeConfig | None, cpu_share: tuple[int, int],
               conn: Connection) -> None:
    """A rank other than 0: join the group, load its shard, then run what rank 0 sends.

    Start-up is reported on ``conn`` (each stage, then ready or the exception)."""
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s [rank-{rank}] %(name)s: "
                               "%(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=exit_with_parent, daemon=True).start()
    try:
        take_cpu_share(*cpu_share)
        torch.manual_seed(config.seed)  # the same unseeded keys as rank 0
        runner, group = _build_runner(config, info, num_blocks, rank, addr, port, None,
                                      spec_config, lambda stage: _report(conn, _STAGE, stage))
    except BaseException:
        # The parent puts the traceback in its error; exiting with 1 (not re-raising) so
        # that it is not printed twice.
        _report(conn, _FAILED, traceback.format_exc())
        conn.close()
        sys.exit(1)
    _report(conn, _READY)
    conn.close()
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


class RankStartupError(RuntimeError):
    """A rank process died or raised before it was ready (the message says which, how and
    where)."""


@dataclass(slots=True)
class _Rank:
    rank: int
    proc: BaseProcess
    conn: Connection | None  # the parent's end of the report pipe; None once closed
    stage: str = "starting"
    ready: bool = False
    error: str | None = None  # the traceback the rank reported


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"exited with code {code} (killed by {signal.Signals(-code).name})"
        except ValueError:
            pass
    return f"exited with code {code}"


class RankProcesses:
    """This node's rank processes (children of this process) and what they report while
    they start."""

    def __init__(self, ranks: list[_Rank]) -> None:
        self._ranks = ranks

    @property
    def procs(self) -> list[BaseProcess]:
        return [r.proc for r in self._ranks]

    @property
    def pids(self) -> list[int | None]:
        return [r.proc.pid for r in self._ranks]

    def wait_ready(self, rank0: Future[Any] | None = None, poll_s: float = 0.1) -> None:
        """Block until every rank process is ready (and ``rank0``, this process's own rank,
        has finished starting). A rank process that dies or raises first raises
        :class:`RankStartupError`; a failed ``rank0`` raises its own exception unless a
        rank process failed too (then that is the cause, chained to rank 0's error). Kills
        no process: the caller does (:meth:`kill`)."""
        while True:
            self._poll()
            self._raise_first_fault()
            if rank0 is not None and rank0.done() and rank0.exception() is not None:
                # Rank 0's error may only be the echo of a rank that died (a collective it
                # was in failed): give the reports a moment to arrive, and prefer them.
                multiprocessing.connection.wait(self._waitables(), timeout=1.0)
                self._poll()
                try:
                    self._raise_first_fault()
                except RankStartupError as exc:
                    raise exc from rank0.exception()
                rank0.result()
            if all(r.ready for r in self._ranks) and (rank0 is None or rank0.done()):
                return
            multiprocessing.connection.wait(self._waitables(), timeout=poll_s)

    def _waitables(self) -> list[Any]:
        return [r.conn for r in self._ranks if r.conn is not None] + [
            r.proc.sentinel for r in self._ranks if r.proc.exitcode is None]

    def _poll(self) -> None:
        for r in self._ranks:
            if r.conn is None:
                continue
            try:
                while r.conn.poll():
                    kind, text = r.conn.recv()
                    if kind == _STAGE:
                        r.stage = text
                    elif kind == _READY:
                        r.ready = True
                    elif kind == _FAILED:
                        r.error = text
            except (EOFError, OSError):  # the rank closed its end (ready, failed or dead)
                r.conn.close()
                r.conn = None

    def _raise_first_fault(self) -> None:
        for r in self._ranks:
            if r.error is not None:
                r.proc.join(5)  # it exits right after reporting; its code is in the message
                cause = r.error.rstrip().splitlines()[-1]
                raise RankStartupError(
                    f"rank {r.rank} (pid {r.proc.pid}) {_exit_text(r.proc.exitcode)} during "
                    f"start-up ({r.stage}): {cause}\n--- rank {r.rank}'s traceback ---\n"
                    f"{r.error.rstrip()}")
        for r in self._ranks:
            # A rank that reported its exception is handled above; this one died (a signal,
            # os._exit, a failure before its own code ran: its stderr has that one). A rank
            # that was ready and then died is more likely an echo of another's failure; if
            # not, the engine's first step finds it.
            if r.proc.exitcode is not None and not r.ready:
                raise RankStartupError(
                    f"rank {r.rank} (pid {r.proc.pid}) {_exit_text(r.proc.exitcode)} during "
                    f"start-up ({r.stage}): it reported no exception"
                    + ("" if r.stage != "starting" else
                       " (it died before it began the rendezvous: its own output above "
                       "has the cause)"))

    def kill(self, grace_s: float = 0.0) -> None:
        """Wait up to ``grace_s`` for each rank to exit, kill what is left, reap them all."""
        deadline = time.monotonic() + grace_s
        for r in self._ranks:
            r.proc.join(max(0.0, deadline - time.monotonic()))
        for r in self._ranks:
            if r.proc.is_alive():
                r.proc.kill()
        for r in self._ranks:
            r.proc.join(5)
            if r.conn is not None:
                r.conn.close()
                r.conn = None

    def join(self) -> None:
        for r in self._ranks:
            r.proc.join()


def spawn_ranks(config: EngineConfig, info: Any, num_blocks: int, ranks: range,
                addr: str, port: int, spec_config: SpeculativeConfig | None,
                share_indices: list[int], num_shares: int) -> RankProcesses:
    """Start one process per rank in ``ranks`` (children of this process); they report
    their start-up to :meth:`RankProcesses.wait_ready`."""
    started: list[_Rank] = []
    try:
        for r, share in zip(ranks, share_indices, strict=True):
            parent_end, child_end = multiprocessing.Pipe(duplex=False)
            proc = start_process(_rank_main, name=f"forerun-rank-{r}", daemon=True,
                                 args=(config, info, num_blocks, r, addr, port,
                                       spec_config, (share, num_shares), child_end))
            # Only the child holds its end now: its death closes the pipe.
            child_end.close()
            started.append(_Rank(r, proc, parent_end))
    except BaseException:
        RankProcesses(started).kill()
        raise
    return RankProcesses(started)


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
        # Set when a rank process fails at start-up: rank 0 stops waiting at the rendezvous.
        abort = threading.Event()
        self._procs = spawn_ranks(config, info, num_blocks, range(1, local), addr, port,
                                  spec_config, [config.data_parallel_rank * local + r
                                                for r in range(1, local)], shares)

        def init_rank0() -> tuple[ModelRunner, dist.ProcessGroup | None]:
            # The worker thread runs every collective of this process. It is shared by every
            # engine in the process: its CPUs and thread count go back at shutdown, or here
            # if the start fails.
            self._saved_cpus = os.sched_getaffinity(0)
            self._saved_threads = torch.get_num_threads()
            take_cpu_share(config.data_parallel_rank * local, shares)
            try:
                built = _build_runner(config, info, num_blocks, 0, addr, port, tracer,
                                      spec_config, abort=abort)
                if abort.is_set():  # a rank process failed while this one loaded
                    _close_rank0(built[0])
                    raise RendezvousAborted("rank 0: start-up ended (another rank failed)")
                return built
            except BaseException:
                self._restore_worker_thread()
                raise

        rank0 = self._pool.submit(init_rank0)
        try:
            self._procs.wait_ready(rank0)
            self.runner, self._control = rank0.result()
        except BaseException:
            abort.set()
            self._procs.kill()
            # Rank 0 ends within moments now (at the rendezvous, or after its load); it is
            # only waited for briefly, so that a rank 0 stuck building the groups with a
            # dead peer (the collective timeout) does not hold this error back.
            try:
                built = rank0.result(timeout=10)
            except BaseException:  # its own failure, or the abort: the error raised is ours
                pass
            else:  # it finished before the abort: take it down on its thread
                self._pool.submit(self._discard_rank0, built[0]).result(timeout=30)
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
                    [os.getpid(), *self._procs.pids])

    def _restore_worker_thread(self) -> None:
        """On the worker thread: leave no group, and give back its CPUs and threads."""
        destroy_model_parallel()
        os.sched_setaffinity(0, self._saved_cpus)
        torch.set_num_threads(self._saved_threads)

    def _discard_rank0(self, runner: ModelRunner) -> None:
        _close_rank0(runner)
        self._restore_worker_thread()

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
                if all(p.is_alive() for p in self._procs.procs):
                    self._broadcast(_SHUTDOWN, ())
                    if self._sent is not None:
                        self._sent.result(timeout=30)
            finally:
                if self.runner.pipeline is not None:
                    self.runner.pipeline.close()
                if self._sender is not None:
                    self._sender.shutdown(wait=False, cancel_futures=True)
                self._restore_worker_thread()
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
        self._procs.kill(grace_s)


def _close_rank0(runner: ModelRunner) -> None:
    if runner.pipeline is not None:
        runner.pipeline.close()
