"""benchmarks/tokenizer_convert.py: both ways timed, their files compared, a bad argument refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def test_it_times_both_ways_and_compares_their_files(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_benchmark("tokenizer_convert")
    out = tmp_path / "r.json"
    assert m.main(["smollm2-135m-instruct", "--rounds", "1", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["models"]["smollm2-135m-instruct"]
    assert r["same_files"] is True and r["class"] == "TokenizersBackend"
    assert r["best_s"]["convert_gguf"] > 0 and r["best_s"]["AutoTokenizer"] > 0
    assert "same files: True" in capsys.readouterr().out


def test_rounds_must_be_positive(load_benchmark: Callable[[str], ModuleType], tmp_path: Path) -> None:
    m = load_benchmark("tokenizer_convert")
    with pytest.raises(SystemExit):
        m.main(["smollm2-135m-instruct", "--rounds", "0", "--out", str(tmp_path / "r")])


def test_an_unknown_model_is_a_usage_error(load_benchmark: Callable[[str], ModuleType], tmp_path: Path) -> None:
    m = load_benchmark("tokenizer_convert")
    with pytest.raises(SystemExit) as exc:
        m.main(["no-such-model", "--out", str(tmp_path / "r")])
    assert exc.value.code == 2
