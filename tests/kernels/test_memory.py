"""kernels/memory.py: buffers of 2 MB or more on their own 2 MB-aligned, huge-page-madvised mappings."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from tokenleap.kernels import formats
from tokenleap.kernels.formats import _weight_buffer
from tokenleap.kernels.memory import HUGE_PAGE, huge_page_tensor

pytestmark = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/proc/self/smaps").is_file()
    or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="no madvise(MADV_HUGEPAGE), transparent huge pages or /proc/self/smaps here",
)


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    return []


def test_big_buffers_are_zero_aligned_and_madvised_over_their_used_pages() -> None:
    big = huge_page_tensor((5, HUGE_PAGE // 2 + 3))  # 2.5 pages: the half-used last page is madvised too
    short = huge_page_tensor((5, HUGE_PAGE // 4 + 3))  # 1.25 pages: the last one stays on small pages
    assert big is not None and short is not None and big.shape == (5, HUGE_PAGE // 2 + 3) and big.dtype == torch.uint8
    for t in (big, short):
        assert int(t.sum()) == 0 and t.data_ptr() % HUGE_PAGE == 0
        t.fill_(7)
        assert int(t.sum()) == 7 * t.numel()
    assert "hg" in _vm_flags(big.data_ptr()) and "hg" in _vm_flags(big.data_ptr() + big.numel() - 1)
    assert "hg" in _vm_flags(short.data_ptr()) and "hg" not in _vm_flags(short.data_ptr() + short.numel() - 1)


def test_other_dtypes_and_small_buffers() -> None:
    kv = huge_page_tensor((2, 3, 1024, 512), torch.bfloat16)
    assert kv is not None and kv.dtype == torch.bfloat16 and kv.shape == (2, 3, 1024, 512) and kv.is_contiguous()
    assert float(kv.float().abs().sum()) == 0.0
    assert huge_page_tensor((1000, 1000)) is None  # under 2 MB: the caller's allocator
    small = _weight_buffer((100, 1000))
    assert small.shape == (100, 1000)  # numpy's allocator (its VmFlags are whatever that allocator's region has)
    assert "hg" in _vm_flags(_weight_buffer((3, HUGE_PAGE)).data_ptr())


def test_weight_buffers_take_a_mapping_from_2_mb_on(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[torch.Tensor | None] = []

    def spy(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
        made.append(huge_page_tensor(shape, dtype))
        return made[-1]

    monkeypatch.setattr(formats, "huge_page_tensor", spy)
    small, big = _weight_buffer((100, 1000)), _weight_buffer((3, HUGE_PAGE))
    assert made[0] is None and made[1] is big and small.shape == (100, 1000)
