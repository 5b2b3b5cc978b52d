"""A reduced draft vocabulary (draft-model's `draft_vocab`, FR-Spec): the cut LM head scores
exactly the whole head's columns for its tokens, the ranking keeps the special tokens, a draft
only proposes (and under sampling only puts probability on) tokens of the cut vocabulary, and
greedy output stays plain decoding's."""

from __future__ import annotations

import pytest
import torch

from tokenleap import LLM, SamplingParams, SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.draft_model import DraftModelDrafter, frequent_tokens
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.kernels import QuantWeight
from tokenleap.models.llama import LlamaModel
from tokenleap.tokenizer import Tokenizer

GREEDY = SamplingParams(temperature=0.0, max_tokens=32)


def _check_cut(model: LlamaModel, keep: torch.Tensor) -> torch.Tensor:
    reduced, ids = model.with_vocab(keep)
    assert torch.equal(ids, torch.unique(ids)) and set(keep.tolist()) <= set(ids.tolist())
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(reduced.compute_logits(hidden), model.compute_logits(hidden)[:, ids])
    assert model.compute_logits(hidden).shape[-1] == model.config.vocab_size  # the original is untouched
    return ids


def test_a_cut_head_scores_the_whole_heads_columns(llm: LLM, tiny_model: LlamaModel) -> None:
    model = llm.model
    keep = frequent_tokens(llm.tokenizer, model.config.vocab_size, 1000)
    ids = _check_cut(model, keep)
    if isinstance(model.lm_head_linear.weight, QuantWeight):  # whole groups of 8 rows: slices of the blocks
        assert len(ids) % 8 == 0 and len(ids) < len(keep) + 8 * len(keep) // 8
    assert model.with_vocab(keep)[0].weight_bytes_per_token() < model.weight_bytes_per_token()
    _check_cut(tiny_model, torch.tensor([3, 200, 17, 17]))
    with pytest.raises(TokenleapError, match="token ids"):
        tiny_model.with_vocab(torch.tensor([256]))


def test_frequent_tokens_are_the_first_ids_and_every_special_one(tokenizer: Tokenizer) -> None:
    vocab = tokenizer.hf.vocab_size + len(tokenizer.hf.get_added_vocab())
    ids = frequent_tokens(tokenizer, vocab, 500).tolist()
    special = (
        set(tokenizer.hf.all_special_ids) | set(tokenizer.hf.get_added_vocab().values()) | set(tokenizer.eos_token_ids)
    )
    assert special <= set(ids)
    assert ids == sorted(ids) and len(set(ids) - special) == 500
    assert [i for i in ids if i not in special] == [i for i in range(vocab) if i not in special][:500]


def test_drafts_stay_in_the_cut_vocabulary_and_q_is_a_distribution_over_it(tiny_model: LlamaModel) -> None:
    reduced, ids = tiny_model.with_vocab(torch.arange(0, 256, 3))
    drafter = DraftModelDrafter(reduced, vocab=ids)
    context = [5, 9, 14, 3, 22, 7]
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=50, seed=3)):
        drafter.begin(DraftRequest("r", context, params, torch.Generator().manual_seed(1)))
        draft = drafter.propose("r", context, 5)
        drafter.end("r")
        assert len(draft.tokens) == 5 and set(draft.tokens) <= set(ids.tolist())
        if not params.greedy:
            assert draft.probs is not None
            outside = torch.ones(256, dtype=torch.bool)
            outside[ids] = False
            assert torch.all(draft.probs[:, outside] == 0)
            torch.testing.assert_close(draft.probs.sum(-1), torch.ones(5))


def test_greedy_output_with_a_cut_draft_vocabulary_is_plain_decoding(llm: LLM) -> None:
    """The default model drafting for itself through a head cut to 4,096 tokens: the output is
    plain decoding's, and the drafts that stay inside the cut vocabulary are accepted."""
    cfg = SpecConfig.from_dict({"method": "draft-model", "model": "smollm2-135m-instruct", "draft_vocab": 4096,
                                "num_speculative_tokens": 4, "adaptive": False})
    assert cfg is not None
    drafter = default_registry().create(
        cfg.method, cfg, target=llm.model, tokenizer=llm.tokenizer, target_path=llm.source.path
    )
    assert (
        isinstance(drafter, DraftModelDrafter)
        and drafter.vocab is not None
        and len(drafter.vocab) < llm.model.config.vocab_size
    )
    spec, plain = Engine(llm.model, llm.tokenizer, spec=cfg, drafter=drafter), Engine(llm.model, llm.tokenizer)
    accepted = 0
    for prompt in ("Write a Python function that returns the n-th Fibonacci number.", "Name the three primary colors."):
        ids = llm.chat_token_ids([{"role": "user", "content": prompt}])
        want, got = plain.add_request(ids, GREEDY), spec.add_request(ids, GREEDY)
        plain.run(want)
        spec.run(got)
        assert got.output_ids == want.output_ids
        accepted += got.metrics.spec.num_accepted_tokens
    assert accepted > 0


def test_a_negative_draft_vocabulary_is_refused() -> None:
    with pytest.raises(TokenleapError, match="draft_vocab"):
        SpecConfig.from_dict({"method": "draft-model", "model": "smollm2-135m-instruct", "draft_vocab": -1})
