"""ARCHITECTURE.md's "How to add a drafter" example runs as written: the code block is read from
the document and executed, so the example cannot rot. Its drafter must satisfy the protocol,
draft, have tokens accepted, and leave greedy output equal to plain decoding."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tokenleap import LLM, SamplingParams
from tokenleap.drafters.base import Drafter, DraftRequest, check_drafter

DOC = Path(__file__).resolve().parents[2] / "ARCHITECTURE.md"


def example_code() -> str:
    section = DOC.read_text().split("## How to add a drafter", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the section should hold exactly one python example"
    return blocks[0]


def test_the_example_drafter_satisfies_the_protocol_and_proposes() -> None:
    code = example_code().split("\nllm = LLM(", 1)[0]  # the class only, without loading a model
    namespace: dict[str, object] = {"__name__": "architecture_example"}
    exec(compile(code, str(DOC), "exec"), namespace)
    drafter = namespace["EchoDrafter"]()  # type: ignore[operator]
    assert isinstance(drafter, Drafter) and check_drafter(drafter) is drafter
    drafter.begin(DraftRequest("r", [5, 1, 2, 3, 1], SamplingParams(temperature=0), torch.Generator()))
    assert drafter.propose("r", [5, 1, 2, 3, 1], 2).tokens == [2, 3]
    assert drafter.propose("r", [5, 1, 2, 3, 9], 2).tokens == []


@pytest.mark.slow
def test_the_example_runs_and_keeps_greedy_output(llm: LLM, capsys: pytest.CaptureFixture[str]) -> None:
    namespace: dict[str, object] = {"__name__": "architecture_example"}
    exec(compile(example_code(), str(DOC), "exec"), namespace)
    out = namespace["out"]
    assert capsys.readouterr().out.strip()  # it printed its text and count
    spec = out.metrics.spec  # type: ignore[attr-defined]
    assert spec.num_draft_tokens > 0 and spec.num_accepted_tokens > 0
    prompt = "red, green, blue, red, green, blue, red, green,"
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # type: ignore[attr-defined]
