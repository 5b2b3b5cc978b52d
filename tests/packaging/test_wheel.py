"""An installed wheel carries the kernels' C sources (they compile on first use), so `pip
install` of the repository runs the same kernels as the editable checkout."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tokenleap import __version__

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_wheel_ships_kernel_sources(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet", "-w",
                           str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("tokenleap-*.whl")
    assert wheel.name.startswith(f"tokenleap-{__version__}-")  # pyproject reads the one version string
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.name for p in (ROOT / "src" / "tokenleap" / "kernels").iterdir() if p.suffix in (".c", ".h")}
    assert sources >= {"kernels.c", "kernels_avx2.c", "quant_k.c", "pool.h", "quant.h"}
    for name in sources:
        assert f"tokenleap/kernels/{name}" in names, name
