"""TOKENLEAP_SPEC_TRACE: one NDJSON line per verified draft, adding up to the request's own
speculation statistics; no file when the variable is unset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.engine.engine import Engine
from tokenleap.engine.trace import ENV, SpecTrace
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer


def test_trace_lines_add_up_to_the_requests_statistics(
    tiny_model: LlamaModel, tokenizer: Tokenizer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "trace.ndjson"
    monkeypatch.setenv(ENV, str(path))
    spec = SpecConfig(method="ngram", num_speculative_tokens=6, adaptive=False)
    engine = Engine(tiny_model, tokenizer, spec=spec, drafter=default_registry().create("ngram", spec))
    prompt = [5, 6, 7, 8, 9] * 6  # repeats: the n-gram drafter proposes from the start
    req = engine.run(engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    s = req.metrics.spec
    assert len(lines) == s.num_drafts > 0
    assert sum(len(x["drafted"]) for x in lines) == s.num_draft_tokens
    assert sum(x["accepted"] for x in lines) == s.num_accepted_tokens
    assert all(
        x["request"] == req.request_id and x["method"] == "ngram" and 0 <= x["accepted"] <= len(x["drafted"])
        for x in lines
    )
    assert [x["step"] for x in lines] == sorted(x["step"] for x in lines)


def test_no_trace_without_the_variable(
    tiny_model: LlamaModel, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ENV, raising=False)
    assert SpecTrace.from_env() is None
    spec = SpecConfig(method="ngram", num_speculative_tokens=4)
    assert Engine(tiny_model, tokenizer, spec=spec, drafter=default_registry().create("ngram", spec))._trace is None
