"""Kernel variants: the CPU's flags pick kernels.c (AVX-512) or kernels_avx2.c (AVX2 + FMA); the
AVX2 variant keeps the row-invariance contract (checked in a subprocess that forces it, so an
AVX-512 machine tests both variants)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenleap.kernels import cpu_flags, kernel_variant, load_kernels


def test_variant_follows_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENLEAP_KERNELS", raising=False)
    assert kernel_variant(frozenset({"avx2", "fma", "avx512f", "avx512_bf16"})) == "avx512"
    assert kernel_variant(frozenset({"avx2", "fma", "f16c", "avx"})) == "avx2"
    assert kernel_variant(frozenset({"avx2"})) is None  # no FMA
    assert kernel_variant(frozenset({"sse4_2"})) is None
    monkeypatch.setenv("TOKENLEAP_KERNELS", "avx2")
    assert kernel_variant(frozenset({"avx2", "fma", "avx512f"})) == "avx2"


_SCRIPT = r"""
import torch
from tokenleap.kernels import PackedWeight, load_kernels
from tokenleap.models.config import ModelConfig
from tokenleap.models.llama import LlamaModel, SeqInput
import sys
sys.path.insert(0, "tests")
from tiny_models import TINY_CONFIG, make_tiny_weights

k = load_kernels()
assert k is not None and k.variant == "avx2" and k.packed and k.bf16_attention, k
g = torch.Generator().manual_seed(3)
for rows in (1, 2, 3, 7, 13):
    x = torch.randn(rows, 96, generator=g)
    w = torch.randn(48, 96, generator=g).bfloat16()
    b = torch.randn(48, generator=g)
    y = k.linear(x, PackedWeight.pack(w), b)
    ref = (x.double() @ w.double().T + b.double()).float()
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=1e-5)
    assert torch.equal(y, torch.cat([k.linear(x[i : i + 1], PackedWeight.pack(w), b) for i in range(rows)]))
    assert torch.equal(k.linear(x, w, b), torch.cat([k.linear(x[i : i + 1], w, b) for i in range(rows)]))
for dtype in (torch.float32, torch.bfloat16):
    model = LlamaModel(TINY_CONFIG, make_tiny_weights(), dtype, k)
    ids = torch.randint(0, 256, (60,), generator=g)
    kv = model.new_kv_cache()
    model.forward(ids[:40], torch.arange(40), kv)
    whole = model.compute_logits(model.forward(ids[40:52], torch.arange(40, 52), kv).hidden)
    kv.truncate(40)
    steps = torch.cat(
        [model.compute_logits(model.forward(ids[i : i + 1], torch.arange(i, i + 1), kv).hidden) for i in range(40, 52)]
    )
    assert torch.equal(whole, steps), (dtype, (whole - steps).abs().max())
print("ok")
"""


def test_avx2_variant_is_row_invariant() -> None:
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("no AVX2 + FMA on this machine")
    env = {**os.environ, "TOKENLEAP_KERNELS": "avx2"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_avx2_blocked_attention_matches_the_reference() -> None:
    """The AVX2 variant's blocked bf16 and q8_0 attention against the same reference, row-invariance and
    token-tree tests as the host's own variant (on an AVX-512 host they would not run it)."""
    if not {"avx2", "fma", "f16c"} <= cpu_flags():
        pytest.skip("no AVX2 + FMA on this machine")
    env = {**os.environ, "TOKENLEAP_KERNELS": "avx2"}
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        str(Path(__file__).with_name("test_attention_blocked.py"))
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0 and " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_kernels_build_wherever_they_can() -> None:
    """A machine with a C compiler and AVX2 + FMA (or AVX-512) must get the kernels: a source
    that fails to compile would otherwise turn every kernel test into a skip."""
    import shutil

    from tokenleap.kernels.build import build_library

    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    flags = cpu_flags()
    if compiler is None or os.environ.get("TOKENLEAP_NO_KERNELS"):
        pytest.skip("no C compiler (or kernels switched off)")
    for variant in ("avx512", "avx2"):
        if variant == "avx512" and "avx512f" not in flags or variant == "avx2" and not {"avx2", "fma", "f16c"} <= flags:
            continue
        try:
            build_library(compiler, variant, flags)
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"kernels_{variant} does not compile:\n{exc.stderr[-3000:]}")
    assert kernel_variant(flags) is None or load_kernels() is not None


def test_another_cpus_code_is_another_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """TOKENLEAP_KERNEL_MARCH builds another CPU's code (benchmarks: Zen 3's AVX2 stream on an
    AVX-512 host) under its own cache key; anything but a CPU name is refused."""
    from tokenleap.kernels.build import kernel_flags, kernel_march, library_path

    flags = frozenset({"avx2", "fma", "f16c"})
    monkeypatch.delenv("TOKENLEAP_KERNEL_MARCH", raising=False)
    assert kernel_march() == "native" and kernel_flags()[0] == "-march=native"
    native = library_path("gcc", "avx2", flags, kernel_march())
    monkeypatch.setenv("TOKENLEAP_KERNEL_MARCH", "znver3")
    assert kernel_march() == "znver3"
    assert [f for f in kernel_flags() if f.startswith("-march")] == ["-march=znver3"]
    zen3 = library_path("gcc", "avx2", flags, kernel_march())
    assert zen3 != native and zen3 == library_path("gcc", "avx2", flags, "znver3")
    for bad in ("znver3 -O0", "../x", "a;b", "-mno-avx"):
        monkeypatch.setenv("TOKENLEAP_KERNEL_MARCH", bad)
        with pytest.raises(ValueError, match="not a CPU name"):
            kernel_march()


def test_the_kernel_cache_keeps_the_most_recently_used_builds_of_a_variant(tmp_path: Path) -> None:
    from tokenleap.kernels.build import prune_kernel_cache

    builds = [tmp_path / f"tokenleap_kernels_avx2_{i:016x}.so" for i in range(7)]
    for age, f in enumerate(builds):  # builds[0] the most recently used
        f.write_bytes(b"so")
        os.utime(f, (1_000_000 - age, 1_000_000 - age))
    other = tmp_path / "tokenleap_kernels_avx512_0000000000000000.so"
    other.write_bytes(b"so")
    os.utime(other, (1, 1))  # the oldest file, but another variant's
    in_use = builds[6]  # the least recently used, but the one being loaded
    removed = prune_kernel_cache(tmp_path, "avx2", in_use, limit=2)
    assert sorted(removed) == sorted(builds[2:6])
    assert {f.name for f in tmp_path.iterdir()} == {builds[0].name, builds[1].name, in_use.name, other.name}
