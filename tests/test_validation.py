"""Validation at the edge, one wire schema, and an engine no request or interrupt can break.

Offline rows: every bad SamplingParams value raises ValueError naming its field; request
bodies are strictly typed and their 400 names the field (no server needed: the server's own
parser and error mapping); the processor names ``prompt``; SamplingParams crosses the process
boundary through the real msgpack encoder/decoder with every field intact. Then, on a tiny
random Llama, exceptions
(KeyboardInterrupt included) injected at each point of a step: the engine must afterwards
generate the same greedy tokens as before and have every KV block free.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

import forerun.llm
from forerun import LLM
from forerun.engine.core_messages import AddRequest, input_decoder, input_encoder
from forerun.engine.parallel_sampling import child_params
from forerun.engine.processor import Processor
from forerun.sampling_params import (
    INT64_MAX,
    MAX_N,
    MAX_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    SamplingParams,
)
from forerun.server.errors import _validation_error
from forerun.server.protocol import ChatCompletionRequest, CompletionRequest
from forerun.structured_params import StructuredOutputsParams
from tests.conftest import assert_all_blocks_free
from tests.tiny_model import write_tiny_llama

VOCAB = 320
PROMPTS = [[5, 17, 250, 3, 99, 42, 7], [9, 8, 7, 6, 5, 9, 8, 7, 6], [100, 200, 300, 10],
           [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
NAN, INF = math.nan, math.inf


# ----- SamplingParams: every bad value names its field --------------------------------------
BAD: list[tuple[str, Any]] = [
    ("max_tokens", 0), ("max_tokens", True), ("max_tokens", 1.0), ("max_tokens", "16"),
    ("max_tokens", 2**63),
    ("temperature", -0.5), ("temperature", "x"), ("temperature", NAN), ("temperature", INF),
    ("temperature", 1e308), ("temperature", MAX_TEMPERATURE * 1.01), ("temperature", True),
    ("temperature", None),
    ("top_p", 0.0), ("top_p", 1.5), ("top_p", NAN), ("top_p", "1"),
    ("top_k", 0), ("top_k", -2), ("top_k", 2**63), ("top_k", True), ("top_k", 5.0),
    ("seed", 2**64), ("seed", SEED_MIN - 1), ("seed", True), ("seed", 1.5), ("seed", "1"),
    ("stop", 123), ("stop", [""]), ("stop", ["ok", 5]), ("stop", {"a": 1}), ("stop", "\ud800"),
    ("stop", ["a\udfffb"]),
    ("stop_token_ids", "x"), ("stop_token_ids", [True]), ("stop_token_ids", [-1]),
    ("stop_token_ids", [2**63]), ("stop_token_ids", [1.0]), ("stop_token_ids", 5),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"), ("spaces_between_special_tokens", None),
    ("include_stop_str_in_output", 0),
    ("min_tokens", -1), ("min_tokens", True), ("min_tokens", 17),
    ("n", 0), ("n", True), ("n", 2.0), ("n", MAX_N + 1),
    ("presence_penalty", 2.5), ("presence_penalty", NAN), ("frequency_penalty", -INF),
    ("frequency_penalty", "0"),
    ("repetition_penalty", 0.0), ("repetition_penalty", NAN), ("repetition_penalty", INF),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300),
    ("min_p", 1.5), ("min_p", NAN), ("min_p", False),
    ("logit_bias", {5: 101.0}), ("logit_bias", {5: NAN}), ("logit_bias", {5: INF}),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {True: 1.0}), ("logit_bias", {-1: 1.0}),
    ("logit_bias", {"-1": 1.0}), ("logit_bias", {2**63: 1.0}), ("logit_bias", {5: True}),
    ("logit_bias", {5: "1"}), ("logit_bias", {1.5: 1.0}), ("logit_bias", [1, 2]),
    ("logit_bias", {"9" * 5000: 1.0}),
    ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", [True]),
    ("allowed_token_ids", "12"), ("allowed_token_ids", [2**63]),
    ("bad_words", "word"), ("bad_words", [""]), ("bad_words", ["  "]), ("bad_words", [5]),
    ("bad_words", ["\ud800"]),
    ("logprobs", -2), ("logprobs", True), ("prompt_logprobs", -2),
    ("prompt_logprobs", 1.0),
    ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", True),
    ("truncate_prompt_tokens", 2**63),
    ("structured_outputs", {"regex": "\ud800"}), ("structured_outputs", {"choice": ["\udc00"]}),
    ("structured_outputs", {"json": {"\ud800": 1}}),
    ("structured_outputs", {"json": {"type": "number", "maximum": NAN}}),
    ("structured_outputs", {"json": {"a": object()}}), ("structured_outputs", {"json": 5}),
    ("structured_outputs", {"json_object": "yes"}), ("structured_outputs", {1: "x"}),
    ("structured_outputs", {"regex": "a", "grammar": "b"}), ("structured_outputs", "regex"),
]


@pytest.mark.parametrize("field, value", BAD, ids=[f"{f}={v!r:.30}" for f, v in BAD])
def test_bad_value_raises_value_error_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert str(e.value).startswith(field), str(e.value)
    # The message is shown to HTTP clients: it must itself be encodable.
    str(e.value).encode("utf-8")


def test_child_seeds_wrap_modulo_2_64() -> None:
    # Child i of an n > 1 request is seeded seed + i, wrapped to stay a 64-bit seed; the
    # worker keys streams modulo 2**64, so the wrap changes no stream.
    p = SamplingParams(seed=SEED_MAX - 1, n=4)
    assert [child_params(p, i).seed for i in range(4)] == [SEED_MAX - 1, SEED_MAX, 0, 1]
    assert [child_params(SamplingParams(seed=-2, n=3), i).seed for i in range(3)] == \
        [SEED_MAX - 1, SEED_MAX, 0]


GOOD: list[tuple[dict[str, Any], dict[str, Any]]] = [
    # (arguments, the fields as stored: normalised types)
    (dict(top_k=INT64_MAX), dict(top_k=INT64_MAX)),
    (dict(top_k=np.int64(5)), dict(top_k=5)),
    (dict(seed=SEED_MIN), dict(seed=SEED_MIN)),
    (dict(seed=SEED_MAX), dict(seed=SEED_MAX)),
    (dict(temperature=1), dict(temperature=1.0)),
    (dict(temperature=MAX_TEMPERATURE), dict(temperature=MAX_TEMPERATURE)),
    (dict(temperature=np.float32(0.5)), dict(temperature=0.5)),
    (dict(stop="x"), dict(stop=["x"])),
    (dict(stop=("a", "b")), dict(stop=["a", "b"])),
    (dict(stop_token_ids=(3, np.int32(4))), dict(stop_token_ids=[3, 4])),
    (dict(logit_bias={"5": 1, 7: -2.5}), dict(logit_bias={5: 1.0, 7: -2.5})),
    (dict(max_tokens=INT64_MAX, min_tokens=3), dict(max_tokens=INT64_MAX, min_tokens=3)),
    (dict(bad_words=("héllo", "日本")), dict(bad_words=["héllo", "日本"])),
    (dict(repetition_penalty=1e-4), dict(repetition_penalty=1e-4)),
    (dict(structured_outputs={"json": {"type": "string", "maxLength": 2**63}}), {}),
]


@pytest.mark.parametrize("kw, stored", GOOD)
def test_edge_values_are_accepted_and_normalised(kw: dict[str, Any],
                                                 stored: dict[str, Any]) -> None:
    p = SamplingParams(**kw)
    for name, value in stored.items():
        got = getattr(p, name)
        assert got == value and type(got) is type(value), (name, got)


# ----- request bodies: strict types, and the error names the field ---------------------------
def body_error(model: type[BaseModel], body: bytes | dict[str, Any]) -> tuple[str | None, str]:
    """(param, message) of the 400 the server sends for ``body`` (JSON bytes are parsed by
    pydantic's JSON parser, as the server does; a dict is validated as Python objects)."""
    with pytest.raises(ValidationError) as e:
        if isinstance(body, bytes):
            model.model_validate_json(body)
        else:
            model.model_validate(body)
    err = _validation_error(RequestValidationError(e.value.errors(include_url=False)))
    assert err.status == 400
    return err.param, err.message


@pytest.mark.parametrize("body, param", [
    (b'{"prompt": "hi", "max_tokens": true}', "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 2.0}', "max_tokens"),
    (b'{"prompt": [true, false]}', "prompt"),
    (b'{"prompt": "hi", "bad_words": "word"}', "bad_words"),
    (b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hi", "temperature": "x"}', "temperature"),
    (b'{"prompt": "hi", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hi", "logit_bias": {"5": -Infinity}}', "logit_bias"),
    (b'{"prompt": "hi", "stop": 123}', "stop"),
    (b'{"prompt": "hi", "stop_token_ids": [true]}', "stop_token_ids"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": 1}}', "stream_options"),
    (b'{"prompt": "hi", "structured_outputs": 5}', "structured_outputs"),
    (b'{"prompt": "hi", "n": 1.0}', "n"),
    (b'{"prompt": "\\ud800"}', None),  # invalid JSON to pydantic's parser: no field yet
    (b'[1]', None),
])
def test_strict_body_types_name_the_field(body: bytes, param: str | None) -> None:
    got, message = body_error(CompletionRequest, body)
    assert got == param, message
    assert param is None or message.startswith(param)


def test_a_json_integer_is_a_valid_float() -> None:
    body = CompletionRequest.model_validate_json(b'{"prompt": "hi", "temperature": 1}')
    assert body.temperature == 1.0 and isinstance(body.temperature, float)


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, {"prompt": "a\ud800"}, "prompt"),
    (CompletionRequest, {"prompt": ["ok", "\udc00"]}, "prompt"),
    (CompletionRequest, {"prompt": "hi", "bad_words": ["\ud800"]}, "bad_words"),
    (CompletionRequest, {"prompt": "hi", "model": "\ud800"}, "model"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "\ud800"}]},
     "messages[0].content"),
    (ChatCompletionRequest,
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
])
def test_lone_surrogates_in_python_objects_name_the_field(
        model: type[BaseModel], body: dict[str, Any], param: str) -> None:
    got, message = body_error(model, body)
    assert got == param, message
    message.encode("utf-8")  # the error itself must be sendable


# ----- one schema across the process boundary ------------------------------------------------
def _non_default(name: str, hint: Any, default: Any) -> Any:
    """A value for a field that differs from its default, derived from its type."""
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = [a for a in typing.get_args(hint) if a is not type(None)] if union else [hint]
    candidates: list[Any] = []
    for t in args:
        origin = typing.get_origin(t) or t
        inner = typing.get_args(t)
        if t is bool:
            candidates.append(not default)
        elif t is int:
            candidates += [3, 2, 1, 7]
        elif t is float:
            candidates += [0.5, 0.25, 1.5]
        elif t is str:
            candidates.append("ab")
        elif origin is list and inner == (str,):
            candidates.append(["ab", "cd"])
        elif origin is list and inner == (int,):
            candidates.append([3, 4])
        elif origin is list and inner == (list[int],):
            candidates.append([[3, 4], [5]])
        elif origin is set:
            candidates.append({3, 9})
        elif origin is dict and inner == (int, float):
            candidates.append({3: 0.5, 7: -1.5})
        elif origin is dict and inner == (str, typing.Any):
            candidates.append({"kv_transfer_params": {"do_remote_decode": True}})
        elif t is StructuredOutputsParams:
            candidates.append(StructuredOutputsParams(regex="[a-z]+"))
    for value in candidates:
        if value == default:
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError:
            continue
        return value
    raise AssertionError(f"no non-default value for SamplingParams.{name}: {hint!r}; "
                         "teach _non_default its type")


def every_field_set() -> SamplingParams:
    """A SamplingParams whose every field (private ones too) differs from its default."""
    hints = typing.get_type_hints(SamplingParams)
    kw: dict[str, Any] = {}
    for f in fields(SamplingParams):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        kw[f.name] = _non_default(f.name, hints[f.name], default)
    p = SamplingParams(**kw)
    for f in fields(SamplingParams):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        assert getattr(p, f.name) != default, f.name
    return p


def test_sampling_params_cross_the_wire_with_every_field() -> None:
    p = every_field_set()
    raw = input_encoder.encode(AddRequest("r-1", [5, 6, 7], p, 12.5))
    msg = input_decoder.decode(raw)
    assert isinstance(msg, AddRequest) and isinstance(msg.params, SamplingParams)
    for f in fields(SamplingParams):
        assert getattr(msg.params, f.name) == getattr(p, f.name), f.name
    # The private fields travelled (9 is in no public field), not rebuilt on arrival.
    assert msg.params.all_stop_token_ids == {3, 4, 9}
    assert msg.params.bad_words_token_ids == [[3, 4], [5]]


def test_the_engines_eos_ids_cross_the_wire() -> None:
    p = SamplingParams(stop_token_ids=[7])
    p.update_from_model([2, 0])  # the frontend's processor does this before sending
    back = input_decoder.decode(input_encoder.encode(AddRequest("r", [1], p, 0.0))).params
    assert back.all_stop_token_ids == {0, 2, 7}


@pytest.mark.parametrize("kw", [
    dict(top_k=INT64_MAX, seed=SEED_MAX), dict(seed=SEED_MIN, top_k=-1),
    dict(logit_bias={INT64_MAX: -100.0}, stop_token_ids=[INT64_MAX]),
    dict(max_tokens=None, temperature=0),
])
def test_extreme_values_cross_the_wire(kw: dict[str, Any]) -> None:
    # top_k=2**63 used to overflow the hand-written mirror ("unpacking long long").
    p = SamplingParams(**kw)
    back = input_decoder.decode(input_encoder.encode(AddRequest("r", [1], p, 0.0))).params
    assert back == p


@pytest.mark.parametrize("so", [
    StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}}),
    StructuredOutputsParams(json='{"type": "string"}'),
    StructuredOutputsParams(regex=r"\d{3}"),
    StructuredOutputsParams(choice=["yes", "no"]),
    StructuredOutputsParams(grammar='root ::= "a"'),
    StructuredOutputsParams(json_object=True),
])
def test_structured_outputs_cross_the_wire(so: StructuredOutputsParams) -> None:
    p = SamplingParams(structured_outputs=so)
    back = input_decoder.decode(input_encoder.encode(AddRequest("r", [1], p, 0.0))).params
    assert back.structured_outputs == so and back.structured_outputs.kind == so.kind


def test_decoding_validates_again() -> None:
    # What the core accepts is what SamplingParams accepts, whoever built the bytes.
    good = msgspec.msgpack.decode(input_encoder.encode(AddRequest("r", [1], SamplingParams(),
                                                                  0.0)))
    params = good[3]
    for name, bad in [("temperature", float("nan")), ("top_k", 0), ("stop", [""])]:
        raw = msgspec.msgpack.encode([*good[:3], {**params, name: bad}, *good[4:]])
        with pytest.raises(msgspec.ValidationError, match=name):
            input_decoder.decode(raw)


def test_clone_is_equal_and_independent_on_every_field() -> None:
    p = every_field_set()
    q = p.clone()
    for f in fields(SamplingParams):
        a, b = getattr(p, f.name), getattr(q, f.name)
        assert a == b, f.name
        if isinstance(a, (list, dict, set)):
            assert a is not b, f.name


# ----- the tiny engine ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama with a word-level tokenizer ("w0z".."w319z")."""
    folder = tmp_path_factory.mktemp("tiny_validation")
    write_tiny_llama(folder, VOCAB, 2)
    return folder


@pytest.fixture(scope="module", params=["on", "off"])
def llm(request: pytest.FixtureRequest, tiny_dir: Path) -> Iterator[LLM]:
    # Few blocks, so that a leak of even one request's blocks shows.
    engine = LLM(model=str(tiny_dir), dtype="float32", seed=0, max_model_len=128,
                 block_size=4, num_gpu_blocks_override=96, async_scheduling=request.param)
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def run(llm: LLM, params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    return run(llm)


# ----- the processor names prompt -------------------------------------------------------------
@pytest.mark.parametrize("prompt, field", [
    ("w5z \ud800 w6z", "prompt"),
    ({"prompt": "\udc00"}, "prompt"),
    ({"prompt_token_ids": [True, False]}, "prompt"),
    ({"prompt_token_ids": "w5z"}, "prompt"),
    ({"prompt_token_ids": [5, 1.0]}, "prompt"),
    ({"prompt_token_ids": [5, -1]}, "prompt"),
    ({"prompt_token_ids": [5, VOCAB]}, "prompt"),
    ({"prompt_token_ids": [5, 2**64]}, "prompt"),
    ({"prompt_token_ids": [5], "prompt": "\ud800"}, "prompt"),
    ({"prompt": {"prompt": "w5z"}}, "prompt"),
    (5, "prompt"),
    ({"prompt_token_ids": []}, "prompt"),
])
def test_bad_prompt_raises_value_error_naming_prompt(llm: LLM, reference: list[list[int]],
                                                     prompt: Any, field: str) -> None:
    with pytest.raises(ValueError) as e:
        llm.generate([{"prompt_token_ids": PROMPTS[0]}, prompt], GREEDY, use_tqdm=False)
    assert str(e.value).startswith(field), str(e.value)
    assert_all_blocks_free(llm)


def test_chat_message_with_a_lone_surrogate_names_messages(llm: LLM) -> None:
    with pytest.raises(ValueError, match="^messages"):
        llm.chat([{"role": "user", "content": "hi \ud800"}], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("field", ["stop_token_ids", "allowed_token_ids", "logit_bias"])
def test_token_ids_beyond_the_vocabulary_name_their_field(llm: LLM, field: str) -> None:
    value: Any = {VOCAB: 1.0} if field == "logit_bias" else [VOCAB]
    with pytest.raises(ValueError, match=f"^{field}"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(**{field: value}),
                     use_tqdm=False)
    assert_all_blocks_free(llm)


def test_top_k_beyond_the_vocabulary_means_no_top_k(llm: LLM) -> None:
    seeded = dict(max_tokens=8, temperature=1.0, seed=SEED_MAX - 1, n=2)
    assert run(llm, SamplingParams(top_k=INT64_MAX, **seeded)) == \
        run(llm, SamplingParams(top_k=-1, **seeded))
    assert_all_blocks_free(llm)


def test_negative_and_huge_seeds_are_reproducible(llm: LLM) -> None:
    for seed in (SEED_MIN, -1, SEED_MAX):
        p = SamplingParams(max_tokens=8, temperature=1.0, seed=seed)
        assert run(llm, p) == run(llm, p)
    # The worker keys streams by the seed modulo 2**64: -1 and 2**64 - 1 are one stream.
    one = run(llm, SamplingParams(max_tokens=8, temperature=1.0, seed=-1))
    assert one == run(llm, SamplingParams(max_tokens=8, temperature=1.0, seed=SEED_MAX))


# ----- exceptions inside a step ---------------------------------------------------------------
class _Interrupt:
    """Wraps ``owner.name`` so that its k-th call raises ``exc`` (the rest run normally)."""

    def __init__(self, owner: Any, name: str, k: int, exc: BaseException,
                 on_result: bool = False) -> None:
        self.owner, self.name, self.k, self.exc, self.on_result = owner, name, k, exc, on_result
        self.calls = 0
        self.orig = getattr(owner, name)

    def __enter__(self) -> _Interrupt:
        setattr(self.owner, self.name, self)
        return self

    def __exit__(self, *_: Any) -> None:
        setattr(self.owner, self.name, self.orig)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.calls == self.k and not self.on_result:
            raise self.exc
        out = self.orig(*args, **kwargs)
        if self.calls == self.k:
            return _InterruptedWait(out, self.exc)
        return out


class _InterruptedWait:
    """A future whose first result() waits for the real result, then raises (Ctrl-C while
    the engine thread waits for a step); later calls return the result."""

    def __init__(self, inner: Any, exc: BaseException) -> None:
        self.inner, self.exc, self.raised = inner, exc, False

    def result(self, timeout: float | None = None) -> Any:
        out = self.inner.result(timeout)
        if not self.raised:
            self.raised = True
            raise self.exc
        return out

    def done(self) -> bool:
        return bool(self.inner.done())


# Where a step can be cut: on the engine thread (between schedule and execute_model,
# between execute_model and sample_tokens, while waiting for the output, in the scheduler)
# and on the worker thread (inside the forward, inside sampling).
POINTS: dict[str, Callable[[LLM], tuple[Any, str, bool]]] = {
    "before_execute": lambda llm: (llm.llm_engine.executor, "execute_model", False),
    "before_sample": lambda llm: (llm.llm_engine.executor, "sample_tokens", False),
    "waiting_for_output": lambda llm: (llm.llm_engine.executor, "sample_tokens", True),
    "schedule": lambda llm: (llm.llm_engine.scheduler, "schedule", False),
    "worker_forward": lambda llm: (llm.llm_engine.executor.runner, "execute_model", False),
    "worker_sample": lambda llm: (llm.llm_engine.executor.runner, "sample_tokens", False),
}


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("point", list(POINTS))
def test_keyboard_interrupt_anywhere_in_a_step_leaves_the_engine_whole(
        llm: LLM, reference: list[list[int]], point: str, k: int) -> None:
    owner, name, on_result = POINTS[point](llm)
    with _Interrupt(owner, name, k, KeyboardInterrupt(f"{point} #{k}"), on_result):
        with pytest.raises(KeyboardInterrupt, match=point):
            run(llm)
    assert_all_blocks_free(llm)
    assert run(llm) == reference
    assert_all_blocks_free(llm)


def test_a_failed_forward_reports_its_own_error(llm: LLM, reference: list[list[int]]) -> None:
    # Not "AssertionError: sample_tokens without execute_model".
    runner = llm.llm_engine.executor.runner
    with _Interrupt(runner, "execute_model", 2, RuntimeError("forward broke")):
        with pytest.raises(RuntimeError, match="forward broke"):
            run(llm)
    assert_all_blocks_free(llm)
    assert run(llm) == reference


def test_progress_bar_errors_abort_the_call_cleanly(llm: LLM, reference: list[list[int]],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    real = forerun.llm.tqdm

    class Broken(real):  # type: ignore[misc, valid-type]
        def update(self, n: float | None = 1) -> bool | None:
            raise OSError("terminal went away")

    monkeypatch.setattr(forerun.llm, "tqdm", Broken)
    with pytest.raises(OSError, match="terminal"):
        run(llm)
    assert_all_blocks_free(llm)

    def no_bar(*_: Any, **__: Any) -> Any:
        raise KeyboardInterrupt("while building the bar")

    monkeypatch.setattr(forerun.llm, "tqdm", no_bar)
    with pytest.raises(KeyboardInterrupt):
        run(llm)
    assert_all_blocks_free(llm)
    monkeypatch.setattr(forerun.llm, "tqdm", real)
    assert run(llm) == reference


@pytest.mark.parametrize("n", [1, 3])
def test_interrupt_while_queueing_leaves_nothing_queued(
        llm: LLM, reference: list[list[int]], n: int) -> None:
    # The third request's add is interrupted: the two before it must not run on.
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, n=n)
    with _Interrupt(llm.llm_engine, "add_request", 3, KeyboardInterrupt("queueing")):
        with pytest.raises(KeyboardInterrupt):
            run(llm, p)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_all_blocks_free(llm)
    assert run(llm) == reference


# ----- huge text prompts ----------------------------------------------------------------------
class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every text it encodes."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.encoded: list[int] = []

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.encoded.append(len(text))
        return self.inner.encode(text, **kwargs)


def test_a_huge_prompt_is_refused_after_tokenising_only_its_head(llm: LLM) -> None:
    real = llm.get_tokenizer()
    tok = _CountingTokenizer(real)
    max_len = 64
    processor = Processor(tok, max_len, VOCAB, [])
    huge = "w5z w6z " * 200_000  # 1.6 M characters
    with pytest.raises(ValueError, match="^prompt: the prompt is longer"):
        processor.process_prompt(huge)
    assert max(tok.encoded) <= 8 * max_len  # never the whole text
    # The oracle: tokenised whole, the prompt is indeed far over the limit.
    assert len(real.encode(huge[:100_000])) > max_len
    # Text that fits is tokenised whole and accepted, head check or not.
    fits = "w5z " * 10
    assert processor.process_prompt(fits).prompt_token_ids == real.encode(fits)
    # Truncation keeps the last tokens, so it needs the whole text tokenised.
    kept = processor.process_prompt(huge, truncate_prompt_tokens=8)
    assert kept.prompt_token_ids == real.encode(huge)[-8:]
