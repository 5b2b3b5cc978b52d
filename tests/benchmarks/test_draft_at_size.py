"""benchmarks/draft_at_size.py: the break-even acceptance and the controller's choice from costs,
and the costed replay drafter (a real draft model's work, the recorded continuation proposed)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from tokenleap import LLM
from tokenleap.engine.speculation import CostCurve, expected_tokens


def test_break_even_and_controller(load_benchmark: Callable[[str], ModuleType]) -> None:
    m = load_benchmark("draft_at_size")
    curve = CostCurve(relative=(1.0, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.7))
    free = m.break_even(curve, 0.0, 1, 0)
    assert free == 0.01  # a free draft of 1 on a free verify pays at any acceptance above 0
    dear = m.break_even(curve, 0.3, 4, 0)
    assert dear is not None and expected_tokens(dear, 4) > curve.cost(4) + 4 * 0.3 >= expected_tokens(dear - 0.01, 4)
    assert m.break_even(curve, 2.0, 4, 0) is None  # drafting dearer than the target never pays
    k_low, gain_low = m.controller_choice(curve, 0.1, 0.2, 8, 0)
    k_high, gain_high = m.controller_choice(curve, 0.1, 0.9, 8, 0)
    assert k_high > k_low and gain_high > gain_low > 0


def test_costed_replay_proposes_the_reference(load_benchmark: Callable[[str], ModuleType], llm: LLM) -> None:
    m = load_benchmark("draft_at_size")
    from tokenleap import SamplingParams
    from tokenleap.drafters.base import DraftRequest
    from tokenleap.drafters.draft_model import DraftModelDrafter

    ids = llm.tokenizer.encode("The quick brown fox")
    reference = ids + [11, 12, 13, 14, 15, 16]
    inner = DraftModelDrafter(llm.model)
    d = m.CostedReplayDrafter(inner, reference, p=1.0)
    d.begin(DraftRequest("r", ids, SamplingParams(temperature=0), torch.Generator()))
    assert d.propose("r", ids, 4).tokens == [11, 12, 13, 14]
    assert inner._states["r"].kv.length > 0  # the draft model ran
    assert d.propose("r", ids + [99], 3).tokens == []  # off the reference: nothing
    d.end("r")
    assert not inner._states


@pytest.fixture(scope="module")
def llm() -> LLM:
    from tokenleap import LLM

    return LLM(model="smollm2-135m-instruct")
