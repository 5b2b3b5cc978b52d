"""benchmarks/spec_bars.py: issue 37's bars from the benchmarks that own them, in one table."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
FILES = [Path("/m/llama-3.2-1b-Q4_K_M.gguf"), Path("/m/llama-3.2-3b-Q4_K_M.gguf"), Path("/m/qwen2.5-1.5b-Q5_K_M.gguf")]
# recorded runs (s33 / s34, the AVX2 variant on a Golden Cove core) under the names spec_bars writes
RECORDED = {
    "rows_llama-3.2-1b-Q4_K_M.json": "forward_rows_avx2_znver3_llama-3.2-1b-Q4_K_M_spr_s33.json",
    "rows_qwen2.5-1.5b-Q5_K_M.json": "forward_rows_avx2_avxvnni_qwen2.5-1.5b-Q5_K_M_spr_s33.json",
    "replay.json": "model_sizes_replay_avx2_znver3_spr_s33.json",
    "draft_cost.json": "draft_cost_avx512_spr_s33.json",
    "pair_humaneval.json": "bench_pair_humaneval_znver3_s34.json",
    "pair_codeedit.json": "bench_pair_codeedit_znver3_s34.json",
    "pair_server.json": "pair_server_avx2_znver3_spr_s33.json",
}


def _table(m: ModuleType, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, dict], str]:
    files = ",".join(map(str, FILES))
    assert m.main(["--summarize", "--out-dir", str(out), "--files", files]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((out / "bars.json").read_text())["bars"]
    return {r["name"]: r for r in rows}, printed


def test_the_table_reads_each_benchmarks_result(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_benchmark("spec_bars")
    for name, recorded in RECORDED.items():
        shutil.copy(RESULTS / recorded, tmp_path / name)
    bars, printed = _table(m, tmp_path, capsys)
    rows_1b = json.loads((RESULTS / RECORDED["rows_llama-3.2-1b-Q4_K_M.json"]).read_text())["cases"]
    eight = bars["llama-3.2-1b-Q4_K_M: a forward of 8 rows / one row"]
    assert eight["measured"] == rows_1b["8 rows"]["best_rel"] and eight["met"] is False  # 1.93x against 1.6x
    assert bars["qwen2.5-1.5b-Q5_K_M: a forward of 4 rows / one row"]["met"] is True  # 1.22x against 1.3x
    assert bars["llama-3.2-3b-Q4_K_M: a forward of 4 rows / one row"]["measured"] is None  # no result: not measured
    assert bars["llama-3.2-1b-Q4_K_M: perfect drafts of 4 / plain"]["met"] is True
    assert bars["llama-3.2-3b-Q4_K_M: perfect drafts of 4 / plain"]["note"] == "identical"
    draft = bars["the draft's step / the target's"]
    assert draft["note"].startswith("draft_vocab 16384") and draft["met"] is True  # the cheapest of three, 0.288
    completions = bars["code completions: the best speculation / plain"]
    assert completions["note"] == "suffix; every output identical" and completions["met"] is True  # 1.88x
    assert bars["code completions: the draft model / plain"]["met"] is False  # 1.19x against 1.2x
    assert bars["code edits: the best speculation / plain"]["met"] is False  # 1.95x against 2x
    assert bars["open chat: the best speculation / plain"]["measured"] is None
    server = bars["tokenleap's best speculation / llama.cpp's best (server)"]
    assert server["measured"] == pytest.approx(40.9486 / 19.8797, rel=1e-4)  # suffix over ngram-mod
    assert "MISSED  code edits" in printed and "not measured" in printed and "met     code completions" in printed


def test_an_output_unlike_plain_is_named(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_benchmark("spec_bars")
    bench = json.loads((RESULTS / RECORDED["pair_codeedit.json"]).read_text())
    bench["summary"]["overall"]["suffix"]["matched_plain"] -= 1
    (tmp_path / "pair_codeedit.json").write_text(json.dumps(bench))
    bars, _ = _table(m, tmp_path, capsys)
    assert bars["code edits: the best speculation / plain"]["note"] == "suffix; OUTPUT DIFFERS"


def test_dry_run_prints_every_parts_command_under_the_kernels_asked_for(
    load_benchmark: Callable[[str], ModuleType], capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_benchmark("spec_bars")
    assert m.main(["--dry-run", "--kernels", "avx2", "--march", "znver3", "--files", ",".join(map(str, FILES))]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert all(line.startswith("TOKENLEAP_KERNELS=avx2 TOKENLEAP_KERNEL_MARCH=znver3 ") for line in lines)
    assert sum("forward_rows.py" in line for line in lines) == 3
    replay = next(line for line in lines if "model_sizes.py" in line)
    assert "Q5_K_M" not in replay and replay.count("Q4_K_M.gguf") == 2  # the replay bar is on the Q4_K_M files
    assert sum(" bench " in line for line in lines) == 3 and not any("pair_server.py" in line for line in lines)
    assert m.main(["--dry-run", "--parts", "server", "--llama-server", "/bin/llama-server"]) == 0
    assert "pair_server.py --llama-server /bin/llama-server" in capsys.readouterr().out


def test_bad_parts_and_missing_files_are_usage_errors(
    load_benchmark: Callable[[str], ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    m = load_benchmark("spec_bars")
    with pytest.raises(SystemExit) as exc:
        m.main(["--parts", "rows,speed"])
    assert exc.value.code == 2
    missing = tmp_path / "no.gguf"
    assert m.main(["--parts", "rows", "--files", str(missing), "--out-dir", str(tmp_path / "o")]) == 2
    assert "make_gguf.py" in capsys.readouterr().err and not (tmp_path / "o").exists()
