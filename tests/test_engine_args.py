"""The engine flags are derived from EngineConfig's fields: every field has one, and a
value given on the command line reaches the config unchanged."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from forerun.config import EngineConfig
from forerun.engine_args import add_engine_args, config_from_args

# A valid non-default command-line value per field, and the value the config must hold.
NON_DEFAULTS: dict[str, tuple[list[str], object]] = {
    "model": (["/models/x.gguf"], "/models/x.gguf"),
    "tokenizer": (["/models/tok"], "/models/tok"),
    "dtype": (["bfloat16"], "bfloat16"),
    "device": (["cpu"], "cpu"),
    "max_model_len": (["512"], 512),
    "max_num_seqs": (["7"], 7),
    "max_num_batched_tokens": (["300"], 300),
    "block_size": (["32"], 32),
    "kv_cache_dtype": (["int8"], "int8"),
    "kv_cache_memory_bytes": (["1048576"], 1048576),
    "gpu_memory_utilization": (["0.5"], 0.5),
    "num_gpu_blocks_override": (["64"], 64),
    "seed": (["11"], 11),
    "async_scheduling": (["on"], "on"),
    "max_concurrent_batches": (["3"], 3),
    "trace_file": (["/tmp/t.json"], "/tmp/t.json"),
    "structured_outputs_compile_timeout_s": (["2.5"], 2.5),
    "max_logprobs": (["-1"], -1),
    "quantization": (["int8"], "int8"),
    "speculative_config": (['{"method": "ngram", "num_speculative_tokens": 2}'],
                           {"method": "ngram", "num_speculative_tokens": 2}),
    "runner": (["pooling"], "pooling"),
    "pooler_config": (['{"pooling_type": "MEAN"}'], {"pooling_type": "MEAN"}),
    "simulated_device": (["h100/llama-3-8b"], "h100/llama-3-8b"),
    "data_parallel_size": (["2"], 2),
    "data_parallel_rank": (["1"], 1),
    "tensor_parallel_size": (["2"], 2),
    "pipeline_parallel_size": (["2"], 2),
    "nnodes": (["2"], 2),
    "node_rank": (["1"], 1),
    "master_addr": (["10.1.2.3"], "10.1.2.3"),
    "master_port": (["29555"], 29555),
    "kv_transfer_config": (['{"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}'],
                           {"kv_connector": "TCPConnector", "kv_role": "kv_consumer"}),
    "kv_offloading_size": (["1.5"], 1.5),
    "kv_offload_dir": (["/tmp/kv"], "/tmp/kv"),
}
BOOLEANS = {"enable_prefix_caching": False, "defer_block_free": True, "enable_expert_parallel": True}


def _parse(argv: list[str]) -> argparse.Namespace:
    return add_engine_args(argparse.ArgumentParser()).parse_args(argv)


def test_every_config_field_has_a_flag_with_help() -> None:
    names = {f.name for f in fields(EngineConfig)}
    assert names == set(NON_DEFAULTS) | set(BOOLEANS)
    actions = {a.dest: a for a in add_engine_args(argparse.ArgumentParser())._actions}
    for name in names:
        assert name in actions and actions[name].help, name


def test_no_flags_give_the_config_defaults() -> None:
    assert config_from_args(_parse([])) == EngineConfig()


@pytest.mark.parametrize("name", sorted(NON_DEFAULTS))
def test_a_flag_value_reaches_its_config_field(name: str) -> None:
    argv, want = NON_DEFAULTS[name]
    args = _parse([f"--{name.replace('_', '-')}", *argv])
    assert getattr(args, name) == want
    assert getattr(EngineConfig(), name) != want  # the value is not the default


@pytest.mark.parametrize(("name", "value"), sorted(BOOLEANS.items()))
def test_boolean_fields_take_a_flag_and_its_negation(name: str, value: bool) -> None:
    flag = name.replace("_", "-")
    assert getattr(_parse([f"--{flag}"]), name) is True
    assert getattr(_parse([f"--no-{flag}"]), name) is False
    assert getattr(_parse([f"--{flag}" if value else f"--no-{flag}"]), name) is value


def test_short_aliases_and_the_async_off_switch() -> None:
    args = _parse(["-tp", "2", "-pp", "1", "-dp", "1", "-q", "gguf", "--no-async-scheduling"])
    cfg = config_from_args(args)
    assert (cfg.tensor_parallel_size, cfg.quantization, cfg.async_scheduling) == (2, "gguf",
                                                                                "off")


def test_a_bad_value_is_an_argparse_error_naming_the_flag(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["--max-num-seqs", "many"])
    assert "--max-num-seqs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parse(["--speculative-config", "[1, 2]"])
    assert "must be a JSON object" in capsys.readouterr().err
