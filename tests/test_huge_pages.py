"""The small-batch path's weights in one buffer advised for transparent huge pages: the
copies equal the originals, start where the kernels need them, and the kernel is asked for
huge pages (the VMA's ``THPeligible`` in /proc/self/smaps) unless FORERUN_HUGE_PAGES=0."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forerun.model import huge_pages
from forerun.model.loader import load_model, load_model_config, resolve_model
from tests.tiny_model import write_tiny_llama

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _thp_mode() -> str | None:
    try:
        text = THP_MODE.read_text()
    except OSError:
        return None
    return text[text.index("[") + 1:text.index("]")]


def _thp_eligible(address: int) -> bool:
    """``THPeligible`` of the mapping that holds ``address``."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "THPeligible:":
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


def test_copies_are_equal_aligned_and_contiguous() -> None:
    tensors = [torch.randn(3, 5), torch.arange(7), torch.randn(1000, 3).bfloat16(),
               torch.randn(4, 6).t()]  # a non-contiguous one
    copies = huge_pages.arena_copy(tensors)
    assert copies[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    for t, c in zip(tensors, copies, strict=True):
        assert c.dtype == t.dtype and c.shape == t.shape and c.is_contiguous()
        assert c.data_ptr() % 64 == 0 and c.data_ptr() != t.data_ptr()
        assert torch.equal(c, t)


def test_arena_hands_out_cache_lines_in_order_and_refuses_more_than_it_holds() -> None:
    a, b = torch.arange(10, dtype=torch.uint8), torch.randn(20)
    arena = huge_pages.Arena(huge_pages.aligned_bytes(a) + huge_pages.aligned_bytes(b))
    ca, cb = arena.copy(a), arena.copy(b)
    assert cb.data_ptr() - ca.data_ptr() == 64  # 10 bytes take one cache line
    assert torch.equal(ca, a) and torch.equal(cb, b)
    with pytest.raises(ValueError, match="arena of 192 bytes has 0 left, 64 asked"):
        arena.copy(a)


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
@pytest.mark.parametrize("enabled", ["1", "0"])
def test_buffer_is_advised_for_huge_pages_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch, enabled: str) -> None:
    monkeypatch.setenv("FORERUN_HUGE_PAGES", enabled)
    buf = huge_pages.empty_bytes(3 << 20)
    if enabled == "1":
        assert _thp_eligible(buf.data_ptr())
    elif _thp_mode() == "madvise":  # with "always" every mapping is eligible
        assert not _thp_eligible(buf.data_ptr())


@pytest.mark.skipif(_thp_mode() not in ("madvise", "always"), reason="no transparent huge pages")
def test_small_batch_weights_of_a_bfloat16_model_live_in_the_advised_buffer(
        tmp_path: Path) -> None:
    folder = tmp_path / "tiny"
    write_tiny_llama(folder)
    source = resolve_model(str(folder))
    model = load_model(source, load_model_config(source), torch.bfloat16, torch.device("cpu"))
    if not (model.small_batch.available and model.small_batch.can_run(torch.bfloat16)):
        pytest.skip("the small-batch path does not run bfloat16 on this CPU")
    packed = model.small_batch.resident_tensors()
    assert packed and all(_thp_eligible(t.data_ptr()) for t in packed)
