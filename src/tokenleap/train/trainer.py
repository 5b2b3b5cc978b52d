"""`tokenleap train-drafter`: trains an EAGLE-3 head (or Medusa-1 heads, `head_type="medusa"`, or a
MiMo-layout MTP layer, `head_type="mtp"`, with the same data, features, loss and loop) for a target
tokenleap runs, on the CPU.

The pipeline (EAGLE-3 / SpecForge's online recipe): records -> optional self-distillation (the
target answers each first user turn again, batched through `LLM.chat`, cached in
`OUTPUT/regenerated.jsonl` so a rerun resumes) -> chat-template tokenization with an assistant
mask -> the draft vocabulary (most frequent assistant tokens) -> for each batch, one target
forward per sequence gives the aux states (inputs of the aux layers) and the target's logits (the
soft labels; no regeneration needed for those) -> training-time-test unrolled loss
(`eagle3_head.TrainableEagle3.ttt_logits`) -> AdamW with warmup and cosine decay.

Every `save_every` steps and at the end (also on --max-time and Ctrl-C) it writes the head in the
EAGLE-3 layout to OUTPUT (loadable at once by `--spec-type eagle3 --model-draft OUTPUT`) and
`trainer_state.pt` (optimizer, step, data order) from which `resume=True` continues. Held-out
sequences give teacher-forced top-1 accuracy per TTT step; the final evaluation runs the real
engine with the head on held-out prompts and reports tokens per target forward against plain
decoding, checking that greedy outputs are identical.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from tokenleap.drafters.eagle3 import Eagle3Config, default_aux_layers
from tokenleap.errors import TokenleapError
from tokenleap.train.data import DraftVocab, Example, Record, build_draft_vocab, load_records, tokenize
from tokenleap.train.eagle3_head import TrainableEagle3, shape_for_target
from tokenleap.train.medusa_head import MedusaShape, TrainableMedusa
from tokenleap.train.mtp_head import TrainableMtp

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
REGEN_FILE = "regenerated.jsonl"


HEAD_TYPES = ("eagle3", "medusa", "mtp")


@dataclass(frozen=True)
class TrainConfig:
    output: Path
    head_type: str = "eagle3"  # or "medusa" (Medusa-1 heads sharing the target's LM head), "mtp" (a MiMo-layout MTP layer)
    medusa_heads: int = 4
    data: tuple[str, ...] = ("sharegpt",)
    max_samples: int | None = 2000
    regenerate: bool = True  # self-distillation: the target answers the first user turn again
    regen_max_tokens: int = 256
    max_len: int = 768
    draft_vocab_size: int = 8192
    aux_layers: tuple[int, int, int] | None = None  # default: inputs of layers 2, N//2, N-3
    ttt_steps: int = 4
    ttt_decay: float = 0.8
    epochs: int = 1
    lr: float = 5e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    tokens_per_batch: int = 2048
    eval_examples: int = 16
    eval_every: int = 100
    save_every: int = 100
    max_time: float | None = None  # seconds of training (regeneration excluded)
    max_steps: int | None = None  # optimizer steps of this run at most (the schedule still spans every epoch)
    eval_prompts: int = 8  # held-out prompts the engine answers with and without the head at the end
    eval_max_tokens: int = 96
    seed: int = 0
    resume: bool = False
    cache_gb: float = 6.0  # target features kept in memory between epochs (bf16, ~4.5 KB a token on the default model)
    bf16: bool = True  # autocast the head's matmuls to bfloat16 (float32 master weights): ~2.5x faster on AVX512-BF16
    norm_before_residual: bool = True  # see eagle3_head.shape_for_target
    command: str | None = None  # the command line that made the head (recorded in its config.json)
    init_from_target: bool = False  # start lm_head / norm from the target's rows of the draft vocabulary

    def __post_init__(self) -> None:
        checks = [
            (self.head_type in HEAD_TYPES, f"head_type must be one of {', '.join(HEAD_TYPES)}, got {self.head_type!r}"),
            (1 <= self.medusa_heads <= 16, "medusa_heads must be in [1, 16]"),
            (self.max_samples is None or self.max_samples >= 1, "max_samples must be >= 1"),
            (self.max_len >= 8, "max_len must be >= 8"),
            (self.draft_vocab_size >= 2, "draft_vocab_size must be >= 2"),
            (1 <= self.ttt_steps <= 16, "ttt_steps must be in [1, 16]"),
            (0 < self.ttt_decay <= 1, "ttt_decay must be in (0, 1]"),
            (self.epochs >= 1, "epochs must be >= 1"),
            (self.lr > 0, "lr must be > 0"),
            (self.tokens_per_batch >= 8, "tokens_per_batch must be >= 8"),
            (self.max_time is None or self.max_time > 0, "max_time must be > 0 seconds"),
            (self.max_steps is None or self.max_steps >= 1, "max_steps must be >= 1"),
            (self.eval_examples >= 0 and self.eval_prompts >= 0, "eval counts must be >= 0"),
            (self.regen_max_tokens >= 1, "regen_max_tokens must be >= 1"),
            (self.cache_gb >= 0, "cache_gb must be >= 0"),
            (self.save_every >= 1 and self.eval_every >= 1, "save_every and eval_every must be >= 1"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TokenleapError(msg)


@dataclass
class TrainResult:
    output: Path
    steps: int
    tokens: int
    seconds: float
    draft_vocab_coverage: float
    eval_accuracy: list[float] = field(default_factory=list)  # held-out top-1 per TTT step
    engine_eval: dict[str, Any] | None = None
    stopped_early: bool = False
    losses: list[float] = field(default_factory=list)  # training loss of each step of this run


# --------------------------------------------------------------------------- target features


@dataclass(frozen=True)
class Features:
    """What one target forward over a sequence gives the trainer: the head's input features
    (EAGLE-3: the aux states [T, 3H]; Medusa: the final normed hidden states [T, H]), the final
    normed hidden states [T, H] (the draft logits come from them) and the target's argmax over the
    full vocabulary [T]. Kept in bfloat16 so a cache of them takes half the float32 size."""

    aux: torch.Tensor
    hidden: torch.Tensor
    argmax: torch.Tensor

    @property
    def nbytes(self) -> int:
        n = self.aux.numel() * self.aux.element_size() + self.argmax.numel() * self.argmax.element_size()
        return n + (0 if self.hidden is self.aux else self.hidden.numel() * self.hidden.element_size())


def forward_features(model: Any, ids: Sequence[int], aux_layers: Sequence[int]) -> Features:
    """One target forward over `ids` (the aux states as the runtime's `Eagle3Head.aux_from`
    builds them: the input of each aux layer; no aux layers: the final hidden states)."""
    t = len(ids)
    x = torch.tensor(list(ids), dtype=torch.long)
    need = sorted({l - 1 for l in aux_layers if l > 0})
    kv = model.new_kv_cache(t)
    try:
        out = model.forward(x, torch.arange(t), kv, return_hidden=need)
    finally:
        kv.free()
    with torch.inference_mode():
        hidden = out.hidden.to(torch.bfloat16)
        parts = [F.embedding(x, model.embed) if l == 0 else out.hidden_states[l - 1] for l in aux_layers]
        aux = torch.cat([p.to(torch.bfloat16) for p in parts], dim=-1) if parts else hidden
        argmax = _logits(model, out.hidden, model.lm_head).argmax(dim=-1).to(torch.int32)
    return Features(aux.clone(), hidden.clone() if parts else aux.clone(), argmax.clone())


def _logits(model: Any, hidden: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden.to(lm.dtype), lm).float()
    cap = getattr(model.config, "final_logit_softcap", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def target_features(model: Any, ids: Sequence[int], aux_layers: Sequence[int], draft_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The aux states [T, 3H] (float32), the target's full-vocabulary argmax [T] and its logits
    over the draft vocabulary [T, Vd] of one sequence."""
    f = forward_features(model, ids, aux_layers)
    with torch.inference_mode():
        dl = _logits(model, f.hidden, model.lm_head[draft_ids])
    return f.aux.float(), f.argmax.long(), dl.clone()


class FeatureCache:
    """Target features of training sequences kept between epochs (the target forward is about
    half of a training step on the CPU), up to `max_bytes`; later sequences are recomputed."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._store: dict[int, Features] = {}
        self.hits = 0

    def get(self, key: int, make: Callable[[], Features]) -> Features:
        f = self._store.get(key)
        if f is not None:
            self.hits += 1
            return f
        f = make()
        if self.bytes + f.nbytes <= self.max_bytes:
            self._store[key] = f
            self.bytes += f.nbytes
        return f


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3H]
    ids: torch.Tensor  # [B, T]
    target_logp: torch.Tensor  # [B, T, Vd] log-probs of the target over the draft vocabulary (row r predicts x_{r+1})
    valid: torch.Tensor  # [B, T] bool: row r's label counts (assistant token x_{r+1}, target argmax in the draft vocabulary)
    target_argmax_draft: torch.Tensor  # [B, T] draft id of the target argmax (accuracy)
    tokens: int


def make_batch(model: Any, examples: Sequence[Example], aux_layers: Sequence[int], vocab: DraftVocab,
               t2d_index: torch.Tensor, cache: FeatureCache | None = None, keys: Sequence[int] | None = None) -> Batch:
    """Padded batch of `examples`; features from `cache` under `keys` when given."""
    draft_ids = torch.tensor(vocab.ids, dtype=torch.long)
    lm_draft = model.lm_head if vocab.size == model.config.vocab_size else model.lm_head[draft_ids]
    t = max(len(e.ids) for e in examples)
    b = len(examples)
    aux = ids = logp = valid = amax = None
    for r, ex in enumerate(examples):
        def make(ex: Example = ex) -> Features:
            return forward_features(model, ex.ids, aux_layers)

        f = cache.get(keys[r], make) if cache is not None and keys is not None else make()
        n = len(ex.ids)
        with torch.inference_mode():
            dl = _logits(model, f.hidden, lm_draft)
        if aux is None:
            aux = torch.zeros(b, t, f.aux.shape[1])
            ids = torch.zeros(b, t, dtype=torch.long)
            logp = torch.zeros(b, t, dl.shape[1])
            valid = torch.zeros(b, t, dtype=torch.bool)
            amax = torch.zeros(b, t, dtype=torch.long)
        assert ids is not None and logp is not None and valid is not None and amax is not None
        am = f.argmax.long()
        aux[r, :n] = f.aux.float()
        ids[r, :n] = torch.tensor(ex.ids)
        logp[r, :n] = torch.log_softmax(dl, dim=-1)
        nxt_mask = torch.tensor(ex.mask[1:] + (False,))
        valid[r, :n] = (t2d_index[am] >= 0) & nxt_mask
        amax[r, :n] = t2d_index[am].clamp(min=0)
    assert aux is not None and ids is not None and logp is not None and valid is not None and amax is not None
    return Batch(aux, ids, logp, valid, amax, sum(len(e.ids) for e in examples))


def ttt_loss(head: TrainableEagle3 | TrainableMedusa | TrainableMtp, batch: Batch, steps: int, decay: float, bf16: bool = False
             ) -> tuple[torch.Tensor, list[float], list[int]]:
    """Weighted TTT loss; also the top-1 hits and counts per step."""
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        outs = head.ttt_logits(batch.aux, batch.ids, steps)
    outs = [o.float() for o in outs]
    t = batch.ids.shape[1]
    total = torch.zeros(())
    hits: list[float] = []
    counts: list[int] = []
    for k, logits in enumerate(outs):
        # step k row i predicts x_{i+k+2}: the target's row i+k+1
        if k + 1 >= t:
            hits.append(0.0)
            counts.append(0)
            continue
        lg = logits[:, : t - k - 1]
        tp = batch.target_logp[:, k + 1 :]
        m = batch.valid[:, k + 1 :]
        n = int(m.sum())
        counts.append(n)
        if n == 0:
            hits.append(0.0)
            continue
        ce = -(tp.exp() * torch.log_softmax(lg, dim=-1)).sum(-1)
        total = total + (decay**k) * (ce * m).sum() / n
        with torch.no_grad():
            hits.append(float(((lg.argmax(-1) == batch.target_argmax_draft[:, k + 1 :]) & m).sum()))
    return total, hits, counts


# --------------------------------------------------------------------------- data preparation


def _regenerate(llm: Any, records: list[Record], cfg: TrainConfig, progress: bool, log: Callable[[str], None]) -> list[Record]:
    """Self-distillation: each conversation's first user turn (with its system turn) answered by
    the target, greedy. Answers already in OUTPUT/regenerated.jsonl are reused."""
    from tokenleap.sampling import SamplingParams

    path = cfg.output / REGEN_FILE
    done: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
                done[row["key"]] = row["answer"]
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut by an interrupted run
    prompts: list[tuple[tuple[str, str], ...]] = []
    out: list[Record] = []
    for rec in records:
        if rec.example is not None:
            out.append(rec)
            continue
        first_user = next(i for i, (r, _) in enumerate(rec.messages) if r == "user")
        prompts.append(rec.messages[: first_user + 1])
    todo = [p for p in dict.fromkeys(prompts) if json.dumps(p) not in done]
    # a prompt that leaves no room for an answer inside a training sequence teaches nothing
    room = min(cfg.max_len, llm.engine.max_context) - 16
    fits = [p for p in todo if len(llm.chat_token_ids([{"role": r, "content": c} for r, c in p])) <= room]
    if len(fits) < len(todo):
        log(f"self-distillation skips {len(todo) - len(fits)} prompts longer than {room} tokens")
    todo = fits
    if todo:
        log(f"self-distillation: the target answers {len(todo)} prompts ({len(done)} cached in {path})")
        params = SamplingParams(temperature=0.0, max_tokens=cfg.regen_max_tokens)
        convs = [[{"role": r, "content": c} for r, c in p] for p in todo]
        with path.open("a") as f:
            for idx, res in llm.chat_iter(convs, params, use_tqdm=progress):
                key = json.dumps(todo[idx])
                done[key] = res.outputs[0].text
                f.write(json.dumps({"key": key, "answer": done[key]}) + "\n")
                f.flush()
    for p in dict.fromkeys(prompts):  # a prompt asked twice gives the same greedy answer: once is enough
        answer = done.get(json.dumps(p), "")
        if answer.strip():
            out.append(Record(messages=(*p, ("assistant", answer))))
    return out


def _batches(examples: Sequence[Example], tokens_per_batch: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped into batches of similar length under a token budget (padded size)."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    batches: list[list[int]] = []
    window = 64
    for w in range(0, len(order), window):
        chunk = sorted(order[w : w + window], key=lambda i: len(examples[i].ids))
        cur: list[int] = []
        longest = 0
        for i in chunk:
            n = len(examples[i].ids)
            if cur and max(longest, n) * (len(cur) + 1) > tokens_per_batch:
                batches.append(cur)
                cur, longest = [], 0
            cur.append(i)
            longest = max(longest, n)
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


# --------------------------------------------------------------------------- evaluation


@torch.no_grad()
def heldout_accuracy(head: TrainableEagle3 | TrainableMedusa | TrainableMtp, model: Any, examples: Sequence[Example], vocab: DraftVocab,
                     t2d_index: torch.Tensor, cfg: TrainConfig, aux_layers: Sequence[int],
                     cache: FeatureCache | None = None) -> list[float]:
    """Teacher-forced top-1 agreement with the target per draft step (EAGLE-3: TTT step;
    Medusa: head) on held-out sequences."""
    steps = _steps(cfg)
    hits = [0.0] * steps
    counts = [0] * steps
    for i, ex in enumerate(examples):
        batch = make_batch(model, [ex], aux_layers, vocab, t2d_index, cache, [i])
        _, h, c = ttt_loss(head, batch, steps, cfg.ttt_decay, cfg.bf16)
        hits = [a + b for a, b in zip(hits, h)]
        counts = [a + b for a, b in zip(counts, c)]
    return [h / c if c else 0.0 for h, c in zip(hits, counts)]


def engine_eval(model_name: str, head_dir: Path, prompts: Sequence[Sequence[dict[str, str]]], max_tokens: int,
                draft_tokens: int, llm_kwargs: dict[str, Any], method: str = "eagle3") -> dict[str, Any]:
    """Held-out prompts answered greedy by plain decoding and with the trained head(s) (chains):
    tokens per target forward, tokens/s ratio, and whether every output is identical."""
    from tokenleap import LLM
    from tokenleap.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    spec = {"method": method, "model": str(head_dir), "num_speculative_tokens": draft_tokens}
    llm = LLM(model=model_name, speculative_config=spec, **llm_kwargs)
    res: dict[str, Any] = {"method": method, "prompts": len(prompts), "max_tokens": max_tokens}
    runs: dict[str, list[Any]] = {}
    for name in ("plain", "spec"):
        outs = []
        t0 = time.perf_counter()
        for conv in prompts:
            ids = llm.chat_token_ids(list(conv))
            req = llm.engine.add_request(ids, params, speculative=(name == "spec"))
            for _ in llm.engine.stream(req):
                pass
            outs.append(req.to_output())
        res[f"{name}_seconds"] = time.perf_counter() - t0
        runs[name] = outs
    tokens = sum(o.metrics.num_decode_tokens for o in runs["spec"])
    forwards = sum(o.metrics.num_forward_passes for o in runs["spec"])
    res["tokens_per_forward"] = tokens / forwards if forwards else 0.0
    res["speedup"] = res["plain_seconds"] / res["spec_seconds"] if res["spec_seconds"] else 0.0
    res["identical"] = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["plain"], runs["spec"]))
    return res


# --------------------------------------------------------------------------- the loop


def _steps(cfg: TrainConfig) -> int:
    return cfg.medusa_heads if cfg.head_type == "medusa" else cfg.ttt_steps


def _first_turn(rec: Record) -> list[dict[str, str]]:
    """The messages through the first user turn (the prompt the engine evaluation answers)."""
    msgs = rec.as_messages()
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: first_user + 1]


def _lr_at(step: int, total: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train_drafter(llm: Any, cfg: TrainConfig, model_name: str, llm_kwargs: dict[str, Any] | None = None,
                  progress: bool = True, on_log: Callable[[str], None] | None = None) -> TrainResult:
    """Train (or resume training) an EAGLE-3 head or Medusa heads for `llm`'s target; see the
    module docstring."""
    log = on_log or logger.warning
    model = llm.engine.model
    tc = model.config
    out = cfg.output
    out.mkdir(parents=True, exist_ok=True)
    medusa = cfg.head_type == "medusa"
    full_vocab = cfg.head_type in ("medusa", "mtp")  # heads that read the target's LM head and its final hidden state
    aux_layers: tuple[int, ...] = () if full_vocab else (cfg.aux_layers or default_aux_layers(tc.num_layers))
    if not full_vocab and (len(aux_layers) != 3 or not all(0 <= l < tc.num_layers for l in aux_layers)):
        raise TokenleapError(f"aux layers {list(aux_layers)} must be 3 layer ids in [0, {tc.num_layers})")
    steps = _steps(cfg)
    state_path = out / STATE_FILE
    state = None
    if cfg.resume:
        if not state_path.is_file():
            raise TokenleapError(f"nothing to resume: {state_path} does not exist")
        state = torch.load(state_path, weights_only=False)

    records = load_records(cfg.data, cfg.max_samples, cfg.seed)
    if cfg.regenerate:
        records = _regenerate(llm, records, cfg, progress, log)
    tok = llm.tokenizer
    max_len = min(cfg.max_len, llm.engine.max_context)
    pairs = [(r, e) for r, e in ((r, tokenize(tok, r, max_len)) for r in records) if e is not None]
    bad = [t for _, e in pairs for t in e.ids if t >= tc.vocab_size]
    if bad:
        raise TokenleapError(f"training data holds token id {bad[0]} outside the target vocabulary ({tc.vocab_size})")
    if len(pairs) < 2:
        raise TokenleapError(f"only {len(pairs)} usable training sequences; need at least 2")
    n_eval = min(cfg.eval_examples, len(pairs) // 5)
    heldout = [e for _, e in pairs[:n_eval]]
    train = [e for _, e in pairs[n_eval:]]
    eos = sorted(getattr(tok, "eos_token_ids", ()) or ())
    if full_vocab:  # the heads share the target's LM head: the whole vocabulary
        vocab = DraftVocab(tuple(range(tc.vocab_size)), tc.vocab_size, 1.0)
    elif state is not None:
        vocab = DraftVocab(tuple(state["draft_ids"]), tc.vocab_size, state["coverage"])
    else:
        vocab = build_draft_vocab(train, cfg.draft_vocab_size, tc.vocab_size, always=eos)
    t2d_index = torch.full((tc.vocab_size,), -1, dtype=torch.long)
    t2d_index[torch.tensor(vocab.ids)] = torch.arange(vocab.size)
    n_tok = sum(len(e.ids) for e in train)
    n_loss = sum(e.num_loss_tokens for e in train)
    log(f"data: {len(train)} training sequences ({n_tok} tokens, {n_loss} assistant), {len(heldout)} held out; "
        f"draft vocabulary {vocab.size} of {tc.vocab_size} covers {vocab.coverage:.1%} of assistant tokens")

    head: TrainableEagle3 | TrainableMedusa | TrainableMtp
    shape: Eagle3Config | MedusaShape
    if cfg.head_type == "mtp":
        shape = shape_for_target(tc, tc.vocab_size, ())  # the target's layer shape, full vocabulary, no aux layers
        head = TrainableMtp(shape, model.embed, model.lm_head, getattr(tc, "final_logit_softcap", None), seed=cfg.seed)
    elif medusa:
        shape = MedusaShape(tc.hidden_size, tc.vocab_size, cfg.medusa_heads)
        head = TrainableMedusa(shape, model.lm_head, getattr(tc, "final_logit_softcap", None))
    else:
        shape = shape_for_target(tc, vocab.size, aux_layers, cfg.norm_before_residual)  # type: ignore[arg-type]
        init = cfg.init_from_target
        head = TrainableEagle3(shape, model.embed, init_lm_head=model.lm_head[torch.tensor(vocab.ids)] if init else None,
                               init_norm=model.norm if init else None, seed=cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    epoch_batches = [_batches(train, cfg.tokens_per_batch, random.Random(cfg.seed + e)) for e in range(cfg.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    step, tokens_seen, elapsed = 0, 0, 0.0
    if state is not None:
        saved_shape = state.get("shape")
        if saved_shape != {"type": cfg.head_type, **asdict(shape)}:
            raise TokenleapError(f"{state_path} was trained for a different head shape / target; use a new --output")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["optimizer"])
        step, tokens_seen, elapsed = state["step"], state["tokens"], state["seconds"]
        log(f"resuming at step {step} of {total_steps} ({tokens_seen} tokens, {elapsed:.0f} s trained)")

    def save() -> None:
        extra = {"steps": step, "tokens": tokens_seen, "seconds": round(elapsed, 1), "data": list(cfg.data),
                 "regenerated": cfg.regenerate, "draft_steps": steps, "draft_vocab_coverage": round(vocab.coverage, 4),
                 "target": model_name, "command": cfg.command}
        if isinstance(head, (TrainableMedusa, TrainableMtp)):
            head.export(out, extra)
        else:
            head.export(out, vocab.d2t(), vocab.t2d(), extra)
        tmp = out / (STATE_FILE + ".tmp")
        torch.save({"head": head.state_dict(), "optimizer": opt.state_dict(), "step": step, "tokens": tokens_seen,
                    "seconds": elapsed, "draft_ids": list(vocab.ids), "coverage": vocab.coverage,
                    "shape": {"type": cfg.head_type, **asdict(shape)}, "config": {k: str(v) for k, v in asdict(cfg).items()}}, tmp)
        tmp.replace(state_path)

    flat = [(e, b) for e, bs in enumerate(epoch_batches) for b in bs]
    cache = FeatureCache(int(cfg.cache_gb * 2**30)) if cfg.epochs > 1 else None
    heldout_cache = FeatureCache(1 << 30)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train-drafter", unit="step", dynamic_ncols=True)
    stopped_early = False
    acc: list[float] = []
    start = time.perf_counter() - elapsed
    run_hits = [0.0] * steps
    run_counts = [0.0] * steps
    losses: list[float] = []
    last = total_steps if cfg.max_steps is None else min(total_steps, step + cfg.max_steps)
    try:
        while step < last:
            if cfg.max_time is not None and time.perf_counter() - start >= cfg.max_time:
                stopped_early = True
                log(f"--max-time reached after {step} steps; saving")
                break
            _, idx = flat[step]
            batch = make_batch(model, [train[i] for i in idx], aux_layers, vocab, t2d_index, cache, idx)
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total_steps, cfg)
            loss, hits, counts = ttt_loss(head, batch, steps, cfg.ttt_decay, cfg.bf16)
            opt.zero_grad(set_to_none=True)
            if loss.requires_grad:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
                opt.step()
            step += 1
            losses.append(float(loss.detach()))
            tokens_seen += batch.tokens
            elapsed = time.perf_counter() - start
            run_hits = [0.9 * a + h for a, h in zip(run_hits, hits)]
            run_counts = [0.9 * a + c for a, c in zip(run_counts, counts)]
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(loss.detach()):.3f}", acc0=f"{run_hits[0] / max(run_counts[0], 1):.2f}",
                                tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
            if heldout and (step % cfg.eval_every == 0 or step == total_steps):
                acc = heldout_accuracy(head, model, heldout, vocab, t2d_index, cfg, aux_layers, heldout_cache)
                log(f"step {step}: held-out top-1 per draft step " + " ".join(f"{a:.3f}" for a in acc))
            if step % cfg.save_every == 0:
                save()
    except KeyboardInterrupt:
        stopped_early = True
        log(f"interrupted after {step} steps; saving")
        save()
        raise
    finally:
        if bar is not None:
            bar.close()
    save()
    if heldout and not acc:
        acc = heldout_accuracy(head, model, heldout, vocab, t2d_index, cfg, aux_layers, heldout_cache)
    result = TrainResult(out, step, tokens_seen, elapsed, vocab.coverage, acc, None, stopped_early or step < total_steps, losses)
    prompts = [_first_turn(r) for r, _ in pairs[:n_eval] if r.example is None][: cfg.eval_prompts]
    if prompts:
        log(f"evaluating the head in the engine on {len(prompts)} held-out prompts (greedy, plain vs {cfg.head_type})")
        result.engine_eval = engine_eval(model_name, out, prompts, cfg.eval_max_tokens, steps if medusa else steps + 2,
                                         llm_kwargs or {}, cfg.head_type)
        (out / "eval.json").write_text(json.dumps({"heldout_top1": acc, **result.engine_eval}, indent=2))
    return result
