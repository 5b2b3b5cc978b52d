"""Build the code-editing workload: real source files given in the prompt, to be returned with
one small change (a rename). Writes `benchmarks/data/code_edit.jsonl` in the `{"messages"}`
format `tokenleap bench --input` reads. The files are this repository's own small modules, so the
workload is reproducible from a checkout.

    python benchmarks/make_code_edit.py && \\
    tokenleap bench --input benchmarks/data/code_edit.jsonl -q 16 -n 4096 --methods ngram,suffix --draft-max 31
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = [  # modules of 0.5-5 kB (100-1500 tokens)
    "src/tokenleap/paths.py",
    "src/tokenleap/errors.py",
    "src/tokenleap/drafters/chain.py",
    "src/tokenleap/verify/reference.py",
    "src/tokenleap/drafters/ngram.py",
    "src/tokenleap/server/errors.py",
    "src/tokenleap/models/config.py",
    "src/tokenleap/drafters/ngram_mod.py",
    "src/tokenleap/models/loading.py",
    "src/tokenleap/server/config.py",
    "src/tokenleap/verify/chain.py",
    "src/tokenleap/drafters/base.py",
    "src/tokenleap/types.py",
    "src/tokenleap/sampling.py",
    "src/tokenleap/tokenizer.py",
    "src/tokenleap/engine/request.py",
]


def edit_for(source: str) -> tuple[str, str] | None:
    """Pick an identifier defined in the file (a function or class) and a new name for it."""
    match = re.search(r"^(?:def|class) ([A-Za-z_][A-Za-z0-9_]*)", source, re.M)
    if match is None:
        return None
    old = match.group(1)
    new = old + "_v2" if old[0].islower() else old + "V2"
    return old, new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks/data/code_edit.jsonl"))
    args = parser.parse_args()
    rows = []
    for rel in FILES:
        source = (ROOT / rel).read_text()
        edit = edit_for(source)
        if edit is None:
            continue
        old, new = edit
        prompt = (
            f"Here is the Python file `{rel}`:\n\n```python\n{source}```\n\n"
            f"Rename `{old}` to `{new}` everywhere in this file. Reply with the complete updated file "
            "in one Python code block and nothing else."
        )
        rows.append({
            "question_id": rel,
            "category": "code_edit",
            "messages": [{"role": "user", "content": prompt}],
            # the answer opens the code block, as code-editing tools prefill it; without it the
            # 135M default model describes the change instead of returning the file
            "assistant_prefix": "```python\n",
            # the answer is the whole file: it ends where the model closes the code block
            "stop": ["\n```"],
            # room for the file (~3.3 characters a token) and then some; the 135M model sometimes
            # loops instead of closing the block, and the cap keeps a loop from dominating the run
            "max_tokens": len(source) // 2 + 64,
        })
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} prompts to {args.out}")


if __name__ == "__main__":
    main()
