"""The kernels' process-wide tile switches set for a block and put back after it, for tests that
compare tiles (VNNI, the buffered many-row tiles: kernels/tiles.py may have chosen either)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tokenleap.kernels import CpuKernels


@contextlib.contextmanager
def tile_settings(kernels: CpuKernels, *, vnni: bool | None = None, xb_rows: int | None = None) -> Iterator[None]:
    """Run the block with VNNI and `quant_xb_rows` as given (None: as they are), then restore both."""
    saved_vnni, saved_xb = kernels.quant_vnni(), kernels.quant_xb_rows()
    try:
        if vnni is not None:
            kernels.quant_vnni(vnni)
        if xb_rows is not None:
            kernels.quant_xb_rows(xb_rows)
        yield
    finally:
        kernels.quant_xb_rows(saved_xb)
        kernels.quant_vnni(saved_vnni)
