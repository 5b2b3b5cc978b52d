"""The examples run as written (a vLLM offline script, its import changed)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.slow
def test_vllm_offline_script_runs(capsys: pytest.CaptureFixture[str]) -> None:
    runpy.run_path(str(EXAMPLES / "vllm_offline.py"), run_name="__main__")
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Prompt:")]
    assert len(lines) == 8  # 4 prompts x n=2
    assert all("sample 0" in a and "sample 1" in b for a, b in zip(lines[::2], lines[1::2]))
