"""The seed's Go program, replayed through the real AsyncScheduler and EngineCore.

The expected traces in tests/data are what the seed's program printed (the oracle).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from forerun.core.async_scheduler import AsyncScheduler
from forerun.core.kv_cache_manager import KVCacheManager
from forerun.core.scheduler import SchedulerConfig
from forerun.engine.core import EngineCore
from forerun.request import Request
from forerun.sampling_params import SamplingParams
from tests.fake_executor import EOS, FakeExecutor

DATA = Path(__file__).parent / "data"


def run_case(max_tokens: int, eos_at: int, depth: int) -> tuple[list[str], int]:
    """Drive one 6-token request with budget 4; return the trace lines and wasted passes."""
    config = SchedulerConfig(max_num_batched_tokens=4, max_num_seqs=4, max_model_len=64,
                             defer_block_free=depth > 1)
    scheduler = AsyncScheduler(config, KVCacheManager(num_blocks=16, block_size=4))
    executor = FakeExecutor(eos_at={"r": eos_at} if eos_at else {})
    engine = EngineCore(scheduler, executor, max_concurrent_batches=depth)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    params.update_from_model([EOS])
    req = Request("r", list(range(10, 16)), params)
    engine.add_request(req)

    lines: list[str] = []
    labels: dict[int, int] = {}  # step_id -> the seed's step number
    orig_schedule, orig_update = scheduler.schedule, scheduler.update_from_output

    def schedule():
        so = orig_schedule()
        n = so.num_scheduled_tokens.get("r", 0)
        if n:
            labels[so.step_id] = scheduler.sched_step_seq
            lines.append(
                f"  schedule step {labels[so.step_id]}: {n} token(s)  -> computed="
                f"{req.num_computed_tokens} known={req.num_tokens} "
                f"placeholders={req.num_output_placeholders}")
        return so

    def update(so, out):
        was_finished = req.is_finished()
        outputs = orig_update(so, out)
        if "r" not in so.num_scheduled_tokens:
            return outputs
        step = labels[so.step_id]
        ids = out.sampled_token_ids[out.req_id_to_index["r"]]
        if was_finished:
            lines.append(f"  output   step {step}: request already finished, result discarded")
        elif ids:
            what = f"token {req.num_output_tokens}"
            if req.get_finished_reason() == "stop":
                what += " = EOS, finished (stop)"
            elif req.get_finished_reason() == "length":
                what += ", finished (length)"
            lines.append(f"  output   step {step}: {what}  -> known={req.num_tokens} "
                         f"placeholders={req.num_output_placeholders}")
        else:
            lines.append(f"  output   step {step}: prefill chunk, nothing sampled")
        return outputs

    scheduler.schedule, scheduler.update_from_output = schedule, update
    while engine.has_work():
        engine.run_step()
    assert not scheduler.requests and scheduler.kv_cache_manager.num_free_blocks == 16
    return lines, scheduler.counters.wasted_tokens


def oracle_cases(name: str) -> dict[str, tuple[list[str], int]]:
    """Split an oracle file into its cases: trace lines and wasted count per case."""
    cases: dict[str, tuple[list[str], int]] = {}
    title, lines = "", []
    for line in (DATA / name).read_text().splitlines():
        if line.startswith("Case"):
            title, lines = line.split(":")[0], []
        elif "wasted forward passes" in line:
            cases[title] = (lines, int(line.rsplit(" ", 1)[1]))
        elif line.strip():
            lines.append(line)
    return cases


@pytest.mark.parametrize("case,max_tokens,eos_at", [("Case 1", 3, 0), ("Case 2", 8, 2)])
def test_depth2_reproduces_seed_trace_event_by_event(case, max_tokens, eos_at):
    expected_lines, expected_wasted = oracle_cases("seed_depth2.txt")[case]
    lines, wasted = run_case(max_tokens, eos_at, depth=2)
    assert lines == expected_lines
    assert wasted == expected_wasted


def test_depth2_eos_as_first_token_wastes_one_pass():
    expected_lines, expected_wasted = oracle_cases("seed_depth2_eos_first.txt")["Case 2"]
    lines, wasted = run_case(8, 1, depth=2)
    assert lines == expected_lines
    assert wasted == expected_wasted == 1


def test_depth3_eos_finish_wastes_two_passes_like_seed():
    expected_lines, expected_wasted = oracle_cases("seed_depth3.txt")["Case 2"]
    lines, wasted = run_case(8, 2, depth=3)
    assert lines == expected_lines
    assert wasted == expected_wasted == 2


def test_depth3_length_finish_wastes_nothing_unlike_seed_guard():
    # The seed's guard looks one step ahead, so at depth 3 it lets step 5 through. The
    # generalised guard (outputs + placeholders >= max_tokens) must not: the trace is the
    # seed's minus step 5, with the placeholder step 5 added gone from every later line.
    expected_lines, expected_wasted = oracle_cases("seed_depth3.txt")["Case 1"]
    assert expected_wasted == 1
    expected: list[str] = []
    after_step5 = False
    for line in expected_lines:
        if "step 5" in line:
            after_step5 = True
            continue
        if after_step5:
            head, p = line.rsplit("placeholders=", 1)
            line = f"{head}placeholders={int(p) - 1}"
        expected.append(line)
    lines, wasted = run_case(3, 0, depth=3)
    assert lines == expected
    assert wasted == 0
