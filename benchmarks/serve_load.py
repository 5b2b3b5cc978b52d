"""Load test of `tokenleap serve`: throughput and latency under concurrency, speculation on vs off,
and a robustness run mixing good, malformed and disconnecting clients.

Measures what vLLM's `benchmark_serving.py` measures, on loopback only: Spec-Bench first turns
sent as streaming chat requests (greedy) with bounded concurrency (1, 4, 16 by default), each
request under the server's speculative config and with `"speculative": {"method": "none"}`.
Per cell: output tokens/s over the cell's wall time, time to first token, inter-token latency
per output token ((end - first token) / (tokens - 1), vLLM's TPOT) and the gaps between streamed
chunks (mean / p50 / p90), mean acceptance length, and whether every greedy answer matched the
other mode's (speculation is lossless). Each concurrency level gets its own prompts (both modes
the same ones), so a drafter that learns from earlier outputs is not handed the answers.
`--mixed` instead sends N requests at concurrency 16, a mix of good, malformed, explicit-null and
mid-stream-disconnecting clients, and checks that every good request completes with the text it
gets alone, every bad one (malformed, or a value the server must refuse) gets a 4xx error body,
every body of OpenAI's explicit nulls and neutral values is answered, the server stays up, and
its live-request count and resident memory return to their baseline.

The server is started here (`tokenleap serve` on a free loopback port, stopped with SIGTERM)
unless `--url` points at a running one. Writes JSON and a PNG chart to benchmarks/results/.

    .venv/bin/python benchmarks/serve_load.py                       # full run (idle machine!)
    .venv/bin/python benchmarks/serve_load.py -n 4 --max-tokens 16 --concurrency 1,4   # smoke
    .venv/bin/python benchmarks/serve_load.py --mixed -n 48         # robustness
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tokenleap.bench import default_spec_bench, load_questions

RESULTS = Path(__file__).resolve().parent / "results"
console = Console(stderr=True)


# --------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        ok = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        ok = False
    if not ok:
        raise SystemExit(f"error: --url must be a loopback address (127.0.0.0/8, ::1, localhost), got {host!r}")


class Server:
    """`tokenleap serve` in a subprocess on a free loopback port."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable, "-m", "tokenleap.cli", "serve", "--port", str(self.port), "--model", args.model,
            "--spec-type", args.spec_type, "--draft-max", str(args.draft_max), "--max-num-seqs", str(args.max_num_seqs),
            "--max-queue", "1024", "--log-level", "warning"
        ]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        with console.status(f"starting tokenleap serve ({args.model}, {args.spec_type})..."):
            while True:
                if self.proc.poll() is not None:
                    raise SystemExit(f"the server exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
                if time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit("the server did not come up within 180 s")
                try:
                    if httpx.get(self.url + "/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# --------------------------------------------------------------------------- one request


@dataclass
class Result:
    ok: bool
    text: str = ""
    tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    chunk_gaps: list[float] = field(default_factory=list)
    acceptance_length: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.tokens - 1) if self.tokens > 1 else None


async def stream_chat(http: httpx.AsyncClient, body: dict[str, Any], disconnect_after: int | None = None) -> Result:
    """One streaming chat request, timed chunk by chunk (closing early after `disconnect_after` chunks)."""
    t0 = time.perf_counter()
    res = Result(ok=False)
    last: float | None = None
    parts: list[str] = []
    chunks = 0
    try:
        async with http.stream(
            "POST", "/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
        ) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = data["error"]["message"]
                    return res
                if data.get("usage"):
                    res.tokens = data["usage"]["completion_tokens"]
                for choice in data.get("choices", []):
                    text = choice.get("delta", {}).get("content") or ""
                    if text:
                        now = time.perf_counter()
                        if last is None:
                            res.ttft = now - t0
                        else:
                            res.chunk_gaps.append(now - last)
                        last = now
                        parts.append(text)
                    if choice.get("finish_reason"):
                        res.acceptance_length = data.get("speculative", {}).get("mean_acceptance_length", 0.0)
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    res.error = "disconnected on purpose"
                    return res
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - t0
    res.text = "".join(parts)
    res.ok = True
    return res


# --------------------------------------------------------------------------- load cells


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0}
    ordered = sorted(values)
    return {
        "mean": statistics.fmean(ordered),
        "p50": ordered[len(ordered) // 2],
        "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
    }


async def run_cell(
    url: str, headers: dict[str, str], bodies: list[dict[str, Any]], concurrency: int, progress: Progress, task: Any
) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(600.0), limits=limits) as http:

        async def one(body: dict[str, Any]) -> Result:
            async with sem:
                res = await stream_chat(http, body)
                progress.advance(task)
                return res

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(b) for b in bodies))
        return list(results), time.perf_counter() - t0


def summarize(mode: str, concurrency: int, results: list[Result], wall: float) -> dict[str, Any]:
    good = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in good)
    return {
        "mode": mode,
        "concurrency": concurrency,
        "requests": len(results),
        "succeeded": len(good),
        "output_tokens": tokens,
        "wall_seconds": round(wall, 3),
        "throughput_tokens_per_second": round(tokens / wall, 2) if wall > 0 else 0.0,
        "ttft_seconds": _stats([r.ttft for r in good]),
        "inter_token_latency_seconds": _stats([t for r in good if (t := r.tpot) is not None]),
        "chunk_gap_seconds": _stats([g for r in good for g in r.chunk_gaps]),
        "mean_acceptance_length": round(statistics.fmean([r.acceptance_length for r in good]), 3) if good else 0.0,
        "errors": sorted({r.error for r in results if not r.ok})[:5],
    }


def load_prompts(args: argparse.Namespace) -> list[str]:
    path = Path(args.input) if args.input else default_spec_bench()
    questions = load_questions(path, args.questions_per_group)
    prompts = [q.turns[0] for q in questions]
    if not prompts:
        raise SystemExit(f"error: no prompts in {path}")
    return prompts


def _body(args: argparse.Namespace, prompt: str, plain: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    if plain:
        body["speculative"] = {"method": "none"}
    return body


async def _warm_up(url: str, headers: dict[str, str], bodies: list[dict[str, Any]]) -> None:
    """Untimed requests first (the cost curve of adaptive speculation is measured on first use)."""
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
        for body in bodies:
            await stream_chat(http, body)


def run_load(args: argparse.Namespace, url: str, headers: dict[str, str]) -> dict[str, Any]:
    prompts = load_prompts(args)
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    need = len(concurrencies) * args.requests + 1
    if len(prompts) < need:
        console.print(
            f"[yellow]{len(prompts)} prompts for {need} requests: prompts repeat across concurrency levels, "
            "and a drafter that learns from earlier outputs (suffix) then accepts more than on new prompts "
            "(raise -q)[/yellow]"
        )
    asyncio.run(_warm_up(url, headers, [{**_body(args, prompts[-1], m == "plain"), "max_tokens": 8} for m in modes]))
    cells, mismatches = [], 0
    total = len(concurrencies) * len(modes) * args.requests
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("requests", total=total)
        for i, c in enumerate(concurrencies):
            # each concurrency level gets its own prompts; both modes get the same ones
            picked = [prompts[(i * args.requests + j) % len(prompts)] for j in range(args.requests)]
            texts = []
            for mode in modes:
                bodies = [_body(args, p, mode == "plain") for p in picked]
                results, wall = asyncio.run(run_cell(url, headers, bodies, c, progress, task))
                cells.append(summarize(mode, c, results, wall))
                texts.append([r.text if r.ok else None for r in results])
            # greedy and lossless speculation: both modes give the same answers
            mismatches += sum(
                1 for ts in texts[1:] for a, b in zip(ts, texts[0]) if a is not None and b is not None and a != b
            )
    return {"cells": cells, "mismatched_answers": mismatches}


# --------------------------------------------------------------------------- mixed clients


_HI = [{"role": "user", "content": "hi"}]

# bodies that must get a 4xx error body: malformed, or values this server must still refuse
BAD_BODIES: list[bytes] = [
    b"{not json",
    json.dumps({"messages": _HI, "temperature": -1}).encode(),
    json.dumps({"messages": _HI, "max_tokens": -5}).encode(),
    json.dumps({"messages": _HI, "top_p": 7}).encode(),
    json.dumps({"messages": _HI, "n": 0}).encode(),
    json.dumps({"messages": _HI, "n": 1000}).encode(),
    json.dumps({"messages": _HI, "stream": "yes"}).encode(),
    json.dumps({"messages": _HI, "stream_options": {"include_usage": True}}).encode(),  # usage without a stream
    json.dumps({"messages": _HI, "top_logprobs": 3}).encode(),  # without logprobs
    json.dumps({"messages": _HI, "audio": {"voice": "alloy", "format": "wav"}}).encode(),  # unsupported fields (README)
    json.dumps({"messages": _HI, "logit_bias": {"50": 10}}).encode(),
    json.dumps({"messages": _HI, "web_search_options": {}}).encode(),
    json.dumps(
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    ).encode(),
    json.dumps({"messages": _HI, "tool_choice": "required"}).encode(),  # without tools
    json.dumps({"model": "no-such-model", "messages": _HI}).encode(),
    json.dumps({"messages": "hello"}).encode(),
    json.dumps({"messages": None}).encode(),
    json.dumps({"messages": _HI, "speculative": {"method": "bogus"}}).encode(),
    json.dumps({"messages": [{"role": "user", "content": "x" * (2 << 20)}]}).encode(),  # over the default body limit
]

# bodies that must be answered (200): OpenAI's explicit nulls ("unset") and neutral values
NULL_BODIES: list[bytes] = [
    json.dumps(
        {
            "messages": _HI, "max_tokens": 4, "stream": None, "n": None, "stream_options": None, "temperature": None,
            "top_p": None, "stop": None, "seed": None, "logprobs": None, "top_logprobs": None, "tools": None,
            "tool_choice": None, "response_format": None, "audio": None, "modalities": None, "logit_bias": None,
            "user": None
        }
    ).encode(),
    json.dumps(
        {
            "messages": _HI, "max_tokens": 4, "n": 2, "stream_options": {}, "modalities": ["text"], "logit_bias": {},
            "store": False, "reasoning_effort": None, "service_tier": "auto"
        }
    ).encode(),
    json.dumps(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}], "name": None}],
            "max_tokens": 4,
            "max_completion_tokens": None,
            "parallel_tool_calls": None,
            "prediction": None,
            "metadata": None,
        }
    ).encode(),
]


def _health(url: str, headers: dict[str, str]) -> dict[str, Any]:
    return httpx.get(url + "/health", headers=headers, timeout=10).json()


def _rss(url: str, headers: dict[str, str]) -> float:
    for line in httpx.get(url + "/metrics", headers=headers, timeout=10).text.splitlines():
        if line.startswith("process_resident_memory_bytes "):
            return float(line.split()[1])
    return 0.0


def run_mixed(args: argparse.Namespace, url: str, headers: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prompts = load_prompts(args)[:4]
    console.print("mixed: reference answers, one request at a time")

    async def references() -> list[str]:
        async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as http:
            return [(await stream_chat(http, _body(args, p, False))).text for p in prompts]

    expected = asyncio.run(references())
    baseline_rss = _rss(url, headers)
    kinds = [rng.choice(("good", "good", "bad", "nulls", "disconnect")) for _ in range(args.requests)]
    outcome: dict[str, list[bool]] = {"good": [], "bad": [], "nulls": [], "disconnect": []}

    async def mixed() -> None:
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(
            base_url=url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=24)
        ) as http:

            async def one(i: int, kind: str, progress: Progress, task: Any) -> None:
                async with sem:
                    k = i % len(prompts)
                    if kind == "good":
                        res = await stream_chat(http, _body(args, prompts[k], rng.random() < 0.5))
                        outcome["good"].append(res.ok and res.text == expected[k])
                    elif kind == "disconnect":
                        await stream_chat(
                            http,
                            {**_body(args, prompts[k], False), "max_tokens": 512, "ignore_eos": True},
                            disconnect_after=rng.randint(1, 5),
                        )
                        outcome["disconnect"].append(True)
                    elif kind == "nulls":
                        r = await http.post(
                            "/v1/chat/completions",
                            content=rng.choice(NULL_BODIES),
                            headers={"content-type": "application/json"},
                        )
                        answer = r.json() if r.status_code == 200 else {}
                        outcome["nulls"].append(
                            r.status_code == 200
                            and isinstance(answer.get("system_fingerprint"), str)
                            and all(c["message"].get("refusal", 0) is None for c in answer.get("choices", [0]))
                        )
                    else:
                        try:
                            r = await http.post(
                                "/v1/chat/completions",
                                content=rng.choice(BAD_BODIES),
                                headers={"content-type": "application/json"},
                            )
                            outcome["bad"].append(400 <= r.status_code < 500 and "error" in r.json())
                        except httpx.HTTPError:  # an oversize upload may be cut off by the server: fine too
                            outcome["bad"].append(True)
                    progress.advance(task)

            with Progress(console=console, transient=True) as progress:
                task = progress.add_task("mixed", total=len(kinds))
                await asyncio.gather(*(one(i, kind, progress, task) for i, kind in enumerate(kinds)))

    asyncio.run(mixed())
    deadline = time.monotonic() + 60
    health = _health(url, headers)
    while (health["live"] or health["running"] or health["waiting"]) and time.monotonic() < deadline:
        time.sleep(0.2)
        health = _health(url, headers)
    rss = _rss(url, headers)
    checks = {
        "every_good_request_correct": all(outcome["good"]),
        "every_bad_request_4xx": all(outcome["bad"]),
        "every_null_body_accepted": all(outcome["nulls"]),
        "server_up": health["status"] == "ok",
        "no_live_requests_left": health["live"] == 0 and health["running"] == 0 and health["waiting"] == 0,
        "rss_back_to_baseline": rss <= baseline_rss * 1.10 + 64e6,
    }
    return {
        "counts": {k: len(v) for k, v in outcome.items()}, "good_correct": sum(outcome["good"]),
        "bad_rejected": sum(outcome["bad"]), "nulls_accepted": sum(outcome["nulls"]), "health_after": health,
        "rss_baseline_bytes": baseline_rss, "rss_after_bytes": rss, "checks": checks
    }


# --------------------------------------------------------------------------- output


def plot(path: Path, cells: list[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for mode in sorted({c["mode"] for c in cells}):
        rows = sorted((c for c in cells if c["mode"] == mode), key=lambda c: c["concurrency"])
        xs = [c["concurrency"] for c in rows]
        label = "speculation on" if mode == "spec" else "speculation off"
        color = "C1" if mode == "spec" else "C0"
        axes[0].plot(xs, [c["throughput_tokens_per_second"] for c in rows], marker="o", color=color, label=label)
        for ax, key, scale in ((axes[1], "ttft_seconds", 1.0), (axes[2], "inter_token_latency_seconds", 1000.0)):
            ax.plot(xs, [c[key]["p50"] * scale for c in rows], marker="o", color=color, label=f"{label} p50")
            ax.plot(
                xs, [c[key]["p90"] * scale for c in rows], marker="x", linestyle="--", color=color, label=f"{label} p90"
            )
    for ax, title, unit in zip(
        axes, ("output throughput", "time to first token", "inter-token latency"), ("tokens/s", "s", "ms per token")
    ):
        ax.set_title(title)
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(unit)
        ax.set_xscale("log", base=2)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle("tokenleap serve under load (Spec-Bench prompts, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(cells: list[dict[str, Any]]) -> None:
    table = Table(title="tokenleap serve load")
    for col in (
        "mode", "clients", "ok", "tok/s", "TTFT p50", "TTFT p90", "ITL mean", "ITL p50", "ITL p90", "accept len"
    ):
        table.add_column(col, justify="left" if col == "mode" else "right")
    for c in cells:
        t, i = c["ttft_seconds"], c["inter_token_latency_seconds"]
        table.add_row(
            c["mode"], str(c["concurrency"]), f"{c['succeeded']}/{c['requests']}",
            f"{c['throughput_tokens_per_second']:.1f}", f"{t['p50']:.3f} s", f"{t['p90']:.3f} s",
            f"{i['mean'] * 1000:.1f} ms", f"{i['p50'] * 1000:.1f} ms", f"{i['p90'] * 1000:.1f} ms",
            f"{c['mean_acceptance_length']:.2f}"
        )
    Console().print(table)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--url", default=None, help="a running server on loopback (default: start tokenleap serve here)")
    p.add_argument(
        "--api-key", default=os.environ.get("TOKENLEAP_API_KEY"), help="Bearer key (default: $TOKENLEAP_API_KEY)"
    )
    p.add_argument(
        "--model", default="smollm2-135m-instruct", help="model for the server started here (default: %(default)s)"
    )
    p.add_argument(
        "--spec-type", default="suffix", help="the started server's default speculation (default: %(default)s)"
    )
    p.add_argument("--draft-max", type=int, default=16, help="draft length cap (default: %(default)s)")
    p.add_argument(
        "--max-num-seqs",
        "--max-batch",
        type=int,
        default=16,
        help="the started server's --max-num-seqs (--max-batch: its former name) (default: %(default)s)",
    )
    p.add_argument("--threads", type=int, default=None, help="the started server's CPU threads")
    p.add_argument(
        "--requests",
        "-n",
        type=int,
        default=32,
        help="requests per cell, or in total with --mixed (default: %(default)s)",
    )
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated client counts (default: %(default)s)")
    p.add_argument(
        "--modes", default="spec,plain", help="spec (server default speculation) and/or plain (default: %(default)s)"
    )
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens per request (default: %(default)s)")
    p.add_argument(
        "--input",
        default=None,
        help="Spec-Bench JSONL (default: ../shared/bench/spec_bench.jsonl, else the shipped subset)",
    )
    p.add_argument(
        "--questions-per-group", "-q", type=int, default=16, help="prompts per Spec-Bench group (default: %(default)s)"
    )
    p.add_argument(
        "--mixed",
        action="store_true",
        help="robustness run: good, malformed and disconnecting clients at concurrency 16",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed run's choices (default: %(default)s)")
    p.add_argument(
        "--out", default=None, help="JSON output (default: results/serve_load.json, or serve_load_mixed.json)"
    )
    p.add_argument("--plot", default=None, help="PNG chart (default: next to --out)")
    args = p.parse_args()
    if args.requests < 1 or args.max_tokens < 1:
        raise SystemExit("error: --requests and --max-tokens must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    server = None
    if args.url:
        _check_loopback(args.url)
        url = args.url.rstrip("/")
    else:
        server = Server(args)
        url = server.url
    meta = {
        "url": url if args.url else "started here", "model": args.model,
        "spec_type": args.spec_type if not args.url else None, "draft_max": args.draft_max,
        "max_num_seqs": args.max_num_seqs, "requests": args.requests, "max_tokens": args.max_tokens,
        "concurrency": args.concurrency, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg(),
        "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")
    }
    try:
        if args.mixed:
            result = run_mixed(args, url, headers)
        else:
            result = run_load(args, url, headers)
    finally:
        if server is not None:
            server.stop()
    RESULTS.mkdir(exist_ok=True)
    out = Path(args.out) if args.out else RESULTS / ("serve_load_mixed.json" if args.mixed else "serve_load.json")
    out.write_text(json.dumps({"meta": meta, **result}, indent=2) + "\n")
    if args.mixed:
        for name, ok in result["checks"].items():
            console.print(f"{'[green]ok[/green]' if ok else '[red]FAILED[/red]'}  {name}")
        console.print(
            f"requests: {result['counts']}; RSS {result['rss_baseline_bytes'] / 1e6:.0f} MB -> "
            f"{result['rss_after_bytes'] / 1e6:.0f} MB; wrote {out}"
        )
        return 0 if all(result["checks"].values()) else 1
    print_table(result["cells"])
    png = Path(args.plot) if args.plot else out.with_suffix(".png")
    plot(png, result["cells"])
    console.print(
        f"answers differing between speculation on and off: {result['mismatched_answers']}; wrote {out} and {png}"
    )
    return 0 if result["mismatched_answers"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
