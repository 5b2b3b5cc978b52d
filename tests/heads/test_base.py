"""The head protocol and the toolkit (heads/base.py): every layer head format is a `DraftHead`
the generic drafter can run and whose cost can be measured; the formats share a base whose
`__init__` each calls, and none inherits another format; the final-hidden-state heads read the
target's final state and its LM head."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.head_drafter import HeadDrafter
from tokenleap.errors import TokenleapError
from tokenleap.heads.base import (
    FINAL_HIDDEN,
    DraftHead,
    FinalHiddenHead,
    HeadKV,
    HeadShape,
    LayerHead,
    measure_step_cost,
)
from tokenleap.heads.eagle1 import Eagle1Head
from tokenleap.heads.eagle3 import Eagle3Head
from tokenleap.heads.mtp import _PARTS, MtpHead
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, make_generator

H, HEADS, KVH, HD, INTER, VOCAB = 64, 4, 2, 32, 128, 256
RAW = {
    "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS, "num_key_value_heads": KVH,
    "head_dim": HD, "vocab_size": VOCAB, "max_position_embeddings": 128
}


def _random(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        name: (1 + 0.1 * torch.randn(*s, generator=g)) if len(s) == 1 else torch.randn(*s, generator=g) * s[-1] ** -0.5
        for name, s in shapes.items()
    }


def eagle3(target: Any) -> Eagle3Head:
    p, qs, ks = "midlayer.", HEADS * HD, KVH * HD
    shapes = {
        "fc.weight": (H, 3 * H), p + "input_layernorm.weight": (H,), p + "hidden_norm.weight": (H,),
        p + "self_attn.q_proj.weight": (qs, 2 * H), p + "self_attn.k_proj.weight": (ks, 2 * H),
        p + "self_attn.v_proj.weight": (ks, 2 * H), p + "self_attn.o_proj.weight": (H, qs),
        p + "post_attention_layernorm.weight": (H,), p + "mlp.gate_proj.weight": (INTER, H),
        p + "mlp.up_proj.weight": (INTER, H), p + "mlp.down_proj.weight": (H, INTER), "norm.weight": (H,),
        "lm_head.weight": (VOCAB, H)
    }
    shape = HeadShape(H, INTER, HEADS, KVH, HD, VOCAB, VOCAB, H, (0, 1, 1), max_position=128)
    return Eagle3Head(shape, _random(shapes), target)


def eagle1(target: Any) -> Eagle1Head:
    p, qs, ks = "layers.0.", HEADS * HD, KVH * HD
    shapes = {
        "fc.weight": (H, 2 * H), p + "self_attn.q_proj.weight": (qs, H), p + "self_attn.k_proj.weight": (ks, H),
        p + "self_attn.v_proj.weight": (ks, H), p + "self_attn.o_proj.weight": (H, qs),
        p + "post_attention_layernorm.weight": (H,), p + "mlp.gate_proj.weight": (INTER, H),
        p + "mlp.up_proj.weight": (INTER, H), p + "mlp.down_proj.weight": (H, INTER)
    }
    return Eagle1Head(RAW, _random(shapes, 1), target)


def mtp(target: Any) -> MtpHead:
    qs, ks = HEADS * HD, KVH * HD
    shapes = {
        "input_proj.weight": (H, 2 * H), "self_attn.q_proj.weight": (qs, H), "self_attn.k_proj.weight": (ks, H),
        "self_attn.v_proj.weight": (ks, H), "self_attn.o_proj.weight": (H, qs), "mlp.gate_proj.weight": (INTER, H),
        "mlp.up_proj.weight": (INTER, H), "mlp.down_proj.weight": (H, INTER)
    }
    return MtpHead(RAW, _random({name: shapes.get(name, (H,)) for name in _PARTS}, 2), target)


FORMATS = {"eagle3": eagle3, "eagle1": eagle1, "mtp": mtp}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_layer_head_is_a_draft_head_the_generic_drafter_runs(tiny_model: LlamaModel, fmt: str) -> None:
    head = FORMATS[fmt](tiny_model)
    assert isinstance(head, DraftHead) and isinstance(head, LayerHead)
    assert head.target is tiny_model and len(head.d2t_list) == head.config.draft_vocab_size
    # one layer step: n rows in, n rows out, n K/V slots appended
    kv = HeadKV(KVH, HD)
    out = head.layer(
        torch.randn(3, H), head.embed_tokens([1, 2, 3]), torch.arange(3), kv, torch.ones(3, 3, dtype=torch.bool).tril()
    )
    assert out.shape == (3, H) and kv.length == 3
    assert head.logits(out).shape == (3, head.config.draft_vocab_size)
    with pytest.raises(TokenleapError, match="head positions must be below"):
        head.layer(
            torch.randn(1, H), head.embed_tokens([1]), torch.tensor([10_000]), kv, torch.ones(1, 4, dtype=torch.bool)
        )
    assert measure_step_cost(head, context=8, repeats=1) > 0
    # the drafter reads the layers the head names, and drafts from them
    drafter = HeadDrafter(head)
    assert drafter.hidden_layers == head.hidden_layers
    drafter.begin(DraftRequest("r", [1], SamplingParams(temperature=0.0), make_generator(None)))
    prompt = [5, 17, 99, 3, 42]
    out = tiny_model.forward(torch.tensor(prompt), torch.arange(5), tiny_model.new_kv_cache(),
                             return_hidden=tuple(x for x in head.hidden_layers if x != FINAL_HIDDEN))
    drafter.observe("r", 0, prompt, {**out.hidden_states, FINAL_HIDDEN: out.hidden})  # as the engine hands them over
    draft = drafter.propose("r", [*prompt, 7], 4).tokens
    assert len(draft) == 4 and all(0 <= t < VOCAB for t in draft)


def test_no_head_format_inherits_another_and_each_runs_the_base_init(tiny_model: LlamaModel) -> None:
    classes = (Eagle3Head, Eagle1Head, MtpHead)
    for a in classes:
        assert issubclass(a, LayerHead)
        assert not any(issubclass(a, b) for b in classes if b is not a), a
    for make in FORMATS.values():
        head = make(tiny_model)
        # set by LayerHead.__init__ only
        assert head.kernels is tiny_model.kernels and head._cos.shape[0] >= tiny_model.config.max_position


def test_final_hidden_heads_read_the_final_state_and_the_targets_lm_head(tiny_model: LlamaModel) -> None:
    for head in (eagle1(tiny_model), mtp(tiny_model)):
        assert isinstance(head, FinalHiddenHead)
        assert head.hidden_layers == (FINAL_HIDDEN,) and head.d2t_list == list(range(VOCAB))
        rows = torch.randn(2, H)
        assert torch.equal(head.fuse(head.aux_from([1, 2], {FINAL_HIDDEN: rows})), rows)
        torch.testing.assert_close(head.logits(rows), tiny_model.compute_logits(rows))
