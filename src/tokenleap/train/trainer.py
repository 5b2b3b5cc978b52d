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

import functools
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

from tokenleap.errors import TokenleapError
from tokenleap.heads.base import HeadShape
from tokenleap.heads.eagle3 import default_aux_layers
from tokenleap.models.base import CausalLM
from tokenleap.models.config import ModelConfig
from tokenleap.train.data import DraftVocab, Example, Record, build_draft_vocab, load_records, tokenize
from tokenleap.train.eagle3_head import TrainableEagle3, shape_for_target
from tokenleap.train.medusa_head import MedusaShape, TrainableMedusa
from tokenleap.train.mtp_head import TrainableMtp
from tokenleap.train.torch_target import TorchTarget

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
REGEN_FILE = "regenerated.jsonl"


HEAD_TYPES = ("eagle3", "medusa", "mtp")


@dataclass(frozen=True)
class TrainConfig:
    output: Path
    # or "medusa" (Medusa-1 heads sharing the target's LM head), "mtp" (a MiMo-layout MTP layer)
    head_type: str = "eagle3"
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
    # with max_time: the learning-rate schedule spans max_time (not the epochs), and training cycles
    # through the data (reshuffled each pass, up to `epochs` passes) until the time is up
    time_schedule: bool = False
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
    # where the target's features, self-distillation and the head run: "cpu" (the runtime's kernels),
    # or a torch device ("cuda", "cuda:1", "mps") through `torch_target.TorchTarget` (Llama-family targets)
    device: str = "cpu"

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
            (not self.time_schedule or self.max_time is not None, "time_schedule needs max_time"),
            (self.eval_examples >= 0 and self.eval_prompts >= 0, "eval counts must be >= 0"),
            (self.regen_max_tokens >= 1, "regen_max_tokens must be >= 1"),
            (self.cache_gb >= 0, "cache_gb must be >= 0"),
            (self.save_every >= 1 and self.eval_every >= 1, "save_every and eval_every must be >= 1"),
            (_device_ok(self.device), f"device must be cpu, cuda, cuda:N or mps, got {self.device!r}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise TokenleapError(msg)


def _device_ok(device: str) -> bool:
    try:
        return torch.device(device).type in ("cpu", "cuda", "mps")
    except (RuntimeError, ValueError):
        return False


def open_device(device: str) -> torch.device:
    """`device` as a torch device, with a clear error when this machine has no such device."""
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise TokenleapError(f"--device {device}: this machine has no CUDA GPU that torch can use "
                             f"(torch {torch.__version__}); train with --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise TokenleapError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise TokenleapError(f"--device {device}: MPS is not available on this machine")
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the target's float32 matmuls: TF32 (features are kept in bf16)
    return dev


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
    eval_acceptance: float | None = None  # held-out chain acceptance length (teacher-forced, greedy)


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


def forward_features(model: CausalLM, ids: Sequence[int], aux_layers: Sequence[int]) -> Features:
    """One target forward over `ids` (the aux states as the runtime's `Eagle3Head.aux_from`
    builds them: the input of each aux layer; no aux layers: the final hidden states)."""
    t = len(ids)
    x = torch.tensor(list(ids), dtype=torch.long)
    need = sorted({layer - 1 for layer in aux_layers if layer > 0})
    kv = model.new_kv_cache(t)
    try:
        out = model.forward(x, torch.arange(t), kv, return_hidden=need)
    finally:
        kv.free()
    with torch.inference_mode():
        hidden = out.hidden.to(torch.bfloat16)
        parts = [F.embedding(x, model.embed) if layer == 0 else out.hidden_states[layer - 1] for layer in aux_layers]
        aux = torch.cat([p.to(torch.bfloat16) for p in parts], dim=-1) if parts else hidden
        argmax = _logits(model.config, out.hidden, model.lm_head).argmax(dim=-1).to(torch.int32)
    return Features(aux.clone(), hidden.clone() if parts else aux.clone(), argmax.clone())


def _logits(config: ModelConfig, hidden: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden.to(lm.dtype), lm).float()
    cap = config.final_logit_softcap
    return torch.tanh(logits / cap) * cap if cap else logits


def target_features(model: CausalLM, ids: Sequence[int], aux_layers: Sequence[int], draft_ids: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The aux states [T, 3H] (float32), the target's full-vocabulary argmax [T] and its logits
    over the draft vocabulary [T, Vd] of one sequence."""
    f = forward_features(model, ids, aux_layers)
    with torch.inference_mode():
        dl = _logits(model.config, f.hidden, model.lm_head[draft_ids])
    return f.aux.float(), f.argmax.long(), dl.clone()


class FeatureCache:
    """Target features of training sequences kept between epochs (the target forward is about
    half of a training step on the CPU), up to `max_bytes`; later sequences are recomputed."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._store: dict[int, Features] = {}
        self.hits = 0

    def lookup(self, key: int) -> Features | None:
        f = self._store.get(key)
        self.hits += f is not None
        return f

    def put(self, key: int, f: Features) -> None:
        if key not in self._store and self.bytes + f.nbytes <= self.max_bytes:
            self._store[key] = f
            self.bytes += f.nbytes

    def get(self, key: int, make: Callable[[], Features]) -> Features:
        f = self.lookup(key)
        if f is None:
            f = make()
            self.put(key, f)
        return f


class RuntimeFeatures:
    """Target features from the runtime's CPU model: one forward a sequence, kept in `cache`."""

    def __init__(self, model: CausalLM, aux_layers: Sequence[int], cache: FeatureCache | None = None) -> None:
        self.model, self.aux_layers, self.cache = model, tuple(aux_layers), cache
        self.config = model.config
        self.device = torch.device("cpu")

    @property
    def embed(self) -> torch.Tensor:
        return self.model.embed

    @property
    def lm_head(self) -> torch.Tensor:
        return self.model.lm_head

    @property
    def norm(self) -> torch.Tensor:
        return self.model.norm

    def features(self, examples: Sequence[Example], keys: Sequence[int] | None) -> list[Features]:
        def make(ex: Example) -> Features:
            return forward_features(self.model, ex.ids, self.aux_layers)

        if self.cache is None or keys is None:
            return [make(ex) for ex in examples]
        return [self.cache.get(k, functools.partial(make, ex)) for ex, k in zip(examples, keys)]


class TorchFeatures:
    """Target features from a `TorchTarget` on its device: one padded forward over the sequences
    a batch lacks, rows kept (bfloat16, on the device) in `cache`."""

    def __init__(self, target: TorchTarget, aux_layers: Sequence[int], cache: FeatureCache | None = None) -> None:
        self.target, self.aux_layers, self.cache = target, tuple(aux_layers), cache
        self.config = target.config
        self.device = target.device
        self.embed, self.lm_head, self.norm = target.embed, target.lm_head, target.norm

    def features(self, examples: Sequence[Example], keys: Sequence[int] | None) -> list[Features]:
        cache = self.cache if keys is not None else None
        out: list[Features | None] = [
            cache.lookup(k) if cache is not None else None for k in keys or [0] * len(examples)
        ]
        todo = [r for r, f in enumerate(out) if f is None]
        if todo:
            t = max(len(examples[r].ids) for r in todo)
            ids = torch.zeros(len(todo), t, dtype=torch.long)
            for j, r in enumerate(todo):
                ids[j, : len(examples[r].ids)] = torch.tensor(examples[r].ids)
            aux, hidden = self.target.features(ids.to(self.device), self.aux_layers)
            argmax = self.target.logits(hidden).argmax(-1).to(torch.int32)
            for j, r in enumerate(todo):
                n = len(examples[r].ids)
                h = hidden[j, :n].to(torch.bfloat16).clone()
                f = Features(aux[j, :n].to(torch.bfloat16).clone() if self.aux_layers else h, h, argmax[j, :n].clone())
                out[r] = f
                if cache is not None and keys is not None:
                    cache.put(keys[r], f)
        return [f for f in out if f is not None]


@dataclass
class Batch:
    aux: torch.Tensor  # [B, T, 3H]
    ids: torch.Tensor  # [B, T]
    target_logp: torch.Tensor  # [B, T, Vd] log-probs of the target over the draft vocabulary (row r predicts x_{r+1})
    # [B, T] bool: row r's label counts (assistant token x_{r+1}, target argmax in the draft vocabulary)
    valid: torch.Tensor
    target_argmax_draft: torch.Tensor  # [B, T] draft id of the target argmax (accuracy)
    tokens: int
    # [B, T] bool: x_{r+1} is an assistant token (the chain acceptance's positions)
    assistant: torch.Tensor | None = None


def make_batch(source: RuntimeFeatures | TorchFeatures, examples: Sequence[Example], vocab: DraftVocab,
               t2d_index: torch.Tensor, keys: Sequence[int] | None = None) -> Batch:
    """Padded batch of `examples` on the source's device; features kept in the source's cache under `keys`."""
    dev = source.device
    feats = source.features(examples, keys)
    lm = source.lm_head
    lm_draft = lm if vocab.size == source.config.vocab_size else lm[torch.tensor(vocab.ids, device=lm.device)]
    b, t = len(examples), max(len(e.ids) for e in examples)
    aux = torch.zeros(b, t, feats[0].aux.shape[1], device=dev)
    hidden = torch.zeros(b, t, feats[0].hidden.shape[1], device=dev, dtype=torch.bfloat16)
    ids = torch.zeros(b, t, dtype=torch.long)
    nxt = torch.zeros(b, t, dtype=torch.bool)
    am = torch.zeros(b, t, dtype=torch.long, device=dev)
    for r, (ex, f) in enumerate(zip(examples, feats)):
        n = len(ex.ids)
        aux[r, :n] = f.aux.float()
        hidden[r, :n] = f.hidden
        am[r, :n] = f.argmax.long()
        ids[r, :n] = torch.tensor(ex.ids)
        nxt[r, : n - 1] = torch.tensor(ex.mask[1:], dtype=torch.bool)
    with torch.inference_mode():
        logp = torch.log_softmax(_logits(source.config, hidden, lm_draft), dim=-1)
    t2d = t2d_index.to(dev)
    valid = (t2d[am] >= 0) & nxt.to(dev)
    return Batch(
        aux, ids.to(dev), logp.clone(), valid, t2d[am].clamp(min=0), sum(len(e.ids) for e in examples), nxt.to(dev)
    )


def ttt_loss(
    head: TrainableEagle3 | TrainableMedusa | TrainableMtp,
    batch: Batch,
    steps: int,
    decay: float,
    bf16: bool = False,
    chain: list[float] | None = None,
) -> tuple[torch.Tensor, list[float], list[int]]:
    """Weighted TTT loss; also the top-1 hits and counts per step. With `chain` ([drafts
    accepted, positions]) it adds, for every position whose next token is an assistant token, how
    many of the `steps` chained drafts a greedy verifier would accept there (the leading steps whose
    top-1 is the target's; none where the target's token is outside the draft vocabulary)."""
    with torch.autocast(batch.aux.device.type, dtype=torch.bfloat16, enabled=bf16):
        outs = head.ttt_logits(batch.aux, batch.ids, steps)
    outs = [o.float() for o in outs]
    t = batch.ids.shape[1]
    total = torch.zeros((), device=batch.aux.device)
    hits: list[float] = []
    counts: list[int] = []
    run: torch.Tensor | None = None
    accepted = torch.zeros((), device=batch.aux.device)
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
        with torch.no_grad():
            match = (lg.argmax(-1) == batch.target_argmax_draft[:, k + 1 :]) & m
            hits.append(float(match.sum()))
            if chain is not None:
                full = torch.zeros(batch.ids.shape[0], t - 1, dtype=torch.bool, device=match.device)
                full[:, : t - k - 1] = match
                run = full if run is None else run & full
                accepted += run.sum()
        if n == 0:
            continue
        ce = -(tp.exp() * torch.log_softmax(lg, dim=-1)).sum(-1)
        total = total + (decay**k) * (ce * m).sum() / n
    if chain is not None:
        chain[0] += float(accepted)
        positions = batch.assistant if batch.assistant is not None else batch.valid
        chain[1] += float(positions[:, 1:].sum())
    return total, hits, counts


# --------------------------------------------------------------------------- data preparation


def _regenerate(llm: Any, records: list[Record], cfg: TrainConfig, progress: bool, log: Callable[[str], None],
                target: TorchTarget | None = None) -> list[Record]:
    """Self-distillation: each conversation's first user turn (with its system turn) answered by
    the target, greedy (by the engine, or by `target` on its device in length-sorted batches).
    Answers already in OUTPUT/regenerated.jsonl are reused."""
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
            def keep(idx: int, text: str) -> None:
                key = json.dumps(todo[idx])
                done[key] = text
                f.write(json.dumps({"key": key, "answer": text}) + "\n")
                f.flush()

            if target is None:
                for idx, res in llm.chat_iter(convs, params, use_tqdm=progress):
                    keep(idx, res.outputs[0].text)
            else:
                _regenerate_on(target, llm, convs, cfg.regen_max_tokens, keep, progress)
    for p in dict.fromkeys(prompts):  # a prompt asked twice gives the same greedy answer: once is enough
        answer = done.get(json.dumps(p), "")
        if answer.strip():
            out.append(Record(messages=(*p, ("assistant", answer))))
    return out


def _regenerate_on(target: TorchTarget, llm: Any, convs: Sequence[Sequence[dict[str, str]]], max_tokens: int,
                   keep: Callable[[int, str], None], progress: bool) -> None:
    """The greedy answers of `convs` by `target` on its device, each passed to `keep` as text."""
    eos = set(getattr(llm.tokenizer, "eos_token_ids", ()) or ())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(convs), desc="self-distillation", unit="prompt", dynamic_ncols=True)

    def on_batch(indices: list[int], answers: list[list[int]]) -> None:
        for i, ids in zip(indices, answers):
            keep(i, llm.tokenizer.decode([t for t in ids if t not in eos]))
        if bar is not None:
            bar.update(len(indices))

    try:
        target.generate([llm.chat_token_ids(list(c)) for c in convs], max_tokens, sorted(eos), on_batch=on_batch)
    finally:
        if bar is not None:
            bar.close()


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


@dataclass(frozen=True)
class HeldOut:
    accuracy: list[float]  # teacher-forced top-1 agreement with the target per draft step
    acceptance: float  # tokens per target forward of a greedy chain of all the steps' drafts (1 + mean drafts accepted)


@torch.no_grad()
def heldout_eval(head: TrainableEagle3 | TrainableMedusa | TrainableMtp, source: RuntimeFeatures | TorchFeatures,
                 examples: Sequence[Example], vocab: DraftVocab, t2d_index: torch.Tensor, cfg: TrainConfig,
                 batch_tokens: int | None = None) -> HeldOut:
    """Held-out sequences, teacher-forced: top-1 agreement per draft step (EAGLE-3: TTT step;
    Medusa: head) and the chain acceptance length it implies where the data is the target's own
    greedy text (self-distilled). Features are cached under keys -1, -2, ... (apart from training's)."""
    steps = _steps(cfg)
    hits = [0.0] * steps
    counts = [0] * steps
    chain = [0.0, 0.0]
    budget = batch_tokens or cfg.tokens_per_batch
    groups: list[list[int]] = [[]]
    for i, ex in enumerate(examples):
        longest = max([len(examples[j].ids) for j in groups[-1]] + [len(ex.ids)])
        if groups[-1] and longest * (len(groups[-1]) + 1) > budget:
            groups.append([])
        groups[-1].append(i)
    for g in groups:
        if not g:
            continue
        batch = make_batch(source, [examples[i] for i in g], vocab, t2d_index, [-1 - i for i in g])
        _, h, c = ttt_loss(head, batch, steps, cfg.ttt_decay, cfg.bf16, chain)
        hits = [a + b for a, b in zip(hits, h)]
        counts = [a + b for a, b in zip(counts, c)]
    return HeldOut([h / c if c else 0.0 for h, c in zip(hits, counts)], 1.0 + chain[0] / chain[1] if chain[1] else 1.0)


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
    res["identical"] = all(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(runs["plain"], runs["spec"])
    )
    return res


# --------------------------------------------------------------------------- the loop


def _steps(cfg: TrainConfig) -> int:
    return cfg.medusa_heads if cfg.head_type == "medusa" else cfg.ttt_steps


def _first_turn(rec: Record) -> list[dict[str, str]]:
    """The messages through the first user turn (the prompt the engine evaluation answers)."""
    msgs = rec.as_messages()
    first_user = next(i for i, m in enumerate(msgs) if m["role"] == "user")
    return msgs[: first_user + 1]


def _lr_at(step: int, total: int, cfg: TrainConfig, time_frac: float | None = None) -> float:
    """Linear warmup over `warmup_steps`, then cosine decay to a tenth of `lr` at the last step
    (or, with `time_frac`, at the end of the time budget)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = time_frac if time_frac is not None else (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def aux_layers_for(cfg: TrainConfig, num_layers: int) -> tuple[int, ...]:
    """The head's aux layers (none for heads that read the final hidden state), checked."""
    if cfg.head_type in ("medusa", "mtp"):
        return ()
    aux = tuple(cfg.aux_layers or default_aux_layers(num_layers))
    if len(aux) != 3 or not all(0 <= layer < num_layers for layer in aux):
        raise TokenleapError(f"aux layers {list(aux)} must be 3 layer ids in [0, {num_layers})")
    return aux


def train_drafter(llm: Any, cfg: TrainConfig, model_name: str, llm_kwargs: dict[str, Any] | None = None,
                  progress: bool = True, on_log: Callable[[str], None] | None = None) -> TrainResult:
    """Train (or resume training) an EAGLE-3 head or Medusa heads for `llm`'s target; see the
    module docstring. With `cfg.device` other than "cpu" the self-distillation, the target's
    features and the head run there (`TorchTarget`); `llm` still tokenizes and evaluates."""
    log = on_log or logger.warning
    tc = llm.engine.model.config
    cfg.output.mkdir(parents=True, exist_ok=True)
    aux_layers = aux_layers_for(cfg, tc.num_layers)
    state = _load_state(cfg)
    target: TorchTarget | None = None
    if cfg.device != "cpu":
        dev = open_device(cfg.device)
        log(f"loading the target onto {dev} (bfloat16)")
        target = TorchTarget.load(llm.source, dev, torch.bfloat16, max_positions=max(cfg.max_len, 64) + 64)

    records = load_records(cfg.data, cfg.max_samples, cfg.seed)
    if cfg.regenerate:
        records = _regenerate(llm, records, cfg, progress, log, target)
    tok = llm.tokenizer
    max_len = min(cfg.max_len, llm.engine.max_context)
    pairs = [(r, e) for r, e in ((r, tokenize(tok, r, max_len)) for r in records) if e is not None]
    if len(pairs) < 2:
        raise TokenleapError(f"only {len(pairs)} usable training sequences; need at least 2")
    n_eval = min(cfg.eval_examples, len(pairs) // 5)
    heldout = [e for _, e in pairs[:n_eval]]
    train = [e for _, e in pairs[n_eval:]]
    eos = sorted(getattr(tok, "eos_token_ids", ()) or ())
    cache = FeatureCache(int(cfg.cache_gb * 2**30) if cfg.epochs > 1 else 0)
    cache.max_bytes += 1 << 30  # the held-out sequences' features (keys < 0)
    source: RuntimeFeatures | TorchFeatures = (RuntimeFeatures(llm.engine.model, aux_layers, cache) if target is None
                                               else TorchFeatures(target, aux_layers, cache))
    result = fit_head(source, train, heldout, cfg, model_name, eos=eos, state=state, progress=progress, log=log)
    steps = _steps(cfg)
    prompts = [_first_turn(r) for r, _ in pairs[:n_eval] if r.example is None][: cfg.eval_prompts]
    if prompts:
        log(f"evaluating the head in the engine on {len(prompts)} held-out prompts (greedy, plain vs {cfg.head_type})")
        result.engine_eval = engine_eval(model_name, cfg.output, prompts, cfg.eval_max_tokens,
                                         steps if cfg.head_type == "medusa" else steps + 2, llm_kwargs or {},
                                         cfg.head_type)
        (cfg.output / "eval.json").write_text(json.dumps({"heldout_top1": result.eval_accuracy,
                                                          "heldout_acceptance": result.eval_acceptance,
                                                          **result.engine_eval}, indent=2))
    return result


def _load_state(cfg: TrainConfig) -> dict[str, Any] | None:
    state_path = cfg.output / STATE_FILE
    if not cfg.resume:
        return None
    if not state_path.is_file():
        raise TokenleapError(f"nothing to resume: {state_path} does not exist")
    return torch.load(state_path, weights_only=False, map_location="cpu")


def _draft_vocab(
    cfg: TrainConfig,
    vocab_size: int,
    train: Sequence[Example],
    heldout: Sequence[Example],
    state: dict[str, Any] | None,
    eos: Sequence[int],
) -> DraftVocab:
    """The head's draft vocabulary: the whole one for heads on the target's LM head (Medusa,
    MTP), a resumed run's own, or the most frequent assistant tokens of `train` (and `eos`)."""
    bad = [t for e in [*train, *heldout] for t in e.ids if t >= vocab_size]
    if bad:
        raise TokenleapError(f"training data holds token id {bad[0]} outside the target vocabulary ({vocab_size})")
    if cfg.head_type in ("medusa", "mtp"):  # the heads share the target's LM head: the whole vocabulary
        return DraftVocab(tuple(range(vocab_size)), vocab_size, 1.0)
    if state is not None:
        return DraftVocab(tuple(state["draft_ids"]), vocab_size, state["coverage"])
    return build_draft_vocab(train, cfg.draft_vocab_size, vocab_size, always=eos)


def _new_head(
    source: RuntimeFeatures | TorchFeatures, cfg: TrainConfig, vocab: DraftVocab, aux_layers: Sequence[int]
) -> tuple[TrainableEagle3 | TrainableMedusa | TrainableMtp, HeadShape | MedusaShape]:
    """A fresh head of `cfg.head_type` for the source's target, and its shape."""
    tc = source.config
    softcap = getattr(tc, "final_logit_softcap", None)
    if cfg.head_type == "mtp":
        shape = shape_for_target(tc, tc.vocab_size, ())  # the target's layer shape, full vocabulary, no aux layers
        return TrainableMtp(shape, source.embed, source.lm_head, softcap, seed=cfg.seed), shape
    if cfg.head_type == "medusa":
        medusa_shape = MedusaShape(tc.hidden_size, tc.vocab_size, cfg.medusa_heads)
        return TrainableMedusa(medusa_shape, source.lm_head, softcap), medusa_shape
    shape = shape_for_target(tc, vocab.size, aux_layers, cfg.norm_before_residual)
    init = cfg.init_from_target
    rows = torch.tensor(vocab.ids, device=source.lm_head.device)
    head = TrainableEagle3(shape, source.embed, init_lm_head=source.lm_head[rows].cpu() if init else None,
                           init_norm=source.norm.cpu() if init else None, seed=cfg.seed)
    return head, shape


def _save(head: TrainableEagle3 | TrainableMedusa | TrainableMtp, opt: torch.optim.Optimizer, vocab: DraftVocab,
          shape: HeadShape | MedusaShape, cfg: TrainConfig, progress: dict[str, Any]) -> None:
    """The head in its layout (with what trained it) and `trainer_state.pt` (to resume), in
    `cfg.output`. `progress`: steps, tokens, seconds, draft_steps, target, device."""
    out = cfg.output
    extra = {
        "steps": progress["steps"], "tokens": progress["tokens"], "seconds": round(progress["seconds"], 1),
        "data": list(cfg.data), "regenerated": cfg.regenerate, "draft_steps": progress["draft_steps"],
        "draft_vocab_coverage": round(vocab.coverage, 4), "target": progress["target"], "command": cfg.command,
        "device": progress["device"]
    }
    if isinstance(head, (TrainableMedusa, TrainableMtp)):
        head.export(out, extra)
    else:
        head.export(out, vocab.d2t(), vocab.t2d(), extra)
    tmp = out / (STATE_FILE + ".tmp")
    torch.save(
        {
            "head": head.state_dict(), "optimizer": opt.state_dict(), "step": progress["steps"],
            "tokens": progress["tokens"], "seconds": progress["seconds"], "draft_ids": list(vocab.ids),
            "coverage": vocab.coverage, "shape": {"type": cfg.head_type, **asdict(shape)},
            "config": {k: str(v) for k, v in asdict(cfg).items()}
        },
        tmp,
    )
    tmp.replace(out / STATE_FILE)


def _resume(head: torch.nn.Module, opt: torch.optim.Optimizer, state: dict[str, Any], shape: dict[str, Any],
            state_path: Path) -> tuple[int, int, float]:
    """Load a saved run's head and optimizer; its step, tokens and seconds trained."""
    if state.get("shape") != shape:
        raise TokenleapError(f"{state_path} was trained for a different head shape / target; use a new --output")
    head.load_state_dict(state["head"])
    opt.load_state_dict(state["optimizer"])
    return state["step"], state["tokens"], state["seconds"]


def fit_head(source: RuntimeFeatures | TorchFeatures, train: Sequence[Example], heldout: Sequence[Example],
             cfg: TrainConfig, model_name: str, *, eos: Sequence[int] = (), state: dict[str, Any] | None = None,
             progress: bool = True, log: Callable[[str], None] = logger.warning) -> TrainResult:
    """The training loop over tokenized `train` sequences on the source's device: the draft
    vocabulary, the head, AdamW with warmup and cosine decay, held-out evaluation, saves (the
    head in its layout and `trainer_state.pt`) every `save_every` steps and at the end."""
    tc, dev, out = source.config, source.device, cfg.output
    out.mkdir(parents=True, exist_ok=True)
    aux_layers = aux_layers_for(cfg, tc.num_layers)
    steps = _steps(cfg)
    state_path = out / STATE_FILE
    vocab = _draft_vocab(cfg, tc.vocab_size, train, heldout, state, eos)
    t2d_index = torch.full((tc.vocab_size,), -1, dtype=torch.long)
    t2d_index[torch.tensor(vocab.ids)] = torch.arange(vocab.size)
    n_tok = sum(len(e.ids) for e in train)
    n_loss = sum(e.num_loss_tokens for e in train)
    log(f"data: {len(train)} training sequences ({n_tok} tokens, {n_loss} assistant), {len(heldout)} held out; "
        f"draft vocabulary {vocab.size} of {tc.vocab_size} covers {vocab.coverage:.1%} of assistant tokens")

    head, shape = _new_head(source, cfg, vocab, aux_layers)
    head.to(dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    epoch_batches = [_batches(train, cfg.tokens_per_batch, random.Random(cfg.seed + e)) for e in range(cfg.epochs)]
    total_steps = sum(len(b) for b in epoch_batches)
    step, tokens_seen, elapsed = 0, 0, 0.0
    if state is not None:
        step, tokens_seen, elapsed = _resume(head, opt, state, {"type": cfg.head_type, **asdict(shape)}, state_path)
        log(f"resuming at step {step} of {total_steps} ({tokens_seen} tokens, {elapsed:.0f} s trained)")

    def save() -> None:
        _save(head, opt, vocab, shape, cfg, {"steps": step, "tokens": tokens_seen, "seconds": elapsed,
                                             "draft_steps": steps, "target": model_name, "device": str(dev)})

    flat = [(e, b) for e, bs in enumerate(epoch_batches) for b in bs]
    keep_keys = cfg.epochs > 1  # features kept between epochs only when a sequence comes back
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=total_steps, initial=step, desc="train-drafter", unit="step", dynamic_ncols=True)
    stopped_early = False
    held: HeldOut | None = None
    start = time.perf_counter() - elapsed
    run_hits = [0.0] * steps
    run_counts = [0.0] * steps
    losses: list[float] = []
    last = total_steps if cfg.max_steps is None else min(total_steps, step + cfg.max_steps)

    def evaluate() -> HeldOut:
        h = heldout_eval(head, source, heldout, vocab, t2d_index, cfg)
        log(f"step {step}: held-out top-1 per draft step " + " ".join(f"{a:.3f}" for a in h.accuracy)
            + f"; chain acceptance {h.acceptance:.2f}")
        return h

    try:
        while step < last:
            if cfg.max_time is not None and time.perf_counter() - start >= cfg.max_time:
                stopped_early = not cfg.time_schedule  # a time-scheduled run ends here by design
                log(f"--max-time reached after {step} steps; saving")
                break
            _, idx = flat[step]
            batch = make_batch(source, [train[i] for i in idx], vocab, t2d_index, idx if keep_keys else None)
            frac = (time.perf_counter() - start) / cfg.max_time if cfg.time_schedule and cfg.max_time else None
            for g in opt.param_groups:
                g["lr"] = _lr_at(step, total_steps, cfg, frac)
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
                bar.set_postfix(loss=f"{losses[-1]:.3f}", acc0=f"{run_hits[0] / max(run_counts[0], 1):.2f}",
                                tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}")
            if heldout and (step % cfg.eval_every == 0 or step == total_steps):
                held = evaluate()
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
    if heldout and held is None:
        held = evaluate()
    return TrainResult(out, step, tokens_seen, elapsed, vocab.coverage, held.accuracy if held else [], None,
                       stopped_early or (step < total_steps and not cfg.time_schedule), losses,
                       held.acceptance if held else None)
