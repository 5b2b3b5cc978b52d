"""benchmarks/draft_sim.py: the offline acceptance replay counts steps as the engine would."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest

from tokenleap import SpecConfig


@pytest.fixture(scope="module")
def draft_sim(load_benchmark: Callable[[str], ModuleType]) -> ModuleType:
    return load_benchmark("draft_sim")


def test_copying_output_is_accepted_in_long_steps(draft_sim: ModuleType) -> None:
    prompt = list(range(100, 140))
    runs = [{"group": "copy", "prompt_ids": prompt, "output_ids": prompt[:32]}]  # the answer repeats the prompt
    al8 = draft_sim.simulate(SpecConfig(method="ngram"), runs, 8)["copy"][0]
    al16 = draft_sim.simulate(SpecConfig(method="ngram"), runs, 16)["copy"][0]
    # step 1 has only the prompt's last token to match (no draft for token 100), then 8 or 16
    # draft tokens are all accepted per step, plus one
    assert al8 == pytest.approx(32 / 5) and al16 == pytest.approx(32 / 3)


def test_unpredictable_output_is_one_token_per_step(draft_sim: ModuleType) -> None:
    runs = [{"group": "g", "prompt_ids": [1, 2, 3], "output_ids": list(range(200, 220))}]
    assert draft_sim.simulate(SpecConfig(method="ngram"), runs, 8)["g"] == [1.0]
