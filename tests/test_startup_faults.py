"""Start-up faults of multi-process ranks (forerun/worker/multiproc_executor.py).

A tensor-parallel engine starts from a script on stdin, from ``python -c``, from IPython
(the interactive shell a notebook kernel runs) and from a script file without a
``__main__`` guard, giving the one-process engine's tokens. A rank killed while it waits at
the rendezvous, and one that raises while loading its weights, each end the engine's start
with an error naming the rank, within seconds, and leave no process (nor zombie) behind and
no process group in the parent; a worker node (``--node-rank 1``) whose rank dies at the
rendezvous exits with the same error.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from forerun import LLM, SamplingParams
from forerun.distributed.parallel_state import free_port
from forerun.worker.multiproc_executor import RankStartupError
from tests.background_process import BackgroundRun
from tests.server_harness import child_pids, forkserver_pids
from tests.test_tensor_parallel import rank_pids, worker_thread_setup
from tests.tiny_model import write_tiny_llama

REPO = Path(__file__).resolve().parents[1]
PROMPT = [5, 17, 250, 3, 99]
# A start-up fault must be an error within this (the issue's bound); the rank processes'
# own start (a fresh interpreter importing torch) is most of it on a loaded 2-core machine.
FAULT_BOUND_S = 30.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_startup")
    write_tiny_llama(folder, seed=7)  # 4 heads, 2 KV heads: splits two ways
    return folder


@pytest.fixture(scope="module")
def want(tiny_dir: Path) -> list[int]:
    """The one-process engine's greedy tokens for PROMPT."""
    one = LLM(**engine_kwargs(tiny_dir))
    try:
        return one.generate([{"prompt_token_ids": PROMPT}],
                            SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        one.shutdown()


def engine_kwargs(tiny_dir: Path) -> dict:
    return dict(model=str(tiny_dir), dtype="float32", max_model_len=128, block_size=4)


def leftover_children() -> list[int]:
    """Rank processes of this process still there, zombies included (a zombie has no
    command line, so :func:`rank_pids` would not see it)."""
    me = os.getpid()
    servers = set(forkserver_pids(me))  # every child of the fork server is a rank
    left = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        parent, zombie = int(fields[1]), fields[0] == "Z"
        if parent == me and (zombie or b"spawn_main" in cmdline) or parent in servers:
            left.append(int(entry))
    return left


def assert_nothing_left(before: tuple[set[int], int]) -> None:
    assert leftover_children() == []
    assert rank_pids() == []
    # Rank 0 left its group and gave back the shared worker thread's CPUs and threads.
    assert not dist.is_initialized()
    assert worker_thread_setup() == before


SCRIPT = """
import json
from forerun import LLM, SamplingParams
llm = LLM(tensor_parallel_size=2, **{kwargs})
out = llm.generate([{{"prompt_token_ids": {prompt}}}],
                   SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
print("TOKENS", json.dumps(out[0].outputs[0].token_ids))
llm.shutdown()
"""


class Script(BackgroundRun):
    """``cmd`` started now with ``stdin`` written to it, its output in files;
    :meth:`tokens` waits for it."""

    def __init__(self, cmd: list[str], stdin: str | None, folder: Path) -> None:
        super().__init__(cmd, stdin, folder, cwd=folder, env=script_env())

    def tokens(self, timeout: float) -> list[int]:
        """The token ids it printed after exiting 0."""
        done = self.result(timeout)
        assert done.returncode == 0, done.stderr[-4000:]
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("TOKENS ")]
        assert lines, done.stdout[-2000:] + done.stderr[-2000:]
        return json.loads(lines[-1].split(" ", 1)[1])


def script_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("FORERUN_RANK_FAULT", None)
    return env


def script_kinds(tiny_dir: Path, folder: Path) -> dict[str, tuple[list[str], str | None]]:
    """The kinds of ``__main__`` a two-rank engine starts from: command and stdin."""
    script = SCRIPT.format(kwargs=repr(engine_kwargs(tiny_dir)), prompt=PROMPT)
    path = folder / "no_guard.py"
    path.write_text(script)
    kinds: dict[str, tuple[list[str], str | None]] = {
        "stdin": ([sys.executable, "-"], script),
        "unguarded-file": ([sys.executable, str(path)], None),
    }
    if importlib.util.find_spec("IPython") is not None:
        kinds["ipython"] = ([sys.executable, "-m", "IPython", "--no-banner",
                             "--colors=NoColor", "-c", script], None)
    return kinds


@pytest.fixture(scope="module")
def scripts(tiny_dir: Path, request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Script]]:
    """The interpreters of the selected tests below, by kind of ``__main__`` (``core``: the
    engine-core script of the last), all started when the first of them runs: their
    imports overlap instead of queueing."""
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    folder = tmp_path_factory.mktemp("scripts")
    todo: dict[str, tuple[list[str], str | None]] = {}
    if "test_a_two_rank_engine_starts_from_any_kind_of_main" in selected:
        todo.update(script_kinds(tiny_dir, folder))
    if "test_the_engine_core_process_starts_from_a_script_on_stdin" in selected:
        todo["core"] = ([sys.executable, "-"],
                        CORE_SCRIPT.format(kwargs=repr(engine_kwargs(tiny_dir)), prompt=PROMPT))
    started = {}
    for how, (cmd, stdin) in todo.items():
        (folder / how).mkdir()
        started[how] = Script(cmd, stdin, folder / how)
    yield started
    for script in started.values():
        if script.proc.poll() is None:
            script.proc.kill()
        script.proc.wait()


def test_a_two_rank_engine_starts_from_any_kind_of_main(tiny_dir, want, scripts):
    """Spawned ranks never re-run the parent's ``__main__``: there is no file to re-run for
    stdin and IPython, and a file without a guard would start engines in its ranks. They
    run at once (their interpreters' imports overlap instead of queueing). ``python -c``
    is not among them: its ``__main__`` has no file, which spawn handles by itself."""
    kinds = [how for how in scripts if how != "core"]
    assert kinds[:2] == ["stdin", "unguarded-file"]
    for how in kinds:
        # Generous: eight interpreters importing torch on a shared 2-core machine. A rank
        # that could not start would fail the run within seconds (the tests below).
        assert scripts[how].tokens(timeout=400) == want, how


CORE_SCRIPT = """
import asyncio, json
from forerun import SamplingParams
from forerun.config import EngineConfig
from forerun.engine.async_llm import AsyncLLM

async def main():
    llm = AsyncLLM(EngineConfig(**{kwargs}), engine_process=True)
    try:
        async for out in llm.generate({{"prompt_token_ids": {prompt}}},
                                      SamplingParams(max_tokens=6, temperature=0.0,
                                                     ignore_eos=True), "r"):
            pass
        print("TOKENS", json.dumps(out.outputs[0].token_ids))
    finally:
        llm.shutdown()

asyncio.run(main())
"""


def test_the_engine_core_process_starts_from_a_script_on_stdin(tiny_dir, want, scripts):
    """``forerun serve``'s engine-core process is spawned the same way as the ranks (its
    script started beside the test above's)."""
    assert scripts["core"].tokens(timeout=400) == want


def test_a_rank_killed_at_the_rendezvous_ends_the_start_naming_it(tiny_dir):
    """Two nodes of two ranks each, the other node never coming: rank 1 (a process of this
    one) checks in at the rendezvous and waits; killed there, the engine's start fails at
    once (the rendezvous timeout is 10 minutes)."""
    before = worker_thread_setup()
    port = free_port()
    with ThreadPoolExecutor(1) as pool:
        start = pool.submit(LLM, tensor_parallel_size=2, pipeline_parallel_size=2, nnodes=2,
                            node_rank=0, master_port=port, **engine_kwargs(tiny_dir))
        # Watch the rendezvous from outside: ranks 0 and 1 checked in, 2 and 3 never will.
        store = dist.TCPStore("127.0.0.1", port, is_master=False,
                              timeout=timedelta(seconds=120))
        deadline = time.monotonic() + 120
        while store.add("forerun/rendezvous/joined", 0) < 2:
            assert time.monotonic() < deadline and not start.done()
            time.sleep(0.05)
        del store
        (pid,) = rank_pids()
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        with pytest.raises(RankStartupError) as err:
            start.result(timeout=FAULT_BOUND_S)
        took = time.monotonic() - killed
    assert took < 5, took  # seen at the next poll, not at a timeout
    assert str(err.value).startswith(
        f"rank 1 (pid {pid}) exited with code -9 (killed by SIGKILL) during start-up "
        "(rendezvous)")
    assert_nothing_left(before)


def test_a_rank_that_raises_while_loading_its_weights_ends_the_start_with_its_traceback(
        tiny_dir, monkeypatch):
    before = worker_thread_setup()
    monkeypatch.setenv("FORERUN_RANK_FAULT", "1:load")  # the rank processes inherit it
    start = time.monotonic()
    with pytest.raises(RankStartupError) as err:
        LLM(tensor_parallel_size=2, **engine_kwargs(tiny_dir))
    assert time.monotonic() - start < FAULT_BOUND_S
    message = str(err.value)
    assert message.startswith("rank 1 (pid "), message
    assert (") exited with code 1 during start-up (loading weights): RuntimeError: rank 1: "
            "injected fault while loading its weights") in message
    assert "--- rank 1's traceback ---\nTraceback (most recent call last):" in message
    assert_nothing_left(before)
    # The next engine of this process starts and runs (rank 0 left no group behind).
    monkeypatch.delenv("FORERUN_RANK_FAULT")
    llm = LLM(tensor_parallel_size=2, **engine_kwargs(tiny_dir))
    try:
        out = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.shutdown()
    assert rank_pids() == []


def test_a_worker_node_whose_rank_dies_at_the_rendezvous_exits_with_the_error(tiny_dir):
    """``forerun serve --node-rank 1`` with no node 0: its rank waits at the rendezvous;
    killed there, the node process exits 1 at once, saying which rank died and how."""
    node1 = subprocess.Popen(
        [sys.executable, "-m", "forerun.cli", "serve", "--model", str(tiny_dir),
         "--dtype", "float32", "--max-model-len", "128", "--tensor-parallel-size", "2",
         "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
         "--master-port", str(free_port())],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        rank: list[int] = []
        while not rank:
            assert time.monotonic() < deadline and node1.poll() is None
            time.sleep(0.1)
            rank = [pid for pid in child_pids(node1.pid) if _is_rank(pid)]
        time.sleep(1.0)  # well into its start (the rendezvous never completes)
        os.kill(rank[0], signal.SIGKILL)
        code = node1.wait(FAULT_BOUND_S)
        out = node1.stdout.read() if node1.stdout else ""
        assert code == 1, out[-3000:]
        assert f"rank 1 (pid {rank[0]}) exited with code -9 (killed by SIGKILL) during " \
               "start-up" in out, out[-3000:]
    finally:
        if node1.poll() is None:
            os.killpg(node1.pid, signal.SIGKILL)
            node1.wait(10)


def _is_rank(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()
    except OSError:
        return False


def test_a_bad_fault_switch_is_refused(monkeypatch):
    from forerun import envs
    monkeypatch.delenv("FORERUN_RANK_FAULT", raising=False)
    assert envs.rank_fault() is None
    monkeypatch.setenv("FORERUN_RANK_FAULT", "1:load")
    assert envs.rank_fault() == (1, "load")
    for bad in ("one:load", "1:later", "1"):
        monkeypatch.setenv("FORERUN_RANK_FAULT", bad)
        with pytest.raises(ValueError, match="FORERUN_RANK_FAULT"):
            envs.rank_fault()


def test_the_start_method_switch_takes_spawn_or_forkserver_and_refuses_others(monkeypatch):
    from forerun import envs, spawn
    monkeypatch.delenv("FORERUN_WORKER_MULTIPROC_METHOD", raising=False)
    assert envs.worker_multiproc_method() == "spawn"
    monkeypatch.setenv("FORERUN_WORKER_MULTIPROC_METHOD", "forkserver")
    assert envs.worker_multiproc_method() == "forkserver"
    monkeypatch.setenv("FORERUN_WORKER_MULTIPROC_METHOD", "fork")  # unsafe here: refused
    with pytest.raises(ValueError, match="FORERUN_WORKER_MULTIPROC_METHOD"):
        envs.worker_multiproc_method()
    with pytest.raises(ValueError, match="spawn or forkserver"):
        spawn.set_start_method("fork")
