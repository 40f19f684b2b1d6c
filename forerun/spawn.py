"""Starting forerun's own processes (engine core, ranks) with multiprocessing's spawn from
any ``__main__``: a script file, ``python -``, ``python -c`` or a notebook.

Spawn re-runs the parent's ``__main__`` in each child (from its file, or as its module). That
breaks a script read from stdin (the child looks for a file named ``<stdin>`` and dies at
once) and re-runs the top level of a script without an ``if __name__ == "__main__"`` guard.
forerun's children need nothing from ``__main__`` (their function and arguments all come
from forerun), so the parent hides it while a child starts.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager

# Serialises the swaps of sys.modules["__main__"] (engines may start from several threads).
_main_lock = threading.Lock()


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
