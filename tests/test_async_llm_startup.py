"""The serving frontend (AsyncLLM) validates requests against the engine core's limits."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM
from forerun.model.info import num_kv_blocks, resolve_model_info


def test_frontend_adopts_the_max_model_len_the_core_lowered(llm_cache: Any) -> None:
    # 20 blocks of 16 hold 320 tokens, far below SmolLM2's 8192: the core lowers the limit.
    cfg = EngineConfig(model=None, dtype="float32", num_gpu_blocks_override=20)
    info = resolve_model_info(cfg)
    cache_tokens = num_kv_blocks(cfg, info, torch.float32, torch.device("cpu")) * cfg.block_size
    assert cache_tokens == 320 < info.max_model_len
    engine = AsyncLLM(cfg, engine_process=False)
    try:
        assert engine.max_model_len == cache_tokens
        # A prompt must leave room for at least one generated token.
        engine.processor.process_prompt({"prompt_token_ids": [5] * (cache_tokens - 1)})
        with pytest.raises(ValueError, match="320"):
            engine.processor.process_prompt({"prompt_token_ids": [5] * cache_tokens})
    finally:
        engine.shutdown()
