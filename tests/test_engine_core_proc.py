"""The engine-core process loop: what it does with input it cannot use."""

from __future__ import annotations

import asyncio
from typing import Any

from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM
from forerun.sampling_params import SamplingParams


def test_an_undecodable_request_fails_alone_and_the_core_lives_on(llm_cache: Any) -> None:
    cfg = EngineConfig(model=None, dtype="float32", num_gpu_blocks_override=64)

    async def run(engine: AsyncLLM) -> tuple[Any, Any]:
        bad = SamplingParams(max_tokens=2, temperature=0)
        # As if a field had slipped past validation: the core's typed decode rejects it.
        bad.top_k = "x"  # type: ignore[assignment]
        outs = [o async for o in engine.generate({"prompt_token_ids": [1, 2, 3]}, bad, "bad")]
        good = [o async for o in engine.generate(
            {"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, temperature=0),
            "good")]
        return outs[-1], good[-1]

    engine = AsyncLLM(cfg, engine_process=False)
    try:
        bad, good = asyncio.run(run(engine))
        assert bad.finished and bad.outputs[0].finish_reason == "error"
        assert bad.outputs[0].token_ids == []
        assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 2
        assert not engine.is_dead
    finally:
        engine.shutdown()
