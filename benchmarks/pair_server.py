"""The real target / draft pair over HTTP: tokenleap's server against llama.cpp's llama-server,
every configuration resident at once and taking turns prompt by prompt (issue 37 item 6).

Servers, each with `--threads` threads, on the same GGUF files (the registry's
qwen2.5-coder-1.5b-instruct target and qwen2.5-coder-0.5b-instruct draft by default):

* tokenleap: one server whose own speculation is the draft model (`--draft-vocab`, `--draft-max`),
  asked per request for plain decoding (`"speculative": {"method": "none"}`), suffix decoding and
  its default (the draft model);
* llama-server plain; with the draft model (`-md`) at llama.cpp's defaults (3 draft tokens, no
  p-min) and tuned (`--llama-draft-flags`, default `--spec-draft-n-max 8 --spec-draft-p-min 0.6`);
  and with its draftless ngram-mod (`--spec-type ngram-mod`).

For each prompt (`--input`'s first user turns, `--per-group` a group: HumanEval's code completions
by default), a greedy chat completion of at most `--max-tokens` goes to every configuration, the
order rotating per prompt (this host's memory bandwidth moves by up to 2x within an hour: runs of
one engine then the other mislead). The figure is completion tokens over wall time as a client
sees it (HTTP, prefill, decode). tokenleap's speculative answers must equal its plain answers
token for token; llama.cpp's answers are counted, not compared (other kernels, other rounding).

    TARGETS="llama-server" benchmarks/build_llamacpp.sh
    .venv/bin/python benchmarks/make_humaneval.py
    .venv/bin/python benchmarks/pair_server.py --llama-server benchmarks/.peer/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
import urllib.error
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from model_sizes import cpu_name  # noqa: E402
from quant_server import free_port, post, stop, wait_healthy  # noqa: E402

from tokenleap.bench import load_questions  # noqa: E402
from tokenleap.models.registry import resolve  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--llama-server", required=True, help="a llama-server binary (benchmarks/build_llamacpp.sh)")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--input", type=Path, default=ROOT / "benchmarks" / "data" / "humaneval.jsonl")
    ap.add_argument("--per-group", "-q", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--draft-max", type=int, default=4, help="tokenleap's draft length cap")
    ap.add_argument("--draft-vocab", type=int, default=32768, help="tokenleap's draft vocabulary (0: the whole)")
    ap.add_argument(
        "--llama-draft-flags",
        default="--spec-draft-n-max 8 --spec-draft-p-min 0.6",
        help="llama-server -md tuned: its draft flags",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "pair_server.json")
    args = ap.parse_args()

    target, draft = resolve(args.target).path, resolve(args.draft).path
    questions = load_questions(args.input, args.per_group)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # llama.cpp's OpenMP keeps its default
    common = ["-m", str(target), "-t", str(args.threads), "-c", "4096", "-np", "1", "--host", "127.0.0.1"]
    llama_configs = {
        "llama-server plain": [],
        "llama-server -md": ["-md", str(draft), "-td", str(args.threads)],
        "llama-server -md tuned": ["-md", str(draft), "-td", str(args.threads), *shlex.split(args.llama_draft_flags)],
        "llama-server ngram-mod": ["--spec-type", "ngram-mod"],
    }
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    tport = free_port()
    tl = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "tokenleap"), "serve", "-m", args.target, "-md", args.draft,
            "--spec-type", "draft-model", "--spec-draft-vocab", str(args.draft_vocab), "--draft-max",
            str(args.draft_max), "--threads", str(args.threads), "--max-num-speculative-tokens", "16", "--port",
            str(tport), "--max-num-seqs", "1", "--log-level", "warning"
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_name(),
        "target": str(target),
        "draft": str(draft),
        "input": str(args.input),
        "threads": args.threads,
        "max_tokens": args.max_tokens,
        "tokenleap": {"draft_max": args.draft_max, "draft_vocab": args.draft_vocab},
        "llama_configs": {k: " ".join(v) for k, v in llama_configs.items()},
        "load_before": os.getloadavg(),
    }
    try:
        for name, extra in llama_configs.items():
            port = free_port()
            procs[name] = (subprocess.Popen([args.llama_server, *common, "--port", str(port), *extra], env=env,
                                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), port)
        wait_healthy(f"http://127.0.0.1:{tport}/health", tl, "tokenleap serve", timeout=600)
        for name, (proc, port) in procs.items():
            wait_healthy(f"http://127.0.0.1:{port}/health", proc, name, timeout=600)
        tl_url = f"http://127.0.0.1:{tport}/v1/chat/completions"
        systems: dict[str, tuple[str, dict[str, Any]]] = {
            "tokenleap plain": (tl_url, {"speculative": {"method": "none"}}),
            "tokenleap suffix": (tl_url, {"speculative": {"method": "suffix", "num_speculative_tokens": 16}}),
            f"tokenleap draft-model (vocab {args.draft_vocab})": (tl_url, {}),
            **{name: (f"http://127.0.0.1:{port}/v1/chat/completions", {}) for name, (_, port) in procs.items()},
        }
        names = list(systems)

        def ask(name: str, text: str) -> tuple[float, dict[str, Any]]:
            url, extra = systems[name]
            body = {
                "model": args.target,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                **extra,
            }
            t0 = time.perf_counter()
            try:
                out = post(url, body)
            except urllib.error.HTTPError as exc:
                raise SystemExit(f"{name}: HTTP {exc.code}: {exc.read().decode(errors='replace')[:500]}") from None
            return time.perf_counter() - t0, out

        for name in names:  # warm-up (tokenleap measures its verify cost curve on first use)
            ask(name, "Say hello.")
        totals = {n: {"seconds": 0.0, "tokens": 0} for n in names}
        texts: dict[str, list[str]] = {n: [] for n in names}
        for i, q in enumerate(questions):
            for name in names[i % len(names) :] + names[: i % len(names)]:
                dt, out = ask(name, q.turns[0])
                totals[name]["seconds"] += dt
                totals[name]["tokens"] += int(out["usage"]["completion_tokens"])
                texts[name].append(out["choices"][0]["message"]["content"])
            print(
                f"[{i + 1}/{len(questions)}] "
                + ", ".join(f"{n} {t['tokens'] / t['seconds']:.1f}" for n, t in totals.items())
                + " tok/s",
                flush=True,
            )
    finally:
        stop(tl)
        for proc, _ in procs.values():
            stop(proc)
    for t in totals.values():
        t["tok_s"] = t["tokens"] / t["seconds"]
    plain = totals["tokenleap plain"]["tok_s"]
    llama_plain = totals["llama-server plain"]["tok_s"]
    best_tl = max((n for n in names if n.startswith("tokenleap")), key=lambda n: totals[n]["tok_s"])
    best_llama = max(
        (n for n in names if n.startswith("llama-server") and n != "llama-server plain"),
        key=lambda n: totals[n]["tok_s"],
    )
    result.update(prompts=len(questions), totals=totals, best_tokenleap=best_tl, best_llama_speculation=best_llama,
                  best_over_best=totals[best_tl]["tok_s"] / totals[best_llama]["tok_s"],
                  identical_to_plain={n: sum(a == b for a, b in zip(texts[n], texts["tokenleap plain"], strict=True))
                                      for n in names if n.startswith("tokenleap")},
                  load_after=os.getloadavg())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{cpu_name()}; {len(questions)} prompts of {args.input.name}, {args.max_tokens} tokens at most")
    print("| system | tok/s | vs tokenleap plain | vs llama-server plain |\n| --- | --- | --- | --- |")
    for n in names:
        print(
            f"| {n} | {totals[n]['tok_s']:.1f} | "
            f"{totals[n]['tok_s'] / plain:.2f}x | {totals[n]['tok_s'] / llama_plain:.2f}x |"
        )
    print(f"best tokenleap ({best_tl}) / best llama.cpp speculation ({best_llama}): {result['best_over_best']:.2f}x; "
          f"identical to plain: {result['identical_to_plain']}")
    return 0 if all(v == len(questions) for v in result["identical_to_plain"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
