"""EAGLE-3 heads in llama.cpp's GGUF layout: a random head written both as an EAGLE checkpoint
and as an `eagle3` GGUF (Q/K permuted as llama.cpp's converter does) drafts the same tokens with
the same logits; metadata variants and bad files fail clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.head_drafter import HeadDrafter as Eagle3Drafter
from tokenleap.errors import TokenleapError
from tokenleap.heads.eagle3_gguf import permute_rope
from tokenleap.heads.loader import load_eagle3
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import unpermute_rope
from tokenleap.sampling import SamplingParams
from tokenleap.train.data import DraftVocab
from tokenleap.train.eagle3_head import TrainableEagle3, shape_for_target

AUX = (0, 1, 1)
_GGUF = {
    "fc.weight": "fc.weight",
    "lm_head.weight": "output.weight",
    "norm.weight": "output_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.hidden_norm.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
}


def _head(model: LlamaModel, nbr: bool) -> tuple[TrainableEagle3, DraftVocab]:
    ids = sorted(torch.randperm(256, generator=torch.Generator().manual_seed(3))[:96].tolist())
    head = TrainableEagle3(shape_for_target(model.config, 96, AUX, nbr), model.embed, seed=5)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() == 2 else 0.2) + (p.dim() == 1))
    return head, DraftVocab(tuple(ids), 256, 1.0)


def write_gguf(
    path: Path, head: TrainableEagle3, vocab: DraftVocab, *, aux_key: str = "target_layers", nbr: bool = False
) -> Path:
    import gguf

    s = head.shape
    w = gguf.GGUFWriter(str(path), "eagle3")
    w.add_uint32("eagle3.embedding_length", s.hidden_size)
    w.add_uint32("eagle3.feed_forward_length", s.intermediate_size)
    w.add_uint32("eagle3.attention.head_count", s.num_heads)
    w.add_uint32("eagle3.attention.head_count_kv", s.num_kv_heads)
    w.add_uint32("eagle3.attention.key_length", s.head_dim)
    w.add_float32("eagle3.attention.layer_norm_rms_epsilon", s.rms_norm_eps)
    w.add_float32("eagle3.rope.freq_base", s.rope_theta)
    w.add_uint32("eagle3.context_length", s.max_position)
    w.add_uint32("eagle3.target_hidden_size", s.hidden_size)
    w.add_uint32("eagle3.vocab_size", s.vocab_size)
    w.add_array(f"eagle3.{aux_key}", list(s.aux_layers))
    w.add_bool("eagle3.norm_before_residual", nbr)
    for name, t in head.eagle_tensors().items():
        a = t.float().numpy()
        if name.endswith("q_proj.weight"):
            a = permute_rope(a, s.num_heads)
        elif name.endswith("k_proj.weight"):
            a = permute_rope(a, s.num_kv_heads)
        w.add_tensor(_GGUF[name], np.ascontiguousarray(a, dtype=np.float32))
    w.add_tensor("d2t", vocab.d2t().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_permutation_round_trips() -> None:
    a = np.arange(8 * 3 * 6, dtype=np.float32).reshape(8 * 3, 6)
    assert np.array_equal(unpermute_rope(permute_rope(a, 3), 3), a)
    assert not np.array_equal(permute_rope(a, 3), a)


@pytest.mark.parametrize(("aux_key", "nbr"), [("target_layers", True), ("extract_layers", False)])
def test_gguf_head_drafts_as_the_safetensors_head(
    tiny_model: LlamaModel, tmp_path: Path, aux_key: str, nbr: bool
) -> None:
    head, vocab = _head(tiny_model, nbr)
    head.export(tmp_path / "st", vocab.d2t(), vocab.t2d())
    ref = load_eagle3(tmp_path / "st", tiny_model)
    got = load_eagle3(write_gguf(tmp_path / "h.gguf", head, vocab, aux_key=aux_key, nbr=nbr), tiny_model)
    assert got.config == ref.config
    assert got.d2t_list == ref.d2t_list
    h = torch.randn(3, head.shape.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(got.logits(h), ref.logits(h))
    prompt = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(1)).tolist()
    drafts = []
    for loaded in (ref, got):
        d = Eagle3Drafter(loaded)
        d.begin(DraftRequest("r", prompt, SamplingParams(), torch.Generator()))
        out = tiny_model.forward(torch.tensor(prompt[:-1]), torch.arange(len(prompt) - 1), tiny_model.new_kv_cache(64),
                                 return_hidden=loaded.hidden_layers)
        d.observe("r", 0, prompt[:-1], out.hidden_states)
        drafts.append(d.propose("r", prompt, 5).tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 5


def test_bad_gguf_files_fail_clearly(tiny_model: LlamaModel, tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(TokenleapError, match="not a readable GGUF"):
        load_eagle3(bad, tiny_model)
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "llama.gguf"), "llama")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(TokenleapError, match="not an EAGLE-3 head"):
        load_eagle3(tmp_path / "llama.gguf", tiny_model)
