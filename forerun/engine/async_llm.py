"""AsyncLLM: the asyncio frontend the server uses, over an engine core client."""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from forerun.config import EngineConfig
from forerun.core.stats import EngineStats
from forerun.engine.core_client import EngineDeadError, make_core_client
from forerun.engine.core_messages import CoreFailed, CoreOutputs, StatsReply
from forerun.engine.output_processor import OutputProcessor
from forerun.engine.parallel_sampling import ParallelSampling
from forerun.engine.processor import ProcessedPrompt, PromptType, make_processor
from forerun.model.info import ModelInfo, resolve_model_info
from forerun.model.tokenizer import load_tokenizer
from forerun.outputs import PoolingRequestOutput, RequestOutput
from forerun.pooling_params import PoolingParams, pooling_sampling_params
from forerun.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_POLL_MS = 500


class EngineOverloadedError(RuntimeError):
    """The frontend will not take this request now: full, or shutting down (HTTP 503)."""

    def __init__(self, message: str, retry_after_s: int = 1,
                 code: str = "server_overloaded") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.code = code


class RequestTimeoutError(RuntimeError):
    """A request ran past the frontend's ``request_timeout_s``; it has been aborted."""


class OutputObserver(Protocol):
    """Gets every RequestOutput as it is dispatched (the server's metrics use this)."""

    def on_output(self, output: RequestOutput) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, one per engine step that produced tokens for it."""

    def __init__(self, engine: AsyncLLM, request_id: str,
                 deadline: float | None = None,
                 prompt_token_ids: list[int] | None = None) -> None:
        self.engine = engine
        self.request_id = request_id
        # Known before the first output: a server sends it (and its length) at once.
        self.prompt_token_ids = prompt_token_ids if prompt_token_ids is not None else []
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False
        # loop.time() after which the request is aborted with RequestTimeoutError.
        self.deadline = deadline

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self.deadline is None or not self.queue.empty():
            item = await self.queue.get()
        else:
            try:
                async with asyncio.timeout_at(self.deadline):
                    item = await self.queue.get()
            except TimeoutError:
                self.abort()
                raise RequestTimeoutError(
                    f"the request ran longer than the server's request timeout "
                    f"({self.engine.request_timeout_s:g} s) and was aborted") from None
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def abort(self) -> None:
        """Stop the request in the engine (frees its KV blocks); safe to call twice."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    """Tokenise, send to the engine core, detokenise, and fan outputs out per request.

    ``engine_process=False`` runs the core in a thread of this process (tests, debugging).
    The output handler task starts on first use inside the running event loop (or at
    ``start()``).

    Admission: at most ``max_num_seqs + max_waiting_requests`` sequences (a request with
    ``n`` choices counts n) are in flight; beyond that, and while draining for shutdown,
    ``add_request`` raises :class:`EngineOverloadedError`. The core beats at least once a
    second; after ``heartbeat_timeout_s`` of silence the engine counts as unresponsive
    (``health()`` says why) and new requests are refused until it beats again.
    """

    def __init__(self, config: EngineConfig, engine_process: bool = True,
                 observer: OutputObserver | None = None,
                 max_waiting_requests: int | None = None,
                 request_timeout_s: float | None = None,
                 heartbeat_timeout_s: float = 30.0) -> None:
        self.config = config
        self.model_info: ModelInfo = resolve_model_info(config)
        self.client = make_core_client(config, engine_process)
        self.client.start()
        try:
            # Load the tokenizer while the core loads the model.
            self.tokenizer = load_tokenizer(self.model_info.tokenizer_from,
                                            self.model_info.model_config.architecture)
            ready = self.client.wait_ready()
        except BaseException:
            self.client.shutdown()
            raise
        info = self.model_info
        if ready.max_model_len != info.max_model_len:
            # The core lowered it to fit its KV cache: validate requests against that.
            logger.info("max_model_len is %d (the engine core's KV cache limit)",
                        ready.max_model_len)
            info.max_model_len = ready.max_model_len
        self.processor = make_processor(config, info, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.observer = observer
        self._streams: dict[str, RequestStream] = {}
        self._parallel = ParallelSampling()
        # call id -> (its future, the replies so far: one per data-parallel engine)
        self._stats_waiters: dict[int, tuple[asyncio.Future[list[EngineStats]],
                                             list[StatsReply]]] = {}
        self._call_ids = itertools.count()
        self._handler: asyncio.Task[None] | None = None
        self.dead_error: str | None = None
        self.max_pending_seqs = (None if max_waiting_requests is None
                                 else config.max_num_seqs + max_waiting_requests)
        self.request_timeout_s = request_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.last_heartbeat = time.monotonic()
        # Why new requests are refused (shutting down), or None while accepting.
        self.draining: str | None = None
        # Called once, from the event loop, when the engine core is found dead.
        self.on_dead: Callable[[str], None] | None = None

    @property
    def max_model_len(self) -> int:
        return self.model_info.max_model_len

    @property
    def is_dead(self) -> bool:
        return self.dead_error is not None or not self.client.is_alive()

    def health(self) -> str | None:
        """None when healthy, else why not (dead, or silent past the heartbeat timeout)."""
        if self.is_dead:
            return self.dead_error or self.client.death_message()
        silent = time.monotonic() - self.last_heartbeat
        if silent > self.heartbeat_timeout_s:
            return f"the engine core has not answered for {silent:.1f} s"
        return None

    @property
    def num_pending_seqs(self) -> int:
        """Sequences sent to the core and not finished (each of n choices counts)."""
        return len(self.output_processor.request_states)

    def check_admission(self, num_seqs: int) -> None:
        """Raise unless ``num_seqs`` more sequences may start now.

        ValueError (a 400) when they could never fit; EngineOverloadedError (a 503 with
        Retry-After) when the server is full, draining, or its engine is not answering.
        """
        if self.draining is not None:
            raise EngineOverloadedError(self.draining, 5, "server_shutting_down")
        problem = self.health()
        if problem is not None:
            if self.is_dead:
                raise EngineDeadError(problem)
            raise EngineOverloadedError(problem, 5, "engine_unresponsive")
        cap = self.max_pending_seqs
        if cap is None:
            return
        if num_seqs > cap:
            raise ValueError(
                f"n: this request asks for {num_seqs} sequences (prompts x n); the server "
                f"runs at most {cap} at once (--max-num-seqs + --max-waiting-requests)")
        if self.num_pending_seqs + num_seqs > cap:
            raise EngineOverloadedError(
                f"the server is full ({self.num_pending_seqs} sequences in flight, limit "
                f"{cap}); retry later")

    def stop_accepting(self, reason: str) -> None:
        """Refuse new requests from now on (graceful shutdown); in-flight ones go on."""
        self.draining = reason

    def start(self) -> None:
        """Start reading the core's messages now (the server calls this at startup)."""
        self._ensure_handler()

    # ----- requests ---------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: float | None = None) -> RequestStream:
        """Validate and send one request; raises ValueError (field name first) if bad.

        With ``params.n > 1`` the request is fanned out into n children (see
        :mod:`forerun.engine.parallel_sampling`); the stream yields the parent's outputs,
        each with all n completions. Raises EngineOverloadedError when the server is full.
        """
        self.check_admission(params.n)
        processed = self.processor.process_prompt(prompt, params.truncate_prompt_tokens)
        params = self.processor.process_params(params)
        return self.add_processed_request(request_id, processed, params, arrival_time)

    def add_processed_request(self, request_id: str, processed: ProcessedPrompt,
                              params: SamplingParams,
                              arrival_time: float | None = None) -> RequestStream:
        """Send a request the processor has already checked (the server does that step
        on a worker thread for big bodies); admission is checked here all the same."""
        self._ensure_handler()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self.check_admission(params.n)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        deadline = None
        if self.request_timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        stream = RequestStream(self, request_id, deadline, processed.prompt_token_ids)
        jobs = self._parallel.fan_out(request_id, params)
        self._streams[request_id] = stream
        tracked: list[str] = []
        sent: list[str] = []
        try:
            # Back to back, so the core admits the children together and they share the
            # prompt's KV blocks through the prefix cache.
            for rid, p in jobs:
                self.output_processor.add_request(rid, processed.prompt,
                                                  processed.prompt_token_ids, p, arrival)
                tracked.append(rid)
                self.client.add_request(rid, processed.prompt_token_ids, p, arrival,
                                        group=request_id if params.n > 1 else None)
                sent.append(rid)
        except BaseException:
            self._streams.pop(request_id, None)
            self._parallel.forget(request_id)
            for rid in tracked:
                self.output_processor.abort_request(rid)
            if sent:
                try:
                    self.client.abort_requests(sent)
                except Exception:
                    logger.debug("abort of %s not delivered", sent, exc_info=True)
            raise
        return stream

    async def generate(self, prompt: PromptType, params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Yield the request's state after every step that gave it tokens."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def add_pooling_request(self, request_id: str, prompt: PromptType,
                            params: PoolingParams,
                            arrival_time: float | None = None) -> RequestStream:
        """Validate and send one pooling request; its stream yields one
        PoolingRequestOutput. Raises ValueError (field name first) if bad."""
        self.check_admission(1)
        processed, params = self.process_pooling(prompt, params)
        return self.add_processed_pooling_request(request_id, processed, params, arrival_time)

    def process_pooling(self, prompt: PromptType, params: PoolingParams
                        ) -> tuple[ProcessedPrompt, PoolingParams]:
        """Check and tokenise a pooling request without sending it (ValueError if bad)."""
        params = self.processor.process_pooling_params(params)
        return self.processor.process_prompt(prompt, params.truncate_prompt_tokens), params

    def add_processed_pooling_request(self, request_id: str, processed: ProcessedPrompt,
                                      params: PoolingParams,
                                      arrival_time: float | None = None) -> RequestStream:
        """Send a pooling request :meth:`process_pooling` has checked."""
        self._ensure_handler()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in flight")
        self.check_admission(1)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        deadline = None
        if self.request_timeout_s is not None:
            deadline = asyncio.get_running_loop().time() + self.request_timeout_s
        stream = RequestStream(self, request_id, deadline, processed.prompt_token_ids)
        self._streams[request_id] = stream
        self.output_processor.add_pooling_request(request_id, processed.prompt,
                                                  processed.prompt_token_ids, params, arrival)
        try:
            self.client.add_request(request_id, processed.prompt_token_ids,
                                    pooling_sampling_params(), arrival,
                                    pooling_params=params)
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort_request(request_id)
            raise
        return stream

    async def encode(self, prompt: PromptType, pooling_params: PoolingParams,
                     request_id: str) -> AsyncIterator[PoolingRequestOutput]:
        """vLLM's ``AsyncLLM.encode``: yield the request's one (final) pooling output."""
        stream = self.add_pooling_request(request_id, prompt, pooling_params)
        try:
            async for out in stream:
                yield out  # type: ignore[misc]
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a request (a parallel-sampling parent aborts all its children)."""
        stream = self._streams.pop(request_id, None)
        ids = self._parallel.forget(request_id)
        states = [self.output_processor.abort_request(rid) for rid in ids]
        if stream is None and all(s is None for s in states):
            return
        if self.observer is not None:
            for rid in ids:
                self.observer.on_abort(rid)
        try:
            self.client.abort_requests(ids)
        except Exception:  # the core is gone: nothing left to free
            logger.debug("abort of %s not delivered", ids, exc_info=True)

    def fail_all(self, error: BaseException) -> None:
        """End every request in flight with ``error`` (shutdown, engine death)."""
        ids: list[str] = []
        for rid, stream in list(self._streams.items()):
            stream.queue.put_nowait(error)
            for eid in self._parallel.forget(rid):
                ids.append(eid)
                self.output_processor.abort_request(eid)
                if self.observer is not None:
                    self.observer.on_abort(eid)
        self._streams.clear()
        if ids and self.client.is_alive():
            self.client.abort_requests(ids)

    # ----- stats ------------------------------------------------------------------------
    async def get_engine_stats(self, timeout_s: float = 10.0,
                               span_window_s: float = 0.0) -> list[EngineStats]:
        """Every engine core's ``stats(span_window_s)`` snapshot, by data-parallel rank."""
        self._ensure_handler()
        if self.is_dead:
            raise EngineDeadError(self.dead_error or self.client.death_message())
        call_id = next(self._call_ids)
        fut: asyncio.Future[list[EngineStats]] = asyncio.get_running_loop().create_future()
        self._stats_waiters[call_id] = (fut, [])
        try:
            self.client.request_stats(call_id, span_window_s)
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._stats_waiters.pop(call_id, None)

    # ----- output handling --------------------------------------------------------------
    def _ensure_handler(self) -> None:
        if self._handler is None or self._handler.done():
            if self._handler is not None and self.dead_error is None:
                logger.error("output handler stopped; restarting it")
            self._handler = asyncio.get_running_loop().create_task(
                self._output_loop(), name="forerun-output-handler")

    async def _output_loop(self) -> None:
        try:
            while self.dead_error is None:
                msgs = await self.client.recv_messages(_POLL_MS)
                if msgs:
                    self.last_heartbeat = time.monotonic()
                for msg in msgs:
                    self._handle(msg)
                if not msgs and not self.client.is_alive():
                    self._die(self.client.death_message())
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("output handler failed")
            self._die(f"output handler failed: {exc}")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, CoreOutputs):
            self._process_outputs(msg)
        elif isinstance(msg, StatsReply):
            waiter = self._stats_waiters.get(msg.call_id)
            if waiter is None:
                return
            fut, replies = waiter
            replies.append(msg)
            if len(replies) == self.client.num_engines and not fut.done():
                del self._stats_waiters[msg.call_id]
                fut.set_result([r.stats for r in sorted(replies, key=lambda r: r.engine_index)])
        elif isinstance(msg, CoreFailed):
            logger.error("engine core failed:\n%s", msg.traceback)
            self._die(f"engine core failed: {msg.error}")

    def _process_outputs(self, msg: CoreOutputs) -> None:
        states = self.output_processor.request_states
        for w in msg.outputs:
            state = states.get(w.request_id)
            if state is not None and w.first_scheduled_time is not None:
                state.metrics.first_scheduled_time = w.first_scheduled_time
        outputs, to_abort = self.output_processor.process_outputs(
            [w.to_core_output() for w in msg.outputs])
        if to_abort:
            self.client.abort_requests(to_abort)
        if self.observer is not None:
            # Metrics count sequences: each child of an n > 1 request on its own.
            for out in outputs:
                if isinstance(out, RequestOutput):  # pooling outputs carry no tokens
                    self.observer.on_output(out)
        for out in self._parallel.merge(outputs):
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            stream.queue.put_nowait(out)

    def _die(self, message: str) -> None:
        if self.dead_error is not None:
            return
        logger.error("%s", message)
        self.dead_error = message
        err = EngineDeadError(message)
        self.fail_all(err)
        for fut, _ in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(err)
        if self.on_dead is not None:
            self.on_dead(message)

    # ----- shutdown ---------------------------------------------------------------------
    async def shutdown_async(self) -> None:
        self.fail_all(EngineDeadError("the server is shutting down"))
        if self._handler is not None:
            self._handler.cancel()
            try:
                await self._handler
            except (asyncio.CancelledError, Exception):
                pass
        await asyncio.to_thread(self.client.shutdown)

    def shutdown(self) -> None:
        """Synchronous shutdown, for use outside a running event loop."""
        self.client.shutdown()
