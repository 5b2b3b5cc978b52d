"""Adaptive draft length: pick each step's k to maximise expected tokens per second.

With per-token acceptance rate alpha, a chain draft of k tokens yields E(k) = (1 - alpha^(k+1))
/ (1 - alpha) committed tokens per target forward (Leviathan et al., 2023), and that forward
costs c(k) = t(k+1 rows) / t(1 row), measured once on this machine (the cost curve, at a short
and a long context: at long contexts each extra row's attention costs more, so the curve is
interpolated at the request's length). The controller keeps a decayed estimate of alpha per
request and chooses k* = argmax E(k) (1 + w) / (c(k) + w + k d) over [draft_min, cap], or 0 when
no k beats plain decoding by a margin. d is a drafter's own cost per draft token and w the
engine's per-step work outside the target forward (sampling, verification, bookkeeping, a head's
feature fusion), both relative to a one-row forward: d starts at the drafter's
`relative_draft_cost` (0 for the model-free drafters) and both are then measured on the
request's own steps (decayed averages of the step's timings): a forward-only curve and a
drafter's one-off estimate miss what a whole step costs on this machine at this context (on the
default model in bf16: w 0.05-0.09; a trained EAGLE-3 head's d 0.06-0.18 against its static
0.12-0.15; a suffix tree's 0.004-0.011, not 0); while off it probes again every `probe_every`
steps with a short draft, so a request whose text turns predictable (a quoted passage, code
being repeated) gets speculation back. A probe that gets nothing accepted doubles the wait
before the next (up to `probe_max` steps; one accepted token resets it): a draft model's probe
is not free (it catches the draft up on the tokens decoded while off, drafts, and widens the
verify), and on text it cannot predict (a summary of a long document) probing every 8 steps cost
11 % of the decode time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokenleap.cost import CostCurve, expected_tokens
from tokenleap.models.base import CausalLM, SeqInput
from tokenleap.paths import cache_dir

__all__ = [
    "CostCurve", "DraftController", "cached_cost_curve", "expected_tokens", "measure_cost_curve", "plan_batch_drafts",
    "timed_row_counts"
]

logger = logging.getLogger(__name__)


def timed_row_counts(max_rows: int) -> list[int]:
    """The row counts a cost curve times: every count up to 8, then every 4th up to 32, every
    8th beyond, and `max_rows` (drafts of 64 tokens: 19 forwards a round instead of 65; the
    curve is smooth, and the counts between are interpolated)."""
    counts = [n for n in range(1, max_rows + 1) if n <= 8 or (n <= 32 and n % 4 == 0) or n % 8 == 0]
    return counts if counts[-1] == max_rows else [*counts, max_rows]


def _time_rows(model: CausalLM, context: int, max_rows: int, repeats: int) -> list[float]:
    """Relative cost of forwards of 1..max_rows rows: the fastest of `repeats` rounds, each
    round timing every row count of `timed_row_counts` in turn (a busy moment then hits one
    sample of several row counts, not every sample of one, and the minimum discards it); the
    counts between are linear interpolations."""
    kv = model.new_kv_cache(context + max_rows + 2)
    # `context` cached positions of zeros, not a prefill (a forward's cost does not depend on the
    # values it attends over; a 1,024-token prefill of a 1.5B model took 10 s of the 25 s curve)
    kv.reserve(context)
    kv.storage().zero_()
    kv.commit(context)
    counts = timed_row_counts(max_rows)
    best = dict.fromkeys(counts, float("inf"))
    for _ in range(repeats):
        for n in counts:
            kv.truncate(context)
            t0 = time.perf_counter()
            # the engine's verify forward (`forward_batch`: the row-invariant path at any row count)
            model.compute_logits(
                model.forward_batch([SeqInput(torch.full((n,), 17), torch.arange(context, context + n), kv)]).hidden
            )
            best[n] = min(best[n], time.perf_counter() - t0)
    kv.free()
    measured = [max(1.0, best[n] / best[1]) for n in counts]
    for k in range(1, len(measured)):  # more rows never cost less (smooth out timing noise)
        measured[k] = max(measured[k], measured[k - 1])
    relative = [1.0] * max_rows
    for (n0, c0), (n1, c1) in zip(zip(counts, measured), zip(counts[1:], measured[1:])):
        for n in range(n0, n1 + 1):
            relative[n - 1] = c0 + (c1 - c0) * (n - n0) / (n1 - n0)
    return relative


COST_CURVE_MAX_AGE_S = 7 * 24 * 3600  # a cached cost curve is measured again after a week


def host_key(model: CausalLM, *parts: object) -> str:
    """What a measured cost depends on: this CPU, the kernels' variant and -march, threads and many-row tile
    (which the load may choose by timing, kernels/tiles.py), the model's shape, dtype, KV type and
    bytes a step, and `parts`; a short digest."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        cpu = ""
    kernels = getattr(model, "kernels", None)
    fields = [
        cpu, platform.machine(), getattr(kernels, "variant", None), getattr(kernels, "march", None),
        getattr(kernels, "threads", torch.get_num_threads()), getattr(kernels, "quant_xb_rows", lambda: None)(),
        repr(model.config), str(getattr(model, "dtype", "")),
        str(getattr(model, "kv_dtype", "")), model.weight_bytes_per_token(), *parts
    ]
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:20]


def cached_cost_curve(model: CausalLM, max_draft: int, folder: Path | None = None, **kwargs: Any) -> CostCurve:
    """`measure_cost_curve`, kept on disk (`<cache>/cost_curves/`) by `host_key`: a process's
    first speculative request, or a server's start, no longer stalls while the curve is timed
    again (8-25 s for a 1.5B model on 2 cores). A curve of more rows serves fewer; an unreadable
    entry, or one older than a week, is measured again."""
    folder = folder if folder is not None else cache_dir() / "cost_curves"
    path = folder / f"{host_key(model, sorted(kwargs.items()))}.json"
    try:
        if time.time() - path.stat().st_mtime > COST_CURVE_MAX_AGE_S:
            raise OSError("stale")  # measured again now and then: a curve timed in a busy hour does not stay for good
        data = json.loads(path.read_text())
        curve = CostCurve(tuple(data["relative"]), tuple(data["long"]) if data["long"] is not None else None,
                          int(data["short_context"]), int(data["long_context"]))
        if len(curve.relative) > max_draft:
            return curve
    except (OSError, ValueError, KeyError, TypeError):
        pass
    curve = measure_cost_curve(model, max_draft, **kwargs)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dataclasses.asdict(curve)))
        tmp.replace(path)
    except OSError as exc:
        logger.info("cost curve not cached (%s)", exc)
    return curve


def measure_cost_curve(
    model: CausalLM, max_draft: int, contexts: tuple[int, int] = (128, 1024), repeats: int = 5
) -> CostCurve:
    """Time forwards of 1..max_draft+1 rows at a short and a long context (fastest of `repeats`).
    The long context is skipped when the model's context cannot hold it; the short one shrinks
    to fit a small model."""
    short_ctx, long_ctx = contexts
    short_ctx = max(1, min(short_ctx, model.max_context - max_draft - 2))
    short = _time_rows(model, short_ctx, max_draft + 1, repeats)
    long = None
    if long_ctx + max_draft + 2 <= model.max_context:
        long = tuple(_time_rows(model, long_ctx, max_draft + 1, repeats))
    return CostCurve(tuple(short), long, short_ctx, long_ctx)


@dataclass
class DraftController:
    """Per-request acceptance estimate and draft-length choice."""

    curve: CostCurve
    cap: int
    floor: int = 0
    decay: float = 0.9
    min_gain: float = 1.05  # speculate only when expected speedup beats this
    probe_every: int = 8  # while off, probe after this many plain steps,
    probe_max: int = 64  # twice as many after each probe with nothing accepted, up to this
    accepted: float = 1.0  # decayed counts (prior alpha = 0.5)
    trials: float = 2.0
    steps_off: int = 0
    draft_cost: float = 0.0  # one draft token's drafting cost relative to a 1-row target forward (a head's step)
    overhead: float = 0.0  # w: a step's work outside the target forward, relative to a 1-row forward
    timing_decay: float = 0.8
    _forward_s: float = 0.0  # decayed measurements (seconds): a 1-row forward, the work outside it,
    _other_s: float = 0.0  # and drafting per draft token
    _draft_s: float | None = None
    _interval: int = 0  # plain steps between probes now (0: probe_every)
    _probing: bool = False  # the draft in verification is a probe

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def observe_timing(self, forward_s: float, step_s: float, draft_s: float, draft_len: int, context: int = 0) -> None:
        """Fold in one single-request step's timings: its target forward over `draft_len` + 1
        rows, the whole step, and the drafting part of it. Updates `overhead` and `draft_cost`."""
        one_row = forward_s / self.curve.cost(draft_len, context)
        other = max(0.0, step_s - forward_s - draft_s)
        a = self.timing_decay
        first = self._forward_s == 0.0
        self._forward_s = one_row if first else a * self._forward_s + (1 - a) * one_row
        self._other_s = other if first else a * self._other_s + (1 - a) * other
        if draft_len > 0:
            per = draft_s / draft_len
            self._draft_s = per if self._draft_s is None else a * self._draft_s + (1 - a) * per
        if self._forward_s > 0:
            self.overhead = self._other_s / self._forward_s
            if self._draft_s is not None:
                self.draft_cost = self._draft_s / self._forward_s

    def step_cost(self, k: int, context: int = 0) -> float:
        """A step verifying a k-token draft, relative to a plain decoding step."""
        return (self.curve.cost(k, context) + self.overhead + self.draft_cost * k) / (1.0 + self.overhead)

    def choose(self, budget: int, context: int = 0) -> int:
        top = min(self.cap, budget)
        if top <= 0:
            return 0
        best_k, best_gain = 0, 1.0
        for k in range(max(1, self.floor), top + 1):
            gain = expected_tokens(self.alpha, k) / self.step_cost(k, context)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k and best_gain >= self.min_gain:
            self.steps_off = 0
            return best_k
        return self.off_step(top)

    @property
    def probe_interval(self) -> int:
        """Plain steps between probes now: `probe_every`, doubled by each failed probe."""
        return self._interval or self.probe_every

    def off_step(self, budget: int) -> int:
        """A step without a draft (the controller's choice, or the batch planner's): count it,
        and probe with a short draft every `probe_interval` such steps."""
        self.steps_off += 1
        if self.steps_off >= self.probe_interval:
            self.steps_off = 0
            if budget >= max(1, self.floor):
                self._probing = True
                return max(1, self.floor)
        return 0

    def update(self, draft_len: int, num_accepted: int) -> None:
        """Fold in one verification: num_accepted successes, then one failure if rejected. A
        probe with nothing accepted doubles the wait for the next one; an accepted one resets it."""
        if draft_len == 0:
            self._probing = False  # the drafter had nothing to offer: the probe cost nothing
            return
        if self._probing:
            self._probing = False
            self._interval = self.probe_every if num_accepted else min(2 * self.probe_interval, self.probe_max)
        fails = 1 if num_accepted < draft_len else 0
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + fails


def plan_batch_drafts(
    curve: CostCurve,
    alphas: list[float | None],
    budgets: list[int],
    floors: list[int],
    min_gain: float = 1.05,
    context: int = 0,
) -> list[int]:
    """Draft lengths for one batched step that maximise expected tokens per unit of forward time.

    Request i commits E_i(k) = sum_{j<=k} alpha_i^j tokens for a k-token draft, and the forward
    costs `curve.rows_cost(sum(1 + k_i), context)` (context: the batch's mean length). Starting
    from no drafts, add one draft token at a time to the request whose next token is most likely
    accepted (alpha_i^(k_i+1)) and keep the allocation with the best tokens per unit time; plain
    decoding wins unless that beats it by the `min_gain` margin. A large batch already fills the
    forward, so its drafts stop paying sooner: the planner then speculates less, down to none.
    `alphas[i] is None` means a fixed-length request (seeded sampling): it gets its budget.
    """
    ks = [b if a is None else 0 for a, b in zip(alphas, budgets)]
    tokens = float(sum(expected_tokens(1.0, k) if a is None else 1.0 for a, k in zip(alphas, ks)))
    rows = sum(1 + k for k in ks)
    base_rate = len(ks) / curve.rows_cost(len(ks), context)  # plain decoding of the adaptive requests
    best_rate, best_ks = tokens / curve.rows_cost(rows, context), list(ks)
    while True:
        pick, gain = -1, 0.0
        for i, (a, k, b) in enumerate(zip(alphas, ks, budgets)):
            if a is not None and k < b and a ** (k + 1) > gain:
                pick, gain = i, a ** (k + 1)
        if pick < 0:
            break
        ks[pick] += 1
        # a floor is all or nothing: a draft shorter than it is never proposed
        while ks[pick] < floors[pick] and ks[pick] < budgets[pick]:
            gain += alphas[pick] ** (ks[pick] + 1)  # type: ignore[operator]  # pick is only ever an adaptive request's (alpha not None)
            ks[pick] += 1
        if ks[pick] < floors[pick]:
            ks[pick] = 0
            budgets = [0 if j == pick else bb for j, bb in enumerate(budgets)]
            continue
        tokens += gain
        rows = sum(1 + k for k in ks)
        rate = tokens / curve.rows_cost(rows, context)
        if rate > best_rate:
            best_rate, best_ks = rate, list(ks)
    if best_rate < base_rate * min_gain and all(a is not None for a in alphas):
        return [0] * len(ks)
    return best_ks
