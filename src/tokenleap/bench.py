"""`tokenleap bench`: the Spec-Bench protocol (Xia et al., 2024) on this machine.

Greedy decoding, batch size 1; every prompt runs under plain decoding and then under each
speculative method, back to back in one process on one loaded model, so machine drift hits all
methods alike. Multi-turn questions run turn by turn, the history built from plain decoding's
answers (identical for exact methods). Reported per group and overall: tokens/s, speedup over
plain end to end (prefill included, Spec-Bench's definition) and in the decode phase (prefill
excluded), mean acceptance length (tokens per target forward), and whether every output matched
plain decoding token for token.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenleap.drafters import default_registry
from tokenleap.drafters.spec import SpecConfig
from tokenleap.engine.engine import Engine
from tokenleap.engine.speculation import measure_cost_curve
from tokenleap.errors import TokenleapError
from tokenleap.models.base import CausalLM
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
GROUPS = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def default_spec_bench() -> Path:
    """`../shared/bench/spec_bench.jsonl` beside the checkout when present (all 480 questions),
    else the 60-question subset shipped in `benchmarks/data/`."""
    repo = Path(__file__).resolve().parents[2]
    shared = repo.parent / "shared" / "bench" / "spec_bench.jsonl"
    return shared if shared.is_file() else repo / "benchmarks" / "data" / "spec_bench_subset.jsonl"


def group_of(category: str) -> str:
    return "mt_bench" if category in MT_BENCH else category


@dataclass(frozen=True)
class Question:
    question_id: str
    group: str
    turns: tuple[str, ...]
    assistant_prefix: str = ""  # text the answer starts with (e.g. "```python\n" for code edits)
    stop: tuple[str, ...] = ()  # strings that end the answer (e.g. the closing code fence)
    max_tokens: int | None = None  # this question's own cap (the run's cap still applies)


def load_questions(path: Path, per_group: int) -> list[Question]:
    """The first `per_group` questions of each group, in Spec-Bench's or a `{"messages"}` JSONL
    (optional `category`, `question_id`, `assistant_prefix`, text the answer starts with,
    `stop`, strings that end it, and `max_tokens`, its own cap)."""
    if not path.is_file():
        raise TokenleapError(f"benchmark file not found: {path}")
    pools: dict[str, dict[str, list[Question]]] = defaultdict(lambda: defaultdict(list))
    for n, line in enumerate(path.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TokenleapError(f"{path}:{n + 1}: not JSON ({exc.msg})") from exc
        if "turns" in row:
            group, turns = group_of(str(row.get("category", "other"))), tuple(row["turns"])
        elif "messages" in row:
            group = str(row.get("category", "messages"))
            turns = tuple(m["content"] for m in row["messages"] if m.get("role") == "user")
        else:
            raise TokenleapError(f"{path}:{n + 1}: expected 'turns' (Spec-Bench) or 'messages'")
        if turns:
            prefix = str(row.get("assistant_prefix", ""))
            category = str(row.get("category", group))
            stop = row.get("stop", [])
            if isinstance(stop, str):
                stop = [stop]
            if not isinstance(stop, list) or not all(isinstance(x, str) and x for x in stop):
                raise TokenleapError(f"{path}:{n + 1}: 'stop' must be a string or a list of non-empty strings")
            cap = row.get("max_tokens")
            if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
                raise TokenleapError(f"{path}:{n + 1}: 'max_tokens' must be a positive integer")
            pools[group][category].append(
                Question(str(row.get("question_id", n)), group, turns, prefix, tuple(stop), cap)
            )
    chosen: list[Question] = []
    for categories in pools.values():  # within a group, take its categories in turn
        queues = [list(qs) for qs in categories.values()]
        taken = 0
        while taken < per_group and any(queues):
            for queue in queues:
                if queue and taken < per_group:
                    chosen.append(queue.pop(0))
                    taken += 1
    return chosen


@dataclass
class Record:
    question_id: str
    group: str
    turn: int
    method: str
    new_tokens: int
    target_forwards: int
    decode_tokens: int  # committed by the target forwards after prefill (a final EOS included)
    wall_seconds: float
    decode_seconds: float
    prefill_seconds: float
    draft_tokens: int
    accepted_tokens: int
    matched_plain: bool
    round: int = 0  # the pass over the questions (`rounds`)


def parse_methods(spec: str, draft_max: int, model: str | None = None, adaptive: bool = True) -> dict[str, SpecConfig]:
    """"ngram,suffix+ngram" -> {label: config}; "a+b" is a chain (the first that proposes wins);
    "draft-model:draft_vocab=32768:draft_p_min=0.5" sets a method's options (the label keeps them).
    `model`: the draft model or EAGLE-3 head of the methods that need one."""
    configs = {}
    for label in [m.strip() for m in spec.split(",") if m.strip()]:
        name, *settings = label.split(":")
        raw: dict[str, object] = {"method": name, "num_speculative_tokens": draft_max, "adaptive": adaptive}
        if model is not None:
            raw["model"] = model
        for setting in settings:
            key, sep, value = setting.partition("=")
            if not sep or not key:
                raise TokenleapError(f"method option {setting!r} in {label!r}: write key=value")
            raw[key.strip()] = _option_value(value.strip())
        cfg = SpecConfig.from_dict(raw)
        if cfg is None:
            raise TokenleapError(f"method {name!r} is not a speculative method")
        configs[label] = cfg
    if not configs:
        raise TokenleapError("no methods to compare (--methods)")
    return configs


def _option_value(text: str) -> object:
    """A method option's value from the command line: a number or a boolean where it reads as one."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


class HFBaseline:
    """transformers' greedy `generate` and its prompt lookup (`prompt_lookup_num_tokens`) on the
    same GGUF, as the peer measured in the same run."""

    def __init__(self, gguf_path: Path, dtype: str, num_tokens: int = 10) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        self.model = AutoModelForCausalLM.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch_dtype
        )
        self.num_tokens = num_tokens

    def generate(self, ids: Sequence[int], max_tokens: int, pld: bool) -> tuple[list[int], float]:
        import torch

        inputs = torch.tensor([list(ids)])
        extra = {"prompt_lookup_num_tokens": self.num_tokens} if pld else {}
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(inputs, attention_mask=torch.ones_like(inputs), do_sample=False,
                                      max_new_tokens=max_tokens, pad_token_id=2, **extra)
        wall = time.perf_counter() - t0
        new = out[0, len(ids):].tolist()
        if new and new[-1] == 2:  # EOS: tokenleap does not count it as output either
            new = new[:-1]
        return new, wall


def run_bench(
    model: CausalLM,
    tokenizer: Tokenizer,
    questions: Sequence[Question],
    methods: dict[str, SpecConfig],
    max_tokens: int,
    temperature: float = 0.0,
    progress: Any = None,
    hf: HFBaseline | None = None,
    seed: int = 0,
    target_name: str | None = None,
    target_path: Any = None,
    rounds: int = 1,
) -> list[Record]:
    """Every method on every question, interleaved question by question, `rounds` times over
    (a round's figures are comparable with each other: the host's speed drifts between rounds)."""
    # one cost curve for every method: they verify on the same model, and a curve measured in
    # an unlucky moment would otherwise handicap one method for the whole run
    cap = max((cfg.num_speculative_tokens for cfg in methods.values()), default=1)
    curve = measure_cost_curve(model, cap) if methods else None

    def fresh_engines() -> dict[str, Engine]:
        """Engines with new drafters: a registry per method (drafters of one registry share
        state, ngram-mod pools), and per round, so a drafter that learns across requests (suffix
        over earlier outputs, ngram-mod, recycling) does not meet the same questions again."""
        engines: dict[str, Engine] = {"plain": Engine(model, tokenizer)}
        for label, cfg in methods.items():
            drafter = default_registry().create(cfg.method, cfg, target=model, tokenizer=tokenizer,
                                                target_name=target_name, target_path=target_path)
            engines[label] = Engine(model, tokenizer, spec=cfg, drafter=drafter, cost_curve=curve)
        return engines

    engines = fresh_engines()
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed)
    records: list[Record] = []
    names = list(engines)
    for rnd, (n, q) in ((rnd, nq) for rnd in range(rounds) for nq in enumerate(questions)):
        if rnd and not n:
            engines = fresh_engines()
        # Rotate which engine runs first on each question: whatever the machine does to the
        # first run after a prompt change (cache, frequency, page faults) lands on every
        # method alike. Plain's output is compared once all have run.
        first = (n + rnd) % len(names)
        order = names[first:] + names[:first]
        history: list[dict[str, str]] = []
        for turn, text in enumerate(q.turns):
            history.append({"role": "user", "content": text})
            ids = tokenizer.apply_chat_template(history)
            if q.assistant_prefix:
                ids += tokenizer.encode(q.assistant_prefix)
            outputs: dict[str, list[int]] = {}
            turn_records: list[Record] = []
            q_params = dataclasses.replace(
                params, stop=q.stop or params.stop, max_tokens=min(max_tokens, q.max_tokens or max_tokens)
            )
            for name in order:
                engine = engines[name]
                req = engine.add_request(ids, q_params)
                t0 = time.perf_counter()
                engine.run(req)
                wall = time.perf_counter() - t0
                outputs[name] = list(req.output_ids)
                if name == "plain":
                    answer = req.text
                m = req.metrics
                turn_records.append(
                    Record(
                        q.question_id, q.group, turn, name, len(req.output_ids), m.num_forward_passes,
                        m.num_decode_tokens, wall, m.decode_seconds, m.prefill_seconds, m.spec.num_draft_tokens,
                        m.spec.num_accepted_tokens, False, rnd
                    )
                )
                if progress is not None:
                    progress()
            plain_ids = outputs["plain"]
            records.extend(
                dataclasses.replace(r, matched_plain=outputs[r.method] == plain_ids)
                for r in sorted(turn_records, key=lambda r: names.index(r.method))
            )
            if hf is not None:  # timed end to end only: its "decode" figures include prefill
                for name, pld in (("hf-plain", False), ("hf-pld", True)):
                    out_ids, wall = hf.generate(ids, max_tokens, pld)
                    records.append(Record(q.question_id, q.group, turn, name, len(out_ids), 0, 0, wall,
                                          wall, 0.0, 0, 0, out_ids == plain_ids, rnd))
                    if progress is not None:
                        progress()
            history.append({"role": "assistant", "content": answer})
    return records


def summarize(records: Sequence[Record]) -> dict[str, dict[str, dict[str, float]]]:
    """group (and "overall") -> method -> figures."""
    by: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        by[(r.group, r.method)].append(r)
        by[("overall", r.method)].append(r)
    out: dict[str, dict[str, dict[str, float]]] = defaultdict(dict)
    for (group, method), rs in by.items():
        tokens = sum(r.new_tokens for r in rs)
        wall = sum(r.wall_seconds for r in rs)
        decode = sum(r.decode_seconds for r in rs)
        forwards = sum(r.target_forwards for r in rs)
        out[group][method] = {
            "prompts": len(rs),
            "tokens": tokens,
            "tokens_per_second": tokens / wall if wall else 0.0,
            "decode_tokens_per_second": sum(r.new_tokens - 1 for r in rs) / decode if decode else 0.0,
            "mean_acceptance_length": sum(r.decode_tokens for r in rs) / forwards if forwards else float("nan"),
            "matched_plain": sum(r.matched_plain for r in rs),
        }
    for methods in out.values():
        for name, fig in methods.items():
            base = methods.get("hf-plain" if name.startswith("hf-") else "plain")
            fig["speedup"] = (
                fig["tokens_per_second"] / base["tokens_per_second"] if base and base["tokens_per_second"] else 0.0
            )
            fig["decode_speedup"] = (
                fig["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                if base and base["decode_tokens_per_second"] else 0.0
            )
    return dict(out)


def round_speedups(records: Sequence[Record]) -> dict[str, dict[str, Any]]:
    """Per method, its end-to-end speedup over plain decoding in each round (all questions of
    the round pooled), and their median, min and max: one run's spread, which says whether a
    difference of a few percent is the method's or the host's."""
    rounds = sorted({r.round for r in records})
    by: dict[tuple[str, int], list[Record]] = defaultdict(list)
    for r in records:
        by[(r.method, r.round)].append(r)

    def rate(rs: list[Record]) -> float:
        wall = sum(r.wall_seconds for r in rs)
        return sum(r.new_tokens for r in rs) / wall if wall else 0.0

    out: dict[str, dict[str, Any]] = {}
    for method in sorted({r.method for r in records} - {"plain", "hf-plain"}):
        base = "hf-plain" if method.startswith("hf-") else "plain"
        speedups = [rate(by[(method, k)]) / rate(by[(base, k)]) for k in rounds if rate(by[(base, k)])]
        if speedups:
            out[method] = {"speedups": speedups, "median": statistics.median(speedups), "min": min(speedups),
                           "max": max(speedups)}
    return out


def write_json(
    path: Path, meta: dict[str, Any], records: Sequence[Record], summary: dict[str, Any], **extra: Any
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"meta": meta, "summary": summary, **extra, "records": [asdict(r) for r in records]}
    path.write_text(json.dumps(doc, indent=1))


def plot(path: Path, summary: dict[str, dict[str, dict[str, float]]], key: str = "tokens_per_second") -> None:
    """Bars per group: each method's `key` (tokens/s) relative to tokenleap's plain decoding, so
    peers (transformers' plain and prompt lookup) sit on the same scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [g for g in (*GROUPS, "overall") if g in summary] + sorted(set(summary) - set(GROUPS) - {"overall"})
    methods = sorted({m for g in summary.values() for m in g} - {"plain"}, key=lambda m: (m.startswith("hf-"), m))
    width = 0.8 / max(1, len(methods))
    fig, ax = plt.subplots(figsize=(1.4 * len(groups) + 2, 4))
    for i, method in enumerate(methods):
        values = []
        for g in groups:
            base = summary[g].get("plain", {}).get(key, 0.0)
            values.append(summary[g].get(method, {}).get(key, 0.0) / base if base else 0.0)
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="grey", linewidth=1, linestyle="--")
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))], groups, rotation=20)
    ax.set_ylabel("tokens/s relative to tokenleap plain")
    ax.set_title(
        "tokenleap bench: "
        + ("end to end" if key == "tokens_per_second" else "decode phase")
        + " (dashed: tokenleap plain decoding)"
    )
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
