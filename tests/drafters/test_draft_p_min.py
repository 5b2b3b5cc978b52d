"""draft-model's `draft_p_min` (llama.cpp's --spec-draft-p-min): a draft stops where the draft
model's top probability falls below it, that token not drafted; 0 never stops. Greedy output with
any threshold is plain decoding's (tiny random model: fast)."""

from __future__ import annotations

import torch

from tokenleap import LLM, SamplingParams
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.draft_model import DraftModelDrafter
from tokenleap.models.llama import LlamaModel

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
CONTEXT = [5, 9, 14, 3, 22, 7]
PROMPT = [5, 9, 14, 3, 22, 7, 5, 9, 14]  # token ids: the tiny model has 256


def _top_probabilities(model: LlamaModel, tokens: list[int], steps: int) -> tuple[list[int], list[float]]:
    """The greedy continuation of `tokens` and each position's top probability, one full forward per step."""
    drafted, tops = [], []
    for _ in range(steps):
        ids = tokens + drafted
        kv = model.new_kv_cache()
        out = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv)
        logits = model.compute_logits(out.hidden, [len(ids) - 1])[0]
        kv.free()
        tops.append(float(torch.softmax(logits.float(), -1).max()))
        drafted.append(int(logits.argmax()))
    return drafted, tops


def _draft(model: LlamaModel, p_min: float, steps: int) -> list[int]:
    d = DraftModelDrafter(model, p_min=p_min)
    d.begin(DraftRequest("r", CONTEXT, GREEDY, torch.Generator()))
    try:
        return list(d.propose("r", CONTEXT, steps).tokens)
    finally:
        d.end("r")


def test_a_draft_stops_where_the_top_probability_falls_below_p_min(tiny_model: LlamaModel) -> None:
    steps = 6
    full, tops = _top_probabilities(tiny_model, CONTEXT, steps)
    assert _draft(tiny_model, 0.0, steps) == full  # off: the whole greedy draft
    for p_min in sorted({*tops, 1.0}):  # each position's own top probability as the threshold, and one above them all
        cut = next((i for i, top in enumerate(tops) if top < p_min), steps)
        assert _draft(tiny_model, p_min, steps) == full[:cut], p_min


def test_greedy_output_with_p_min_is_plain_decoding(tiny_hf_folder: object) -> None:
    folder = str(tiny_hf_folder)
    plain = LLM(folder, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = plain.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    for p_min in (0.0, 0.02, 0.9):
        spec = LLM(folder, dtype="float32", speculative_config={"method": "draft-simple", "model": folder,
                                                                "draft_p_min": p_min, "num_speculative_tokens": 4,
                                                                "adaptive": False})
        assert spec.spec_config is not None and spec.spec_config.options_for().draft_p_min == p_min
        assert spec.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == want, p_min
