"""A command started now, its output in files, waited for later: the tests that start
several interpreters together (each importing torch for seconds) and read them one by one."""

from __future__ import annotations

import subprocess
from pathlib import Path


class BackgroundRun:
    """``cmd`` started now with ``stdin`` written to it, stdout and stderr in ``folder``;
    :meth:`result` waits for it."""

    def __init__(self, cmd: list[str], stdin: str | None, folder: Path,
                 cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.args = cmd
        self.out = (folder / "stdout").open("w+", encoding="utf-8")
        self.err = (folder / "stderr").open("w+", encoding="utf-8")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=self.out,
                                     stderr=self.err, text=True, cwd=cwd, env=env)
        assert self.proc.stdin is not None
        self.proc.stdin.write(stdin or "")
        self.proc.stdin.close()

    def result(self, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """Its exit status and output, once it exits (killed after ``timeout`` seconds)."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        texts = []
        for f in (self.out, self.err):
            f.seek(0)
            texts.append(f.read())
            f.close()
        return subprocess.CompletedProcess(self.args, self.proc.returncode, *texts)
