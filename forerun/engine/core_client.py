"""API-process side of the engine core: starts it, sends it work, receives its messages."""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any

import zmq
import zmq.asyncio

from forerun.config import EngineConfig
from forerun.engine.core_messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    CoreOutputs,
    GetStats,
    Ready,
    Shutdown,
    StartupFailed,
    input_encoder,
    output_decoder,
)
from forerun.engine.core_proc import run_engine_core
from forerun.engine.dp_router import PrefixAwareRouter
from forerun.pooling_params import PoolingParams
from forerun.sampling_params import SamplingParams
from forerun.spawn import start_process

logger = logging.getLogger(__name__)


class EngineStartupError(RuntimeError):
    """The engine core could not start (bad model path, too little KV memory, ...)."""


class EngineDeadError(RuntimeError):
    """The engine core stopped while requests were in flight, or before they were sent."""


class EngineCoreClient:
    """Runs the engine core in a spawned process (default) or in a thread of this process.

    Both modes speak the same ZMQ protocol, so everything above this class is identical.
    ``start()`` returns at once so the caller can load the tokenizer meanwhile;
    ``wait_ready()`` blocks until the core reports ready or raises EngineStartupError.
    """

    def __init__(self, config: EngineConfig, engine_process: bool = True) -> None:
        self.config = config
        self.engine_process = engine_process
        self._tmpdir = tempfile.mkdtemp(prefix="forerun-ipc-")
        self.input_addr = f"ipc://{os.path.join(self._tmpdir, 'input')}"
        self.output_addr = f"ipc://{os.path.join(self._tmpdir, 'output')}"
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        for s in (self._in, self._out):
            s.setsockopt(zmq.LINGER, 0)
        # No high-water mark towards the core: the frontend's admission limit bounds what is
        # queued, and an abort must never be dropped because adds filled the pipe.
        self._in.setsockopt(zmq.SNDHWM, 0)
        self._in.bind(self.input_addr)
        self._out.bind(self.output_addr)
        self._aout: zmq.asyncio.Socket | None = None
        self._proc: Any = None
        self._thread: threading.Thread | None = None
        self._closed = False

    # ----- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self.engine_process:
            # A daemonic process may not start processes, and a core with TP/PP ranks
            # starts one per rank. Not daemonic, it is stopped here at exit instead (this
            # runs before multiprocessing's own exit hook, which would wait for it).
            daemon = self.config.world_size == 1
            self._proc = start_process(
                run_engine_core, name="forerun-engine-core", daemon=daemon,
                args=(self.config, self.input_addr, self.output_addr))
            if not daemon:
                atexit.register(self.shutdown)
            logger.info("engine core process started (pid %d)", self._proc.pid)
        else:
            self._thread = threading.Thread(
                target=run_engine_core, name="forerun-engine-core", daemon=True,
                args=(self.config, self.input_addr, self.output_addr, True))
            self._thread.start()

    def wait_ready(self, timeout_s: float = 900.0) -> Ready:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._out.poll(200):
                msg = output_decoder.decode(self._out.recv())
                if isinstance(msg, Ready):
                    logger.info("engine core ready")
                    return msg
                if isinstance(msg, StartupFailed):
                    logger.debug("engine core startup traceback:\n%s", msg.traceback)
                    raise EngineStartupError(f"engine core failed to start: {msg.error}")
                logger.warning("unexpected message before ready: %r", msg)
            elif not self.is_alive():
                raise EngineStartupError(
                    f"engine core exited during startup{self._exit_detail()}")
        raise EngineStartupError(f"engine core did not start within {timeout_s:.0f} s")

    def is_alive(self) -> bool:
        if self._closed:
            return False
        if self._proc is not None:
            return self._proc.is_alive()
        return self._thread is not None and self._thread.is_alive()

    def _exit_detail(self) -> str:
        if self._proc is not None and self._proc.exitcode is not None:
            return f" (exit code {self._proc.exitcode})"
        return ""

    def death_message(self) -> str:
        return f"engine core stopped unexpectedly{self._exit_detail()}"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, then make sure it has: no orphan process survives."""
        if self._closed:
            return
        try:
            if self.is_alive():
                self._send(Shutdown())
        except zmq.ZMQError:
            pass
        if self._proc is not None:
            self._proc.join(timeout_s)
            if self._proc.is_alive():
                logger.warning("engine core did not stop; terminating it")
                self._proc.terminate()
                self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)
        elif self._thread is not None:
            self._thread.join(timeout_s)
        self._closed = True
        if self._aout is not None:
            self._aout.close(linger=0)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)

    # ----- requests ---------------------------------------------------------------------
    def _send(self, msg: CoreInput) -> None:
        self._in.send(input_encoder.encode(msg), zmq.NOBLOCK)

    @property
    def num_engines(self) -> int:
        return 1

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    group: str | None = None,
                    pooling_params: PoolingParams | None = None) -> None:
        """``group``: requests that should share an engine (the children of one n > 1
        request); meaningful only to :class:`DPEngineCoreClient`."""
        if not self.is_alive():
            raise EngineDeadError(self.death_message())
        self._send(AddRequest(request_id, prompt_token_ids, params, arrival_time,
                              pooling_params))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.is_alive():
            self._send(AbortRequests(list(request_ids)))

    def request_stats(self, call_id: int, span_window_s: float = 0.0) -> None:
        if not self.is_alive():
            raise EngineDeadError(self.death_message())
        self._send(GetStats(call_id, span_window_s))

    # ----- outputs ----------------------------------------------------------------------
    def output_socket(self) -> zmq.asyncio.Socket:
        """The socket the core's messages arrive on, for the running event loop."""
        if self._aout is None:
            self._aout = zmq.asyncio.Socket.from_socket(self._out)
        return self._aout

    async def recv_messages(self, timeout_ms: int) -> list[Any]:
        """Every message waiting now, after waiting up to ``timeout_ms`` for the first."""
        sock = self.output_socket()
        if not await sock.poll(timeout_ms):
            return []
        msgs = []
        while True:
            try:
                raw = await sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return msgs
            msgs.append(output_decoder.decode(raw))


class DPEngineCoreClient:
    """``data_parallel_size`` engine cores behind one frontend (data parallelism).

    Each core is a full :class:`EngineCoreClient` with its own process, sockets, CPUs and
    KV cache. A request goes to the core whose prefix cache most likely holds the longest
    prefix of its prompt, unless that core is much busier than the others, else to the core
    with the fewest requests in flight (what waits and runs there, as this side counts it):
    :class:`PrefixAwareRouter`. The children of one ``n > 1`` request go to the same core
    (they share the prompt's KV blocks); aborts follow the request to its core. Output
    messages of all cores are merged; a stats request is answered once per core.
    """

    def __init__(self, config: EngineConfig, engine_process: bool = True) -> None:
        self.clients = [EngineCoreClient(dataclasses.replace(config, data_parallel_rank=i),
                                         engine_process)
                        for i in range(config.data_parallel_size)]
        self.load = [0] * len(self.clients)
        self.router = PrefixAwareRouter(len(self.clients), config.block_size,
                                        max_imbalance=max(2, config.max_num_seqs // 8))
        self._owner: dict[str, int] = {}
        self._groups: dict[str, tuple[int, int]] = {}  # group -> (engine, requests left)
        self._group_of: dict[str, str] = {}
        self._poller: zmq.asyncio.Poller | None = None

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    def start(self) -> None:
        for c in self.clients:
            c.start()

    def wait_ready(self, timeout_s: float = 900.0) -> Ready:
        readies = [c.wait_ready(timeout_s) for c in self.clients]
        # Every core has the same KV budget; take the smallest limit all the same.
        return min(readies, key=lambda r: r.max_model_len)

    def is_alive(self) -> bool:
        return all(c.is_alive() for c in self.clients)

    def death_message(self) -> str:
        for i, c in enumerate(self.clients):
            if not c.is_alive():
                return f"data-parallel engine {i}: {c.death_message()}"
        return "engine core stopped unexpectedly"

    def shutdown(self, timeout_s: float = 10.0) -> None:
        for c in self.clients:
            c.shutdown(timeout_s)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float,
                    group: str | None = None,
                    pooling_params: PoolingParams | None = None) -> None:
        if group is not None and group in self._groups:
            i, left = self._groups[group]
        else:
            i = self.router.choose(prompt_token_ids, self.load)
            left = 0
        self.clients[i].add_request(request_id, prompt_token_ids, params, arrival_time,
                                    pooling_params=pooling_params)
        self._owner[request_id] = i
        self.load[i] += 1
        if group is not None:
            self._groups[group] = (i, left + 1)
            self._group_of[request_id] = group

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self._owner.get(rid)
            if i is not None:
                by_engine.setdefault(i, []).append(rid)
        for i, ids in by_engine.items():
            self.clients[i].abort_requests(ids)
            for rid in ids:
                self._finished(rid)

    def _finished(self, request_id: str) -> None:
        i = self._owner.pop(request_id, None)
        if i is None:
            return
        self.load[i] -= 1
        group = self._group_of.pop(request_id, None)
        if group is not None:
            engine, left = self._groups[group]
            if left <= 1:
                del self._groups[group]
            else:
                self._groups[group] = (engine, left - 1)

    def request_stats(self, call_id: int, span_window_s: float = 0.0) -> None:
        for c in self.clients:
            c.request_stats(call_id, span_window_s)

    async def recv_messages(self, timeout_ms: int) -> list[Any]:
        """Every message waiting on any core, after waiting up to ``timeout_ms``."""
        if self._poller is None:
            self._poller = zmq.asyncio.Poller()
            for c in self.clients:
                self._poller.register(c.output_socket(), zmq.POLLIN)
        if not await self._poller.poll(timeout_ms):
            return []
        msgs: list[Any] = []
        for c in self.clients:
            msgs += await c.recv_messages(0)
        for msg in msgs:
            if isinstance(msg, CoreOutputs):
                for w in msg.outputs:
                    if w.finish_reason is not None:
                        self._finished(w.request_id)
        return msgs


def make_core_client(config: EngineConfig, engine_process: bool = True
                     ) -> EngineCoreClient | DPEngineCoreClient:
    """One engine core, or ``data_parallel_size`` of them behind one client."""
    if config.data_parallel_size > 1:
        return DPEngineCoreClient(config, engine_process)
    return EngineCoreClient(config, engine_process)
