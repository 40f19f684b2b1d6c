"""The offloading connector on a real (tiny) model: RAM and disk tiers behind a small pool.

The workload's prefixes need three times the device pool, so the second round of each
conversation finds its prefix evicted from the device and loads it back (from RAM, or from
disk once RAM has let it go); its tokens must be those of a pool big enough for everything.
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Any

import pytest

from forerun import LLM, SamplingParams
from forerun.core.block_hash import hash_block_tokens
from forerun.kv_connector.config import KVTransferConfig
from forerun.kv_connector.disk_tier import DiskTier
from forerun.kv_connector.offload_store import OffloadStore
from tests.conftest import assert_all_blocks_free
from tests.tiny_model import write_tiny_llama

BS = 4
POOL = 24  # blocks of 4: 96 tokens
# 8 conversations with 40-token prefixes (10 blocks each): 80 blocks, over 3x the pool.
PREFIXES = [[1] + [(7 * c + 3 * j) % 300 + 3 for j in range(39)] for c in range(8)]
BLOCK_BYTES = 2 * 2 * 2 * 16 * BS * 4  # layers x (K, V) x kv heads x head dim x tokens x fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = tmp_path_factory.mktemp("kvoff") / "tiny"
    write_tiny_llama(folder)
    return str(folder)


def _run(model: str, num_blocks: int = POOL, **kw: Any) -> tuple[LLM, list[list[int]]]:
    """Two rounds over the conversations, one request at a time (each a new turn)."""
    llm = LLM(model, block_size=BS, num_gpu_blocks_override=num_blocks, max_num_seqs=2,
              dtype="float32", max_model_len=96, **kw)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    outs = []
    for turn in range(2):
        # The second round newest first: what RAM still holds, then what only disk does.
        for prefix in PREFIXES if turn == 0 else PREFIXES[::-1]:
            out = llm.generate([{"prompt_token_ids": prefix + [5 + turn]}], params,
                               use_tqdm=False)
            outs.append(list(out[0].outputs[0].token_ids))
    assert_all_blocks_free(llm)
    return llm, outs


def _store(llm: LLM) -> OffloadStore:
    return llm.llm_engine.engine_core.scheduler.connector.store


@pytest.fixture(scope="module")
def reference(tiny: str) -> list[list[int]]:
    llm, outs = _run(tiny, num_blocks=400)
    llm.shutdown()
    return outs


def test_prefixes_three_times_the_pool_hit_ram_and_disk_and_survive_a_restart(
        tiny: str, reference: list[list[int]], tmp_path: Path) -> None:
    # RAM for 40 blocks: the first four conversations are on disk only by the second round.
    ram_gib = 40 * BLOCK_BYTES / (1 << 30)
    llm, outs = _run(tiny, kv_offloading_size=ram_gib, kv_offload_dir=str(tmp_path))
    store = _store(llm)
    assert outs == reference
    assert store.num_ram_hits > 0 and store.num_disk_hits > 0, vars(store)
    assert llm.llm_engine.engine_core.scheduler.connector.scheduler.num_loaded_tokens > 0
    llm.shutdown()
    assert store.disk is not None
    files = list(store.disk.dir.glob("*.kv"))
    assert len(files) >= 8 * 9  # every conversation's full prefix blocks

    # A restart finds the files: every first-round prefix now comes from disk.
    llm2, outs2 = _run(tiny, kv_offload_dir=str(tmp_path))
    store2 = _store(llm2)
    assert outs2 == reference
    assert store2.num_disk_hits >= 8 * 9 and store2.num_misses == 0
    llm2.shutdown()


def test_corrupt_or_truncated_files_are_ignored_and_recomputed(
        tiny: str, reference: list[list[int]], tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    llm, _ = _run(tiny, kv_offload_dir=str(tmp_path))
    disk = _store(llm).disk
    assert disk is not None
    llm.shutdown()
    # The first block of two conversations: one byte flipped, one file cut short.
    first = [disk.path_of(h) for h in _first_block_hashes()]
    flipped, cut = first[0], first[1]
    raw = bytearray(flipped.read_bytes())
    raw[-7] ^= 0x5A
    flipped.write_bytes(bytes(raw))
    cut.write_bytes(cut.read_bytes()[:-100])
    with caplog.at_level(logging.WARNING, logger="forerun.kv_connector"):
        llm2, outs = _run(tiny, kv_offload_dir=str(tmp_path))
    assert outs == reference
    store = _store(llm2)
    assert store.disk is not None and store.disk.num_corrupt == 2
    assert "checksum mismatch" in caplog.text and "truncated" in caplog.text
    llm2.shutdown()


def _first_block_hashes() -> list[bytes]:
    return [hash_block_tokens(None, p[:BS]) for p in PREFIXES]


def test_a_full_disk_is_a_logged_fallback(tiny: str, reference: list[list[int]],
                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          caplog: pytest.LogCaptureFixture) -> None:
    def full(path: Path, header: bytes, data: memoryview) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskTier, "_write_file", staticmethod(full))
    ram_gib = 200 * BLOCK_BYTES / (1 << 30)
    with caplog.at_level(logging.WARNING, logger="forerun.kv_connector"):
        llm, outs = _run(tiny, kv_offloading_size=ram_gib, kv_offload_dir=str(tmp_path))
    assert outs == reference
    store = _store(llm)
    assert store.disk is not None and store.disk.num_write_errors > 0 and not len(store.disk)
    assert store.num_ram_hits > 0  # RAM still serves the hits
    assert "ENOSPC" in caplog.text
    llm.shutdown()
    assert not list(store.disk.dir.iterdir())  # no temporary left behind


def test_disk_tier_keeps_to_its_size_and_to_its_fingerprint(tmp_path: Path) -> None:
    import torch
    fp_a, fp_b = b"a" * 32, b"b" * 32
    payload = torch.arange(64, dtype=torch.uint8)
    header = 4 + 4 + 32 + 32 + 8 + 32
    tier = DiskTier(tmp_path, fp_a, capacity_bytes=3 * (header + 64))
    hashes = [bytes([i]) * 32 for i in range(4)]
    for h in hashes:
        assert tier.put(h, payload)
    assert hashes[0] not in tier and all(h in tier for h in hashes[1:])  # LRU by size
    got = tier.get(hashes[1], 64)
    assert got is not None and torch.equal(got, payload)
    # Another model's folder never sees these; the same fingerprint after a restart does.
    assert not len(DiskTier(tmp_path, fp_b, 1 << 20))
    again = DiskTier(tmp_path, fp_a, 1 << 20)
    assert set(hashes[1:]) == set(again._files)
    # A file renamed to another block's name is refused by its header.
    again.path_of(hashes[2]).write_bytes(again.path_of(hashes[3]).read_bytes())
    assert again.get(hashes[2], 64) is None and hashes[2] not in again


def test_kv_transfer_config_is_checked_and_the_flags_come_from_engine_config() -> None:
    import argparse

    from forerun.config import EngineConfig
    from forerun.engine_args import add_engine_args, config_from_args
    with pytest.raises(ValueError, match="kv_role"):
        KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector", "kv_role": "x"})
    with pytest.raises(ValueError, match="unknown keys"):
        KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector", "kv_rol": "x"})
    with pytest.raises(ValueError, match="tensor/pipeline parallel"):
        EngineConfig(kv_offloading_size=1.0, tensor_parallel_size=2)
    args = add_engine_args(argparse.ArgumentParser()).parse_args(
        ["--kv-offloading-size", "0.5", "--kv-offload-dir", "/x", "--kv-transfer-config",
         '{"kv_connector": "OffloadingConnector", "kv_connector_extra_config": '
         '{"disk_bytes": 1024}}'])
    config = config_from_args(args)
    kv = config.resolve_kv_transfer()
    assert kv is not None and kv.kv_connector_extra_config == {"disk_bytes": 1024}
    assert config.kv_offloading_size == 0.5 and config.kv_offload_dir == "/x"
