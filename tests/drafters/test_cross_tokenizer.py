"""Cross-tokenizer drafting (string-level re-tokenization): a tiny target over a character vocabulary
drafted for by a tiny model over the same characters under permuted ids, so the vocabularies differ
while the draft model computes the target's function in text space. Greedy output equals plain
decoding with nearly every draft accepted; sampled output keeps the target's distribution
(chi-squared over the first three tokens); the text mapping anchors on the context."""

from __future__ import annotations

import pytest
import torch

from sampling_stats import exact_joint, first_three, fit_pvalue
from tiny_models import TINY_CONFIG, make_tiny_weights
from tokenleap import SpecConfig
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.cross_tokenizer import CrossTokenizerDrafter
from tokenleap.drafters.draft_model import same_vocabulary
from tokenleap.engine.engine import Engine
from tokenleap.kernels import load_kernels
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, logits_to_probs
from tokenleap.tokenizer import Tokenizer

PROMPT_TEXT = "speculative decoding, "

Pair = tuple[LlamaModel, Tokenizer, LlamaModel, Tokenizer]  # target, its tokenizer, draft, its tokenizer


CHARS = [chr(c) for c in range(32, 127)] + [chr(c) for c in range(0x100, 0x100 + 161)]  # 256 code points


def _char_tokenizer(order: list[int]) -> Tokenizer:
    """A character-level tokenizer (256 characters, no merges) whose i-th character has id order[i]:
    every id sequence decodes to text that encodes back to it, as real text does."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    raw = RawTokenizer(models.BPE(vocab={ch: order[i] for i, ch in enumerate(CHARS)}, merges=[]))
    raw.decoder = decoders.Fuse()
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False))


@pytest.fixture(scope="module")
def pair() -> Pair:
    perm = torch.randperm(256, generator=torch.Generator().manual_seed(3)).tolist()
    target_tok, draft_tok = _char_tokenizer(list(range(256))), _char_tokenizer(perm)
    w = make_tiny_weights(TINY_CONFIG, seed=0)
    inv = torch.empty(256, dtype=torch.long)
    inv[torch.tensor(perm)] = torch.arange(256)  # draft id j is target id inv[j]
    dw = dict(w, embed=w["embed"][inv], lm_head=w["lm_head"][inv])
    kernels = load_kernels()
    target = LlamaModel(TINY_CONFIG, w, torch.float32, kernels)
    draft = LlamaModel(TINY_CONFIG, dw, torch.float32, kernels)
    return target, target_tok, draft, draft_tok


def test_vocabularies_differ_and_text_maps_back(pair: Pair) -> None:
    target, target_tok, draft, draft_tok = pair
    assert not same_vocabulary(target_tok, draft_tok, target, draft)
    d = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    ctx = target_tok.encode("hello, wor")
    assert (
        target_tok.hf.decode(d.draft_context(ctx)) != "" and draft_tok.hf.decode(d.draft_context(ctx)) == "hello, wor"
    )
    assert d.to_target(ctx, "ld!") == target_tok.encode("ld!")
    assert d.draft_text(draft_tok.encode("hello"), draft_tok.encode(" world")) == " world"
    assert d.to_target(ctx, "") == []


def test_greedy_identical_to_plain_with_drafts_accepted(pair: Pair) -> None:
    target, target_tok, draft, draft_tok = pair
    drafter = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = target_tok.encode(PROMPT_TEXT)
    plain = Engine(target, target_tok).run(Engine(target, target_tok).add_request(prompt, params))
    spec = SpecConfig(method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=6)
    engine = Engine(target, target_tok, spec=spec, drafter=drafter)
    out = engine.run(engine.add_request(prompt, params))
    assert out.output_ids == plain.output_ids
    s = out.metrics.spec
    assert s.num_draft_tokens >= 30 and s.num_accepted_tokens >= 0.9 * s.num_draft_tokens, s


def test_sampled_first_three_tokens_follow_the_target(pair: Pair) -> None:
    target, target_tok, draft, draft_tok = pair
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=16, ignore_eos=True)
    prompt = target_tok.encode(PROMPT_TEXT)

    def probs(ctx: list[int]) -> torch.Tensor:
        kv = target.new_kv_cache(64)
        out = target.forward(torch.tensor(prompt + ctx), torch.arange(len(prompt) + len(ctx)), kv)
        p = logits_to_probs(target.compute_logits(out.hidden, [len(prompt) + len(ctx) - 1]), params)[0].double()
        kv.free()
        return p

    joint = exact_joint(probs)
    drafter = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    spec = SpecConfig(method="custom", drafter=drafter, adaptive=False, num_speculative_tokens=4)
    engine = Engine(target, target_tok, spec=spec, drafter=drafter)
    counts = dict.fromkeys(joint, 0)
    n, accepted = 1500, 0
    for seed in range(n):
        out, acc = first_three(engine, prompt, params, seed)
        assert out in counts, f"an impossible output {out}"
        counts[out] += 1
        accepted += acc
    pvalue, report = fit_pvalue(counts, joint)
    assert pvalue >= 1e-3, report
    assert accepted / n > 0.5, accepted / n  # the drafts (the target's argmax in text space) were taken


def test_drafter_lifecycle_rolls_back_by_common_prefix(pair: Pair) -> None:
    target, target_tok, draft, draft_tok = pair
    d = CrossTokenizerDrafter(draft, draft_tok, target_tok)
    params = SamplingParams(temperature=0.0)
    d.begin(DraftRequest("r", target_tok.encode("abc"), params, torch.Generator()))
    ctx = target_tok.encode("abcdef")
    first = d.propose("r", ctx, 4).tokens
    again = d.propose("r", ctx, 4).tokens  # after a full rejection the context is the same: same draft
    assert first == again and len(first) == 4
    assert d.propose("r", ctx + first[:2], 2).tokens == first[2:4]
    d.end("r")
    assert not d._states
