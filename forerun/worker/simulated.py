"""A simulated device: the real engine around a forward that only takes modelled time.

Async scheduling pays where a step on the device takes a few milliseconds and the host's
work around it (scheduling, input preparation, detokenising, streaming) about one: the
regime of a GPU, which this machine does not have. :class:`SimulatedModelRunner` keeps
everything the host does for a step real (the scheduler, the runner's own bookkeeping and
input preparation, the frontend) and replaces the forward and sampling by a device clock:
a step occupies the device for the time a roofline model gives for it on the chosen
device, and reading its sampled ids waits for that. The CPU stays free meanwhile, as it
does while a GPU's kernels run. Sampled ids are a fixed function of the request and the
position, so the synchronous and the async engine produce the same tokens.

The roofline of one step: the device reads every weight once and the KV cache of every
token attended to, and does ``2 * params`` FLOPs per token plus the attention's; the step
takes the longer of bytes / bandwidth and FLOPs / peak, plus a fixed launch overhead.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from typing import Any

import torch

from forerun.core.output import ModelRunnerOutput
from forerun.worker.model_runner import ModelRunner
from forerun.worker.request_state import CachedRequestState
from forerun.worker.step_backend import StepState
from forerun.worker.step_inputs import StepInputs


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """What bounds a step on a device: memory bandwidth, dense bf16 FLOPs, launch cost."""

    name: str
    mem_bytes_per_s: float
    flops_per_s: float
    # Per-step cost that does not shrink with the work: kernel launches (CUDA graphs),
    # the sampler, the copy of the sampled ids to the host.
    step_overhead_s: float


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes a roofline needs (bf16 weights and KV cache)."""

    name: str
    num_params: float
    num_layers: int
    hidden_size: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int = 2

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_param


# Public datasheet figures: H100 SXM, 3.35 TB/s HBM3 and 989 TFLOP/s dense bf16; a step
# overhead of 0.3 ms is what CUDA-graph decode steps measure in vLLM's traces.
DEVICES = {
    "h100": DeviceSpec("h100", 3.35e12, 989e12, 0.3e-3),
    "a100": DeviceSpec("a100", 2.0e12, 312e12, 0.3e-3),
}
MODELS = {
    "smollm2-135m": ModelShape("smollm2-135m", 134.5e6, 30, 576, 3, 64),
    "llama-3-8b": ModelShape("llama-3-8b", 8.03e9, 32, 4096, 8, 128),
    "qwen3-32b": ModelShape("qwen3-32b", 32.8e9, 64, 5120, 8, 128),
}


def parse_simulated_device(value: str) -> tuple[DeviceSpec, ModelShape]:
    """``"h100"`` or ``"h100/llama-3-8b"`` (device / model shape); ValueError naming both lists."""
    device_name, _, model_name = value.partition("/")
    device = DEVICES.get(device_name)
    model = MODELS.get(model_name or "llama-3-8b")
    if device is None or model is None:
        raise ValueError(
            f"simulated_device: expected DEVICE[/MODEL] with DEVICE in {sorted(DEVICES)} and "
            f"MODEL in {sorted(MODELS)}; got {value!r}")
    return device, model


def step_time_s(device: DeviceSpec, model: ModelShape, num_tokens: int,
                context_lens: list[int]) -> float:
    """Roofline time of one step computing ``num_tokens`` tokens of sequences whose
    attention spans (tokens attended to, per sequence) are ``context_lens``."""
    attended = sum(context_lens)
    mem = model.num_params * model.bytes_per_param + attended * model.kv_bytes_per_token
    # QK^T and PV: 2 matmuls of 2 FLOPs per (query, key, dim), roughly num_tokens x span.
    mean_span = attended / max(len(context_lens), 1)
    attn = 4 * num_tokens * mean_span * model.hidden_size * model.num_layers
    flops = 2 * model.num_params * num_tokens + attn
    return max(mem / device.mem_bytes_per_s, flops / device.flops_per_s) + device.step_overhead_s


def simulated_token(req_id: str, position: int, vocab_size: int) -> int:
    """The id 'sampled' for ``req_id`` at ``position``: deterministic, never the low ids
    where tokenizers keep their special tokens."""
    h = zlib.crc32(f"{req_id}:{position}".encode())
    return 1000 + h % (vocab_size - 1000)


class _DeviceResult:
    """A step's sampled ids, readable once the simulated device has finished the step
    (a :class:`~forerun.worker.output_plan.DeferredOutput`)."""

    def __init__(self, ready_at: float, output: ModelRunnerOutput) -> None:
        self._ready_at = ready_at
        self._output = output

    def get_output(self) -> ModelRunnerOutput:
        delay = self._ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self._output


class SimulatedDevice:
    """The :class:`~forerun.worker.step_backend.StepBackend` whose device is a clock.

    ``forward`` "launches" the step: the device starts it when it is free and the host
    does not wait, as with a GPU's asynchronous launches. ``sample`` returns at once too;
    whoever reads the ids waits for the device, as the real runner's CUDA output waits on
    its copy event.
    """

    def __init__(self, device: DeviceSpec, shape: ModelShape,
                 requests: dict[str, CachedRequestState], vocab_size: int) -> None:
        self.device_spec = device
        self.shape = shape
        self.requests = requests
        self.vocab_size = vocab_size
        self.simulated_device_s = 0.0  # modelled busy time, summed over steps
        self._device_free_at = 0.0
        self._step_done_at = 0.0

    def fill_placeholders(self, inputs: StepInputs, last_sampled: torch.Tensor) -> None:
        # Real host work, as the real runner does it (nothing reads the ids it writes).
        inputs.placeholders.fill(inputs.input_ids, last_sampled)

    def forward(self, inputs: StepInputs, step_id: int) -> StepState:
        meta = inputs.meta
        t = step_time_s(self.device_spec, self.shape, meta.num_tokens, meta.seq_lens)
        self.simulated_device_s += t
        start = max(time.perf_counter(), self._device_free_at)
        self._device_free_at = self._step_done_at = start + t
        return StepState(list(inputs.num_tokens_of), inputs.sample_req_ids, None, None,
                         step_id)

    def sample(self, step: StepState, grammar_bitmask: object | None) -> _DeviceResult:
        # A request's last_sampled_pos is the position its sample takes: forward and
        # sample of a step come in a row, and only the next step's inputs move it.
        sampled = {r: [simulated_token(r, self.requests[r].last_sampled_pos, self.vocab_size)]
                   for r in step.sample_req_ids}
        for r in sampled:
            # The next step's input at this position comes from last_sampled, as in the
            # real runner; the forward that would read it is a clock.
            self.requests[r].num_output_tokens += 1
        out = ModelRunnerOutput(
            req_ids=step.req_ids,
            req_id_to_index={r: i for i, r in enumerate(step.req_ids)},
            sampled_token_ids=[sampled.get(r, []) for r in step.req_ids])
        # An empty step (no forward) is ready when the step before it is.
        return _DeviceResult(self._step_done_at, out)


class SimulatedModelRunner(ModelRunner):
    """A model runner whose device is a clock (see the module docstring).

    Everything the host does for a step is the real runner's; only its ``backend`` is a
    :class:`SimulatedDevice`. So the worker prepares step N+1 while step N "runs", and a
    synchronous engine idles the device while it schedules. Its KV cache is a token-sized
    stub: nothing reads it.
    """

    def __init__(self, device: DeviceSpec, shape: ModelShape, num_blocks: int,
                 block_size: int, max_num_seqs: int, vocab_size: int, **kw: Any) -> None:
        super().__init__(torch.nn.Identity(), num_blocks, block_size, num_kv_heads=1,
                         head_dim=1, num_layers=1, dtype=torch.float32,
                         device=torch.device("cpu"), max_num_seqs=max_num_seqs,
                         vocab_size=vocab_size, **kw)
        self.device_spec = device
        self.shape = shape
        self.clock = SimulatedDevice(device, shape, self.requests, vocab_size)
        self.backend = self.clock

    @property
    def simulated_device_s(self) -> float:
        """Modelled device busy time, summed over steps."""
        return self.clock.simulated_device_s
