"""The adaptive draft-length controller (engine/speculation.py): its cost model calibrated on a
request's own step timings (per-step work outside the forward, drafting cost per token)."""

from __future__ import annotations

import pytest

from tokenleap.engine.speculation import CostCurve, DraftController

CURVE = CostCurve(tuple(1.0 + 0.06 * k for k in range(9)))


def test_step_cost_without_timings_is_the_forward_curve_plus_drafting() -> None:
    c = DraftController(CURVE, cap=8, draft_cost=0.15)
    assert c.step_cost(0) == pytest.approx(1.0)
    assert c.step_cost(2) == pytest.approx(1.12 + 0.3)


def test_timings_give_overhead_and_draft_cost_relative_to_a_one_row_forward() -> None:
    c = DraftController(CURVE, cap=8, draft_cost=0.15, timing_decay=0.5)
    # a 2-token draft: forward of 3 rows 5.6 ms (one row: 5 ms), drafting 0.5 ms, 1.5 ms besides
    for _ in range(20):
        c.observe_timing(forward_s=5.6e-3, step_s=7.6e-3, draft_s=0.5e-3, draft_len=2)
    assert c.overhead == pytest.approx(1.5 / 5.0)
    assert c.draft_cost == pytest.approx(0.25 / 5.0)
    # relative to a plain step (5 + 1.5 ms): (5.6 + 1.5 + 0.5) / 6.5
    assert c.step_cost(2) == pytest.approx(7.6 / 6.5)


def test_plain_steps_measure_overhead_but_keep_the_drafters_cost() -> None:
    c = DraftController(CURVE, cap=8, draft_cost=0.15)
    c.observe_timing(forward_s=5e-3, step_s=6e-3, draft_s=0.0, draft_len=0)
    assert c.overhead == pytest.approx(0.2)
    assert c.draft_cost == pytest.approx(0.15)


def test_measured_overhead_makes_a_costly_drafter_draft_again() -> None:
    """Acceptance 0.25 with a head costing 0.15 of a forward per token: against the forward-only
    curve no draft pays (1.25 / 1.21 is under the 1.05 margin); with the step's real work outside
    the forward measured (w = 0.4: 1.25 / 1.15), a one-token draft pays."""
    def ctrl() -> DraftController:
        return DraftController(CURVE, cap=8, accepted=0.5, trials=2.0, draft_cost=0.15, probe_every=1000)

    bare = ctrl()
    assert bare.choose(8) == 0
    timed = ctrl()
    for _ in range(10):
        timed.observe_timing(forward_s=5.3e-3, step_s=5.3e-3 + 2e-3 + 0.75e-3, draft_s=0.75e-3, draft_len=1)
    assert timed.overhead == pytest.approx(0.4)
    assert timed.choose(8) >= 1


def _steps_until_probe(c: DraftController) -> int:
    """Plain steps the controller takes before its next probe (a draft of one token)."""
    for n in range(1, 1000):
        if c.choose(8):
            return n
    raise AssertionError("no probe in 1000 steps")


def test_failed_probes_back_off_and_an_accepted_one_resets_the_wait() -> None:
    """Off (acceptance ~0), the controller probes after `probe_every` plain steps; each probe
    with nothing accepted doubles the wait up to `probe_max`, an accepted token brings it back."""
    c = DraftController(CURVE, cap=8, accepted=0.0, trials=50.0, probe_every=8, probe_max=32)
    waits = []
    for _ in range(5):
        waits.append(_steps_until_probe(c))
        c.update(1, 0)  # the probe's token rejected
    assert waits == [8, 16, 32, 32, 32]
    c.update(0, 0)  # a step without a draft changes nothing
    assert _steps_until_probe(c) == 32
    c.update(1, 1)  # accepted: back to probe_every
    c.accepted, c.trials = 0.0, 50.0  # (still off)
    assert _steps_until_probe(c) == 8


@pytest.mark.parametrize("p", [1.0, 0.8, 0.6, 0.3])
def test_adaptive_length_nearly_matches_the_best_fixed_length(p: float) -> None:
    """With its cost model right (a 1.7B target's curve, a draft model's 0.149 a token) and
    Bernoulli acceptance p per token, the controller's choices over 256 tokens reach at least 93 %
    of the best fixed draft length's speed-up (mean of 20 seeds), and never lose to plain decoding."""
    import random
    import statistics

    curve = CostCurve(relative=(1.0, 1.16, 1.38, 1.63, 1.84, 2.12, 2.29, 2.63, 3.10))
    d = 0.149

    def speedup(fixed: int | None, seed: int) -> float:
        rng = random.Random(seed)
        ctl = DraftController(curve=curve, cap=6, draft_cost=d)
        tokens, cost = 0, 0.0
        while tokens < 256:
            k = fixed if fixed is not None else ctl.choose(6, 300)
            cost += curve.cost(k, 300) + d * k if k else 1.0
            accepted = 0
            while accepted < k and rng.random() < p:
                accepted += 1
            if k:
                ctl.update(k, accepted)
            tokens += accepted + 1
        return tokens / cost

    best = max(statistics.mean(speedup(k, s) for s in range(20)) for k in range(0, 7))
    adaptive = statistics.mean(speedup(None, s) for s in range(20))
    assert adaptive >= 0.93 * best and adaptive >= 0.97, (adaptive, best)
