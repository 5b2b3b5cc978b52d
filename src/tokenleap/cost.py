"""The cost model of speculation, shared by the engine and the drafters that weigh cost.

A draft of k tokens is verified by one target forward over k + 1 rows; its cost relative to a
one-row forward is the cost curve (`CostCurve`, measured on the machine by
`tokenleap.engine.speculation.measure_cost_curve`), and with per-token acceptance rate alpha it
commits E(k) = (1 - alpha^(k+1)) / (1 - alpha) tokens (`expected_tokens`; Leviathan et al.,
2023, section 3.4). The engine's draft-length controller and the cost-aware drafter chain both
choose by E(k) per unit of cost. This module imports nothing of the engine or the drafters.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CostCurve:
    """Relative cost of a forward over n rows, measured at a short context and (optionally) a
    long one: past a few hundred tokens, each extra row's attention makes verification dearer,
    so the cost at a request's context is interpolated (and extrapolated) linearly between the
    two measurements."""

    relative: tuple[float, ...]  # relative[k] = cost of k+1 rows / cost of 1 row, at short_context
    long: tuple[float, ...] | None = None  # the same at long_context
    short_context: int = 128
    long_context: int = 1024

    def _weight(self, context: int) -> float:
        if self.long is None or context <= self.short_context:
            return 0.0
        return min(3.0, (context - self.short_context) / (self.long_context - self.short_context))

    @staticmethod
    def _at(curve: tuple[float, ...], rows: int) -> float:
        if rows <= len(curve):
            return curve[max(rows, 1) - 1]
        slope = curve[-1] - curve[-2] if len(curve) > 1 else 1.0
        return curve[-1] + max(slope, 0.0) * (rows - len(curve))

    def rows_cost(self, rows: int, context: int = 0) -> float:
        """Relative cost of a forward over `rows` rows (any mix of sequences) at `context`
        tokens, extrapolated linearly from the last measured step past the measured rows."""
        short = self._at(self.relative, rows)
        w = self._weight(context)
        if w == 0.0 or self.long is None:
            return short
        return max(1.0, short + w * (self._at(self.long, rows) - short))

    def cost(self, k: int, context: int = 0) -> float:
        """Relative cost of verifying k draft tokens (k + 1 rows)."""
        return self.rows_cost(k + 1, context)


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
