"""The draft-model drafter's bookkeeping: the prompt runs through the draft model at `begin`
(beside the target's prefill), a catch-up over tokens committed while speculation was off is
timed apart from the draft (`Draft.setup_seconds`, left out of the controller's price of a draft
token), a draft context window (`draft_context`) reads only a long prompt's last tokens, and a
draft token is priced by the weight bytes it reads;
drafts equal the draft model's own greedy continuation throughout (tiny random model)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tokenleap import LLM, SamplingParams
from tokenleap.drafters import draft_model
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.chain import ChainDrafter
from tokenleap.drafters.draft_model import DraftModelDrafter, auto_draft_context, step_price
from tokenleap.errors import TokenleapError
from tokenleap.models.llama import LlamaModel

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [5, 9, 14, 3, 22, 7, 5, 9, 14, 40, 41, 42]


def _greedy(model: LlamaModel, tokens: list[int], steps: int) -> list[int]:
    out: list[int] = []
    for _ in range(steps):
        ids = tokens + out
        kv = model.new_kv_cache()
        hidden = model.forward(torch.tensor(ids), torch.arange(len(ids)), kv).hidden
        out.append(int(model.compute_logits(hidden, [len(ids) - 1])[0].argmax()))
        kv.free()
    return out


def test_begin_prefills_and_a_catch_up_is_setup_not_drafting(tiny_model: LlamaModel) -> None:
    d = DraftModelDrafter(tiny_model)
    d.begin(DraftRequest("r", PROMPT, GREEDY, torch.Generator()))
    state = d._states["r"]
    assert state.cached == PROMPT and state.kv.length == len(PROMPT)  # the prompt ran at begin
    first = d.propose("r", PROMPT + [60], 3)
    assert first.tokens == _greedy(tiny_model, PROMPT + [60], 3) and first.setup_seconds == 0.0
    later = PROMPT + [60, 61, 62, 63, 64, 65]  # five tokens committed without asking the drafter
    caught = d.propose("r", later, 3)
    assert caught.tokens == _greedy(tiny_model, later, 3) and caught.setup_seconds > 0.0
    d.end("r")


def test_pending_tokens_and_setup_cost_count_what_the_draft_has_not_run(tiny_model: LlamaModel) -> None:
    """Before begin: its prompt window and what followed; after: the context it has not seen
    (the last token is run by the draft step itself). Priced at the step price x PREFILL_SHARE."""
    d = DraftModelDrafter(tiny_model, context=5, relative_draft_cost=0.4)
    request = DraftRequest("r", PROMPT, GREEDY, torch.Generator())
    assert d.pending_tokens(request, PROMPT + [60, 61]) == 5 + 2 - 1
    assert d.setup_cost(request, PROMPT + [60, 61]) == pytest.approx(0.4 * draft_model.PREFILL_SHARE * 6)
    d.begin(request)
    assert d.pending_tokens(request, PROMPT + [60]) == 0
    d.propose("r", PROMPT + [60], 2)
    drafted = d._states["r"].cached[-1]  # its first draft token ran too (a rejected one is rolled back)
    assert d.pending_tokens(request, PROMPT + [60, drafted + 1, 62, 63]) == 2  # two unseen, 63 runs in the step
    d.end("r")


def test_a_draft_context_window_reads_the_prompts_last_tokens(tiny_model: LlamaModel) -> None:
    d = DraftModelDrafter(tiny_model, context=5)
    d.begin(DraftRequest("r", PROMPT, GREEDY, torch.Generator()))
    assert d._states["r"].offset == len(PROMPT) - 5 and d._states["r"].kv.length == 5
    tokens = PROMPT + [60]
    assert d.propose("r", tokens, 3).tokens == _greedy(tiny_model, tokens[len(PROMPT) - 5 :], 3)
    d.end("r")


def test_greedy_output_with_a_draft_context_is_plain_decoding(tiny_hf_folder: object) -> None:
    folder = str(tiny_hf_folder)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = LLM(folder, dtype="float32").generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    spec = LLM(folder, dtype="float32", speculative_config={"method": "draft-model", "model": folder,
                                                            "draft_context": 4, "num_speculative_tokens": 4,
                                                            "adaptive": False})
    assert spec.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids == want


def test_a_draft_tokens_price_is_its_weight_bytes_over_the_targets(
    tiny_model: LlamaModel, tiny_hf_folder: object
) -> None:
    """A decode step reads its weights: a draft token costs the draft's bytes over the target's
    (HasDraftCost), which starts the controller's estimate and makes a chain with a draftless
    member weigh the two by expected tokens per cost instead of plain precedence."""
    half = tiny_model.with_layers(1)
    assert step_price(half, tiny_model) == half.weight_bytes_per_token() / tiny_model.weight_bytes_per_token()
    assert 0.0 < step_price(half, tiny_model) < 1.0 and step_price(tiny_model, tiny_model) == 1.0
    folder = str(tiny_hf_folder)
    llm = LLM(
        folder, dtype="float32", speculative_config={"method": "suffix+draft-model", "model": folder, "draft_layers": 1}
    )
    chain = llm.engine.drafter
    assert isinstance(chain, ChainDrafter) and chain.cost_aware
    assert chain.costs == [0.0, pytest.approx(step_price(half, tiny_model))]


def test_by_default_the_draft_reads_what_the_answer_can_repay(
    tiny_model: LlamaModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The default window: max(128, 2 x max_tokens) prompt tokens; 0 reads everything."""
    assert auto_draft_context(16) == 128 and auto_draft_context(200) == 400 and auto_draft_context(None) == 0
    monkeypatch.setattr(draft_model, "AUTO_CONTEXT_MIN", 16)  # the tiny model holds 128 positions
    prompt = [int(t) for t in torch.randint(3, 200, (100,), generator=torch.Generator().manual_seed(0))]
    for max_tokens, context, offset in ((10, None, 100 - 20), (60, None, 0), (10, 0, 0), (10, 30, 70)):
        d = DraftModelDrafter(tiny_model, context=context)
        d.begin(DraftRequest("r", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens), torch.Generator()))
        assert d._states["r"].offset == offset and d._states["r"].kv.length == 100 - offset
        d.end("r")


def test_the_draft_has_its_own_kv_cache_type(tmp_path: Path) -> None:
    """llama.cpp's -ctkd / -ctvd: the draft model's cache in q8_0 while the target's stays bf16
    (the default model, and a copy of its file as the draft); greedy output is still plain
    decoding. The target drafting for itself has no cache of its own."""
    from tokenleap.config import DEFAULT_MODEL
    from tokenleap.models.registry import resolve

    source = resolve(DEFAULT_MODEL).path
    other = tmp_path / source.name
    shutil.copyfile(source, other)  # the same weights, loaded as a draft of its own
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = "Count from one to ten in words: one, two,"
    plain = LLM(DEFAULT_MODEL)
    want = plain.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(TokenleapError, match="needs a draft model of its own"):
        LLM(
            DEFAULT_MODEL,
            speculative_config={"method": "draft-model", "model": DEFAULT_MODEL, "draft_cache_type_k": "q8_0"},
        )
    # no blocked attention here (no AVX512-BF16): the draft's q8_0 cache is refused as the target's is
    if not plain.model.kv_blocked:
        with pytest.raises(TokenleapError, match="q8_0 KV cache needs the kernels' blocked attention"):
            LLM(
                DEFAULT_MODEL,
                speculative_config={"method": "draft-model", "model": str(other), "draft_cache_type_k": "q8_0"},
            )
        pytest.skip("q8_0 KV caches need the kernels' blocked bf16 attention (AVX512-BF16)")
    spec = LLM(DEFAULT_MODEL, speculative_config={"method": "draft-model", "model": str(other),
                                                  "draft_cache_type_v": "q8_0", "num_speculative_tokens": 3,
                                                  "adaptive": False})
    draft = spec.engine.drafter
    assert isinstance(draft, DraftModelDrafter) and draft.model is not spec.model
    if spec.model.kernels is not None:  # q8_0 caches are the kernels' blocked ones
        assert draft.model.kv_dtype == torch.int8 and spec.model.kv_dtype != torch.int8
    assert spec.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids == want
