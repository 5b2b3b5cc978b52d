"""KV cache: growth keeps content, truncate / compact roll back exactly, overflow and bad arguments are rejected."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from tokenleap.attention import tree_mask
from tokenleap.errors import TokenleapError
from tokenleap.kernels import CpuKernels
from tokenleap.kv.cache import KVCache, q8_dequantize, q8_quantize
from tokenleap.models.llama import LlamaModel
from tokenleap.tokenizer import Tokenizer

LAYERS, HEADS, HD = 3, 2, 4


def _cache(max_capacity: int = 64, initial_capacity: int = 4) -> KVCache:
    return KVCache(LAYERS, HEADS, HD, dtype=torch.float32, max_capacity=max_capacity, initial_capacity=initial_capacity)


def _fill(kv: KVCache, n: int, base: float = 0.0) -> None:
    """Append `n` slots whose keys/values encode (layer, slot) so moves are visible."""
    kv.reserve(n)
    start = kv.length
    for layer in range(LAYERS):
        slots = torch.arange(start, start + n, dtype=torch.float32)
        k = (base + 1000 * layer + slots).view(1, n, 1).expand(HEADS, n, HD).clone()
        kv.write(layer, start, k, -k)
    kv.commit(n)


def _slot_ids(kv: KVCache, layer: int = 0) -> list[int]:
    return [int(x) for x in kv.keys(layer, kv.length)[0, :, 0].tolist()]


# --------------------------------------------------------------------------- unit


def test_reserve_grows_by_doubling_and_keeps_content() -> None:
    kv = _cache(initial_capacity=4)
    assert kv.capacity == 4 and kv.length == 0
    _fill(kv, 3)
    before = [kv.keys(layer, 3).clone() for layer in range(LAYERS)]
    kv.reserve(2)  # 5 > 4: grow
    assert kv.capacity == 8
    assert kv.length == 3  # reserving does not commit
    for layer in range(LAYERS):
        assert torch.equal(kv.keys(layer, 3), before[layer])
        assert torch.equal(kv.values(layer, 3), -before[layer])
    kv.reserve(30)  # need 33 > 2 * 8: grows straight to what is needed
    assert kv.capacity == 33
    assert torch.equal(kv.keys(2, 3), before[2])
    kv.reserve(61)  # 64 == max_capacity
    assert kv.capacity == 64
    _fill(kv, 61)
    assert _slot_ids(kv) == list(range(64))
    assert kv.nbytes() == LAYERS * 2 * HEADS * 64 * HD * 4


def test_reserve_within_capacity_does_not_reallocate() -> None:
    kv = _cache(initial_capacity=16)
    _fill(kv, 4)
    data = kv.storage().data_ptr()
    kv.reserve(12)
    assert kv.storage().data_ptr() == data


def test_context_overflow_raises() -> None:
    kv = _cache(max_capacity=10)
    _fill(kv, 8)
    kv.reserve(2)
    with pytest.raises(TokenleapError, match="exceeds the context length"):
        kv.reserve(3)
    assert kv.length == 8
    assert _slot_ids(kv) == list(range(8))


def test_commit_past_capacity_raises() -> None:
    kv = _cache(initial_capacity=4)
    with pytest.raises(ValueError):
        kv.commit(5)


def test_truncate() -> None:
    kv = _cache()
    _fill(kv, 10)
    kv.truncate(6)
    assert kv.length == 6
    _fill(kv, 2, base=0.5)  # new slots overwrite from 6 on
    assert _slot_ids(kv)[:6] == list(range(6))
    assert kv.keys(0, 8)[0, 6:, 0].tolist() == [6.5, 7.5]
    kv.truncate(0)
    assert kv.length == 0


@pytest.mark.parametrize("length", [-1, 11])
def test_truncate_bad_length(length: int) -> None:
    kv = _cache()
    _fill(kv, 10)
    with pytest.raises(ValueError):
        kv.truncate(length)
    assert kv.length == 10


def test_compact_moves_kept_slots_in_every_layer() -> None:
    kv = _cache()
    _fill(kv, 12)
    kv.compact(5, [5, 7, 10, 11])
    assert kv.length == 9
    for layer in range(LAYERS):
        expected = [1000 * layer + s for s in [0, 1, 2, 3, 4, 5, 7, 10, 11]]
        assert _slot_ids(kv, layer) == expected
        assert torch.equal(kv.values(layer, 9), -kv.keys(layer, 9))


def test_compact_prefix_and_empty_keep() -> None:
    kv = _cache()
    _fill(kv, 12)
    kv.compact(5, [5, 6, 7])  # already in place: a truncate
    assert kv.length == 8 and _slot_ids(kv) == list(range(8))
    kv.compact(3, [])
    assert kv.length == 3 and _slot_ids(kv) == [0, 1, 2]


@pytest.mark.parametrize(
    ("start", "keep"),
    [
        (5, [7, 6]),  # not increasing
        (5, [6, 6]),  # duplicate
        (5, [4, 6]),  # before start
        (5, [6, 12]),  # past length
        (5, [-1]),
    ],
)
def test_compact_bad_arguments(start: int, keep: Sequence[int]) -> None:
    kv = _cache()
    _fill(kv, 12)
    with pytest.raises(ValueError):
        kv.compact(start, keep)
    assert kv.length == 12
    assert _slot_ids(kv) == list(range(12))


@pytest.mark.parametrize("start", [13, -1])
def test_compact_start_outside_the_cache(start: int) -> None:
    """compact(start, []) with start past the committed length (or negative) must not move
    `length` past the written slots (or below zero): it is an argument error."""
    kv = _cache()
    _fill(kv, 12)
    with pytest.raises(ValueError):
        kv.compact(start, [])
    assert kv.length == 12


def test_free_resets_and_cache_is_reusable() -> None:
    kv = _cache()
    _fill(kv, 20)
    kv.free()
    assert kv.length == 0
    assert kv.nbytes() == 0
    _fill(kv, 5)
    assert kv.length == 5 and _slot_ids(kv) == list(range(5))


# --------------------------------------------------------------------------- with a model


def _forward(model: LlamaModel, kv: KVCache, ids: Sequence[int], start: int) -> torch.Tensor:
    out = model.forward(torch.tensor(list(ids)), torch.arange(start, start + len(ids)), kv)
    return model.compute_logits(out.hidden)


def _check_truncate_recompute(
    model: LlamaModel, prompt: Sequence[int], wrong: Sequence[int], right: Sequence[int]
) -> None:
    """Prompt, then a wrong continuation rolled back, then the right one == prompt, right."""
    p = len(prompt)
    kv = model.new_kv_cache()
    _forward(model, kv, prompt, 0)
    _forward(model, kv, wrong, p)
    kv.truncate(p)
    after_rollback = _forward(model, kv, right, p)

    fresh = model.new_kv_cache()
    _forward(model, fresh, prompt, 0)
    never_went_further = _forward(model, fresh, right, p)
    assert torch.equal(after_rollback, never_went_further)
    assert kv.length == fresh.length == p + len(right)


def test_truncate_then_recompute_tiny(tiny_model: LlamaModel) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (80,), generator=g).tolist()
    _check_truncate_recompute(tiny_model, ids[:30], ids[30:40], ids[40:44])  # row-path continuation
    _check_truncate_recompute(tiny_model, ids[:10], ids[10:50], ids[50:80])
    _check_truncate_recompute(tiny_model, ids[:5], ids[5:45], ids[45:80][:1] * 40)  # batch-path continuation


@pytest.mark.slow
def test_truncate_then_recompute_real(model_fp32: LlamaModel, tokenizer: Tokenizer, questions: list[str]) -> None:
    prompt = tokenizer.encode(questions[0])
    wrong = tokenizer.encode(" Absolutely not, I refuse to write")
    right = tokenizer.encode(" Here is a blog post")
    _check_truncate_recompute(model_fp32, prompt, wrong, right)


def _check_compact(
    model: LlamaModel,
    prompt: Sequence[int],
    tokens: Sequence[int],
    parents: Sequence[int],
    path: Sequence[int],
    nxt: int,
) -> None:
    """Verify a tree, keep one root-to-leaf path with compact, decode one more token; compare
    with a cache that only ever saw prompt + path."""
    p = len(prompt)
    depths: list[int] = []
    for parent in parents:
        depths.append(0 if parent < 0 else depths[parent] + 1)
    kv = model.new_kv_cache()
    _forward(model, kv, prompt, 0)
    model.forward(torch.tensor(list(tokens)), torch.tensor([p + d for d in depths]), kv, tree_mask(parents, p))
    kv.compact(p, [p + i for i in path])
    assert kv.length == p + len(path)
    compacted = _forward(model, kv, [nxt], kv.length)

    fresh = model.new_kv_cache()
    _forward(model, fresh, prompt, 0)
    _forward(model, fresh, [tokens[i] for i in path], p)
    reference = _forward(model, fresh, [nxt], fresh.length)
    for layer in range(model.config.num_layers):
        assert torch.equal(kv.keys(layer, kv.length), fresh.keys(layer, fresh.length))
        assert torch.equal(kv.values(layer, kv.length), fresh.values(layer, fresh.length))
    assert torch.equal(compacted, reference)


def test_compact_equals_fresh_forward_over_kept_path(tiny_model: LlamaModel, kernels: CpuKernels) -> None:
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (40,), generator=g).tolist()
    tokens = torch.randint(0, 256, (7,), generator=g).tolist()
    parents = [-1, 0, 0, 1, 2, 4, -1]
    _check_compact(tiny_model, prompt, tokens, parents, [0, 2, 4, 5], 17)  # path that skips slots
    _check_compact(tiny_model, prompt, tokens, parents, [0, 1, 3], 17)  # prefix already in place
    _check_compact(tiny_model, prompt, tokens, parents, [6], 17)  # the second root


@pytest.mark.slow
def test_compact_equals_fresh_forward_real(
    model_fp32: LlamaModel, tokenizer: Tokenizer, questions: list[str], kernels: CpuKernels
) -> None:
    prompt = tokenizer.encode(questions[1])
    tokens = tokenizer.encode(" Well, I think that rockets are")
    parents = [-1, 0, 0, 2, 3, 1]
    _check_compact(model_fp32, prompt, tokens[:6], parents, [0, 2, 3, 4], tokens[6])


def test_forward_past_context_raises(tiny_model: LlamaModel) -> None:
    kv = tiny_model.new_kv_cache(max_capacity=16)
    _forward(tiny_model, kv, list(range(12)), 0)
    with pytest.raises(TokenleapError, match="context length"):
        _forward(tiny_model, kv, list(range(5)), 12)
    assert kv.length == 12
    logits = _forward(tiny_model, kv, list(range(4)), 12)  # exactly full is fine
    assert kv.length == 16 and logits.shape == (4, 256)


_TRIM_SCENARIO = """
import os, torch
from tokenleap.kv.cache import trim_free_memory
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
big = torch.ones(20 << 20, dtype=torch.uint8)  # an mmapped chunk: raises glibc's mmap threshold
del big
burst, pins = [], []
for _ in range(30):  # 240 MB from the heap, each piece followed by a small live allocation
    burst.append(torch.ones(8 << 20, dtype=torch.uint8))
    pins.append(torch.ones(64 << 10, dtype=torch.uint8))
del burst
before = rss()
ok = trim_free_memory()
print(ok, before, rss())
"""


def test_trim_free_memory_returns_freed_heap_to_the_os() -> None:
    """Medium buffers (like a request's KV cache) freed after a burst stay in glibc's heap
    until trimmed: a server would keep its high-water mark. Run in a fresh interpreter, whose
    allocator state is known."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _TRIM_SCENARIO], capture_output=True, text=True, check=True
    ).stdout.split()
    ok, before, after = out[0] == "True", int(out[1]), int(out[2])
    if not ok:
        pytest.skip("no malloc_trim in this C library")
    assert after < before - (100 << 20)


def test_blocked_cache_reads_back_what_was_written_through_growth_and_compaction() -> None:
    """The bf16 slot-blocked layout behaves like a plain cache to the torch path."""
    g = torch.Generator().manual_seed(0)
    kv = KVCache(2, 3, 8, dtype=torch.bfloat16, max_capacity=100, initial_capacity=5, blocked=True)
    assert kv.capacity == 16 and kv.storage().abs().sum() == 0  # rounded up to blocks, zeroed
    k = torch.randn(2, 3, 40, 8, generator=g)
    v = torch.randn(2, 3, 40, 8, generator=g)
    for start, n in [(0, 7), (7, 20), (27, 13)]:  # unaligned writes, growing twice
        kv.reserve(n)
        for layer in range(2):
            kv.write(layer, start, k[layer, :, start : start + n], v[layer, :, start : start + n])
        kv.commit(n)
    assert kv.capacity % 16 == 0 and kv.capacity >= 40
    for layer in range(2):
        assert torch.equal(kv.keys(layer, 40), k[layer].bfloat16().float())
        assert torch.equal(kv.values(layer, 40), v[layer].bfloat16().float())
    # the layout itself: keys in [cap/16, hd/2, 16, 2] blocks, values in [cap/2, hd, 2] pairs
    plane_k = kv.storage()[1, 0, 2].reshape(-1)
    plane_v = kv.storage()[1, 1, 2].reshape(-1)
    slot, d = 21, 5
    assert plane_k[(slot // 16) * 16 * 8 + (d // 2) * 32 + (slot % 16) * 2 + d % 2] == k[1, 2, slot, d].bfloat16()
    assert plane_v[(slot // 2) * 16 + d * 2 + slot % 2] == v[1, 2, slot, d].bfloat16()
    kv.compact(30, [31, 35, 39])
    assert kv.length == 33
    keep = [*range(30), 31, 35, 39]
    assert torch.equal(kv.keys(0, 33), k[0][:, keep].bfloat16().float())
    assert torch.equal(kv.values(1, 33), v[1][:, keep].bfloat16().float())
    with pytest.raises(ValueError, match="bfloat16"):
        KVCache(1, 1, 8, dtype=torch.float32, max_capacity=16, blocked=True)


def test_blocked_cache_grown_in_inference_mode_compacts_outside_it() -> None:
    """The engine grows caches inside the model's inference mode and compacts them outside:
    that must not raise ("inplace update to inference tensor outside InferenceMode")."""
    kv = KVCache(1, 1, 8, dtype=torch.bfloat16, max_capacity=64, initial_capacity=4, blocked=True)
    k = torch.randn(1, 1, 20, 8)
    with torch.inference_mode():
        kv.reserve(20)
        kv.write(0, 0, k[0, :, :20], k[0, :, :20])
        kv.commit(20)
    kv.compact(10, [12, 15])
    assert kv.length == 12 and torch.equal(kv.keys(0, 12), k[0][:, [*range(10), 12, 15]].bfloat16().float())


def test_q8_0_cache_reads_back_what_was_written_through_growth_and_compaction() -> None:
    """The q8_0 layout (`dtype=torch.int8`) behaves like a plain cache of q8_0-rounded values
    to the torch path, and its bytes are ggml's q8_0 blocks in the kernel's order."""
    g = torch.Generator().manual_seed(1)
    hd = 64
    kv = KVCache(2, 3, hd, dtype=torch.int8, max_capacity=100, initial_capacity=5, blocked=True)
    assert kv.capacity == 16 and kv.storage().shape[-1] == hd + hd // 16 and not kv.storage().any()
    k = torch.randn(2, 3, 40, hd, generator=g) * 3
    v = torch.randn(2, 3, 40, hd, generator=g) / 7
    for start, n in [(0, 7), (7, 20), (27, 13)]:  # unaligned writes, growing twice
        kv.reserve(n)
        for layer in range(2):
            kv.write(layer, start, k[layer, :, start : start + n], v[layer, :, start : start + n])
        kv.commit(n)
    assert kv.capacity % 16 == 0 and kv.capacity >= 40

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return q8_dequantize(*q8_quantize(x))

    for layer in range(2):
        assert torch.equal(kv.keys(layer, 40), rounded(k[layer]))
        assert torch.equal(kv.values(layer, 40), rounded(v[layer]))
    torch.testing.assert_close(kv.keys(0, 40), k[0], atol=3 * 4 / 127, rtol=0)  # within half a step of the largest |k|
    # the layout itself: a block of 16 slots is int8 keys [hd/4, 16, 4] (values [16, hd]), then
    # fp16 scales [hd/32, 16]
    slot, d = 21, 37
    q, s = q8_quantize(k[1, 2, slot])
    block = kv.storage()[1, 0, 2].reshape(-1)[(slot // 16) * 16 * (hd + hd // 16) :]
    assert block[(d // 4) * 64 + (slot % 16) * 4 + d % 4] == q[d]
    assert block[16 * hd :].view(torch.float16)[(d // 32) * 16 + slot % 16] == s[d // 32]
    q, s = q8_quantize(v[1, 2, slot])
    block = kv.storage()[1, 1, 2].reshape(-1)[(slot // 16) * 16 * (hd + hd // 16) :]
    assert torch.equal(block[(slot % 16) * hd : (slot % 16 + 1) * hd], q)
    assert torch.equal(block[16 * hd :].view(torch.float16)[slot % 16 : hd // 2 : 16], s)
    kv.compact(30, [31, 35, 39])
    assert kv.length == 33
    keep = [*range(30), 31, 35, 39]
    assert torch.equal(kv.keys(0, 33), rounded(k[0][:, keep]))
    assert torch.equal(kv.values(1, 33), rounded(v[1][:, keep]))
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(1, 1, 16, dtype=torch.int8, max_capacity=16, blocked=True)


def test_q8_quantize_is_ggml_q8_0() -> None:
    """Per 32 values d = fp16(max|x| / 127), q = round-half-even(x / d): exact multiples of a
    block's step come back exactly, ties go to even, and a zero block stays zero."""
    x = torch.zeros(96)
    x[:32] = torch.arange(-16, 16) * 0.5  # max 8: d = 8/127, not a power of two
    x[32:64] = torch.linspace(-127, 127, 32)  # d = 1: the values are their own q
    q, d = q8_quantize(x)
    assert d.dtype == torch.float16 and d.tolist()[1:] == [1.0, 0.0]
    assert float(d[0]) == float(torch.tensor(8 / 127).half())
    assert torch.equal(q[32:64], torch.round(torch.linspace(-127, 127, 32)).to(torch.int8))
    assert not q[64:].any() and int(q[:32].abs().max()) == 127
    assert torch.equal(
        q8_quantize(torch.tensor([2.5, -0.5, 0.5, 1.5] + [0.0] * 27 + [127.0]))[0][:4],
        torch.tensor([2, 0, 0, 2], dtype=torch.int8),
    )
