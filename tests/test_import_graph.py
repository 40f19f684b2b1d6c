"""The layers' import arrows point down: entry points -> engine -> worker -> core / model.

Read from the source (every ``import``, at module level or inside a function), so that a
lazy import that points the wrong way counts too; and checked in a fresh interpreter for
what the API process actually loads.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "forerun"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every forerun module ``path`` imports, wherever the statement sits."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return {m for m in out if m == "forerun" or m.startswith("forerun.")}


GRAPH = {_module_name(p): _imports(p) for p in PACKAGE.rglob("*.py")}


def _arrows(src_prefixes: tuple[str, ...], dst_prefixes: tuple[str, ...]) -> list[str]:
    return sorted(f"{src} -> {dst}" for src, dsts in GRAPH.items()
                  if src.startswith(src_prefixes) for dst in dsts
                  if dst.startswith(dst_prefixes))


def test_worker_and_model_never_import_the_engine_or_the_server() -> None:
    assert _arrows(("forerun.worker", "forerun.model"),
                   ("forerun.engine", "forerun.server", "forerun.llm")) == []


def test_core_imports_neither_the_engine_nor_the_worker() -> None:
    assert _arrows(("forerun.core",), ("forerun.engine", "forerun.worker",
                                       "forerun.server")) == []


@pytest.mark.parametrize("module", ["forerun.request", "forerun.sampling_params",
                                    "forerun.structured_params", "forerun.pooling_params"])
def test_value_types_import_no_feature_package(module: str) -> None:
    # pooling_params is a value type too (PoolingParams beside SamplingParams).
    allowed = {"forerun.sampling_params", "forerun.structured_params",
               "forerun.pooling_params"}
    assert {m for m in GRAPH[module] if not m.startswith(tuple(allowed))} == set()


def test_the_api_process_loads_no_builder_worker_or_model_code() -> None:
    probe = ("import sys, forerun.server.cli_serve, forerun.server.api\n"
             "print(' '.join(sorted(m for m in sys.modules if m.startswith("
             "('forerun.engine.builder', 'forerun.worker.model_runner', 'forerun.model.llama',"
             " 'forerun.model.loader')))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == []
