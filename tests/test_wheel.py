"""forerun as a wheel, installed as a user would (``pip install forerun-*.whl``, not ``-e``).

The wheel is built from this checkout and installed into a fresh virtual environment
(which sees this interpreter's packages, so that torch and the rest are not installed
again). Run from an empty folder with an empty kernel cache, the installed copy must compile
every C kernel file from the sources the wheel ships; with the user's cache, it must print
the same greedy text as the checkout does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from forerun import SamplingParams
from tests.background_process import BackgroundRun

ROOT = Path(__file__).resolve().parents[1]
GENERATE = ["generate", "The capital of France is", "--max-tokens", "10", "--dtype", "float32",
            "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "512"]
# Prints where forerun was imported from, whether the kernel library built, and the names
# of the kernel files it compiled (from the installed package's csrc/).
PROBE = """
import forerun, logging
from forerun.model import cpu_kernels
lib = cpu_kernels.kernel_library()
print(forerun.__file__)
print("kernels", lib is not None)
print(" ".join(sorted(p.name for p in cpu_kernels._SOURCES)))
"""


def _run(cmd: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (cmd, out.stdout[-2000:], out.stderr[-4000:])
    return out


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """(the venv's python, an environment with an empty forerun cache) with the wheel in."""
    tmp = tmp_path_factory.mktemp("wheel")
    env = {**os.environ, "FORERUN_CACHE_DIR": str(tmp / "cache"), "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)
    # No build isolation: setuptools is already here, and CI needs no download for it.
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(tmp / "dist"), str(ROOT)], tmp, env)
    [wheel] = (tmp / "dist").glob("forerun-*.whl")
    venv.create(tmp / "venv", system_site_packages=True, with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
          str(wheel)], tmp, env)
    return python, env


class Started(BackgroundRun):
    """A command of the installed wheel, started now from ``cwd``; :meth:`result` waits for
    it and asserts it exited 0."""

    def __init__(self, cmd: list[str], cwd: Path, env: dict[str, str]) -> None:
        super().__init__(cmd, None, cwd, cwd=cwd, env=env)

    def result(self, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        done = super().result(timeout)
        assert done.returncode == 0, (self.args, done.stdout[-2000:], done.stderr[-4000:])
        return done


@pytest.fixture(scope="module")
def runs(installed: tuple[Path, dict[str, str]], request: pytest.FixtureRequest,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Started]]:
    """The selected tests' commands of the installed wheel, all started together, each from
    its own empty folder: the empty cache's compile (gcc on every core for a while) and the
    generate run (a torch import and a model load, one core) overlap instead of queueing.
    The generate run reads the user's own cache (the checkout's converted model and
    kernels, keyed by the GGUF file and the kernel sources), not the empty one."""
    python, env = installed
    user_env = {**env, "FORERUN_CACHE_DIR": os.environ.get("FORERUN_CACHE_DIR", "")}
    if not user_env["FORERUN_CACHE_DIR"]:
        del user_env["FORERUN_CACHE_DIR"]
    commands = {
        "test_the_wheel_compiles_every_kernel_file_it_ships": ([str(python), "-c", PROBE], env),
        "test_the_wheel_generates_the_same_text_as_the_checkout": (
            [str(python), "-m", "forerun.cli", *GENERATE], user_env),
    }
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    started = {name: Started(cmd, tmp_path_factory.mktemp("run"), cmd_env)
               for name, (cmd, cmd_env) in commands.items() if name in selected}
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def test_the_wheel_compiles_every_kernel_file_it_ships(
        installed: tuple[Path, dict[str, str]], runs: dict[str, Started],
        request: pytest.FixtureRequest) -> None:
    python, env = installed
    out = runs[request.node.originalname].result().stdout.splitlines()
    site = Path(out[0]).resolve()
    assert ROOT not in site.parents, f"imported the checkout, not the wheel: {site}"
    assert out[1] == "kernels True", out
    shipped = sorted(p.name for p in (ROOT / "forerun" / "model" / "csrc").glob("*.c"))
    assert out[2].split() == shipped
    compiled = list(Path(env["FORERUN_CACHE_DIR"]).rglob("*.so"))
    assert compiled, "no kernel library was compiled into the empty cache"


def test_the_wheel_ships_the_web_page(installed: tuple[Path, dict[str, str]],
                                      tmp_path: Path) -> None:
    python, env = installed
    where = ("import importlib.util; "
             "print(importlib.util.find_spec('forerun').submodule_search_locations[0])")
    site = Path(_run([str(python), "-c", where], tmp_path, env).stdout.strip())
    assert ROOT not in site.resolve().parents
    static = ROOT / "forerun" / "server" / "static"
    names = sorted(p.name for p in static.iterdir())
    assert names == ["app.js", "index.html", "style.css"]
    for name in names:
        assert (site / "server" / "static" / name).read_bytes() == (static / name).read_bytes()


@pytest.mark.slow
def test_the_wheel_generates_the_same_text_as_the_checkout(
        runs: dict[str, Started], request: pytest.FixtureRequest, llm_cache: Any) -> None:
    """The checkout's text from the session's in-process engine (float32, greedy: the same
    tokens as the checkout's CLI, which tests/test_cli.py pins to it). The wheel's run
    uses the user's own cache: the empty cache's compile is the test above's."""
    wheel = runs[request.node.originalname].result()
    checkout = llm_cache().generate([GENERATE[1]], SamplingParams(max_tokens=10, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    assert checkout.strip() and wheel.stdout == checkout + "\n"
