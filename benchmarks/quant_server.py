"""Spec-Bench end to end over HTTP: `tokenleap serve --quantization gguf` with and without
speculation against llama.cpp's plain `llama-server`, on the same GGUF file, back to back.

Both servers run side by side on the default model's own Q4_1 file (`--threads` each; a server
that is not answering sleeps) and get the same requests one at a time: for each Spec-Bench first
turn (`--per-group` per group, as `tokenleap bench -q`), a chat completion with greedy decoding and
`--max-tokens`, sent to llama-server, to tokenleap with `"speculative": {"method": "none"}` (plain
decoding, same server) and to tokenleap with its default speculation (`--spec-type`), the order
rotating per prompt. The figure is end-to-end tokens per second as a client sees it: completion
tokens over wall time from request to full response (HTTP, prefill, decode; natural stops, so
each system generates its own answer's length). llama-server keeps its defaults (prompt cache on:
the chat template's shared system prompt is not prefilled again). Every tokenleap speculative
answer must equal tokenleap's plain answer token for token (greedy, same weights); llama.cpp's
answers differ in places (other kernels, other rounding) and are only counted.

    benchmarks/build_llamacpp.sh   # TARGETS="llama-bench llama-server"
    .venv/bin/python benchmarks/quant_server.py --llama-server benchmarks/.peer/llama.cpp/build/bin/llama-server
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

from tokenleap.bench import default_spec_bench, load_questions  # noqa: E402
from tokenleap.models.registry import resolve  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def wait_healthy(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.5)
    raise SystemExit(f"{what} not ready after {timeout:.0f} s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--llama-server", required=True, help="path of a llama-server binary (benchmarks/build_llamacpp.sh)"
    )
    ap.add_argument(
        "--per-group", "-q", type=int, default=8, help="Spec-Bench first turns per group (default: %(default)s)"
    )
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--spec-type", default="suffix", help="tokenleap's speculation (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "quant_server.json")
    args = ap.parse_args()

    model_file = resolve("smollm2-135m-instruct").path
    questions = load_questions(default_spec_bench(), args.per_group)
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}  # llama.cpp's OpenMP keeps its default
    lport, tport = free_port(), free_port()
    llama = subprocess.Popen(
        [args.llama_server, "-m", str(model_file), "-t", str(args.threads), "-c", "4096", "-np", "1",
         "--host", "127.0.0.1", "--port", str(lport)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    tl = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "tokenleap"), "serve", "--quantization", "gguf", "--spec-type",
            args.spec_type, "--threads", str(args.threads), "--port", str(tport), "--max-num-seqs", "1", "--log-level",
            "warning"
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "model_file": str(model_file), "threads": args.threads, "spec_type": args.spec_type,
        "max_tokens": args.max_tokens, "load_before": os.getloadavg()
    }
    try:
        wait_healthy(f"http://127.0.0.1:{lport}/health", llama, "llama-server")
        wait_healthy(f"http://127.0.0.1:{tport}/health", tl, "tokenleap serve")
        systems = {
            "llama-server": (f"http://127.0.0.1:{lport}/v1/chat/completions", {}),
            "tokenleap plain": (f"http://127.0.0.1:{tport}/v1/chat/completions", {"speculative": {"method": "none"}}),
            f"tokenleap {args.spec_type}": (f"http://127.0.0.1:{tport}/v1/chat/completions", {}),
        }
        names = list(systems)

        def ask(name: str, text: str) -> tuple[float, dict[str, Any]]:
            url, extra = systems[name]
            body = {"model": "smollm2-135m-instruct", "messages": [{"role": "user", "content": text}],
                    "max_tokens": args.max_tokens, "temperature": 0.0, **extra}
            t0 = time.perf_counter()
            out = post(url, body)
            return time.perf_counter() - t0, out

        for name in names:  # warm-up (tokenleap measures its verify cost curve on first use)
            ask(name, "Say hello.")
        totals = {n: {"seconds": 0.0, "tokens": 0} for n in names}
        per_group: dict[str, dict[str, dict[str, float]]] = {}
        texts: dict[str, list[str]] = {n: [] for n in names}
        for i, q in enumerate(questions):
            for name in names[i % 3 :] + names[: i % 3]:
                dt, out = ask(name, q.turns[0])
                tokens = int(out["usage"]["completion_tokens"])
                for bucket in (
                    totals[name],
                    per_group.setdefault(q.group, {}).setdefault(name, {"seconds": 0.0, "tokens": 0}),
                ):
                    bucket["seconds"] += dt
                    bucket["tokens"] += tokens
                texts[name].append(out["choices"][0]["message"]["content"])
            print(
                f"[{i + 1}/{len(questions)}] "
                + ", ".join(f"{n} {totals[n]['tokens'] / totals[n]['seconds']:.1f}" for n in names)
                + " tok/s",
                flush=True,
            )
    finally:
        stop(tl)
        stop(llama)
    spec = names[2]
    for bucket in [*totals.values(), *(b for g in per_group.values() for b in g.values())]:
        bucket["tok_s"] = bucket["tokens"] / bucket["seconds"]
    result["totals"] = totals
    result["per_group"] = per_group
    result["prompts"] = len(questions)
    result["spec_over_llama_server"] = totals[spec]["tok_s"] / totals["llama-server"]["tok_s"]
    result["plain_over_llama_server"] = totals["tokenleap plain"]["tok_s"] / totals["llama-server"]["tok_s"]
    result["spec_over_plain"] = totals[spec]["tok_s"] / totals["tokenleap plain"]["tok_s"]
    result["spec_identical_to_plain"] = sum(a == b for a, b in zip(texts[spec], texts["tokenleap plain"]))
    result["llama_identical_to_tokenleap"] = sum(
        a == b for a, b in zip(texts["llama-server"], texts["tokenleap plain"])
    )
    result["load_after"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "per_group"}, indent=1))
    for g, by in sorted(per_group.items()):
        print(f"{g:22s} " + "  ".join(f"{n} {b['tok_s']:.1f}" for n, b in by.items()))
    return 0 if result["spec_identical_to_plain"] == len(questions) else 1


if __name__ == "__main__":
    raise SystemExit(main())
