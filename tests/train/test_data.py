"""Training data: every accepted record shape, the cut-short ShareGPT file, the assistant mask
under the real chat template, and the draft vocabulary's d2t / t2d."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tokenleap.errors import TokenleapError
from tokenleap.tokenizer import Tokenizer
from tokenleap.train.data import Example, Record, build_draft_vocab, load_records, parse_record, tokenize


def test_parse_record_shapes() -> None:
    msgs = parse_record({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "a"}]})
    assert msgs == Record(messages=(("system", "s"), ("user", "q"), ("assistant", "a")))
    share = parse_record({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"},
                                            {"from": "human", "value": "unanswered"}]})
    assert share == Record(messages=(("user", "q"), ("assistant", "a")))  # the trailing question is dropped
    assert parse_record({"prompt": "q", "response": "a"}) == Record(messages=(("user", "q"), ("assistant", "a")))
    pre = parse_record({"token_ids": [1, 2, 3], "loss_mask": [0, 1, 1]})
    assert pre is not None and pre.example == Example((1, 2, 3), (False, True, True))
    for bad in ({"messages": [{"role": "assistant", "content": "a"}]},  # no user first
                {"messages": [{"role": "user", "content": "q"}, {"role": "user", "content": "q2"}]},  # no alternation
                {"conversations": [{"from": "human", "value": "q"}]},  # no answer
                {"token_ids": [1, 2], "loss_mask": [1]}, {"token_ids": [-1]}, {"other": 1}, [1, 2]):
        assert parse_record(bad) is None, bad


def test_load_records_reads_cut_short_json_and_jsonl(tmp_path: Path) -> None:
    conv = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    cut = tmp_path / "cut.json"
    cut.write_text(json.dumps([conv, conv, conv])[:-30])  # the third record is cut mid-string
    assert len(load_records([str(cut)])) == 2
    jl = tmp_path / "d.jsonl"
    jl.write_text("\n".join(json.dumps({"prompt": f"q{i}", "response": "a"}) for i in range(5)) + "\n\n")
    recs = load_records([str(jl)], limit=3, seed=1)
    assert len(recs) == 3 and len({r.messages for r in recs}) == 3
    assert len(load_records([str(cut), str(jl)])) == 7
    with pytest.raises(TokenleapError, match="does not exist"):
        load_records([str(tmp_path / "missing.jsonl")])
    (tmp_path / "bad.jsonl").write_text("{not json}\n")
    with pytest.raises(TokenleapError, match="bad.jsonl:1 is not valid JSON"):
        load_records([str(tmp_path / "bad.jsonl")])
    (tmp_path / "binary.jsonl").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TokenleapError, match="not UTF-8 text"):
        load_records([str(tmp_path / "binary.jsonl")])
    (tmp_path / "empty.jsonl").write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(TokenleapError, match="no usable training records"):
        load_records([str(tmp_path / "empty.jsonl")])


def test_sharegpt_wheel_loads() -> None:
    recs = load_records(["sharegpt"], limit=50)
    assert len(recs) == 50 and all(r.messages[0][0] in ("user", "system") for r in recs)


def test_tokenize_masks_exactly_the_assistant_turns(tokenizer: Tokenizer) -> None:
    rec = Record(
        messages=(("user", "What is 2+2?"), ("assistant", "It is 4."), ("user", "And 3+3?"), ("assistant", "6."))
    )
    ex = tokenize(tokenizer, rec, 4096)
    assert ex is not None
    spans = []
    start = None
    for i, m in enumerate(ex.mask + (False,)):
        if m and start is None:
            start = i
        if not m and start is not None:
            spans.append(tokenizer.decode(list(ex.ids[start:i]), skip_special_tokens=False))
            start = None
    assert spans == ["It is 4.<|im_end|>\n", "6.<|im_end|>\n"] or spans == ["It is 4.<|im_end|>", "6.<|im_end|>"], spans
    assert tokenize(tokenizer, rec, 10) is None  # cut inside the template's system turn: nothing to learn
    cut = tokenize(tokenizer, rec, len(ex.ids) - 3)
    assert cut is not None and cut.ids == ex.ids[:-3] and cut.mask == ex.mask[:-3]


def test_draft_vocab_maps_back_to_target_ids() -> None:
    exs = [Example((5, 7, 7, 9, 9, 9), (False, True, True, True, True, True)), Example((3, 9), (True, True))]
    v = build_draft_vocab(exs, 4, 20, always=[2])
    assert v.ids[:4] == (2, 3, 7, 9) and v.size == 4  # 2 (always), then 9, 7, 3 by count; sorted
    assert torch.equal(torch.arange(4) + v.d2t(), torch.tensor(v.ids))
    assert v.t2d().sum() == 4 and bool(v.t2d()[9]) and not bool(v.t2d()[5])
    assert v.coverage == 1.0
    small = build_draft_vocab(exs, 2, 20)
    assert small.ids == (7, 9) and small.coverage == pytest.approx(6 / 7)
    filled = build_draft_vocab(exs, 6, 20)
    assert filled.size == 6 and set(filled.ids) >= {3, 7, 9}
