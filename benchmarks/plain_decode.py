"""Plain (non-speculative) decoding speed of tokenleap against transformers, and its floors.

Everything is measured back to back in one process, on the same prompts, with
`torch.set_num_threads(--threads)` (default 2) for every engine:

1. Greedy decoding tokens/s. The first `--questions-per-group` questions (file order) of each
   of Spec-Bench's six groups (MT-bench = writing, roleplay, reasoning, math, coding,
   extraction, stem, humanities; translation; summarization; qa; math_reasoning; rag), first
   turn only, wrapped in the model's chat template by tokenleap's tokenizer; the same token ids
   go to every engine. Engines: tokenleap bf16 and fp32 (`LLM.generate`,
   `SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)`) and transformers fp32 and
   bf16 (`generate(do_sample=False, max_new_tokens=N, min_new_tokens=N)`, its default cache and
   attention), so every engine produces exactly N new tokens. Engines are interleaved per
   prompt (prompt 1 on every engine, then prompt 2, ...; the engine order rotates by prompt)
   so machine drift hits all of them alike.

   * Decode tokens/s excludes prefill and the first token on both sides: (N - 1) / time from
     the first new token to the last. tokenleap: `RequestOutput.metrics.decode_tokens_per_second`
     (the sum of `Engine.step` times: forward, LM head, argmax, detokenization). transformers: a
     `BaseStreamer` timestamps every `put` (on CPU `generate` calls it synchronously right
     after each token is chosen); decode time = last put - first new-token put. This is the
     same interval as tokenleap's, with no second generate call to subtract.
   * End-to-end tokens/s = N / wall-clock time of the whole generate call (prefill included).
   * Aggregates are total tokens / total seconds; ratios are of those aggregates, and also the
     geometric mean of the per-prompt (paired) ratios.
   * Greedy equality, tokenleap fp32 vs transformers fp32 (and bf16 vs bf16, for information):
     tokens are compared up to the first end-of-sequence token either engine's tokenizer
     declares, because transformers' `min_new_tokens` masks EOS out of the logits while
     tokenleap's `ignore_eos` emits it and continues; after that point the two are not
     computing the same thing.

2. Bytes of weights read per decoded token (`model.weight_bytes_per_token()` per dtype) and
   the bandwidth floor: memory read bandwidth is measured in the same run (`torch.sum` over a
   1 GiB float32 tensor, best of several) together with copy bandwidth (1 GiB `copy_`, counted
   as bytes read + bytes written); floor tokens/s = read bandwidth / bytes per token, and each
   engine's decode tokens/s is reported as a fraction of its dtype's floor. The "kernel
   floor": one pass of single-row linears over every weight matrix of the model (all 30
   layers' QKV, O, gate+up, down, then the LM head: cold, the pass is far larger than the
   caches) with torch `F.linear` (bf16 and fp32) and with tokenleap's kernels
   (`tokenleap.kernels.load_kernels().linear`, fp32 activations); 1 / pass time is the
   tokens/s ceiling if decoding were only those linears.

3. Verify cost curve: with ~`--verify-context` tokens in a `KVCache`, the time of one
   `model.forward` of k new tokens plus `compute_logits` on all k rows, for k = 1..32, then
   `kv.truncate` back; median over repeats (repeats outermost, so drift is shared), reported
   relative to k = 1, for bf16 and fp32. Plotted to `verify_cost.png` next to the JSON.

4. A `torch.profiler` breakdown of tokenleap bf16 decode steps, top ops by self CPU time. The
   compiled kernels are called through ctypes and would be invisible to the profiler, so the
   model's kernel object is wrapped for the profile only in one that opens a
   `record_function("tokenleap::linear" / "tokenleap::attention")` range per call.

Absolute numbers drift on shared machines (the project's performance method: ratios in one run,
never absolute times); the load average before and after the run is stored with the results,
and the JSON is rewritten after every prompt and
section (`"complete": false` until the end), so an interrupted run keeps what it measured. On a
CPU shared with other busy processes the OpenMP threads of the kernels spin-wait and decoding
slows down several-fold; such a run measures the contention, not the engine. Results: JSON
(default benchmarks/results/plain_decode.json, or plain_decode_quick.json with --quick), the
plot beside it, and rich tables on stdout.

    python benchmarks/plain_decode.py --quick          # smoke run: 2 prompts, 32 tokens
    python benchmarks/plain_decode.py                  # 24 prompts, 128 tokens, 4 engines
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from tokenleap import LLM, SamplingParams
from tokenleap.bench import default_spec_bench
from tokenleap.config import DEFAULT_MODEL
from tokenleap.kernels import CpuKernels, load_kernels
from tokenleap.models.llama import LlamaModel
from tokenleap.models.registry import resolve

ROOT = Path(__file__).resolve().parent
SPEC_BENCH = default_spec_bench()  # ../shared/bench beside the checkout, else the shipped subset
MT_BENCH = frozenset({"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"})
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")
ENGINES = ("tl-bf16", "tl-fp32", "hf-fp32", "hf-bf16")
ENGINE_DTYPE = MappingProxyType({"tl-bf16": "bf16", "tl-fp32": "fp32", "hf-fp32": "fp32", "hf-bf16": "bf16"})
RATIOS = (("tl-bf16", "hf-fp32"), ("tl-bf16", "hf-bf16"), ("tl-fp32", "hf-fp32"))
GIB = 1 << 30


# ----------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Question:
    question_id: int
    category: str
    group: str
    text: str


def group_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


def load_questions(path: Path, per_group: int, limit: int | None = None) -> list[Question]:
    """The first `per_group` questions of each group, round-robin over groups (then `limit`)."""
    by_group: dict[str, list[Question]] = {g: [] for g in GROUPS}
    with path.open() as f:
        for line in f:
            row = json.loads(line)
            group = group_of(row["category"])
            if group in by_group and len(by_group[group]) < per_group:
                by_group[group].append(Question(int(row["question_id"]), row["category"], group, row["turns"][0]))
    ordered = [by_group[g][i] for i in range(per_group) for g in GROUPS if i < len(by_group[g])]
    return ordered[:limit] if limit else ordered


# ----------------------------------------------------------------------------- engines


@dataclass
class GenResult:
    tokens: list[int]
    prefill_s: float  # prompt forward + first token
    decode_s: float  # first new token -> last new token
    e2e_s: float  # wall clock of the whole call

    @property
    def decode_tps(self) -> float:
        return (len(self.tokens) - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def e2e_tps(self) -> float:
        return len(self.tokens) / self.e2e_s if self.e2e_s > 0 else 0.0


class Engine(Protocol):
    name: str

    def generate(self, prompt_ids: list[int], max_tokens: int) -> GenResult: ...


class TokenleapEngine:
    def __init__(self, name: str, llm: LLM) -> None:
        self.name = name
        self.llm = llm

    def generate(self, prompt_ids: list[int], max_tokens: int) -> GenResult:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        out = self.llm.generate(prompt_ids, params, use_tqdm=False)[0]
        e2e = time.perf_counter() - t0
        m = out.metrics
        return GenResult(list(out.outputs[0].token_ids), m.prefill_seconds, m.decode_seconds, e2e)


def _streamer_class() -> type:
    from transformers.generation.streamers import BaseStreamer

    class TimestampStreamer(BaseStreamer):
        """Records perf_counter() at every put after the prompt's (one put per new token)."""

        def __init__(self) -> None:
            self.times: list[float] = []
            self._seen_prompt = False

        def put(self, value: torch.Tensor) -> None:
            now = time.perf_counter()
            if not self._seen_prompt:
                self._seen_prompt = True
                return
            self.times.append(now)

        def end(self) -> None:
            pass

    return TimestampStreamer


class TransformersEngine:
    def __init__(self, name: str, model: Any, pad_token_id: int) -> None:
        self.name = name
        self.model = model
        self.pad_token_id = pad_token_id
        self._streamer_cls = _streamer_class()

    def generate(self, prompt_ids: list[int], max_tokens: int) -> GenResult:
        ids = torch.tensor([prompt_ids], dtype=torch.long)
        streamer = self._streamer_cls()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=self.pad_token_id,
                streamer=streamer,
            )
        e2e = time.perf_counter() - t0
        tokens = out[0, len(prompt_ids) :].tolist()
        times = streamer.times
        if len(times) != len(tokens):
            raise RuntimeError(f"{self.name}: streamer saw {len(times)} tokens, generate returned {len(tokens)}")
        return GenResult(tokens, times[0] - t0, times[-1] - times[0], e2e)


def load_transformers(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # GGUF conversion progress bars and the packed-weights notice
    hf_logging.disable_progress_bar()
    with contextlib.redirect_stderr(io.StringIO()):  # its GGUF de-quantization bar is a bare tqdm
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    model.eval()
    gc_ = model.generation_config  # drop sampling defaults so greedy generate does not warn
    for attr in ("temperature", "top_p", "top_k"):
        if hasattr(gc_, attr):
            setattr(gc_, attr, None)
    return model


# ----------------------------------------------------------------------------- decode comparison


@dataclass
class PromptRun:
    question_id: int
    group: str
    prompt_tokens: int
    engine: str
    new_tokens: int
    prefill_s: float
    decode_s: float
    e2e_s: float
    decode_tps: float
    e2e_tps: float


def eos_cut(a: Sequence[int], b: Sequence[int], eos: frozenset[int]) -> int:
    """Length to compare: up to (excluding) the first EOS in either sequence."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] in eos or b[i] in eos:
            return i
    return n


def compare_tokens(a: Sequence[int], b: Sequence[int], eos: frozenset[int]) -> dict[str, Any]:
    n = eos_cut(a, b, eos)
    mismatch = next((i for i in range(n) if a[i] != b[i]), None)
    return {"compared": n, "first_mismatch": mismatch, "equal": mismatch is None}


def run_decode(
    engines: list[Engine],
    questions: list[Question],
    prompts: list[list[int]],
    max_tokens: int,
    progress: bool,
    on_prompt: Callable[[list[PromptRun]], None] | None = None,
) -> tuple[list[PromptRun], dict[str, dict[int, list[int]]]]:
    """Every engine on prompt 1 (engine order rotated by prompt), then prompt 2, ..."""
    runs: list[PromptRun] = []
    tokens: dict[str, dict[int, list[int]]] = {e.name: {} for e in engines}
    bar = tqdm(total=len(questions) * len(engines), desc="decode", disable=not progress)
    for i, (q, ids) in enumerate(zip(questions, prompts)):
        order = engines[i % len(engines) :] + engines[: i % len(engines)]
        for eng in order:
            bar.set_postfix_str(f"q{q.question_id} {eng.name}")
            r = eng.generate(ids, max_tokens)
            if len(r.tokens) != max_tokens:
                raise RuntimeError(f"{eng.name} produced {len(r.tokens)} tokens, expected {max_tokens}")
            tokens[eng.name][q.question_id] = r.tokens
            runs.append(
                PromptRun(q.question_id, q.group, len(ids), eng.name, len(r.tokens), r.prefill_s, r.decode_s,
                          r.e2e_s, r.decode_tps, r.e2e_tps)
            )
            bar.update()
        if on_prompt is not None:
            on_prompt(runs)
    bar.close()
    return runs, tokens


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize_decode(runs: list[PromptRun], engines: Sequence[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    summary: dict[str, Any] = {}
    for name in engines:
        rs = [r for r in runs if r.engine == name]
        summary[name] = {
            "prompts": len(rs),
            "decode_tps": sum(r.new_tokens - 1 for r in rs) / sum(r.decode_s for r in rs),
            "e2e_tps": sum(r.new_tokens for r in rs) / sum(r.e2e_s for r in rs),
            "decode_tps_median": statistics.median(r.decode_tps for r in rs),
            "prefill_s_mean": statistics.fmean(r.prefill_s for r in rs),
        }
    ratios: dict[str, Any] = {}
    for a, b in RATIOS:
        if a not in summary or b not in summary:
            continue
        pa = {r.question_id: r for r in runs if r.engine == a}
        pb = {r.question_id: r for r in runs if r.engine == b}
        qids = sorted(pa.keys() & pb.keys())
        ratios[f"{a}/{b}"] = {
            "decode": summary[a]["decode_tps"] / summary[b]["decode_tps"],
            "e2e": summary[a]["e2e_tps"] / summary[b]["e2e_tps"],
            "decode_paired_geomean": geomean([pa[q].decode_tps / pb[q].decode_tps for q in qids]),
            "e2e_paired_geomean": geomean([pa[q].e2e_tps / pb[q].e2e_tps for q in qids]),
        }
    return summary, ratios


def greedy_matches(
    tokens: dict[str, dict[int, list[int]]], eos: frozenset[int]
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a, b in (("tl-fp32", "hf-fp32"), ("tl-bf16", "hf-bf16")):
        if a not in tokens or b not in tokens:
            continue
        per = {q: compare_tokens(tokens[a][q], tokens[b][q], eos) for q in tokens[a] if q in tokens[b]}
        out[f"{a} vs {b}"] = {
            "equal": sum(v["equal"] for v in per.values()),
            "prompts": len(per),
            "per_prompt": {str(q): v for q, v in per.items()},
        }
    return out


# ----------------------------------------------------------------------------- bandwidth and floors


def measure_bandwidth(repeats: int, nbytes: int = GIB) -> dict[str, float]:
    """Best-of-`repeats` read (torch.sum) and copy (read + write counted) bandwidth, GB/s."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in
    reads, copies = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        dst.copy_(src)
        copies.append(time.perf_counter() - t0)
    del src, dst
    gc.collect()
    return {
        "read_gbps": nbytes / min(reads) / 1e9,
        "read_gbps_median": nbytes / statistics.median(reads) / 1e9,
        "copy_gbps": 2 * nbytes / min(copies) / 1e9,
        "copy_gbps_median": 2 * nbytes / statistics.median(copies) / 1e9,
        "buffer_bytes": nbytes,
        "repeats": repeats,
    }


def weight_matrices(model: LlamaModel) -> list[torch.Tensor]:
    mats = [w.dense() for layer in model.layers for w in layer.linears()]  # dense, as torch reads them
    return mats + [model.lm_head]


def time_linear_pass(
    mats: list[torch.Tensor], linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x_dtype: torch.dtype, repeats: int,
) -> dict[str, float]:
    """Single-row linear over every matrix in turn; best and median pass time."""
    xs = {m.shape[1]: torch.randn(1, m.shape[1]).to(x_dtype) for m in mats}
    nbytes = sum(m.numel() * m.element_size() for m in mats)
    times = []
    with torch.inference_mode():
        for i in range(repeats + 1):
            t0 = time.perf_counter()
            for m in mats:
                linear(xs[m.shape[1]], m)
            if i:  # the first pass is a warm-up
                times.append(time.perf_counter() - t0)
    best, med = min(times), statistics.median(times)
    return {"pass_ms": best * 1e3, "pass_ms_median": med * 1e3, "tokens_per_s": 1 / best,
            "tokens_per_s_median": 1 / med, "gbps": nbytes / best / 1e9, "bytes": nbytes}


def kernel_floor(models: dict[str, LlamaModel], kernels: CpuKernels | None, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype, model in models.items():
        mats = weight_matrices(model)
        out[f"torch F.linear {dtype}"] = time_linear_pass(mats, lambda x, w: F.linear(x, w), model.dtype, repeats)
        if kernels is not None:
            out[f"tokenleap kernel {dtype}"] = time_linear_pass(
                mats, lambda x, w: kernels.linear(x, w), torch.float32, repeats
            )
    return out


# ----------------------------------------------------------------------------- verify cost curve


def verify_curve(
    models: dict[str, LlamaModel], context_ids: list[int], ks: Sequence[int], repeats: int, progress: bool
) -> dict[str, Any]:
    caches = {}
    for dtype, model in models.items():
        kv = model.new_kv_cache(len(context_ids) + max(ks) + 8)
        model.forward(torch.tensor(context_ids), torch.arange(len(context_ids)), kv)
        caches[dtype] = kv
    ctx = len(context_ids)
    draft = torch.tensor((context_ids * 2)[: max(ks)], dtype=torch.long)
    times: dict[str, dict[int, list[float]]] = {d: {k: [] for k in ks} for d in models}
    bar = tqdm(total=(repeats + 1) * len(models) * len(ks), desc="verify cost", disable=not progress)
    for rep in range(repeats + 1):  # rep 0 is a warm-up
        for dtype, model in models.items():
            kv = caches[dtype]
            for k in ks:
                t0 = time.perf_counter()
                out = model.forward(draft[:k], torch.arange(ctx, ctx + k), kv)
                model.compute_logits(out.hidden)
                dt = time.perf_counter() - t0
                kv.truncate(ctx)
                if rep:
                    times[dtype][k].append(dt)
                bar.update()
    bar.close()
    result: dict[str, Any] = {"context_tokens": ctx, "repeats": repeats, "ks": list(ks), "dtypes": {}}
    for dtype in models:
        med = {k: statistics.median(times[dtype][k]) for k in ks}
        best = {k: min(times[dtype][k]) for k in ks}
        result["dtypes"][dtype] = {
            "ms": {str(k): med[k] * 1e3 for k in ks},
            "relative": {str(k): med[k] / med[ks[0]] for k in ks},
            "ms_min": {str(k): best[k] * 1e3 for k in ks},
            "relative_min": {str(k): best[k] / best[ks[0]] for k in ks},
        }
    return result


def plot_verify(curve: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ks = curve["ks"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for dtype, d in curve["dtypes"].items():
        ax1.plot(ks, [d["relative"][str(k)] for k in ks], marker="o", ms=3, label=dtype)
        ax2.plot(ks, [d["ms"][str(k)] for k in ks], marker="o", ms=3, label=dtype)
    ax1.set(xlabel="query tokens k", ylabel="time / time(k=1)", title="relative cost of one forward")
    ax2.set(xlabel="query tokens k", ylabel="ms", title="forward + logits on k rows")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- profile


@dataclass(frozen=True)
class ProfiledKernels:
    """Wraps `CpuKernels` so each ctypes call shows up as a named range in torch.profiler."""

    inner: CpuKernels

    def __getattr__(self, name: str) -> Any:
        target = getattr(self.inner, name)
        if not callable(target):
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"tokenleap::{name}"):
                return target(*args, **kwargs)

        return call


def profile_decode(llm: LLM, prompt_ids: list[int], steps: int, top: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    engine, model = llm.engine, llm.model
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    req = engine.add_request(prompt_ids, params)
    engine.prefill(req)
    for _ in range(3):
        engine.step(req)
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step(req)
    plain_ms = (time.perf_counter() - t0) / steps * 1e3
    original = model.kernels
    if original is not None:
        model.kernels = ProfiledKernels(original)  # type: ignore[assignment]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step(req)
            profiled_ms = (time.perf_counter() - t0) / steps * 1e3
    finally:
        model.kernels = original
        req.kv.free()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total_self_us = sum(e.self_cpu_time_total for e in events)
    rows = [
        {
            "op": e.key,
            "calls_per_step": e.count / steps,
            "self_ms_per_step": e.self_cpu_time_total / steps / 1e3,
            "self_share": e.self_cpu_time_total / total_self_us if total_self_us else 0.0,
        }
        for e in events[:top]
    ]
    return {
        "steps": steps,
        "context_tokens": len(prompt_ids),
        "step_ms_unprofiled": plain_ms,
        "step_ms_profiled": profiled_ms,
        "self_ms_per_step_all_ops": total_self_us / steps / 1e3,
        "top_ops": rows,
    }


# ----------------------------------------------------------------------------- output


def fmt(x: float, digits: int = 1) -> str:
    return f"{x:.{digits}f}"


def print_report(console: Console, res: dict[str, Any]) -> None:
    d = res.get("decode")
    if d:
        t = Table(title=f"Greedy decoding, {res['config']['max_tokens']} new tokens, "
                        f"{len(res['prompts'])} Spec-Bench prompts")
        for col in ("engine", "decode tok/s", "median decode tok/s", "e2e tok/s", "mean prefill ms",
                    "decode / floor"):
            t.add_column(col, justify="right" if col != "engine" else "left")
        for name, s in d["summary"].items():
            fl = res["floors"].get(ENGINE_DTYPE[name], {}).get("tokens_per_s")
            t.add_row(name, fmt(s["decode_tps"]), fmt(s["decode_tps_median"]), fmt(s["e2e_tps"]),
                      fmt(s["prefill_s_mean"] * 1e3), f"{s['decode_tps'] / fl:.0%}" if fl else "-")
        console.print(t)
        if d["ratios"]:
            t = Table(title="Ratios (aggregate; geometric mean of per-prompt paired ratios)")
            for col in ("ratio", "decode", "decode paired", "e2e", "e2e paired"):
                t.add_column(col, justify="right" if col != "ratio" else "left")
            for key, r in d["ratios"].items():
                t.add_row(key, f"{r['decode']:.2f}x", f"{r['decode_paired_geomean']:.2f}x",
                          f"{r['e2e']:.2f}x", f"{r['e2e_paired_geomean']:.2f}x")
            console.print(t)
        for key, g in d["greedy_match"].items():
            mism = {q: v["first_mismatch"] for q, v in g["per_prompt"].items() if not v["equal"]}
            console.print(f"greedy tokens {key}: {g['equal']}/{g['prompts']} prompts identical "
                          f"(compared up to the first EOS)" + (f"; first mismatch at {mism}" if mism else ""))
    bw = res["bandwidth"]
    t = Table(title="Memory bandwidth and floors")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_row("read bandwidth (sum, best)", f"{bw['read_gbps']:.1f} GB/s (median {bw['read_gbps_median']:.1f})")
    t.add_row("copy bandwidth (read+write, best)", f"{bw['copy_gbps']:.1f} GB/s (median {bw['copy_gbps_median']:.1f})")
    for dtype, f in res["floors"].items():
        t.add_row(f"weight bytes / token {dtype}", f"{f['bytes_per_token'] / 1e6:.1f} MB")
        t.add_row(f"bandwidth floor {dtype}", f"{f['tokens_per_s']:.1f} tok/s")
    for name, k in res["kernel_floor"].items():
        t.add_row(f"linears-only ceiling, {name}",
                  f"{k['tokens_per_s']:.1f} tok/s ({k['pass_ms']:.2f} ms/pass, {k['gbps']:.1f} GB/s)")
    console.print(t)
    vc = res.get("verify_cost")
    if vc:
        t = Table(title=f"Verify cost: forward of k tokens + logits, ~{vc['context_tokens']} cached tokens "
                        f"(median of {vc['repeats']})")
        t.add_column("k", justify="right")
        for dtype in vc["dtypes"]:
            t.add_column(f"{dtype} ms", justify="right")
            t.add_column(f"{dtype} / k=1", justify="right")
        for k in vc["ks"]:
            cells = []
            for dd in vc["dtypes"].values():
                cells += [f"{dd['ms'][str(k)]:.2f}", f"{dd['relative'][str(k)]:.2f}"]
            t.add_row(str(k), *cells)
        console.print(t)
    pr = res.get("profile")
    if pr:
        t = Table(title=f"tokenleap bf16 decode step profile ({pr['step_ms_unprofiled']:.2f} ms/step unprofiled, "
                        f"{pr['step_ms_profiled']:.2f} profiled, context {pr['context_tokens']})")
        for col in ("op", "calls/step", "self ms/step", "share"):
            t.add_column(col, justify="right" if col != "op" else "left")
        for r in pr["top_ops"]:
            t.add_row(r["op"], fmt(r["calls_per_step"]), f"{r['self_ms_per_step']:.3f}", f"{r['self_share']:.1%}")
        console.print(t)


# ----------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Plain greedy decoding speed: tokenleap vs transformers, bandwidth floor, "
                    "verify cost curve and a decode-step profile (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=DEFAULT_MODEL, help="registered model name or .gguf path")
    p.add_argument("--questions-per-group", type=int, default=4, help="Spec-Bench questions per group (6 groups)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (forced on every engine)")
    p.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES), help="engines to run")
    p.add_argument("--skip-transformers", action="store_true", help="run tokenleap engines only")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for every engine")
    p.add_argument("--verify-context", type=int, default=300, help="cached tokens for the verify cost curve")
    p.add_argument("--verify-max-k", type=int, default=32, help="largest k of the verify cost curve")
    p.add_argument("--repeats", type=int, default=7, help="repeats for the bandwidth, floor and verify timings")
    p.add_argument("--profile-steps", type=int, default=20, help="decode steps in the profile")
    p.add_argument("--spec-bench", type=Path, default=SPEC_BENCH, help="Spec-Bench question.jsonl")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON output; the plot goes beside it [default: results/plain_decode.json, "
                        "results/plain_decode_quick.json with --quick]")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 prompts, 32 tokens, fewer repeats")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = p.parse_args(argv)
    if args.skip_transformers:
        args.engines = [e for e in args.engines if not e.startswith("hf-")]
    if args.out is None:
        args.out = ROOT / "results" / ("plain_decode_quick.json" if args.quick else "plain_decode.json")
    if args.quick:
        args.max_tokens = min(args.max_tokens, 32)
        args.repeats = min(args.repeats, 3)
        args.profile_steps = min(args.profile_steps, 5)
    for name in ("questions_per_group", "max_tokens", "threads", "verify_context", "verify_max_k", "repeats",
                 "profile_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.max_tokens < 2:
        p.error("--max-tokens must be >= 2 (decode tokens/s excludes the first token)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console()
    progress = not args.no_progress
    torch.set_num_threads(args.threads)  # before load_kernels(), which captures the thread count
    load_start = os.getloadavg()
    t_start = time.perf_counter()

    source = resolve(args.model)
    kernels = load_kernels()
    console.print(f"[bold]model[/] {source.path}  threads={torch.get_num_threads()}  "
                  f"kernels={'yes' if kernels else 'no (torch fallback)'}  loadavg={load_start}")
    llms = {"bf16": LLM(args.model, dtype="bfloat16", quantization="none"), "fp32": LLM(args.model, dtype="float32")}
    tok = llms["bf16"].get_tokenizer()

    questions = load_questions(args.spec_bench, 1 if args.quick else args.questions_per_group,
                               2 if args.quick else None)
    prompts = [llms["bf16"].chat_token_ids([{"role": "user", "content": q.text}]) for q in questions]

    engines: list[Engine] = []
    hf_info: dict[str, Any] = {}
    eos = set(tok.eos_token_ids)
    for name in ENGINES:
        if name not in args.engines:
            continue
        if name.startswith("tl-"):
            engines.append(TokenleapEngine(name, llms[ENGINE_DTYPE[name]]))
        else:
            dtype = torch.float32 if ENGINE_DTYPE[name] == "fp32" else torch.bfloat16
            t0 = time.perf_counter()
            with console.status(f"loading transformers {name}"):
                model = load_transformers(source.path, dtype)
            gen_eos = model.generation_config.eos_token_id
            eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
            q_proj = model.model.layers[0].self_attn.q_proj  # dense nn.Linear unless the GGUF stayed packed
            hf_info[name] = {
                "load_s": time.perf_counter() - t0,
                "attn_implementation": getattr(model.config, "_attn_implementation", None),
                "linear_class": f"{type(q_proj).__module__}.{type(q_proj).__name__}",
                "weight_dtypes": sorted({str(t.dtype) for t in model.parameters()}),
                "parameter_bytes": sum(t.numel() * t.element_size() for t in model.parameters()),
            }
            pad = tok.hf.pad_token_id if tok.hf.pad_token_id is not None else min(tok.eos_token_ids)
            engines.append(TransformersEngine(name, model, pad))

    # warm-up every engine on a short prompt (oneDNN/MKL init, allocator)
    for eng in engines:
        eng.generate(prompts[0][:32], 4)

    result: dict[str, Any] = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": _version("transformers"),
            "cpu": _cpu_name(),
            "threads": torch.get_num_threads(),
            "loadavg_start": load_start,
            "omp_env": {k: v for k, v in os.environ.items() if k.startswith(("OMP_", "GOMP_", "KMP_", "MKL_"))},
            "kernels": kernels is not None,
            "model": str(source.path),
            "transformers_engines": hf_info,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if argv is None else " ".join(argv),
        },
        "config": {
            "max_tokens": args.max_tokens,
            "questions_per_group": args.questions_per_group,
            "quick": args.quick,
            "engines": [e.name for e in engines],
            "repeats": args.repeats,
        },
        "prompts": [
            {**asdict(q), "text": q.text[:80], "prompt_tokens": len(ids)} for q, ids in zip(questions, prompts)
        ],
    }

    def save(complete: bool) -> None:  # partial results survive an interrupted run
        result["complete"] = complete
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2))

    def save_partial(runs: list[PromptRun]) -> None:
        result["decode_partial"] = [asdict(r) for r in runs]
        save(False)

    if engines:
        runs, tokens = run_decode(engines, questions, prompts, args.max_tokens, progress, save_partial)
        result.pop("decode_partial", None)
        summary, ratios = summarize_decode(runs, [e.name for e in engines])
        result["decode"] = {
            "summary": summary,
            "ratios": ratios,
            "greedy_match": greedy_matches(tokens, frozenset(eos)),
            "eos_ids_for_comparison": sorted(eos),
            "per_prompt": [asdict(r) for r in runs],
        }
        save(False)
    for eng in engines:  # free the transformers models before the bandwidth test
        if isinstance(eng, TransformersEngine):
            eng.model = None
    engines.clear()
    gc.collect()

    with console.status("memory bandwidth"):
        result["bandwidth"] = measure_bandwidth(args.repeats)
    models = {d: llm.model for d, llm in llms.items()}
    result["floors"] = {
        d: {"bytes_per_token": m.weight_bytes_per_token(),
            "tokens_per_s": result["bandwidth"]["read_gbps"] * 1e9 / m.weight_bytes_per_token()}
        for d, m in models.items()
    }
    with console.status("linears-only ceilings"):
        result["kernel_floor"] = kernel_floor(models, kernels, args.repeats)
        save(False)

    ks = [1, 2, 4, 8, 16, 32] if args.quick else list(range(1, args.verify_max_k + 1))
    ks = [k for k in ks if k <= args.verify_max_k]
    long_ids = max(prompts, key=len)
    context = (long_ids * (args.verify_context // len(long_ids) + 1))[: args.verify_context]
    result["verify_cost"] = verify_curve(models, context, ks, args.repeats, progress)
    save(False)

    with console.status("profiling a bf16 decode step"):
        result["profile"] = profile_decode(llms["bf16"], prompts[0], args.profile_steps, top=20)

    result["meta"]["loadavg_end"] = os.getloadavg()
    result["meta"]["wall_s"] = time.perf_counter() - t_start
    save(True)
    png = args.out.with_name("verify_cost_quick.png" if args.quick else "verify_cost.png")
    plot_verify(result["verify_cost"], png,
                f"tokenleap {source.name}, {torch.get_num_threads()} threads, ~{len(context)} cached tokens")
    print_report(console, result)
    console.print(f"wrote {args.out} and {png} in {result['meta']['wall_s']:.0f} s "
                  f"(loadavg start {load_start}, end {result['meta']['loadavg_end']})")
    return 0


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    raise SystemExit(main())
