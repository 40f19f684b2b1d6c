"""The engine-core loop that runs in its own process (or a thread, for debugging).

It owns the scheduler, executor and model; the API process owns tokenizer and HTTP.
Both directions are ZMQ PUSH/PULL pairs that the API process binds and the core connects.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from typing import Any

import msgspec
import zmq

from forerun.config import EngineConfig
from forerun.core.block_hash import make_block_hasher
from forerun.engine.core import EngineCore
from forerun.engine.core_messages import (
    HEARTBEAT_INTERVAL_S,
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreOutputs,
    GetStats,
    Heartbeat,
    Ready,
    Shutdown,
    StartupFailed,
    StatsReply,
    WireOutput,
    input_decoder,
    output_encoder,
)
from forerun.model.info import resolve_model_info
from forerun.request import Request
from forerun.spawn import parent_alive
from forerun.worker.cpu_threads import take_cpu_share

logger = logging.getLogger(__name__)

_IDLE_POLL_MS = 500
_PARENT_CHECK_S = 1.0


class EngineCoreProc:
    """Drains inputs, steps the core, and ships each step's outputs as one message."""

    def __init__(self, core: EngineCore, config: EngineConfig, in_sock: zmq.Socket,
                 out_sock: zmq.Socket, watch_parent: bool) -> None:
        self.core = core
        self.in_sock = in_sock
        self.out_sock = out_sock
        self.watch_parent = watch_parent
        self.block_hasher = make_block_hasher(config.block_size)
        self.engine_index = config.data_parallel_rank
        # Requests whose first scheduling time has not been reported yet.
        self.unreported: dict[str, Request] = {}
        self.running = True
        self.last_sent = time.monotonic()

    def run(self) -> None:
        last_parent_check = time.monotonic()
        while self.running:
            if time.monotonic() - self.last_sent >= HEARTBEAT_INTERVAL_S:
                self._send(Heartbeat())
            busy = self.core.has_work()
            if self.in_sock.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_inputs()
            now = time.monotonic()
            if now - last_parent_check > _PARENT_CHECK_S:
                last_parent_check = now
                if self._parent_gone():
                    logger.warning("API process is gone; engine core exits")
                    return
            if self.running and self.core.has_work():
                self._step()

    def _parent_gone(self) -> bool:
        # The API process died without telling us.
        return self.watch_parent and not parent_alive()

    def _drain_inputs(self) -> None:
        while True:
            try:
                raw = self.in_sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = input_decoder.decode(raw)
            except msgspec.MsgspecError as exc:
                self._reject(raw, exc)
                continue
            self._handle(msg)

    def _reject(self, raw: bytes, exc: Exception) -> None:
        """A message that does not decode fails alone, never the core: a request that
        slipped past the frontend's validation ends with finish reason ``error``."""
        logger.error("dropping an undecodable message from the API process: %s", exc)
        try:
            fields = msgspec.msgpack.decode(raw)
        except msgspec.MsgspecError:
            return
        if (isinstance(fields, list) and len(fields) > 1 and fields[0] == "add"
                and isinstance(fields[1], str)):
            self._send(CoreOutputs([WireOutput(fields[1], [], "error", None, 0)]))

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, AddRequest):
            req = Request(msg.request_id, msg.prompt_token_ids, msg.params,
                          arrival_time=msg.arrival_time, block_hasher=self.block_hasher,
                          pooling_params=msg.pooling_params)
            self.unreported[req.request_id] = req
            self.core.add_request(req)
        elif isinstance(msg, AbortRequests):
            for rid in msg.request_ids:
                self.unreported.pop(rid, None)
            self.core.abort_requests(msg.request_ids)
        elif isinstance(msg, GetStats):
            self._send(StatsReply(msg.call_id, self.core.stats(msg.span_window_s),
                                 self.engine_index))
        elif isinstance(msg, Shutdown):
            self.running = False

    def _step(self) -> None:
        outs = self.core.run_step()
        if not outs:
            return
        wire = []
        for o in outs:
            sched_time = None
            req = self.unreported.get(o.request_id)
            if req is not None and req.first_scheduled_time is not None:
                sched_time = req.first_scheduled_time
                del self.unreported[o.request_id]
            if o.finish_reason is not None:
                self.unreported.pop(o.request_id, None)
            wire.append(WireOutput(o.request_id, o.new_token_ids, o.finish_reason,
                                   o.stop_reason, o.num_cached_tokens, sched_time,
                                   o.logprobs, o.prompt_logprobs, o.pooling_output,
                                   o.kv_transfer_params))
        self._send(CoreOutputs(wire))

    def _send(self, msg: CoreOutputs | StatsReply | Heartbeat) -> None:
        self.out_sock.send(output_encoder.encode(msg))
        self.last_sent = time.monotonic()


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str,
                    in_process: bool = False) -> None:
    """Entry point of the core process (or thread): build the core, report, loop."""
    if not in_process:
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s")
        # Ctrl-C, and a supervisor's SIGTERM, reach the whole process group: the API
        # process decides when we stop (after draining), and we exit if it dies.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if config.data_parallel_size > 1 and config.world_size == 1:
            cpus = take_cpu_share(config.data_parallel_rank, config.data_parallel_size)
            logger.info("data-parallel rank %d of %d on CPUs %s", config.data_parallel_rank,
                        config.data_parallel_size, cpus)
    ctx = zmq.Context.instance() if in_process else zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    for s in (in_sock, out_sock):
        s.setsockopt(zmq.LINGER, 1000)
    in_sock.setsockopt(zmq.RCVHWM, 0)  # see EngineCoreClient: aborts must always get through
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    core: EngineCore | None = None
    try:
        try:
            # Imported here: the API process imports this module for the process target
            # and must not load the builder (and through it the worker and model code).
            from forerun.engine.builder import build_engine_core

            info = resolve_model_info(config)
            core = build_engine_core(config, info)
        except Exception as exc:
            logger.error("engine core failed to start: %s", exc)
            out_sock.send(output_encoder.encode(
                StartupFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc())))
            return
        out_sock.send(output_encoder.encode(Ready(os.getpid(), info.max_model_len)))
        proc = EngineCoreProc(core, config, in_sock, out_sock, not in_process)
        try:
            proc.run()
        except Exception as exc:
            logger.exception("engine core loop failed")
            out_sock.send(output_encoder.encode(
                CoreFailed(f"{type(exc).__name__}: {exc}", traceback.format_exc())))
        if config.trace_file:
            core.tracer.write(config.trace_file)
    finally:
        if core is not None:
            core.shutdown()
        in_sock.close()
        out_sock.close()
        if not in_process:
            ctx.term()
