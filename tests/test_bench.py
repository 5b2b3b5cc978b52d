"""tokenleap bench: question loading, method parsing, summaries, the chart, and a real run."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from tokenleap.bench import (
    Question,
    Record,
    default_spec_bench,
    load_questions,
    parse_methods,
    plot,
    round_speedups,
    run_bench,
    summarize,
)
from tokenleap.errors import TokenleapError
from tokenleap.models.llama import LlamaModel
from tokenleap.tokenizer import Tokenizer


def test_default_questions_cover_all_groups_with_categories_in_turn() -> None:
    qs = load_questions(default_spec_bench(), 8)
    groups = {q.group for q in qs}
    assert groups == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(sum(q.group == g for q in qs) == 8 for g in groups)
    mt = [q for q in qs if q.group == "mt_bench"]
    assert len({q.question_id for q in mt}) == 8 and all(len(q.turns) == 2 for q in mt)


def test_messages_format_and_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "m.jsonl"
    good.write_text(json.dumps({"category": "edit", "messages": [{"role": "user", "content": "hi"}],
                                "assistant_prefix": "```", "stop": "\n```"}) + "\n")
    (q,) = load_questions(good, 5)
    assert q.group == "edit" and q.turns == ("hi",) and q.assistant_prefix == "```" and q.stop == ("\n```",)
    bad_stop = tmp_path / "s.jsonl"
    bad_stop.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "stop": [3]}) + "\n")
    with pytest.raises(TokenleapError, match="'stop' must be"):
        load_questions(bad_stop, 1)
    bad = tmp_path / "b.jsonl"
    bad.write_text("{not json\n")
    with pytest.raises(TokenleapError, match="not JSON"):
        load_questions(bad, 1)
    with pytest.raises(TokenleapError, match="not found"):
        load_questions(tmp_path / "missing.jsonl", 1)


def test_parse_methods_labels_chains_and_rejects_none() -> None:
    methods = parse_methods("ngram, suffix+ngram", 6)
    assert list(methods) == ["ngram", "suffix+ngram"]
    assert methods["suffix+ngram"].method == "chain" and methods["suffix+ngram"].chain == ("suffix", "ngram")
    assert methods["ngram"].num_speculative_tokens == 6
    with pytest.raises(TokenleapError):
        parse_methods("none", 4)
    with pytest.raises(TokenleapError):
        parse_methods("bogus", 4)


def test_parse_methods_takes_each_methods_options() -> None:
    methods = parse_methods("draft-model:draft_vocab=32768:draft_p_min=0.5,draft-model", 4, model="m")
    assert list(methods) == ["draft-model:draft_vocab=32768:draft_p_min=0.5", "draft-model"]
    opts = methods["draft-model:draft_vocab=32768:draft_p_min=0.5"].options_for()
    assert (opts.draft_vocab, opts.draft_p_min) == (32768, 0.5)
    assert methods["draft-model"].options_for().draft_vocab == 0
    with pytest.raises(TokenleapError, match="key=value"):
        parse_methods("draft-model:draft_vocab", 4, model="m")
    with pytest.raises(TokenleapError):
        parse_methods("draft-model:draft_vocab=-1", 4, model="m")


def _rec(
    method: str,
    group: str,
    tokens: int,
    wall: float,
    decode: float,
    forwards: int,
    decode_tokens: int,
    match: bool = True,
) -> Record:
    return Record("1", group, 0, method, tokens, forwards, decode_tokens, wall, decode, wall - decode, 0, 0, match)


def test_summarize_speedups_and_acceptance(tmp_path: Path) -> None:
    records = [
        _rec("plain", "qa", 101, 10.0, 9.0, 100, 100),
        _rec("ngram", "qa", 101, 5.0, 4.5, 50, 100),
        _rec("hf-plain", "qa", 101, 20.0, 20.0, 0, 0, match=False),
        _rec("hf-pld", "qa", 101, 10.0, 10.0, 0, 0, match=False),
    ]
    s = summarize(records)
    assert s["qa"]["ngram"]["speedup"] == pytest.approx(2.0)
    assert s["qa"]["ngram"]["decode_speedup"] == pytest.approx(2.0)
    assert s["qa"]["ngram"]["mean_acceptance_length"] == pytest.approx(2.0)
    assert s["qa"]["plain"]["mean_acceptance_length"] == pytest.approx(1.0)
    assert s["qa"]["hf-pld"]["speedup"] == pytest.approx(2.0)  # relative to transformers' own plain
    assert s["overall"]["ngram"]["matched_plain"] == 1 and s["overall"]["hf-pld"]["matched_plain"] == 0
    png = tmp_path / "chart.png"
    plot(png, s)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_run_bench_on_the_real_model_honours_prefix_and_stop(model_bf16: LlamaModel, tokenizer: Tokenizer) -> None:
    source = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n"
    prompt = (
        f"Here is a file:\n\n```python\n{source}```\n\n"
        "Rename `add` to `plus`. Reply with the whole file in one code block."
    )
    q = Question("edit", "code_edit", (prompt,), "```python\n", ("\n```",))
    records = run_bench(model_bf16, tokenizer, [q], parse_methods("ngram", 8), max_tokens=96)
    assert [r.method for r in records] == ["plain", "ngram"]
    assert all(r.matched_plain for r in records)
    plain = records[0]
    assert 0 < plain.new_tokens < 96  # ended at the closing fence, not at max_tokens
    assert records[1].target_forwards < plain.target_forwards  # the copy was drafted


def test_round_speedups_give_each_rounds_ratio_and_their_median() -> None:
    """Each round's questions pooled: speedup = (tokens / wall) over plain's in the same round;
    median, min and max across rounds (hf- methods against transformers' own plain)."""
    records = []
    for rnd, (plain_wall, ngram_wall) in enumerate([(10.0, 5.0), (10.0, 8.0), (12.0, 4.0)]):
        records += [
            dataclasses.replace(_rec("plain", "qa", 100, plain_wall, 1.0, 100, 100), round=rnd),
            dataclasses.replace(_rec("ngram", "qa", 100, ngram_wall, 1.0, 50, 100), round=rnd),
            dataclasses.replace(_rec("hf-plain", "qa", 100, 20.0, 20.0, 0, 0), round=rnd),
            dataclasses.replace(_rec("hf-pld", "qa", 100, 10.0, 10.0, 0, 0), round=rnd),
        ]
    spread = round_speedups(records)
    assert set(spread) == {"ngram", "hf-pld"}
    assert spread["ngram"]["speedups"] == pytest.approx([2.0, 1.25, 3.0])
    ngram = spread["ngram"]
    assert (ngram["median"], ngram["min"], ngram["max"]) == pytest.approx((2.0, 1.25, 3.0))
    assert spread["hf-pld"]["median"] == pytest.approx(2.0)


@pytest.mark.slow
def test_run_bench_rounds_repeat_every_method_in_turn(model_bf16: LlamaModel, tokenizer: Tokenizer) -> None:
    """Each round repeats every method on every question, with new drafters: suffix decoding
    over earlier outputs would otherwise draft round 2's answers from round 1's (fixed draft
    lengths here, so equal drafting is the same drafts)."""
    q = Question("count", "qa", ("Count from one to five in words.",))
    methods = parse_methods("suffix", 4, adaptive=False)
    records = run_bench(model_bf16, tokenizer, [q], methods, max_tokens=24, rounds=2)
    assert [(r.round, r.method) for r in records] == [(0, "plain"), (0, "suffix"), (1, "plain"), (1, "suffix")]
    assert all(r.matched_plain for r in records) and records[0].new_tokens == records[2].new_tokens
    first, second = records[1], records[3]
    assert (first.target_forwards, first.draft_tokens, first.accepted_tokens) == (
        second.target_forwards, second.draft_tokens, second.accepted_tokens)
    assert len(round_speedups(records)["suffix"]["speedups"]) == 2


def test_parse_methods_passes_the_draft_model_to_methods_that_need_one() -> None:
    from tokenleap.bench import parse_methods
    from tokenleap.errors import TokenleapError

    methods = parse_methods("eagle3,ngram", 6, "/heads/h")
    assert methods["eagle3"].model == "/heads/h" and methods["eagle3"].num_speculative_tokens == 6
    with pytest.raises(TokenleapError, match="medusa"):
        parse_methods("medusa", 6)
    assert parse_methods("eagle3", 6)["eagle3"].model is None  # the head shipped for the target, resolved at load
