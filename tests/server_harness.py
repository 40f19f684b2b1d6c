"""Start real ``forerun serve`` subprocesses for the server tests, once per test session.

Servers are cached by their arguments so test_server.py and test_bench_serve.py share one;
each runs in its own process group, which is killed at interpreter exit.

A server takes seconds to load, so it is started ahead of need: a module lists the servers
its fixtures start in ``SERVERS`` (:class:`ServerSpec`); after collection conftest.py hands
:func:`plan_servers` those lists, in the order the modules run; and when a module in that
plan runs its first test, :func:`prestart_for` starts its own servers and the next module's,
which then load while this module's tests run (mostly waiting on their server). A module
whose tests are timing-sensitive sets ``PRESTART_NEXT = False``. The fixtures start (or
reuse, or for ``fresh`` ones claim) the servers with :func:`start_server` as before.
"""

from __future__ import annotations

import atexit
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import NamedTuple

from forerun.bench.serve import wait_until_healthy

MODEL = "SmolLM2-135M-Instruct"
BASE_ARGS = ["--dtype", "float32", "--kv-cache-memory-bytes", str(256 << 20),
             "--max-model-len", "2048"]


@dataclass(slots=True)
class ServerHandle:
    """A running server: its process and base URL."""

    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: str

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        try:
            wait_until_healthy(self.base_url, self.proc.poll, timeout_s, poll_s=0.3)
        except (RuntimeError, TimeoutError) as exc:
            raise type(exc)(f"{exc}:\n{self.log()}") from None

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(20)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # anything left in the group
        except ProcessLookupError:
            pass


class ServerSpec(NamedTuple):
    """The arguments of one :func:`start_server` call."""

    extra: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    fresh: bool = False


_servers: dict[tuple[object, ...], ServerHandle] = {}
_fresh: list[ServerHandle] = []
_spares: dict[tuple[object, ...], list[ServerHandle]] = {}  # fresh ones started ahead
# (module name, its servers, whether the next module's may load during its tests)
_plan: list[tuple[str, list[ServerSpec], bool]] = []
_prestarted: set[str] = set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*extra: str, env: dict[str, str] | None = None,
                 fresh: bool = False) -> ServerHandle:
    """Start (or reuse) a server with ``extra`` arguments; does not wait for health.

    ``fresh`` always starts a new one (for tests that kill or stop it); ``env`` adds
    environment variables.
    """
    key = _key(extra, env)
    if not fresh and key in _servers and _servers[key].proc.poll() is None:
        return _servers[key]
    if fresh:
        spares = _spares.get(key, [])
        while spares:
            handle = spares.pop(0)
            if handle.proc.poll() is None:
                return handle
    handle = _launch(extra, env)
    if fresh:
        _fresh.append(handle)
    else:
        _servers[key] = handle
    return handle


def _key(extra: tuple[str, ...], env: dict[str, str] | None) -> tuple[object, ...]:
    return (*extra, *sorted((env or {}).items()))


def _launch(extra: tuple[str, ...], env: dict[str, str] | None) -> ServerHandle:
    port = free_port()
    log_path = f"/tmp/forerun-test-server-{port}.log"
    log = open(log_path, "wb")  # noqa: SIM115 - the child keeps writing to it
    proc = subprocess.Popen(
        [sys.executable, "-m", "forerun.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), *BASE_ARGS, *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **(env or {})})
    return ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)


def plan_servers(plan: list[tuple[str, list[ServerSpec], bool]]) -> None:
    """The session's server modules in the order they will run: (module name, the
    servers its fixtures start, whether the next module's may load during its tests)."""
    _plan[:] = plan
    _prestarted.clear()


def prestart_for(module: str) -> None:
    """``module`` is about to run its first test: start its servers, and the next planned
    module's unless it opted out (no-op for modules not in the plan, and after the first)."""
    names = [name for name, _, _ in _plan]
    if module not in names or module in _prestarted:
        return
    _prestarted.add(module)
    i = names.index(module)
    groups = [_plan[i][1]]
    if _plan[i][2] and i + 1 < len(_plan):
        groups.append(_plan[i + 1][1])
    for group in groups:
        needed: dict[tuple[object, ...], int] = {}
        for spec in group:
            key = _key(spec.extra, spec.env)
            if not spec.fresh:
                if not (key in _servers and _servers[key].proc.poll() is None):
                    _servers[key] = _launch(spec.extra, spec.env)
                continue
            needed[key] = needed.get(key, 0) + 1
            spares = _spares.setdefault(key, [])
            if len([h for h in spares if h.proc.poll() is None]) < needed[key]:
                handle = _launch(spec.extra, spec.env)
                _fresh.append(handle)  # stopped at exit if never claimed
                spares.append(handle)


def engine_pid(server_pid: int) -> int:
    """The pid of the engine-core process a server spawned."""
    for pid in child_pids(server_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return pid
    raise AssertionError("no engine core process found")


def child_pids(parent: int) -> list[int]:
    """Live processes whose parent is ``parent``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == parent and fields[0] != "Z":
            found.append(int(entry))
    return found


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@atexit.register
def _stop_all() -> None:
    for handle in [*_servers.values(), *_fresh]:
        handle.stop()
