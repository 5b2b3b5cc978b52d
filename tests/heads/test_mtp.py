"""MiMo MTP layers as draft heads: a tiny random Qwen2 target (made by transformers) with an MTP
layer written in MiMo's layout; the head's forward against an independent slow reference, greedy
speculation identical to plain decoding, clear errors for the kinds the runtime cannot run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenleap import SpecConfig
from tokenleap.drafters import default_registry
from tokenleap.engine.engine import Engine
from tokenleap.errors import TokenleapError
from tokenleap.heads.base import HeadKV
from tokenleap.heads.mtp import load_mtp
from tokenleap.kernels import load_kernels
from tokenleap.models.llama import LlamaModel
from tokenleap.models.loaders import load_hf_folder
from tokenleap.sampling import SamplingParams
from tokenleap.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

H, INTER, NH, NKV, HD, V = 64, 128, 4, 2, 16, 49152  # SmolLM2's vocabulary: the real tokenizer fits
EPS = 1e-6


def _mtp_tensors(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def r(*shape: int, scale: float = 0.08) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    t = {
        "token_layernorm.weight": 1 + r(H, scale=0.3),
        "hidden_layernorm.weight": 1 + r(H, scale=0.3),
        "input_proj.weight": r(H, 2 * H),
        "input_layernorm.weight": 1 + r(H, scale=0.3),
        "self_attn.q_proj.weight": r(NH * HD, H),
        "self_attn.k_proj.weight": r(NKV * HD, H),
        "self_attn.v_proj.weight": r(NKV * HD, H),
        "self_attn.o_proj.weight": r(H, NH * HD),
        "self_attn.q_proj.bias": r(NH * HD),
        "self_attn.k_proj.bias": r(NKV * HD),
        "self_attn.v_proj.bias": r(NKV * HD),
        "post_attention_layernorm.weight": 1 + r(H, scale=0.3),
        "mlp.gate_proj.weight": r(INTER, H),
        "mlp.up_proj.weight": r(INTER, H),
        "mlp.down_proj.weight": r(H, INTER),
        "final_layernorm.weight": 1 + r(H, scale=0.3),
    }
    return {f"model.mtp_layers.0.{k}": v.contiguous() for k, v in t.items()}


@pytest.fixture(scope="module")
def mimo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 checkpoint (transformers) with one MiMo MTP layer in a second safetensors file."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("mimo")
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(
        vocab_size=V, hidden_size=H, intermediate_size=INTER, num_hidden_layers=2, num_attention_heads=NH,
        num_key_value_heads=NKV, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=EPS
    )
    transformers.Qwen2ForCausalLM(cfg).float().eval().save_pretrained(str(folder))
    raw = json.loads((folder / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw))
    save_file(_mtp_tensors(), str(folder / "mtp.safetensors"))
    return folder


@pytest.fixture(scope="module")
def target(mimo: Path) -> LlamaModel:
    config, weights = load_hf_folder(mimo)
    return LlamaModel(config, weights, torch.float32, load_kernels())


def _reference(t: dict[str, torch.Tensor], g: torch.Tensor, e: torch.Tensor, theta: float) -> torch.Tensor:
    """MiMo's MTP layer over a whole sequence, causal, by hand (fp32)."""
    w = {k.removeprefix("model.mtp_layers.0."): v.float() for k, v in t.items()}

    def rms(x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w[name]

    n = g.shape[0]
    x = torch.cat([rms(g, "hidden_layernorm.weight"), rms(e, "token_layernorm.weight")], -1) @ w["input_proj.weight"].T
    xn = rms(x, "input_layernorm.weight")
    q = (xn @ w["self_attn.q_proj.weight"].T + w["self_attn.q_proj.bias"]).view(n, NH, HD)
    k = (xn @ w["self_attn.k_proj.weight"].T + w["self_attn.k_proj.bias"]).view(n, NKV, HD)
    v = (xn @ w["self_attn.v_proj.weight"].T + w["self_attn.v_proj.bias"]).view(n, NKV, HD)
    inv = 1.0 / theta ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    cos, sin = (
        torch.cat([ang.cos(), ang.cos()], -1).float()[:, None],
        torch.cat([ang.sin(), ang.sin()], -1).float()[:, None],
    )

    def rope(z: torch.Tensor) -> torch.Tensor:
        return z * cos + torch.cat([-z[..., HD // 2:], z[..., : HD // 2]], -1) * sin

    q, k = rope(q), rope(k)
    out = torch.zeros(n, NH, HD)
    for i in range(n):
        for hh in range(NH):
            kv = hh // (NH // NKV)
            s = (k[: i + 1, kv] @ q[i, hh]) / math.sqrt(HD)
            out[i, hh] = torch.softmax(s, 0) @ v[: i + 1, kv]
    h = x + out.reshape(n, -1) @ w["self_attn.o_proj.weight"].T
    m = rms(h, "post_attention_layernorm.weight")
    h = h + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) @ w["mlp.down_proj.weight"].T
    return rms(h, "final_layernorm.weight")


def test_the_target_loads_beside_its_mtp_layer_and_the_head_matches_the_reference(
    mimo: Path, target: LlamaModel
) -> None:
    head = load_mtp(mimo, target)
    ids = torch.tensor([3, 17, 99, 5, 200, 41, 7, 8, 150, 2])
    n = len(ids) - 1
    # the target's normed final states
    g = target.forward(ids, torch.arange(len(ids)), target.new_kv_cache()).hidden[:n]
    e = head.embed_tokens(ids[1:].tolist())
    ours = head.layer(g, e, torch.arange(n), HeadKV(NKV, HD), torch.ones(n, n, dtype=torch.bool).tril())
    ref = _reference(_mtp_tensors(), g, e, target.config.rope_theta)
    torch.testing.assert_close(ours, ref, rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(head.logits(ours), ref @ target.lm_head.float().T, rtol=2e-4, atol=2e-4)


def test_greedy_speculation_with_the_mtp_layer_is_plain_decoding(
    mimo: Path, target: LlamaModel, tokenizer: Tokenizer
) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 9, 10]
    plain = Engine(target, tokenizer)
    want = plain.run(plain.add_request(prompt, params)).output_ids
    for spec in (SpecConfig("mtp", num_speculative_tokens=3, adaptive=False),
                 SpecConfig("mimo_mtp", num_speculative_tokens=6, tree_topk=2, tree_depth=3, adaptive=False)):
        drafter = default_registry().create(spec.method, spec, target=target, target_path=mimo)
        assert drafter.name == "mtp"
        fast = Engine(target, tokenizer, spec=spec, drafter=drafter)
        req = fast.run(fast.add_request(prompt, params))
        assert req.output_ids == want and req.metrics.spec.num_drafts > 0


def test_kinds_the_runtime_cannot_run_are_named(tmp_path: Path, mimo: Path, target: LlamaModel) -> None:
    from safetensors.torch import save_file

    deepseek = tmp_path / "deepseek"
    deepseek.mkdir()
    (deepseek / "config.json").write_text(json.dumps({"hidden_size": H, "num_hidden_layers": 2}))
    save_file({"model.layers.2.eh_proj.weight": torch.zeros(H, 2 * H)}, str(deepseek / "model.safetensors"))
    with pytest.raises(TokenleapError, match="MLA / MoE"):
        load_mtp(deepseek, target)
    qwen3next = tmp_path / "qwen3next"
    qwen3next.mkdir()
    (qwen3next / "config.json").write_text("{}")
    save_file({"mtp.fc.weight": torch.zeros(2, 2)}, str(qwen3next / "model.safetensors"))
    with pytest.raises(TokenleapError, match="Qwen3-Next"):
        load_mtp(qwen3next, target)
    with pytest.raises(TokenleapError, match="not a model folder"):
        load_mtp(tmp_path / "nothing", target)
    with pytest.raises(TokenleapError, match="GGUF"):
        default_registry().create("mtp", SpecConfig("mtp"), target=target, target_path=tmp_path / "model.gguf")


def test_tokenleap_bench_finds_the_targets_own_mtp_layer(mimo: Path, target: LlamaModel, tokenizer: Tokenizer) -> None:
    from tokenleap.bench import Question, run_bench

    q = Question("q", "qa", ("Count: one two three one two three one two three",), "", ())
    records = run_bench(
        target, tokenizer, [q], {"mtp": SpecConfig("mtp", num_speculative_tokens=3)}, max_tokens=16, target_path=mimo
    )
    assert [r.method for r in records] == ["plain", "mtp"] and all(r.matched_plain for r in records)
