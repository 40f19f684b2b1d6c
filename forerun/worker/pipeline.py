"""What a pipeline stage's runner sends and receives around its forward and its sampling.

Every stage gets every step (the executor broadcasts it) and runs steps in order. A stage
other than the first receives the previous stage's ``[2, tokens, hidden]`` intermediate
before its layers; a stage other than the last sends its own after them. Only the last
stage samples; its output goes back to the first stage, which needs the sampled ids as the
input of the requests' next positions and hands the output to the scheduler.

The first stage must not wait for an output it does not need yet: while the last stage
finishes step N, the first already runs step N+1 (other requests). So its
``sample_tokens`` returns at once with a :class:`StageOutput`, a receive runs on a thread
of its own, and a step that feeds a request's last sample waits only for the outputs up to
the one that holds it.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from forerun.core.output import ModelRunnerOutput
from forerun.distributed.parallel_state import PipelineParallelGroup


class StageOutput:
    """The first stage's handle on a step's output, which the last stage sends back."""

    def __init__(self, future: Future[ModelRunnerOutput]) -> None:
        self._future = future

    def get_output(self) -> ModelRunnerOutput:
        return self._future.result()

    def done(self) -> bool:
        return self._future.done()


class PipelineComm:
    """One stage's sends and receives (see the module docstring)."""

    def __init__(self, group: PipelineParallelGroup, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.group = group
        self._shape = (2, hidden_size)
        self._dtype = dtype
        self._device = device
        # The send in flight and its tensor (kept alive until the send completes).
        self._send: tuple[dist.Work, torch.Tensor] | None = None
        self._receiver = (ThreadPoolExecutor(1, thread_name_prefix="forerun-pp-recv")
                          if group.is_first else None)
        # First stage: outputs not yet applied, oldest first: the requests that step
        # sampled, their rows in last_sampled, and the output on its way.
        self._pending: deque[tuple[list[str], list[int], Future[ModelRunnerOutput]]] = deque()

    @property
    def is_first(self) -> bool:
        return self.group.is_first

    @property
    def is_last(self) -> bool:
        return self.group.is_last

    # ----- hidden states, stage to stage ------------------------------------------------
    def recv_intermediate(self, num_tokens: int) -> torch.Tensor:
        buf = torch.empty(self._shape[0], num_tokens, self._shape[1], dtype=self._dtype,
                          device=self._device)
        dist.recv(buf, src=self.group.global_rank(self.group.stage - 1), group=self.group.group)
        return buf

    def send_intermediate(self, intermediate: torch.Tensor) -> None:
        # Asynchronous, so this stage starts its next step while the next stage receives;
        # one send at a time keeps the order and bounds the memory held.
        self.wait_sends()
        t = intermediate.contiguous()
        self._send = (dist.isend(t, dst=self.group.global_rank(self.group.stage + 1),
                                 group=self.group.group), t)

    def wait_sends(self) -> None:
        if self._send is not None:
            self._send[0].wait()
            self._send = None

    # ----- the sampled output, last stage to first ----------------------------------------
    def send_output(self, output: ModelRunnerOutput) -> None:
        dist.send_object_list([output], dst=self.group.global_rank(0),
                              group=self.group.output_group)

    def _recv_output(self) -> ModelRunnerOutput:
        box: list[ModelRunnerOutput | None] = [None]
        dist.recv_object_list(box, src=self.group.global_rank(self.group.size - 1),
                              group=self.group.output_group)
        assert box[0] is not None
        return box[0]

    def expect_output(self, sample_req_ids: list[str], sample_slots: list[int]
                      ) -> StageOutput:
        """First stage: the output of the step just run, received in the background."""
        assert self._receiver is not None
        future = self._receiver.submit(self._recv_output)
        self._pending.append((sample_req_ids, sample_slots, future))
        return StageOutput(future)

    def apply_outputs(self, last_sampled: torch.Tensor, needed: set[str]) -> None:
        """Write received samples into ``last_sampled``, oldest step first: every output
        already here, and (waiting for them) all up to the newest that sampled a request
        in ``needed``."""
        last_needed = -1
        for i, (req_ids, _, _) in enumerate(self._pending):
            if needed.intersection(req_ids):
                last_needed = i
        latest: dict[int, int] = {}  # row -> sample; a later step's sample wins
        i = 0
        while self._pending and (i <= last_needed or self._pending[0][2].done()):
            req_ids, slots, future = self._pending.popleft()
            out = future.result()
            for req_id, slot in zip(req_ids, slots, strict=True):
                j = out.req_id_to_index.get(req_id)
                if j is not None and out.sampled_token_ids[j]:
                    latest[slot] = out.sampled_token_ids[j][-1]
            i += 1
        if latest:
            device = last_sampled.device
            last_sampled[torch.tensor(list(latest), device=device)] = torch.tensor(
                list(latest.values()), dtype=last_sampled.dtype, device=device)

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.shutdown(wait=False, cancel_futures=True)
        self._send = None
