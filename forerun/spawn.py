"""Starting forerun's own processes (engine core, ranks) from any ``__main__``: a script
file, ``python -``, ``python -c`` or a notebook; and their watch on the parent.

Two start methods (``FORERUN_WORKER_MULTIPROC_METHOD``): ``spawn``, a fresh interpreter per
process, and ``forkserver``, a fork of one server process that imported torch and forerun
once (a process that starts many engines, such as a notebook or a test session, then pays
those imports once instead of a few seconds per process). Neither forks the caller itself,
which may already run the engine's threads and an OpenMP pool.

Spawn re-runs the parent's ``__main__`` in each child (from its file, or as its module). That
breaks a script read from stdin (the child looks for a file named ``<stdin>`` and dies at
once) and re-runs the top level of a script without an ``if __name__ == "__main__"`` guard.
forerun's children need nothing from ``__main__`` (their function and arguments all come
from forerun), so the parent hides it while a child starts.

A fork server's children inherit the environment the server had when it started, not the
caller's of the moment; so every child is given the caller's environment as it is at
``start``. And a fork server's child is not the caller's child: the parent-death check is
multiprocessing's parent sentinel (a pipe the parent holds open), not ``os.getppid()``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.process import BaseProcess
from typing import Any

from forerun import envs

# Serialises the swaps of sys.modules["__main__"] (engines may start from several threads).
_main_lock = threading.Lock()

# This process's start method when set by set_start_method (else the environment's).
_method: str | None = None

# What a fork server imports before it forks: what every forerun child imports anyway.
_FORKSERVER_PRELOAD = ["torch", "forerun.engine.core_proc", "forerun.worker.multiproc_executor"]


@contextmanager
def main_hidden() -> Iterator[None]:
    """While a child process starts, ``__main__`` is a bare module: multiprocessing's spawn
    then tells the child not to re-run the parent's main script or module. Hold it only for
    ``Process.start`` (pickling the arguments, starting the interpreter): a few
    milliseconds."""
    with _main_lock:
        main = sys.modules.get("__main__")
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            yield
        finally:
            if main is not None:
                sys.modules["__main__"] = main
            else:
                del sys.modules["__main__"]


def set_start_method(method: str | None) -> None:
    """Use ``method`` (``spawn`` or ``forkserver``) for the processes this process starts,
    whatever ``FORERUN_WORKER_MULTIPROC_METHOD`` says; ``None``: the environment's again.
    Not inherited by child processes."""
    global _method
    if method not in (None, "spawn", "forkserver"):
        raise ValueError(f"start method must be spawn or forkserver, got {method!r}")
    _method = method


def _context() -> multiprocessing.context.BaseContext:
    method = _method or envs.worker_multiproc_method()
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_FORKSERVER_PRELOAD)
    return ctx


def _run_in_environ(environ: dict[str, str], target: Callable[..., None],
                    args: tuple[Any, ...]) -> None:
    os.environ.clear()
    os.environ.update(environ)
    target(*args)


def start_process(target: Callable[..., None], args: tuple[Any, ...], name: str,
                  daemon: bool) -> BaseProcess:
    """Start ``target(*args)`` in a child process by the configured method, with this
    process's environment of now."""
    proc = _context().Process(target=_run_in_environ, name=name, daemon=daemon,
                              args=(dict(os.environ), target, args))
    with main_hidden():
        proc.start()
    return proc


def parent_alive() -> bool:
    """False once the process that started this one (by :func:`start_process`) has exited;
    True in a process that was not started that way."""
    parent = multiprocessing.parent_process()
    return parent is None or parent.is_alive()


def exit_with_parent() -> None:
    """Block until the parent exits, then end this process at once (run on a daemon
    thread)."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return
    multiprocessing.connection.wait([parent.sentinel])
    os._exit(1)
