"""EAGLE-1/2 heads (`fc` over [embedding, final feature] with a bias, `layers.0.*` without an
input norm, the target's LM head): random weights in exactly that layout for the tiny target,
drafts against an independent slow reference, greedy output through the engine equals plain."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.drafters.base import DraftRequest
from tokenleap.drafters.head_drafter import HeadDrafter
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.heads.eagle1 import Eagle1Head
from tokenleap.heads.loader import load_eagle3
from tokenleap.models.llama import LlamaModel
from tokenleap.sampling import SamplingParams, make_generator
from tokenleap.tokenizer import Tokenizer

H, HEADS, KVH, HD, INTER, VOCAB = 64, 4, 2, 32, 128, 256


def eagle1_tensors(seed: int = 0, qkv_bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    p = "layers.0."
    t = {
        "fc.weight": rnd(H, 2 * H, std=(2 * H) ** -0.5),
        "fc.bias": rnd(H, std=0.1),
        p + "self_attn.q_proj.weight": rnd(HEADS * HD, H, std=H**-0.5),
        p + "self_attn.k_proj.weight": rnd(KVH * HD, H, std=H**-0.5),
        p + "self_attn.v_proj.weight": rnd(KVH * HD, H, std=H**-0.5),
        p + "self_attn.o_proj.weight": rnd(H, HEADS * HD, std=(HEADS * HD) ** -0.5),
        p + "post_attention_layernorm.weight": 1 + rnd(H, std=0.1),
        p + "mlp.gate_proj.weight": rnd(INTER, H, std=H**-0.5),
        p + "mlp.up_proj.weight": rnd(INTER, H, std=H**-0.5),
        p + "mlp.down_proj.weight": rnd(H, INTER, std=INTER**-0.5),
    }
    if qkv_bias:
        for n, size in (("q", HEADS * HD), ("k", KVH * HD), ("v", KVH * HD)):
            t[f"{p}self_attn.{n}_proj.bias"] = rnd(size, std=0.1)
    return t


def write_eagle1(folder: Path, **kw: bool) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "intermediate_size": INTER,
        "num_attention_heads": HEADS, "num_key_value_heads": KVH, "head_dim": HD, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0, "max_position_embeddings": 128, "vocab_size": VOCAB, "num_hidden_layers": 1, "bias": True
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file(eagle1_tensors(**kw), str(folder / "model.safetensors"))
    return folder


def _rope(x: torch.Tensor, pos: int) -> torch.Tensor:
    half = HD // 2
    ang = (pos * (1.0 / (10000.0 ** (torch.arange(half, dtype=torch.float64) / half)))).float()
    return x * torch.cat([ang.cos(), ang.cos()]) + torch.cat([-x[:, half:], x[:, :half]], dim=-1) * torch.cat(
        [ang.sin(), ang.sin()]
    )


def reference_chain(target: LlamaModel, t: dict[str, torch.Tensor], tokens: list[int], k: int) -> list[int]:
    """k drafts, recomputing the head over every position from scratch at every step."""
    p = "layers.0."
    final = target.forward(torch.tensor(tokens[:-1]), torch.arange(len(tokens) - 1), target.new_kv_cache()).hidden
    feats, seq, out = list(final), list(tokens), []
    embed, lm_head = target.embed.float(), target.lm_head.float()

    def bias(n: str) -> torch.Tensor:
        return t.get(f"{p}self_attn.{n}_proj.bias", torch.zeros(t[f"{p}self_attn.{n}_proj.weight"].shape[0]))

    for _ in range(k):
        ks, vs, h = [], [], None
        for i, f in enumerate(feats):
            x = t["fc.weight"] @ torch.cat([embed[seq[i + 1]], f]) + t["fc.bias"]
            q = _rope((t[p + "self_attn.q_proj.weight"] @ x + bias("q")).view(HEADS, HD), i)
            ks.append(_rope((t[p + "self_attn.k_proj.weight"] @ x + bias("k")).view(KVH, HD), i))
            vs.append((t[p + "self_attn.v_proj.weight"] @ x + bias("v")).view(KVH, HD))
            heads = []
            for hh in range(HEADS):
                kvh = hh // (HEADS // KVH)
                w = (torch.stack([q[hh] @ kk[kvh] for kk in ks]) / math.sqrt(HD)).softmax(0)
                heads.append(sum(wj * v[kvh] for wj, v in zip(w, vs)))
            h = x + t[p + "self_attn.o_proj.weight"] @ torch.cat(heads)
            m = h * torch.rsqrt(h.pow(2).mean() + 1e-5) * t[p + "post_attention_layernorm.weight"]
            h = h + t[p + "mlp.down_proj.weight"] @ (
                F.silu(t[p + "mlp.gate_proj.weight"] @ m) * (t[p + "mlp.up_proj.weight"] @ m)
            )
        tok = int((lm_head @ h).argmax())
        out.append(tok)
        feats.append(h)
        seq.append(tok)
    return out


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_eagle1_chain_matches_slow_reference(tiny_model: LlamaModel, tmp_path: Path, qkv_bias: bool) -> None:
    head = load_eagle3(write_eagle1(tmp_path / "e1", qkv_bias=qkv_bias), tiny_model)
    assert isinstance(head, Eagle1Head) and head.hidden_layers == (-1,)
    drafter = HeadDrafter(head)
    assert drafter.name == "eagle"  # named for what it runs: an EAGLE-1/2 head, not "eagle3"
    drafter.begin(DraftRequest("r", [1], SamplingParams(temperature=0.0), make_generator(None)))
    prompt = [5, 17, 99, 3, 42, 7, 200, 11]
    out = tiny_model.forward(torch.tensor(prompt[:-1]), torch.arange(7), tiny_model.new_kv_cache())
    drafter.observe("r", 0, prompt[:-1], {-1: out.hidden})
    assert drafter.propose("r", prompt, 5).tokens == reference_chain(
        tiny_model, eagle1_tensors(qkv_bias=qkv_bias), prompt, 5
    )


@pytest.mark.parametrize("topk", [1, 3])
def test_eagle1_engine_greedy_output_equals_plain(
    tiny_model: LlamaModel, tokenizer: Tokenizer, tmp_path: Path, topk: int
) -> None:
    folder = write_eagle1(tmp_path / "e1")
    spec = SpecConfig(method="eagle", model=str(folder), num_speculative_tokens=6, tree_topk=topk, tree_depth=3,
                      adaptive=False)
    drafter = default_registry().create(spec.method, spec, target=tiny_model)
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = Engine(tiny_model, tokenizer)
    want = plain.run(plain.add_request(prompt, params)).output_ids
    fast = Engine(tiny_model, tokenizer, spec=spec, drafter=drafter)
    req = fast.run(fast.add_request(prompt, params))
    assert req.output_ids == want and req.metrics.spec.num_drafts > 0


def test_eagle1_bad_shapes_fail_clearly(tiny_model: LlamaModel, tmp_path: Path) -> None:
    folder = write_eagle1(tmp_path / "bad")
    t = eagle1_tensors()
    t["layers.0.mlp.down_proj.weight"] = t["layers.0.mlp.down_proj.weight"][:, :64].contiguous()
    save_file(t, str(folder / "model.safetensors"))
    with pytest.raises(TokenleapError, match="down_proj"):
        load_eagle3(folder, tiny_model)
