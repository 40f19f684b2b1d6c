"""The ``forerun`` command line, run as a user would.

Each command that loads the model is a fresh interpreter that imports torch; the module
starts every selected test's command at once, when its first test runs, so that they run
side by side instead of one after another. The flag errors stop before any model loads, in
``forerun.cli.main`` (what ``python -m forerun.cli`` calls and exits with), so they run in
this process: a fresh interpreter for each would cost seconds of importing torch on a
2-core CI machine while proving nothing the commands that do start prove.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from forerun import SamplingParams
from tests.background_process import BackgroundRun

MISSING = Path(tempfile.gettempdir()) / "forerun-test-cli-missing-model" / "nope"
MODEL_ARGS = ("--dtype", "float32", "--kv-cache-memory-bytes", str(64 << 20),
              "--max-model-len", "1024")
DRAFTS_PROMPT = "Repeat after me: one two three four five six. Again: one two three"
# Each test's command line and standard input.
COMMANDS: dict[str, tuple[tuple[str, ...], str | None]] = {
    "test_generate_prints_the_same_greedy_text_as_the_offline_api": (
        ("generate", "The capital of France is", "--max-tokens", "10", *MODEL_ARGS), None),
    "test_chat_answers_each_line_and_ends_on_eof": (
        ("chat", "--max-tokens", "12", *MODEL_ARGS), "What is the capital of France?\n"),
    "test_generate_with_drafts_prints_the_same_greedy_text": (
        ("generate", DRAFTS_PROMPT, "--max-tokens", "16", *MODEL_ARGS,
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'), None),
}


class Run(BackgroundRun):
    """``python -m forerun.cli *args`` started now; :meth:`result` waits for it."""

    def __init__(self, args: tuple[str, ...], stdin: str | None, folder: Path) -> None:
        super().__init__([sys.executable, "-m", "forerun.cli", *args], stdin, folder)


@pytest.fixture(scope="module")
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> dict[str, Run]:
    """The selected tests' commands, all started together."""
    selected = {item.originalname for item in request.session.items
                if item.module is request.module}
    started = {name: Run(args, stdin, tmp_path_factory.mktemp("cli"))
               for name, (args, stdin) in COMMANDS.items() if name in selected}
    yield started
    for run in started.values():
        if run.proc.poll() is None:
            run.proc.kill()
            run.proc.wait()


def forerun(runs: dict[str, Run], request: pytest.FixtureRequest
            ) -> subprocess.CompletedProcess[str]:
    """The finished command of the calling test."""
    return runs[request.node.originalname].result()


def in_process(capsys: pytest.CaptureFixture[str], *args: str
               ) -> subprocess.CompletedProcess[str]:
    """``forerun *args`` through ``forerun.cli.main``: its exit status and output. An
    exception escaping ``main`` (a traceback in a real run) fails the test."""
    from forerun.cli import main

    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["forerun", *args], code, out, err)


def test_bad_sampling_flag_is_a_one_line_error_not_a_traceback(capsys):
    proc = in_process(capsys, "generate", "Hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_path_is_a_one_line_error(capsys):
    assert not MISSING.exists()
    proc = in_process(capsys, "generate", "Hi", "--model", str(MISSING))
    assert proc.returncode == 2
    assert str(MISSING) in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_generate_prints_the_same_greedy_text_as_the_offline_api(llm_cache, runs, request):
    prompt = "The capital of France is"
    expected = llm_cache().generate([prompt], SamplingParams(max_tokens=10, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    proc = forerun(runs, request)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"


@pytest.mark.slow
def test_chat_answers_each_line_and_ends_on_eof(llm_cache, runs, request):
    expected = llm_cache().chat([{"role": "user", "content": "What is the capital of France?"}],
                                SamplingParams(max_tokens=12, temperature=0),
                                use_tqdm=False)[0].outputs[0].text
    proc = forerun(runs, request)
    assert proc.returncode == 0, proc.stderr
    assert expected.strip() and expected in proc.stdout


def test_bad_speculative_config_is_a_one_line_error(capsys):
    proc = in_process(capsys, "generate", "Hi", "--speculative-config",
                      '{"method": "medusa", "num_speculative_tokens": 2}')
    assert proc.returncode == 2, proc.stderr
    assert "speculative_config.method" in proc.stderr and "Traceback" not in proc.stderr
    # Not even JSON: argparse's own usage error (exit 2), before any model loads.
    from forerun.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "Hi", "--speculative-config", '{"method"'])
    assert e.value.code == 2


@pytest.mark.slow
def test_generate_with_drafts_prints_the_same_greedy_text(llm_cache, runs, request):
    expected = llm_cache().generate([DRAFTS_PROMPT],
                                    SamplingParams(max_tokens=16, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    proc = forerun(runs, request)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == expected + "\n"
