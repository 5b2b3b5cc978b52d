"""The weight formats as one table: kernels/formats.py's `FORMATS` rows against quant.h's
`TLQ_FORMATS` (exported by `tl_formats`), the rows' own consistency, and every prose list of the
formats generated from the table (`format_names`)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenleap.cli import build_parser
from tokenleap.kernels import FORMATS, CpuKernels, format_names
from tokenleap.kernels.formats import BY_GGML, BY_KERNEL

ROOT = Path(__file__).resolve().parents[2]


def test_the_c_table_is_the_python_table(kernels: CpuKernels) -> None:
    rows = np.zeros((64, 5), dtype=np.int32)
    n = kernels.lib.tl_formats(rows.ctypes.data, 64)
    c_rows = {tuple(int(v) for v in row) for row in rows[:n]}
    py_rows = {(f.ggml_id, f.kernel_id, f.block_weights, f.file_bytes, f.group_bytes) for f in FORMATS}
    assert c_rows == py_rows
    for f in FORMATS:
        assert kernels.lib.tl_quant_group_bytes(f.kernel_id) == f.group_bytes, f.name


def test_rows_are_ggml_types_read_in_their_own_bytes() -> None:
    assert len(BY_GGML) == len(BY_KERNEL) == len(FORMATS), "one row per GGML type and per kernel format"
    assert all(0 < f.kernel_id < 16 for f in FORMATS), "a kernel format fits TLQ_STACK's 4 bits"
    for f in FORMATS:
        qtype = gguf.GGMLQuantizationType(f.ggml_id)
        assert qtype.name == f.name
        assert gguf.GGML_QUANT_SIZES[qtype] == (f.block_weights, f.file_bytes), f.name
        assert f.group_bytes == 8 * f.file_bytes * 32 // f.block_weights, f"{f.name} is widened"
        assert f.superblock == (f.name in ("Q4_K", "Q5_K", "Q6_K"))


@pytest.mark.parametrize("path", ["README.md", "docs/models.md"])
def test_prose_lists_are_the_table(path: str) -> None:
    assert format_names() in (ROOT / path).read_text(), f"{path}: write the formats as format_names() gives them"


def test_quantization_help_lists_the_table() -> None:
    generate = next(a for a in build_parser()._actions if a.dest == "command").choices["generate"]  # type: ignore[union-attr]
    help_text = next(a.help for a in generate._actions if a.dest == "quantization")
    assert format_names("/") in str(help_text), "the --quantization help names every format of the table"
