"""Adaptive draft length: pick each step's k to maximise expected tokens per second.

With per-token acceptance rate alpha, a chain draft of k tokens yields
E(k) = (1 - alpha^(k+1)) / (1 - alpha) committed tokens per target forward (Leviathan et al.,
2023), and that forward costs c(k) = t(k+1 rows) / t(1 row), measured once on this machine (the
cost curve). The controller keeps a decayed estimate of alpha per request and chooses
k* = argmax E(k) / c(k) over [draft_min, cap], or 0 when no k beats plain decoding by a margin;
while off it probes again every `probe_every` steps with a short draft, so a request whose text
turns predictable (a quoted passage, code being repeated) gets speculation back.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from tokenleap.models.llama import LlamaModel


@dataclass(frozen=True)
class CostCurve:
    relative: tuple[float, ...]  # relative[k] = cost of verifying k drafts (k+1 rows) / cost of 1 row

    def cost(self, k: int) -> float:
        return self.relative[min(k, len(self.relative) - 1)]


def measure_cost_curve(model: LlamaModel, max_draft: int, context: int = 128, repeats: int = 3) -> CostCurve:
    """Time forwards of 1..max_draft+1 rows at a short context; median of `repeats`."""
    kv = model.new_kv_cache(context + max_draft + 2)
    ids = torch.arange(context) % model.config.vocab_size
    model.forward(ids, torch.arange(context), kv)
    times = []
    for k in range(max_draft + 1):
        samples = []
        for _ in range(repeats):
            kv.truncate(context)
            rows = torch.full((k + 1,), 17)
            t0 = time.perf_counter()
            model.compute_logits(model.forward(rows, torch.arange(context, context + k + 1), kv).hidden)
            samples.append(time.perf_counter() - t0)
        times.append(statistics.median(samples))
    base = times[0]
    relative = [1.0] + [max(1.0, t / base) for t in times[1:]]
    # a longer draft never costs less than a shorter one (smooth out timing noise)
    for k in range(1, len(relative)):
        relative[k] = max(relative[k], relative[k - 1])
    return CostCurve(tuple(relative))


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass
class DraftController:
    """Per-request acceptance estimate and draft-length choice."""

    curve: CostCurve
    cap: int
    floor: int = 0
    decay: float = 0.9
    min_gain: float = 1.05  # speculate only when expected speedup beats this
    probe_every: int = 8
    accepted: float = 1.0  # decayed counts (prior alpha = 0.5)
    trials: float = 2.0
    steps_off: int = 0

    @property
    def alpha(self) -> float:
        return self.accepted / self.trials

    def choose(self, budget: int) -> int:
        top = min(self.cap, budget)
        if top <= 0:
            return 0
        best_k, best_gain = 0, 1.0
        for k in range(max(1, self.floor), top + 1):
            gain = expected_tokens(self.alpha, k) / self.curve.cost(k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        if best_k and best_gain >= self.min_gain:
            self.steps_off = 0
            return best_k
        self.steps_off += 1
        if self.steps_off >= self.probe_every:
            self.steps_off = 0
            return max(1, self.floor) if max(1, self.floor) <= top else 0
        return 0

    def update(self, draft_len: int, num_accepted: int) -> None:
        """Fold in one verification: num_accepted successes, then one failure if rejected."""
        if draft_len == 0:
            return
        fails = 1 if num_accepted < draft_len else 0
        self.accepted = self.decay * self.accepted + num_accepted
        self.trials = self.decay * self.trials + num_accepted + fails
