"""`FusedLayers` (one kernel call for a forward's layers) is bit-identical to the per-call loop it
replaces, for every kind of weight the fused path reads (GGUF blocks, packed bf16, dense fp32
with a QKV bias, QK-norm), every kind of forward (prefill, decode, verify, token tree, a batch of
sequences, a model cut to its first layers), and hands back the asked-for hidden states."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import pytest
import torch

from tiny_models import TINY_CONFIG, make_tiny_weights
from tokenleap import LLM
from tokenleap.attention.ops import AttentionMask, RowGroup, causal_mask, plan_rows, tree_mask
from tokenleap.kernels import CpuKernels, Linear, QuantWeight
from tokenleap.kernels.fused import FusedLayers
from tokenleap.kv.cache import KVCache
from tokenleap.models.layers import LayerWeights
from tokenleap.models.llama import LlamaModel, SeqInput


def _loop(model: LlamaModel) -> LlamaModel:
    """The same model (same weights) with the per-call loop instead of the fused call."""
    ref = copy.copy(model)
    ref.fused = None
    return ref


def _session(model: LlamaModel, vocab: int) -> list[torch.Tensor]:
    """Logits and hidden states of a prefill, decode steps, an 8-row verify, a rejected suffix
    rolled back, a token tree and a batch of two sequences."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (80,), generator=g)
    out: list[torch.Tensor] = []

    def fwd(kv: KVCache, lo: int, hi: int, attn: AttentionMask | None = None) -> None:
        o = model.forward(ids[lo:hi], torch.arange(lo, hi), kv, attn, return_hidden=(0, model.config.num_layers - 1))
        out.extend([model.compute_logits(o.hidden), *o.hidden_states.values()])

    kv = model.new_kv_cache(128)
    fwd(kv, 0, 40)
    fwd(kv, 40, 41)
    fwd(kv, 41, 49)
    kv.truncate(44)  # a rejected suffix
    fwd(kv, 44, 45)
    # a token tree: root 45 with two children, one grandchild
    parents = [-1, 0, 0, 1]
    tree_ids = ids[45:49]
    o = model.forward(tree_ids, torch.tensor([45, 46, 46, 47]), kv, tree_mask(parents, kv.length))
    out.append(model.compute_logits(o.hidden))
    kv.truncate(45)
    other = model.new_kv_cache(128)
    model.forward(ids[50:70], torch.arange(20), other)
    batch = model.forward_batch(
        [SeqInput(ids[45:48], torch.arange(45, 48), kv), SeqInput(ids[70:75], torch.arange(20, 25), other)]
    )
    out.append(model.compute_logits(batch.hidden))
    return out


def _assert_same(model: LlamaModel, vocab: int) -> None:
    assert model.fused is not None, "the fused Llama path should describe its layers for one call"
    fused, loop = _session(model, vocab), _session(_loop(model), vocab)
    assert len(fused) == len(loop)
    for a, b in zip(fused, loop):
        assert torch.equal(a, b)


@pytest.mark.slow
def test_gguf_blocks_fused_equals_per_call(llm: LLM) -> None:
    model = llm.model
    assert model.quantization == "gguf" and isinstance(model.layers[0].wqkv.weight, QuantWeight)
    _assert_same(model, model.config.vocab_size)


@pytest.mark.slow
def test_bf16_fused_equals_per_call(model_bf16: LlamaModel) -> None:
    _assert_same(model_bf16, model_bf16.config.vocab_size)


def test_dense_fp32_with_qkv_bias_fused_equals_per_call(kernels: CpuKernels) -> None:
    config = TINY_CONFIG
    w = make_tiny_weights(config)
    g = torch.Generator().manual_seed(3)
    for i in range(config.num_layers):
        for n, size in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
            w[f"layers.{i}.{n}_bias"] = torch.randn(size, generator=g)
    model = LlamaModel(config, w, torch.float32, kernels)
    assert model.layers[0].bqkv is not None and model.fused is not None and model.fused.dense
    _assert_same(model, config.vocab_size)


def test_qk_norm_fused_equals_per_call(kernels: CpuKernels) -> None:
    """Qwen3's blocks (QK-norm before RoPE) take the fused path too."""
    config = dataclasses.replace(TINY_CONFIG, architecture="qwen3", qk_norm=True)
    w = make_tiny_weights(config)
    g = torch.Generator().manual_seed(4)
    for i in range(config.num_layers):
        w[f"layers.{i}.q_norm"] = 1.0 + 0.3 * torch.randn(config.head_dim, generator=g)
        w[f"layers.{i}.k_norm"] = 1.0 + 0.3 * torch.randn(config.head_dim, generator=g)
    model = LlamaModel(config, w, torch.float32, kernels)
    assert model.path == "fused" and model.layers[0].q_norm is not None
    _assert_same(model, config.vocab_size)
    plain = LlamaModel(TINY_CONFIG, make_tiny_weights(TINY_CONFIG), torch.float32, kernels)
    ids = torch.arange(5)
    assert not torch.equal(model.forward(ids, torch.arange(5), model.new_kv_cache(16)).hidden,
                           plain.forward(ids, torch.arange(5), plain.new_kv_cache(16)).hidden)


def _gemma_like(kernels: CpuKernels, dtype: torch.dtype) -> LlamaModel:
    """A tiny Gemma 3 block: QK-norm with a query scale, post-norms, GeGLU, scaled embeddings,
    a sliding window of 16 on the first layer (own rope base), global rope scaling on the other."""
    config = dataclasses.replace(
        TINY_CONFIG, architecture="gemma3", qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=8.0,
        query_scale=0.2, sliding_window=16, sliding_layers=(True, False), rope_theta=1e6, rope_local_theta=1e4,
        rope_linear_factor=8.0, tie_word_embeddings=True,
    )  # fmt: skip
    w = make_tiny_weights(config)
    g = torch.Generator().manual_seed(5)
    for i in range(config.num_layers):
        for n, size in (
            ("q_norm", config.head_dim),
            ("k_norm", config.head_dim),
            ("post_attn_norm", config.hidden_size),
            ("post_mlp_norm", config.hidden_size),
        ):
            w[f"layers.{i}.{n}"] = 1.0 + 0.3 * torch.randn(size, generator=g)
    return LlamaModel(config, {k: v.to(dtype) if v.dim() == 2 else v for k, v in w.items()}, dtype, kernels)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gemma3_block_fused_equals_per_call(kernels: CpuKernels, dtype: torch.dtype) -> None:
    """Gemma 3's blocks take the fused path: local and global layers (their own plans and rope
    tables, the window binding from position 16 on), post-norms, GeGLU, the query scale."""
    model = _gemma_like(kernels, dtype)
    assert model.path == "fused" and model.fused is not None and model.fused.has_local and model.fused.post_norms
    _assert_same(model, TINY_CONFIG.vocab_size)
    # the blocks differ from a plain Llama's, and the window changes what a late row sees
    plain = LlamaModel(TINY_CONFIG, make_tiny_weights(TINY_CONFIG), torch.float32, kernels)
    unwindowed = copy.copy(model)
    unwindowed.config = dataclasses.replace(model.config, sliding_window=None, sliding_layers=None)

    def decode(m: LlamaModel) -> torch.Tensor:
        kv = m.new_kv_cache(64)
        return torch.cat([m.forward(torch.tensor([i]), torch.tensor([i]), kv).hidden for i in range(20)])

    hidden, wide = decode(model), decode(unwindowed)
    assert not torch.equal(hidden[:1], decode(plain)[:1])
    assert torch.equal(hidden[:16], wide[:16]) and not torch.equal(hidden[16:], wide[16:])


def test_tiny_bf16_fused_equals_per_call(tiny_model_bf16: LlamaModel) -> None:
    _assert_same(tiny_model_bf16, TINY_CONFIG.vocab_size)


def test_first_layers_only(tiny_model: LlamaModel) -> None:
    """A model cut to its first layer (self-speculation's draft) runs that layer only."""
    cut = tiny_model.with_layers(1)
    _assert_same(cut, TINY_CONFIG.vocab_size)
    ids = torch.arange(5)
    full = tiny_model.forward(ids, torch.arange(5), tiny_model.new_kv_cache(16)).hidden
    assert not torch.equal(cut.forward(ids, torch.arange(5), cut.new_kv_cache(16)).hidden, full)


def test_rejects_what_it_cannot_run(tiny_model: LlamaModel, kernels: CpuKernels) -> None:
    layer = tiny_model.layers[0]
    good = dataclasses.replace(layer, bqkv=None, q_norm=None, k_norm=None, post_attn_norm=None, post_mlp_norm=None)
    c = TINY_CONFIG
    make: Callable[[LayerWeights], FusedLayers] = lambda layer_weights: FusedLayers(  # noqa: E731
        kernels, [layer_weights], dim=c.hidden_size, inter=c.intermediate_size, heads=c.num_heads,
        kv_heads=c.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps,
    )  # fmt: skip
    make(good)
    with pytest.raises(ValueError, match="unsupported weight"):
        make(dataclasses.replace(good, wo=Linear(layer.wo.dense().t())))  # transposed shape
    with pytest.raises(ValueError, match="unsupported weight"):
        make(dataclasses.replace(good, w_down=Linear(layer.w_down.dense().half())))
    with pytest.raises(ValueError, match="fp32"):
        make(dataclasses.replace(good, attn_norm=layer.attn_norm[:10]))
    fused = make(good)
    kv = tiny_model.new_kv_cache(16)
    kv.reserve(2)
    plan = plan_rows([RowGroup(kv, 0, torch.arange(2), causal_mask())])
    with pytest.raises(ValueError, match="does not fit"):  # 3 rows for a plan of 2
        fused.run(torch.zeros(3, c.hidden_size), plan, tiny_model._cos, tiny_model._sin)
    with pytest.raises(ValueError, match="layers of"):
        fused.run(torch.zeros(2, c.hidden_size), plan, tiny_model._cos, tiny_model._sin, layers=2)
