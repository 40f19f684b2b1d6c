"""Start real ``forerun serve`` subprocesses for the server tests, once per test session.

Servers are cached by their arguments so test_server.py and test_bench_serve.py share one;
each runs in its own process group, which is killed at interpreter exit, and (on Linux) gets
SIGTERM when the test process dies without one (a killed pytest).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass

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


_servers: dict[tuple[object, ...], ServerHandle] = {}
# The servers' logs live while this process does (a failing test quotes their tails);
# removed at exit so that a session leaves no files behind.
_LOGS = tempfile.TemporaryDirectory(prefix="forerun-test-servers-")
_fresh: list[ServerHandle] = []


def _die_with_parent(parent: int) -> None:
    """Run in the child before exec: SIGTERM when the test process dies (PR_SET_PDEATHSIG),
    so a killed pytest leaves no server behind; exit at once if it is already gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


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
    key = (*extra, *sorted((env or {}).items()))
    if not fresh and key in _servers and _servers[key].proc.poll() is None:
        return _servers[key]
    port = free_port()
    log_path = os.path.join(_LOGS.name, f"server-{port}.log")
    log = open(log_path, "wb")  # noqa: SIM115 - the child keeps writing to it
    proc = subprocess.Popen(
        [sys.executable, "-m", "forerun.cli", "serve", "--host", "127.0.0.1",
         "--port", str(port), *BASE_ARGS, *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=lambda parent=os.getpid(): _die_with_parent(parent),
        env={**os.environ, **(env or {})})
    handle = ServerHandle(proc, f"http://127.0.0.1:{port}", log_path)
    if fresh:
        _fresh.append(handle)
    else:
        _servers[key] = handle
    return handle


@dataclass(frozen=True, slots=True)
class ServerArgs:
    """One cached server's arguments, declared once and started with :meth:`start` by every
    fixture that uses it."""

    extra: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def start(self) -> ServerHandle:
        return start_server(*self.extra, env=dict(self.env) or None)


DEFAULT = ServerArgs()  # the session's shared default server


def engine_pid(server_pid: int) -> int:
    """The pid of the engine-core process a server started."""
    for pid in started_pids(server_pid):
        return pid
    raise AssertionError("no engine core process found")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def started_pids(parent: int) -> list[int]:
    """Live processes ``parent`` started through forerun.spawn (engine cores, ranks): its
    spawned children, and the children of its fork server."""
    found = []
    for pid in child_pids(parent):
        cmdline = _cmdline(pid)
        if b"spawn_main" in cmdline:
            found.append(pid)
        elif b"multiprocessing.forkserver" in cmdline:
            found.extend(child_pids(pid))
    return found


def forkserver_pids(parent: int) -> list[int]:
    """``parent``'s fork server, if it started one."""
    return [pid for pid in child_pids(parent)
            if b"multiprocessing.forkserver" in _cmdline(pid)]


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
