"""tokenleap bench: question loading, method parsing, summaries and the chart (no model needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenleap.bench import Record, default_spec_bench, load_questions, parse_methods, plot, summarize
from tokenleap.errors import TokenleapError


def test_default_questions_cover_all_groups_with_categories_in_turn() -> None:
    qs = load_questions(default_spec_bench(), 8)
    groups = {q.group for q in qs}
    assert groups == {"mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag"}
    assert all(sum(q.group == g for q in qs) == 8 for g in groups)
    mt = [q for q in qs if q.group == "mt_bench"]
    assert len({q.question_id for q in mt}) == 8 and all(len(q.turns) == 2 for q in mt)


def test_messages_format_and_bad_lines(tmp_path: Path) -> None:
    good = tmp_path / "m.jsonl"
    good.write_text(json.dumps({"category": "edit", "messages": [{"role": "user", "content": "hi"}], "assistant_prefix": "```"}) + "\n")
    (q,) = load_questions(good, 5)
    assert q.group == "edit" and q.turns == ("hi",) and q.assistant_prefix == "```"
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


def _rec(method: str, group: str, tokens: int, wall: float, decode: float, forwards: int, decode_tokens: int, match: bool = True) -> Record:
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
