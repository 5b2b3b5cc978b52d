"""benchmarks/quant_roofline.py (a format's compute time against the memory's, per row count) and
benchmarks/kernel_mca.py (llvm-mca's cycle counts of the AVX2 K tiles)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from tokenleap.kernels.build import cpu_flags, kernel_variant


def test_a_format_reports_its_compute_and_streamed_times_per_row_count(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    variant = kernel_variant(cpu_flags())
    if variant is None or shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no kernels or no C compiler on this machine")
    m = load_benchmark("quant_roofline")
    binary = m.build("avx2", tmp_path / "qr", optimize="-O1")
    run = m.run(binary, m.FORMATS["Q4_K"], [1, 3])
    assert run["read_gbps_per_core"] > 0 and run["bytes"] == m.SHAPE[0] * m.SHAPE[1] * 144 // 256
    assert set(run["rows"]) == {1, 3} and all(v["hot_ns"] > 0 and v["cold_ns"] > 0 for v in run["rows"].values())
    s = m.summarize({"read_gbps_per_core": 10.0, "bytes": 10_000, "rows": {1: {"hot_ns": 400.0, "cold_ns": 1000.0},
                                                                        2: {"hot_ns": 900.0, "cold_ns": 1100.0},
                                                                        4: {"hot_ns": 1800.0, "cold_ns": 1900.0}}})
    assert s["memory_ns"] == 1000.0 and s["free_rows"] == 2
    assert s["rows"][4]["compute_over_memory"] == pytest.approx(1.8) and s["rows"][4][
        "cold_over_one_row"
    ] == pytest.approx(1.9)


def test_bad_arguments_are_usage_errors(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("quant_roofline")
    for argv in (["--types", "Q9_K"], ["--rows", "0"], ["--variants", "neon"]):
        with pytest.raises(SystemExit) as exc:
            m.main(argv)
        assert exc.value.code == 2, argv


def test_llvm_mca_counts_cycles_per_block_for_each_row_count(load_benchmark: Callable[[str], ModuleType]) -> None:
    if shutil.which("llvm-mca") is None or shutil.which("gcc") is None:
        pytest.skip("llvm-mca or gcc missing")
    m = load_benchmark("kernel_mca")
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        asm = m.assembly(m.KERNEL_DIR, "haswell", Path(tmp) / "k.s", [], ["qk_groups_q4k"])  # the K unit alone
        rows = m.model(asm, "qk_groups_q4k", "haswell")
    by_rows = {r["maddubs"] // 8: r["cycles"] for r in rows if r["maddubs"] % 8 == 0}
    assert set(by_rows) == set(range(1, 9))  # one tile per row count, 8 multiplies a row
    assert by_rows[8] > by_rows[4] > by_rows[1] > 0
    # each row count has a group-major block (activations broadcast per group) and a superblock-major
    # one (read from the broadcast buffer): the counts tell them apart
    for broadcasts in (True, False):
        tiles = {r["maddubs"] // 8 for r in rows if r["maddubs"] % 8 == 0 and (r["broadcasts"] > 0) == broadcasts}
        assert tiles == set(range(1, 9)), (broadcasts, tiles)


def test_kernel_mca_finds_a_function_gcc_split(load_benchmark: Callable[[str], ModuleType]) -> None:
    """GCC's partial inlining renames a function (q_run -> q_run.part.0): its blocks are still found,
    and a name that is only a prefix of another function's is not taken for it."""
    m = load_benchmark("kernel_mca")
    asm = "\n".join(
        [
            "q_run_other:", "\tvpaddd\t%ymm0, %ymm0, %ymm0", "\t.size\tq_run_other, .-q_run_other",
            "q_run.part.0:", "\tvpmaddubsw\t%ymm1, %ymm2, %ymm3", "\tjne\t.L5", ".L5:", "\tvpaddw\t%ymm3, %ymm4, %ymm4",
            "\t.size\tq_run.part.0, .-q_run.part.0",
        ]
    )
    blocks = m.blocks(asm, "q_run")
    assert [len(b) for b in blocks if b] == [2, 1] and "vpmaddubsw" in blocks[0][0]
    with pytest.raises(ValueError, match="no function q_ru "):
        m.blocks(asm, "q_ru")


def test_kernel_mca_puts_each_row_count_against_the_memory(load_benchmark: Callable[[str], ModuleType]) -> None:
    """The predicted roofline: each row count's fastest block (of the group-major and run-major
    ones) against the cycles the memory takes for the block's bytes; free rows stop at the first
    row count over it."""
    m = load_benchmark("kernel_mca")
    rows = [
        {"maddubs": 8, "cycles": 10.0}, {"maddubs": 16, "cycles": 30.0}, {"maddubs": 16, "cycles": 20.0},
        {"maddubs": 24, "cycles": 50.0}, {"maddubs": 32, "cycles": 30.0}, {"maddubs": 12, "cycles": 1.0},
    ]
    r = m.roofline(rows, block_bytes=144, read_gbs=4.8, ghz=1.2)  # 4 bytes a cycle: 36 cycles a block
    assert r["memory_cycles"] == pytest.approx(36.0)
    assert set(r["rows"]) == {1, 2, 3, 4}  # 12 multiplies is no whole row count
    assert r["rows"][2]["cycles"] == 20.0 and r["free_rows"] == 2  # 3 rows over the memory: 4 (under it) is not free
    assert r["rows"][1]["over_one_row"] == 1.0 and r["rows"][3]["over_one_row"] == pytest.approx(50 / 36)
    only_two = m.roofline(rows[1:3], 144, 4.8, 1.2)  # no one-row tile (run-major): one row at the memory's time
    assert only_two["rows"][2]["over_one_row"] == 1.0 and only_two["free_rows"] == 2
    unknown_block = ["--read-gbs", "10", "--ghz", "3", "--function", "q_run"]
    for argv in (["--read-gbs", "10"], ["--ghz", "3", "--read-gbs", "0"], unknown_block):
        with pytest.raises(SystemExit) as exc:
            m.main(argv)
        assert exc.value.code == 2, argv
