"""The ``forerun`` command line, run as a user would."""

from __future__ import annotations

import subprocess
import sys

import pytest

from forerun import SamplingParams


def forerun(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "forerun.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_bad_sampling_flag_is_a_one_line_error_not_a_traceback():
    proc = forerun("generate", "Hi", "--temperature", "-1")
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_model_path_is_a_one_line_error(tmp_path):
    proc = forerun("generate", "Hi", "--model", str(tmp_path / "nope"))
    assert proc.returncode == 2
    assert str(tmp_path / "nope") in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.slow
def test_generate_prints_the_same_greedy_text_as_the_offline_api(llm_cache):
    prompt = "The capital of France is"
    proc = forerun("generate", prompt, "--max-tokens", "10", "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024")
    assert proc.returncode == 0, proc.stderr
    expected = llm_cache().generate([prompt], SamplingParams(max_tokens=10, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == expected + "\n"


@pytest.mark.slow
def test_chat_answers_each_line_and_ends_on_eof(llm_cache):
    proc = forerun("chat", "--max-tokens", "12", "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024",
                   stdin="What is the capital of France?\n")
    assert proc.returncode == 0, proc.stderr
    expected = llm_cache().chat([{"role": "user", "content": "What is the capital of France?"}],
                                SamplingParams(max_tokens=12, temperature=0),
                                use_tqdm=False)[0].outputs[0].text
    assert expected.strip() and expected in proc.stdout


def test_bad_speculative_config_is_a_one_line_error():
    proc = forerun("generate", "Hi", "--speculative-config",
                   '{"method": "medusa", "num_speculative_tokens": 2}')
    assert proc.returncode == 2, proc.stderr
    assert "speculative_config.method" in proc.stderr and "Traceback" not in proc.stderr
    # Not even JSON: argparse's own usage error (exit 2), before any model loads.
    from forerun.cli import main
    with pytest.raises(SystemExit) as e:
        main(["generate", "Hi", "--speculative-config", '{"method"'])
    assert e.value.code == 2


@pytest.mark.slow
def test_generate_with_drafts_prints_the_same_greedy_text(llm_cache):
    prompt = "Repeat after me: one two three four five six. Again: one two three"
    proc = forerun("generate", prompt, "--max-tokens", "16", "--dtype", "float32",
                   "--kv-cache-memory-bytes", str(64 << 20), "--max-model-len", "1024",
                   "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}')
    assert proc.returncode == 0, proc.stderr
    expected = llm_cache().generate([prompt], SamplingParams(max_tokens=16, temperature=0),
                                    use_tqdm=False)[0].outputs[0].text
    assert proc.stdout == expected + "\n"
