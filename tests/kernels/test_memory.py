"""kernels/memory.py: buffers of 2 MB or more on their own 2 MB-aligned, huge-page-madvised mappings; a
model's small weights gathered onto one."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from smaps import vm_flags  # tests/smaps.py
from tokenleap.kernels import formats
from tokenleap.kernels.formats import _weight_buffer
from tokenleap.kernels.memory import HUGE_PAGE, copy_to_huge_pages, gather_on_huge_pages, huge_page_tensor

pytestmark = pytest.mark.skipif(
    not hasattr(mmap, "MADV_HUGEPAGE")
    or not Path("/proc/self/smaps").is_file()
    or not Path("/sys/kernel/mm/transparent_hugepage").is_dir(),
    reason="no madvise(MADV_HUGEPAGE), transparent huge pages or /proc/self/smaps here",
)


def test_big_buffers_are_zero_aligned_and_madvised_over_their_used_pages() -> None:
    big = huge_page_tensor((5, HUGE_PAGE // 2 + 3))  # 2.5 pages: the half-used last page is madvised too
    short = huge_page_tensor((5, HUGE_PAGE // 4 + 3))  # 1.25 pages: the last one stays on small pages
    assert big is not None and short is not None and big.shape == (5, HUGE_PAGE // 2 + 3) and big.dtype == torch.uint8
    for t in (big, short):
        assert int(t.sum()) == 0 and t.data_ptr() % HUGE_PAGE == 0
        t.fill_(7)
        assert int(t.sum()) == 7 * t.numel()
    assert "hg" in vm_flags(big.data_ptr()) and "hg" in vm_flags(big.data_ptr() + big.numel() - 1)
    assert "hg" in vm_flags(short.data_ptr()) and "hg" not in vm_flags(short.data_ptr() + short.numel() - 1)


def test_other_dtypes_and_small_buffers() -> None:
    kv = huge_page_tensor((2, 3, 1024, 512), torch.bfloat16)
    assert kv is not None and kv.dtype == torch.bfloat16 and kv.shape == (2, 3, 1024, 512) and kv.is_contiguous()
    assert float(kv.float().abs().sum()) == 0.0
    assert huge_page_tensor((1000, 1000)) is None  # under 2 MB: the caller's allocator
    small = _weight_buffer((100, 1000))
    assert small.shape == (100, 1000)  # numpy's allocator (its VmFlags are whatever that allocator's region has)
    assert "hg" in vm_flags(_weight_buffer((3, HUGE_PAGE)).data_ptr())


def test_weight_buffers_take_a_mapping_from_2_mb_on(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[torch.Tensor | None] = []

    def spy(shape: tuple[int, ...], dtype: torch.dtype = torch.uint8) -> torch.Tensor | None:
        made.append(huge_page_tensor(shape, dtype))
        return made[-1]

    monkeypatch.setattr(formats, "huge_page_tensor", spy)
    small, big = _weight_buffer((100, 1000)), _weight_buffer((3, HUGE_PAGE))
    assert made[0] is None and made[1] is big and small.shape == (100, 1000)


def test_small_tensors_are_gathered_onto_one_mapping_in_place() -> None:
    a = torch.arange(1000, dtype=torch.int32).to(torch.uint8).reshape(10, 100)
    b = torch.randn(1000, 500).to(torch.bfloat16)  # 1 MB
    d = torch.randn(300, 1000)  # 1.2 MB
    big = torch.randn(2000, 1000)  # 8 MB: stays where it is
    values = [t.clone() for t in (a, b, d, big)]
    big_at = big.data_ptr()
    moved = gather_on_huge_pages([a, b, big, a, d])  # a twice: moved once
    assert moved == a.numel() + 2 * b.numel() + 4 * d.numel()
    assert big.data_ptr() == big_at
    for t, v in zip((a, b, d, big), values):
        assert t.dtype == v.dtype and t.shape == v.shape and torch.equal(t, v)
    assert a.data_ptr() % HUGE_PAGE == 0  # the mapping's start, then each 64-byte aligned, in order
    assert b.data_ptr() == a.data_ptr() + 1024 and d.data_ptr() == b.data_ptr() + 1_000_000
    assert "hg" in vm_flags(a.data_ptr()) and "hg" in vm_flags(d.data_ptr())
    a.fill_(3)  # the tensors own their new bytes: writing one leaves its neighbours
    assert torch.equal(b, values[1]) and int(a.sum()) == 3 * a.numel()
    assert gather_on_huge_pages([torch.zeros(10), torch.zeros(20)]) == 0  # under 2 MB in all: left alone


def test_copies_to_huge_pages_from_2_mb_on() -> None:
    t = torch.randn(1024, 1024)[:, :600]  # not contiguous, 2.4 MB
    c = copy_to_huge_pages(t)
    assert torch.equal(c, t) and c.is_contiguous() and c.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags(c.data_ptr())
    s = torch.arange(10)
    small = copy_to_huge_pages(s)
    assert torch.equal(small, s) and small.data_ptr() != s.data_ptr()


def test_a_models_small_weights_share_one_huge_page_mapping() -> None:
    from tokenleap import LLM

    model = LLM(model="smollm2-135m-instruct", speculative_config=None).model
    linears = [w for layer in model.layers for w in layer.linears()]
    ptrs = [(w.weight if isinstance(w.weight, torch.Tensor) else w.weight.data).data_ptr() for w in linears]
    assert all(w.nbytes < HUGE_PAGE for w in linears)  # SmolLM2-135M: every matrix is small
    assert ptrs == sorted(ptrs) and ptrs[0] % HUGE_PAGE == 0  # in forward order from the mapping's start
    assert ptrs[-1] - ptrs[0] < sum(w.nbytes for w in linears)  # one mapping, back to back
    assert "hg" in vm_flags(ptrs[len(ptrs) // 2])
