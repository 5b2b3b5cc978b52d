"""Medusa heads: random weights in the FasterDecoding and vLLM layouts for the tiny target,
drafts against an independent reference, greedy output through the engine equals plain, clear
errors for bad checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.head_drafter import MedusaDrafter
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.heads.medusa import load_medusa
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, make_generator
from tokenleap.tokenizer import Tokenizer

H, VOCAB, HEADS = 64, 256, 3


def medusa_tensors(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(H, H, generator=g) * H**-0.5, torch.randn(H, generator=g) * 0.1,
             torch.randn(VOCAB, H, generator=g) * H**-0.5) for _ in range(HEADS)]


def write_medusa(folder: Path, layout: str = "fasterdecoding", share_head: int | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    t: dict[str, torch.Tensor] = {}
    for i, (w, b, p) in enumerate(medusa_tensors()):
        if layout == "vllm":
            t[f"blocks.{i}.layers.0.weight"], t[f"blocks.{i}.layers.0.bias"] = w, b
            if i != share_head:
                t[f"lm_heads.{i}.weight"] = p
        else:
            t[f"medusa_head.{i}.0.linear.weight"], t[f"medusa_head.{i}.0.linear.bias"] = w, b
            if i != share_head:
                t[f"medusa_head.{i}.1.weight"] = p
    config = ({"num_heads": HEADS, "num_hidden_layers": 1, "hidden_size": H, "vocab_size": VOCAB} if layout == "vllm"
              else {"medusa_num_heads": HEADS, "medusa_num_layers": 1, "base_model_name_or_path": "tiny"})
    (folder / "config.json").write_text(json.dumps(config))
    save_file(t, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize("layout", ["fasterdecoding", "vllm"])
def test_medusa_drafts_match_reference(tiny_model: LlamaModel, tmp_path: Path, layout: str) -> None:
    drafter = MedusaDrafter(load_medusa(write_medusa(tmp_path / layout, layout, share_head=1), tiny_model))
    drafter.begin(DraftRequest("r", [1], SamplingParams(temperature=0.0), make_generator(None)))
    prompt = [5, 17, 99, 3, 42, 7, 200, 11]
    final = tiny_model.forward(torch.tensor(prompt[:-1]), torch.arange(7), tiny_model.new_kv_cache()).hidden
    drafter.observe("r", 0, prompt[:-1], {-1: final})
    f = final[-1]
    want = []
    for i, (w, b, p) in enumerate(medusa_tensors()):
        x = f + F.silu(w @ f + b)
        want.append(int(((tiny_model.lm_head.float() if i == 1 else p) @ x).argmax()))
    assert drafter.propose("r", prompt, 8).tokens == want
    assert drafter.propose("r", prompt, 2).tokens == want[:2]
    assert drafter.propose("r", prompt + [1], 8).tokens == []  # the feature is not the last position's


@pytest.mark.parametrize("topk", [1, 3])
def test_medusa_engine_greedy_output_equals_plain(
    tiny_model: LlamaModel, tokenizer: Tokenizer, tmp_path: Path, topk: int
) -> None:
    spec = SpecConfig(
        method="medusa",
        model=str(write_medusa(tmp_path / "m")),
        num_speculative_tokens=7,
        adaptive=False,
        tree_topk=topk,
    )
    drafter = default_registry().create(spec.method, spec, target=tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = Engine(tiny_model, tokenizer)
    want = plain.run(plain.add_request(prompt, params)).output_ids
    fast = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    req = fast.run(fast.add_request(prompt, params))
    assert req.output_ids == want and req.metrics.spec.num_drafts >= 20  # a draft every step


def test_medusa_bad_checkpoints_fail_clearly(tiny_model: LlamaModel, tmp_path: Path) -> None:
    folder = write_medusa(tmp_path / "bad")
    (folder / "config.json").write_text(json.dumps({"medusa_num_heads": 5, "medusa_num_layers": 1}))
    with pytest.raises(TokenleapError, match="lacks tensor '3.0.linear.weight'"):
        load_medusa(folder, tiny_model)
    (folder / "config.json").write_text(json.dumps({"foo": 1}))
    with pytest.raises(TokenleapError, match="names no heads"):
        load_medusa(folder, tiny_model)
    with pytest.raises(TokenleapError, match="needs Medusa heads"):
        SpecConfig(method="medusa")


def test_medusa_tree_is_well_formed_and_starts_with_the_chain(tiny_model: LlamaModel, tmp_path: Path) -> None:
    from tokenleap.verify.tree import check_parents, first_path, tree_depths

    heads = load_medusa(write_medusa(tmp_path / "t"), tiny_model)
    chain, tree = MedusaDrafter(heads), MedusaDrafter(heads, topk=3)
    prompt = [8, 18, 28, 38, 48]
    final = tiny_model.forward(torch.tensor(prompt[:-1]), torch.arange(4), tiny_model.new_kv_cache()).hidden
    for d in (chain, tree):
        d.begin(DraftRequest("r", [1], SamplingParams(temperature=0.0), make_generator(None)))
        d.observe("r", 0, prompt[:-1], {-1: final})
    draft = tree.propose("r", prompt, 7)
    assert draft.parents is not None and len(draft) == 7
    check_parents(draft.parents, 7)
    assert max(tree_depths(draft.parents)) <= HEADS
    path = [draft.tokens[i] for i in first_path(draft.parents)]
    assert path == chain.propose("r", prompt, 3).tokens[: len(path)]
